"""Fakes of the world the watchdog touches, so tests signal, scan and read nothing real.

`FakePsutil` stands in for the process table (`types.ProcessTable`), `no_cpu_waits` for
its processes' CPU waits (`types.CpuWaits`), `fake_host` for the host of both
(`types.ProcessHost`), `FakeNvml` for NVML (`types.Nvml`),
`FakeSenders` for whom spans may speak for (`types.SpanSenders`).
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omni_watchdog.config import WatchdogConfig, load_config, merge_layers
from omni_watchdog.types import ProcessHost, ProcessInfo, ProcessRole, ProcessStatus, StageRef

# --- the process table ------------------------------------------------------------------

# The port a fake server listens on unless a test names another.
SERVER_PORT = 8000


@dataclass(frozen=True)
class FakeAddress:
    ip: str
    port: int


@dataclass(frozen=True)
class FakeSocket:
    pid: int | None
    status: str
    laddr: FakeAddress
    raddr: FakeAddress | tuple[()] = ()


@dataclass(frozen=True)
class FakeCpuTimes:
    user: float
    system: float


@dataclass
class FakeProcess:
    """One process of a `FakePsutil` table, with psutil's calls; the test edits its fields."""

    table: FakePsutil = field(repr=False, compare=False)
    pid: int
    parent: int
    pgid: int
    argv: list[str]
    state: str
    started: float
    # Signals it survives (SIGKILL is never one).
    ignores: set[int] = field(default_factory=set)
    # (ip, port) of the peers it holds established TCP connections to.
    connected_to: set[tuple[str, int]] = field(default_factory=set)
    env: dict[str, str] = field(default_factory=dict)
    # The kernel's name for it, which a zombie keeps: its executable's, or a title set
    # by the process, cut to 15 characters.
    comm: str = "python3"

    def oneshot(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def status(self) -> str:
        return self.state

    def ppid(self) -> int:
        return self.parent

    def name(self) -> str:
        return self.comm

    def cmdline(self) -> list[str]:
        if self.state == FakePsutil.STATUS_ZOMBIE:
            raise FakePsutil.ZombieProcess(self.pid)
        return self.argv

    def environ(self) -> dict[str, str]:
        return dict(self.env)

    def cpu_times(self) -> FakeCpuTimes:
        return FakeCpuTimes(user=1.5, system=0.5)

    def children(self, recursive: bool) -> list[FakeProcess]:
        self.table.listings += 1
        direct = [p for p in self.table.table.values() if p.parent == self.pid]
        return self._descendants(direct) if recursive else direct

    def _descendants(self, direct: list[FakeProcess]) -> list[FakeProcess]:
        found = list(direct)
        for process in found:
            found.extend(p for p in self.table.table.values() if p.parent == process.pid)
        return found

    def parents(self) -> list[FakeProcess]:
        parent = self.table.table.get(self.parent)
        return [parent, *parent.parents()] if parent else []

    def net_connections(self, kind: str) -> list[FakeSocket]:
        held = [self.table.listener(self.pid)] if self.pid in self.table.listening else []
        return held + [
            FakeSocket(
                self.pid,
                FakePsutil.CONN_ESTABLISHED,
                FakeAddress("127.0.0.1", 40000),
                FakeAddress(ip, port),
            )
            for ip, port in sorted(self.connected_to)
        ]


class FakePsutil:
    """The psutil calls the watchdog makes, over a table the test edits, and the signal and
    process-group calls that go with it (`kill`, `killpg`, `getpgid`, `start_time`)."""

    class Error(Exception):
        pass

    class NoSuchProcess(Error):
        pass

    class ZombieProcess(NoSuchProcess):
        pass

    class AccessDenied(Error):
        pass

    STATUS_ZOMBIE = "zombie"
    CONN_LISTEN = "LISTEN"
    CONN_ESTABLISHED = "ESTABLISHED"

    def __init__(self, port: int = SERVER_PORT) -> None:
        self.table: dict[int, FakeProcess] = {}
        # Pids holding a listening socket on `port`, in the socket table's order.
        self.listening: list[int] = []
        self.port = port
        self.signals: list[tuple[str, int, int]] = []
        self._last_start = 1.0
        # Processes added, which moves on at each as the kernel's last pid does, and
        # children() calls, each of which lists the whole table in psutil.
        self.births = 0
        self.listings = 0

    def add(
        self,
        pid: int,
        ppid: int = 1,
        cmdline: list[str] | str = "",
        *,
        pgid: int | None = None,
        status: str = "sleeping",
        create_time: float | None = None,
        ignores: set[int] | None = None,
    ) -> FakeProcess:
        """Start a process (replacing one with its pid); by default it leads its own process
        group and starts a second after the last one added."""
        if create_time is None:
            create_time = self._last_start + 1.0
        self._last_start = create_time
        self.births += 1
        argv = cmdline.split() if isinstance(cmdline, str) else cmdline
        self.table[pid] = FakeProcess(
            self,
            pid,
            ppid,
            pid if pgid is None else pgid,
            argv,
            status,
            create_time,
            ignores or set(),
        )
        return self.table[pid]

    def Process(self, pid: int) -> FakeProcess:
        if pid not in self.table:
            raise self.NoSuchProcess(pid)
        return self.table[pid]

    def last_pid(self) -> int:
        """What `process_start.last_pid` answers: it moves on at every birth."""
        return self.births

    def process_iter(self, attrs: list[str]) -> list[FakeProcess]:
        return list(self.table.values())

    def net_connections(self, kind: str) -> list[FakeSocket]:
        # Like psutil's socket table: one holder per socket, here the first one listed.
        return [self.listener(self.listening[0])] if self.listening else []

    def listener(self, pid: int) -> FakeSocket:
        return FakeSocket(pid, self.CONN_LISTEN, FakeAddress("0.0.0.0", self.port))

    def start_time(self, pid: int) -> float:
        """What `process_start.start_time` answers in production."""
        return self.Process(pid).started

    def getpgid(self, pid: int) -> int:
        if pid not in self.table:
            raise ProcessLookupError(pid)
        return self.table[pid].pgid

    def kill(self, pid: int, sig: int) -> None:
        if pid not in self.table:
            raise ProcessLookupError(pid)
        self.signals.append(("kill", pid, sig))
        self._deliver(self.table[pid], sig)

    def killpg(self, pgid: int, sig: int) -> None:
        members = [p for p in self.table.values() if p.pgid == pgid]
        if not members:
            raise ProcessLookupError(pgid)
        self.signals.append(("killpg", pgid, sig))
        for member in members:
            self._deliver(member, sig)

    def _deliver(self, process: FakeProcess, sig: int) -> None:
        if sig == signal.SIGKILL or sig not in process.ignores:
            del self.table[process.pid]


def no_cpu_waits(pid: int, runnable: bool) -> float:
    """The CPU waits of a `FakePsutil` table's processes: none. Its pids are not this
    kernel's, so reading theirs would read some other process's."""
    return 0.0


def fake_host(table: FakePsutil) -> ProcessHost:
    """The host of a `FakePsutil` table: its own start times, and none of the readers that
    ask this kernel about a pid (exit notices, socket owners, /proc for activity)."""
    return ProcessHost(process_table=table, cpu_waits=no_cpu_waits, start_time=table.start_time)


def info(
    pid: int, pgid: int, role: ProcessRole, create_time: float = 100.0, stage: int | None = None
) -> ProcessInfo:
    return ProcessInfo(
        pid,
        create_time,
        1,
        pgid,
        pgid,
        role.value,
        ProcessStatus.SLEEPING,
        0.0,
        role,
        None if stage is None else StageRef(stage),
    )


# --- NVML ---------------------------------------------------------------------------------


@dataclass
class FakeGpuProcess:
    pid: int
    usedGpuMemory: int | None


@dataclass(frozen=True)
class FakeMemory:
    used: int
    total: int


@dataclass(frozen=True)
class FakeUtilization:
    gpu: int


@dataclass
class FakeDevice:
    """One device as the test sets it; `broken` makes its memory unreadable."""

    used: int
    total: int
    utilization: int | None
    processes: list[FakeGpuProcess] = field(default_factory=list)
    broken: bool = False


class FakeNvml:
    """The NVML calls the GPU probe makes, over devices the test edits."""

    class NVMLError(Exception):
        pass

    def __init__(self, devices: list[FakeDevice], init_failures: int = 0) -> None:
        self.devices = devices
        self.init_failures = init_failures
        self.init_calls = 0

    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.init_failures:
            self.init_failures -= 1
            raise self.NVMLError("Driver Not Loaded")

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeDevice:
        return self.devices[index]

    def nvmlDeviceGetMemoryInfo(self, handle: FakeDevice) -> FakeMemory:
        if handle.broken:
            raise self.NVMLError("GPU is lost")
        return FakeMemory(used=handle.used, total=handle.total)

    def nvmlDeviceGetUtilizationRates(self, handle: FakeDevice) -> FakeUtilization:
        if handle.utilization is None:
            raise self.NVMLError("Not Supported")
        return FakeUtilization(gpu=handle.utilization)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeDevice) -> list[FakeGpuProcess]:
        return list(handle.processes)


# --- span senders -------------------------------------------------------------------------


class FakeSenders:
    """Whom spans may speak for, as a test declares it; by default anyone, for any stage."""

    def __init__(
        self,
        owned: set[tuple[int, int]] | None = None,
        stages: set[StageRef] | None = None,
        mapped: set[StageRef] | None = None,
    ) -> None:
        self.owned = owned
        self.stages = stages
        self.mapped = mapped

    def owns(self, pid: int | None, start_ticks: int | None) -> bool:
        if self.owned is None:
            return True
        return pid is not None and start_ticks is not None and (pid, start_ticks) in self.owned

    def knows(self, stage: StageRef) -> bool:
        return self.stages is None or stage in self.stages

    def maps(self, stage: StageRef) -> bool:
        return self.mapped is None or stage in self.mapped

    def live_pids(self) -> list[int]:
        return sorted({pid for pid, _ in self.owned or ()})


# --- a watchdog in the test's own process ---------------------------------------------------


def local_config(state: Path, overrides: Mapping[str, Any] | None = None) -> WatchdogConfig:
    """A watchdog's config with both listeners on free local ports and a target nothing
    answers on (port 9, discard), for tests that stand in for its probes."""
    base = {
        "target": "http://127.0.0.1:9",
        "listen": "127.0.0.1:0",
        "state_dir": str(state),
        "spans": {"otlp_listen": "127.0.0.1:0"},
    }
    return load_config(None, overrides=merge_layers(base, overrides or {}), environ={})
