"""A vLLM-Omni 0.30 headless stage (`--headless --stage-id N`): one stage's replicas for a
head on another host.

The root process has no HTTP API and no title. It spawns the stage's replicas as a local
0.30 server does and holds one connection to the head's coordinator per replica: it
registers the replica, hands it the requests that come in and sends back what it says,
its heartbeats included. A replica beats from a thread of its own, so a stopped or killed
replica falls silent while a blocked forward does not. A replica that dies is reported at
once by closing its connection. A head that goes away leaves the stage running with its
memory held, trying again every second, as vLLM-Omni's does.

Faults at run time: lines like `{"kind": "silent-stall", "replica": 0}` appended to
`$STATE/faults.jsonl`. The stage's own state is in `$STATE/headless.json`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omni_watchdog.sim.engine import Message, StageSpec
from omni_watchdog.sim.faults import (
    FAULTS_FILE,
    FaultError,
    check_headless_fault,
    fault_from_mapping,
)
from omni_watchdog.sim.nvml import write_json_atomically
from omni_watchdog.sim.orchestrator import READY_TIMEOUT_S, Replica, spawn_replica, stop_replicas
from omni_watchdog.sim.pipelines import ExecutionType
from omni_watchdog.sim.stages import next_message
from omni_watchdog.sim.wire import (
    HEADLESS_FILE,
    MASTER_HEARTBEAT_S,
    MAX_LINE_BYTES,
    QUOTE_CHARS,
    ProtocolError,
    encode,
    read_message,
)

logger = logging.getLogger("omni_watchdog.sim")

RETRY_S = 1.0
CONNECT_TIMEOUT_S = 2.0
# A replica is registered only while it beats: a stopped one would just be evicted again.
FRESH_BEAT_S = 2.5 * MASTER_HEARTBEAT_S
WATCH_S = 0.05
FAULT_POLL_S = 0.2
# Fault lines are short; a longer one is not one.
MAX_FAULT_LINE_BYTES = 4096
# The head sends each stage at most its own `--max-tokens-cap`; this bounds a wild one.
MAX_REQUEST_TOKENS = 1 << 16
# What the root relays from a replica to the head; a "fatal" is followed by its death.
RELAYED = frozenset({"heartbeat", "started", "token", "done", "error"})


class ReplicaLink:
    """One local replica and its connection to the master."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self.last_beat: float | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.dead = False

    @property
    def index(self) -> int:
        return self.replica.spec.replica

    def beating(self) -> bool:
        return self.last_beat is not None and time.monotonic() - self.last_beat < FRESH_BEAT_S

    def send(self, message: Message) -> None:
        if self.writer is not None and not self.writer.is_closing():
            self.writer.write(encode(message))

    def disconnect(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _request(message: Message) -> Message | None:
    """The request in a message from the head, or None when it is not a sound one."""
    tokens = message.get("tokens")
    sound = (
        message["type"] == "request"
        and isinstance(message.get("request_id"), str)
        and isinstance(tokens, int)
        and not isinstance(tokens, bool)
        and 0 < tokens <= MAX_REQUEST_TOKENS
    )
    return message if sound else None


class HeadlessStage:
    """The root process of a headless stage."""

    def __init__(
        self, specs: Sequence[StageSpec], address: str, port: int, state_dir: Path
    ) -> None:
        self._specs = specs
        self._stage_id = specs[0].stage_id
        self._address = address
        self._port = port
        self._state_dir = state_dir
        self._hostname = socket.gethostname()
        self._links: list[ReplicaLink] = []
        self._stop = asyncio.Event()
        self._armed: list[dict[str, Any]] = []
        self._master_down_logged = False

    async def serve(self) -> int:
        """Run the stage until SIGTERM or SIGINT; the process's exit code."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._stop.set)
        # On this (the main) thread: the replicas' parent-death signal follows it.
        self._links = [ReplicaLink(spawn_replica(spec)) for spec in self._specs]
        tasks = [asyncio.create_task(self._pump(link)) for link in self._links]
        if await self._ready():
            self._write_state()
            logger.info(
                "stage %d: %d replica(s) ready; master at %s:%d",
                self._stage_id,
                len(self._links),
                self._address,
                self._port,
            )
            tasks += [asyncio.create_task(self._keep_registered(link)) for link in self._links]
            tasks += [asyncio.create_task(self._watch()), asyncio.create_task(self._faults())]
            await self._stop.wait()
            logger.info("shutting down")
        for task in tasks:
            task.cancel()
        for link in self._links:
            link.disconnect()
        await loop.run_in_executor(None, stop_replicas, [link.replica for link in self._links])
        # Stopped, or a replica that never got ready.
        return 0 if self._stop.is_set() else 1

    async def _ready(self) -> bool:
        deadline = time.monotonic() + READY_TIMEOUT_S
        for link in self._links:
            while not link.replica.ready.is_set():
                if self._stop.is_set():
                    return False
                if time.monotonic() > deadline or not link.replica.process.is_alive():
                    logger.error("stage %d replica %d did not start", self._stage_id, link.index)
                    return False
                await asyncio.sleep(WATCH_S)
        return True

    async def _pump(self, link: ReplicaLink) -> None:
        """Relay the replica's messages to the master while connected."""
        replica = link.replica
        while True:
            message = await next_message(replica.out_q)
            if message is None:
                if link.dead:
                    return
                continue
            kind = message["type"]
            if kind == "ready":
                replica.pid = int(message["pid"])
                replica.ready.set()
            elif kind == "child":
                replica.children.append({"kind": message["kind"], "pid": message["pid"]})
                self._write_state()
            elif kind in RELAYED:
                if kind == "heartbeat":
                    link.last_beat = time.monotonic()
                link.send(message)

    async def _keep_registered(self, link: ReplicaLink) -> None:
        """Register the replica with the master whenever it beats and is not registered."""
        while not link.dead:
            if link.beating():
                try:
                    await self._registered(link)
                except (OSError, asyncio.TimeoutError) as error:
                    self._master_down(str(error) or type(error).__name__)
                except ProtocolError as error:
                    logger.error(
                        "stage %d: the master broke the protocol: %s", self._stage_id, error
                    )
                finally:
                    link.disconnect()
                    self._write_state()
            await asyncio.sleep(RETRY_S)

    async def _registered(self, link: ReplicaLink) -> None:
        """Connect, register and hand the master's requests to the replica until the
        connection ends."""
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(self._address, self._port, limit=MAX_LINE_BYTES),
            CONNECT_TIMEOUT_S,
        )
        link.writer = writer
        if writer.get_extra_info("sockname") == writer.get_extra_info("peername"):
            # TCP's simultaneous open: with no master on the port, a retry that drew that very
            # port as its own connected to itself, and would hold it against the next master.
            raise ConnectionRefusedError("connected to itself")
        link.send(
            {
                "type": "register",
                "stage": self._stage_id,
                "replica": link.index,
                "pid": link.replica.pid,
                "host": self._hostname,
            }
        )
        self._master_down_logged = False
        logger.info(
            "stage %d replica %d (pid %d) registered with the master at %s:%d",
            self._stage_id,
            link.index,
            link.replica.pid,
            self._address,
            self._port,
        )
        self._write_state()
        while (message := await read_message(reader)) is not None:
            request = _request(message)
            if request is None:
                kind = str(message["type"])[:QUOTE_CHARS]
                logger.warning("stage %d: ignored a %r from the master", self._stage_id, kind)
                continue
            link.replica.in_q.put(request)
        if not link.dead:
            logger.warning(
                "stage %d replica %d: the master closed the connection", self._stage_id, link.index
            )

    def _master_down(self, why: str) -> None:
        # Once per outage: the stage tries again every second for as long as it takes.
        if not self._master_down_logged:
            logger.warning(
                "stage %d: master at %s:%d unreachable (%s); the stage keeps running and "
                "tries again every %g s",
                self._stage_id,
                self._address,
                self._port,
                why,
                RETRY_S,
            )
            self._master_down_logged = True

    async def _watch(self) -> None:
        """A replica that dies is reported to the master at once: its connection closes."""
        while True:
            for link in self._links:
                process = link.replica.process
                if not link.dead and not process.is_alive():
                    link.dead = True
                    link.disconnect()
                    logger.error(
                        "stage %d replica %d (pid %d) died with exit code %s",
                        self._stage_id,
                        link.index,
                        link.replica.pid,
                        process.exitcode,
                    )
                    self._write_state()
            await asyncio.sleep(WATCH_S)

    async def _faults(self) -> None:
        """Arm the faults appended to `$STATE/faults.jsonl`, each once, in order."""
        path = self._state_dir / FAULTS_FILE
        offset = 0
        partial = b""
        while True:
            await asyncio.sleep(FAULT_POLL_S)
            with contextlib.suppress(FileNotFoundError):
                with path.open("rb") as stream:
                    stream.seek(offset)
                    chunk = stream.read(MAX_FAULT_LINE_BYTES)
                offset += len(chunk)
                *lines, partial = (partial + chunk).split(b"\n")
                if len(partial) > MAX_FAULT_LINE_BYTES:
                    logger.error("%s: a line over %d bytes: skipped", path, MAX_FAULT_LINE_BYTES)
                    partial = b""
                for line in lines:
                    if line.strip():
                        self._arm(line)

    def _arm(self, line: bytes) -> None:
        try:
            document = json.loads(line)
            if not isinstance(document, dict):
                raise FaultError('expected a JSON object like {"kind": "silent-stall"}')
            fault = fault_from_mapping({"stage": self._stage_id, **document})
            diffusion = self._specs[0].execution_type is ExecutionType.DIFFUSION
            check_headless_fault(fault, self._stage_id, len(self._links), diffusion)
        except (FaultError, ValueError, RecursionError) as error:
            logger.error("%s: fault not armed: %s", FAULTS_FILE, error)
            return
        link = self._links[fault.replica]
        if link.dead:
            logger.error("%s: stage %d replica %d is dead", FAULTS_FILE, fault.stage, fault.replica)
            return
        link.replica.in_q.put({"type": "fault", "kind": fault.kind.value})
        self._armed.append(fault.as_dict())
        logger.info("fault armed: %s", fault.as_dict())
        self._write_state()

    def _write_state(self) -> None:
        replicas = [
            {
                "replica": link.index,
                "pid": link.replica.pid,
                "alive": not link.dead,
                "registered": link.writer is not None,
                "children": list(link.replica.children),
            }
            for link in self._links
        ]
        document = {
            "pid": os.getpid(),
            "stage": self._stage_id,
            "master": {"address": self._address, "port": self._port},
            "replicas": replicas,
            "armed_faults": list(self._armed),
        }
        write_json_atomically(self._state_dir / HEADLESS_FILE, document)
