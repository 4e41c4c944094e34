"""The head's coordinator for headless stages (vLLM-Omni 0.30's `--omni-master-port`).

A headless stage's root process opens one connection per replica, registers the replica
and relays: requests go out as JSON lines, the replica's progress and heartbeats come back
the same way. A registered replica stands in the orchestrator like a local one and is alive
while its connection is open and its last heartbeat is younger than the heartbeat timeout.
Everything a peer sends is bounded and checked; a peer that breaks the protocol is dropped
and counted, never trusted with more.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Sequence
from typing import Any, TypeGuard

from omni_watchdog.sim.engine import Message, StageSpec
from omni_watchdog.sim.orchestrator import Orchestrator, Replica
from omni_watchdog.sim.wire import (
    MAX_LINE_BYTES,
    QUOTE_CHARS,
    ProtocolError,
    encode,
    read_message,
)

logger = logging.getLogger("omni_watchdog.sim")

# Connections that have not registered yet; registered ones are bounded by the stages'
# replica slots, each held by its latest registration.
MAX_PENDING_PEERS = 16
REGISTER_TIMEOUT_S = 5.0
CLOSE_TIMEOUT_S = 1.0
MAX_HOST_CHARS = 253
# Requests a peer leaves unread before the head gives up on it.
MAX_UNREAD_BYTES = 1 << 20
REFUSALS = (
    "too_many_peers",
    "registration_timeout",
    "bad_registration",
    "garbage",
    "oversized",
)


def _is_index(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _progress(message: Message) -> bool:
    """Whether `message` is a replica's progress with the fields the orchestrator reads."""
    kind = message["type"]
    if not isinstance(message.get("request_id"), str):
        return False
    if kind in ("started", "token"):
        return True
    if kind == "done":
        seconds = message.get("seconds")
        return (
            isinstance(message.get("text"), str)
            and _is_index(message.get("tokens"))
            and isinstance(seconds, (int, float))
            and not isinstance(seconds, bool)
            and seconds >= 0
        )
    return kind == "error" and isinstance(message.get("error"), str)


class RemoteLink:
    """A remote replica's connection where a local replica has its process and request
    queue: `is_alive` and `kill` for the orchestrator, `put` for its requests."""

    def __init__(self, writer: asyncio.StreamWriter, heartbeat_timeout: float) -> None:
        self._writer = writer
        self._timeout = heartbeat_timeout
        self._last_beat = time.monotonic()
        self._lost: str | None = None

    @property
    def reason(self) -> str | None:
        """Why the replica counts as gone, or None while it lives."""
        if self._lost is None:
            silent = time.monotonic() - self._last_beat
            if silent > self._timeout:
                return f"no heartbeat for {silent:.1f} s"
        return self._lost

    def is_alive(self) -> bool:
        return self.reason is None

    def beat(self) -> None:
        # Once silent past the timeout it stays gone: a late beat does not revive it.
        if self.is_alive():
            self._last_beat = time.monotonic()

    def put(self, message: Message) -> None:
        if self._lost is not None:
            return
        self._writer.write(encode(message))
        if self._writer.transport.get_write_buffer_size() > MAX_UNREAD_BYTES:
            self.lose("it stopped reading its requests")

    def lose(self, reason: str) -> None:
        """Close the connection; the first reason is the one that stays."""
        if self._lost is None:
            self._lost = self.reason or reason
        self._writer.close()

    def kill(self) -> None:
        self.lose("cut off by the head")


class Coordinator:
    """Listens for headless stages' replicas and hands the registered ones to the
    orchestrator; runs on the orchestrator's loop."""

    def __init__(
        self,
        orchestrator: Orchestrator,
        specs: Sequence[StageSpec],
        remote_stages: frozenset[int],
        heartbeat_timeout: float,
        listener: socket.socket,
    ) -> None:
        self._orchestrator = orchestrator
        self._specs = {(s.stage_id, s.replica): s for s in specs if s.stage_id in remote_stages}
        self._timeout = heartbeat_timeout
        self._listener = listener
        self._address = listener.getsockname()[:2]
        self._server: asyncio.Server | None = None
        # Every connection's handler, with its writer to close at the end.
        self._peers: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self._pending = 0
        # Fixed keys: the API thread copies it while this loop counts.
        self.refused = dict.fromkeys(REFUSALS, 0)

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._serve, sock=self._listener, limit=MAX_LINE_BYTES
        )

    async def close(self) -> None:
        """Stop listening and drop every peer: the headless stages keep running."""
        if self._server is not None:
            self._server.close()
        for writer in self._peers.values():
            writer.close()
        # Each handler sees its end and returns; cancelled, it would log an error.
        if self._peers:
            await asyncio.wait(list(self._peers), timeout=CLOSE_TIMEOUT_S)

    def state(self) -> dict[str, Any]:
        host, port = self._address
        return {
            "host": host,
            "port": port,
            "peers": len(self._peers),
            "refused": dict(self.refused),
        }

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = writer.get_extra_info("peername", ("?", "?"))[:2]
        peer = f"{host}:{port}"
        if self._pending >= MAX_PENDING_PEERS:
            self._refuse(peer, "too_many_peers", f"{MAX_PENDING_PEERS} peers already registering")
            writer.close()
            return
        task = asyncio.current_task()
        assert task is not None
        self._peers[task] = writer
        link: RemoteLink | None = None
        try:
            self._pending += 1
            try:
                first = await asyncio.wait_for(read_message(reader), REGISTER_TIMEOUT_S)
            finally:
                self._pending -= 1
            if first is None:
                return
            link = RemoteLink(writer, self._timeout)
            replica = self._register(first, link)
            await self._relay(reader, replica, link)
        except ProtocolError as error:
            self._refuse(peer, error.kind, str(error))
            if link is not None:
                link.lose(f"it broke the protocol: {error}")
        except asyncio.TimeoutError:  # not yet the builtin one in Python 3.10
            self._refuse(peer, "registration_timeout", f"no registration in {REGISTER_TIMEOUT_S} s")
        except ConnectionError:
            pass  # reset by the peer: the same as a close
        finally:
            del self._peers[task]
            if link is not None:
                link.lose("connection closed")
            writer.close()

    def _register(self, message: Message, link: RemoteLink) -> Replica:
        if message["type"] != "register":
            raise ProtocolError("bad_registration", "the first message must be a registration")
        stage, index, pid, host = (message.get(k) for k in ("stage", "replica", "pid", "host"))
        if not (_is_index(stage) and _is_index(index) and _is_index(pid)):
            raise ProtocolError("bad_registration", "stage, replica and pid must be indices")
        if not isinstance(host, str) or len(host) > MAX_HOST_CHARS or not host.isprintable():
            raise ProtocolError("bad_registration", "host must be a host name")
        spec = self._specs.get((stage, index))
        if spec is None:
            raise ProtocolError(
                "bad_registration", f"stage {stage} replica {index} is not a remote replica here"
            )
        replica = Replica(spec, link, link, link, pid=pid, remote=True, host=host)
        replica.ready.set()
        self._orchestrator.attach(replica)
        return replica

    async def _relay(
        self, reader: asyncio.StreamReader, replica: Replica, link: RemoteLink
    ) -> None:
        """Feed the replica's messages to the orchestrator until it closes or is evicted."""
        while not replica.evicted:
            message = await read_message(reader)
            if message is None:
                return
            if message["type"] == "heartbeat":
                link.beat()
            elif _progress(message):
                self._orchestrator.dispatch(replica, message)
            else:
                kind = str(message["type"])[:QUOTE_CHARS]
                raise ProtocolError("garbage", f"an unexpected {kind!r} message")

    def _refuse(self, peer: str, kind: str, detail: str) -> None:
        self.refused[kind] += 1
        logger.warning("omni master: dropped peer %s: %s", peer, detail)
