"""The link probe: a headless stage's link to its master, the head's coordinator.

A vLLM-Omni 0.30 stage started with `--headless --omni-master-address A
--omni-master-port P` serves a head on another host. When the head is gone the stage is
orphaned: vLLM-Omni never ends it and never registers it again, so nothing will send it
work, and it holds its GPUs until someone ends it. The link is up while the master's port
accepts a connection and a process of the stage's tree holds an established connection to
the master's host (the stage is still registered there). A master's name that stops
resolving is not its end: its last addresses stand in, and the stage's own connections
decide; one that never resolved leaves the link unjudged (the probe's error). A port that
refuses is no link, whatever the stage still holds: a piece of a dead head (its forked
coordinator) can keep the stage's connections open for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable, Sequence
from urllib.parse import urlsplit

from omni_watchdog.types import (
    Clock,
    HealthOutcome,
    MasterLink,
    Observation,
    ObservationKind,
    ProbeError,
    ProcessInfo,
    ProcessSocket,
    ProcessTable,
)

# Where the instrument plugin (and any OTLP exporter) sends spans from the stage's processes.
SPAN_ENDPOINT_VARIABLES = (
    "OMNI_WATCHDOG_OTLP_ENDPOINT",
    "OMNI_WATCHDOG_HEAD_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
)
MASTER_ADDRESS_FLAG = "--omni-master-address"
MASTER_PORT_FLAG = "--omni-master-port"


def master_of(argv: Sequence[str]) -> tuple[str, int] | None:
    """The master's (address, port) from a headless stage's command line, or None."""
    values: dict[str, str] = {}
    for index, part in enumerate(argv):
        for flag in (MASTER_ADDRESS_FLAG, MASTER_PORT_FLAG):
            if part == flag and index + 1 < len(argv):
                values[flag] = argv[index + 1]
            elif part.startswith(flag + "="):
                values[flag] = part.partition("=")[2]
    address, port = values.get(MASTER_ADDRESS_FLAG), values.get(MASTER_PORT_FLAG)
    if not address or port is None or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return address, int(port)


class MasterLinkProbe:
    """Checks the link of the recorded headless stage to the master its command line names."""

    name = "link"

    def __init__(
        self,
        process_table: ProcessTable,
        clock: Clock,
        root: Callable[[], ProcessInfo | None],
        processes: Callable[[], Sequence[ProcessInfo]],
        timeout: float,
        resolve: Callable[[str, int], Awaitable[set[str]]] | None = None,
    ) -> None:
        """`root()` is the stage server's recorded root process, `processes()` its live
        recorded tree; `timeout` bounds the connection attempt; `resolve(name, port)` gives
        the master's addresses (the system's resolver by default)."""
        self._psutil = process_table
        self._clock = clock
        self._root = root
        self._processes = processes
        self._timeout = timeout
        self._resolve = resolve or _addresses_of
        self.master: tuple[str, int] | None = None
        self._last: MasterLink | None = None
        # The master's addresses as last resolved: a name that stops resolving says
        # nothing of the master, whose connections with the stage the kernel still shows.
        self._resolved: tuple[str, set[str]] | None = None

    async def collect(self) -> Sequence[Observation]:
        root = self._root()
        if root is None:
            return []
        master = master_of(root.title.split())
        if master is None:
            self.master = None
            return [self._link(HealthOutcome.ERROR, f"no {MASTER_ADDRESS_FLAG}/{MASTER_PORT_FLAG}")]
        self.master = address, port = master
        ips, note = await self._addresses(address, port)
        outcome, reason = await self._reach(sorted(ips), port)
        if outcome is not HealthOutcome.OK:
            return [self._link(outcome, f"master {address}:{port} {reason}{note}")]
        holders = await asyncio.to_thread(self._connected, root.pid, ips)
        if not holders:
            return [
                self._link(
                    HealthOutcome.UNHEALTHY,
                    f"master {address}:{port} reachable, but no stage process is connected to"
                    f" its host: the stage is not registered{note}",
                )
            ]
        return [
            self._link(
                HealthOutcome.OK, f"connected to {address}:{port} from pid {holders[0]}{note}"
            )
        ]

    async def _addresses(self, address: str, port: int) -> tuple[set[str], str]:
        """The master's addresses, and a note when they are the last ones known because its
        name did not resolve now. Raises `ProbeError` when it never resolved: the link is
        then not judged at all, since nothing says where the master is."""
        try:
            ips = await self._resolve(address, port)
        except OSError as error:
            known = self._resolved
            if known is None or known[0] != address:
                raise ProbeError(
                    f"cannot resolve {address}: {error}; the link is judged once it resolves"
                ) from None
            shown = ", ".join(sorted(known[1]))
            return known[1], f" ({address} did not resolve: {error}; its last address {shown})"
        self._resolved = (address, ips)
        return ips, ""

    async def _reach(self, ips: Sequence[str], port: int) -> tuple[HealthOutcome, str]:
        """Whether the master's port takes a connection on one of its addresses."""
        outcome, reason = HealthOutcome.ERROR, "has no address"
        for ip in ips:
            outcome, reason = await self._connect(ip, port)
            if outcome is HealthOutcome.OK:
                break
        return outcome, reason

    async def _connect(self, ip: str, port: int) -> tuple[HealthOutcome, str]:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), self._timeout)
        except asyncio.TimeoutError:
            return HealthOutcome.TIMEOUT, f"did not answer in {self._timeout:g}s"
        except ConnectionRefusedError:
            return HealthOutcome.REFUSED, "refused the connection"
        except OSError as error:
            return HealthOutcome.ERROR, f"unreachable ({error.strerror or error})"
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return HealthOutcome.OK, ""

    def _connected(self, root_pid: int, ips: set[str]) -> list[int]:
        """Pids of the stage's processes with an established connection to the master's
        host, other than to a span receiver.

        vLLM-Omni 0.30 registers over a short-lived connection to the master port; a
        registered engine core then stays connected to the head's coordinator and to its
        input and output sockets, on ports the head picks. Its spans may go to the head's
        watchdog on the same host: those connections say nothing of the registration.
        """
        telemetry = self._span_ports(root_pid)
        held: list[tuple[int, Sequence[ProcessSocket]]] = []
        for info in self._processes():
            try:
                held.append((info.pid, self._psutil.Process(info.pid).net_connections(kind="tcp")))
            except self._psutil.Error:
                continue
        # A head on the stage's own host shares its address: the stage's processes talking
        # to each other over loopback (ZMQ between its engine and workers) are not the head.
        own_ends = {
            (connection.laddr.ip, connection.laddr.port)
            for _, connections in held
            for connection in connections
            if connection.laddr
        }
        holders = []
        for pid, connections in held:
            for connection in connections:
                remote = connection.raddr
                if (
                    connection.status == self._psutil.CONN_ESTABLISHED
                    and remote
                    and remote.ip in ips
                    and remote.port not in telemetry
                    and (remote.ip, remote.port) not in own_ends
                ):
                    holders.append(pid)
                    break
        return holders

    def _span_ports(self, root_pid: int) -> set[int]:
        """Ports of the span receivers the stage's environment names."""
        try:
            environ = self._psutil.Process(root_pid).environ()
        except self._psutil.Error:
            return set()
        ports = set()
        for variable in SPAN_ENDPOINT_VARIABLES:
            with contextlib.suppress(ValueError):
                url = urlsplit(environ.get(variable, "").strip())
                if url.hostname:
                    ports.add(url.port or (443 if url.scheme == "https" else 80))
        return ports

    def state(self) -> MasterLink | None:
        """The link as last checked; None before the stage server was found."""
        return self._last

    def _link(self, outcome: HealthOutcome, detail: str) -> Observation:
        now = self._clock.monotonic()
        up = outcome is HealthOutcome.OK
        last = self._last
        since = last.since if last is not None and last.up == up else now
        address, port = self.master or ("", 0)
        self._last = MasterLink(address, port, up, since, detail)
        return Observation(ObservationKind.LINK, now, outcome=outcome, detail=detail)


async def _addresses_of(name: str, port: int) -> set[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return {str(info[4][0]) for info in infos}
