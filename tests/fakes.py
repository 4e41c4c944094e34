"""A fake process table and signal functions, so tests signal nothing real."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any

from omni_watchdog.types import ProcessInfo, ProcessRole, ProcessStatus, StageRef


class NoSuchProcess(Exception):
    pass


@dataclass
class FakeProcess:
    pid: int
    create_time: float
    pgid: int
    ignores: set[int] = field(default_factory=set)
    status: str = "sleeping"


class FakePsutil:
    """The psutil calls the actuators use, over a table the test controls."""

    NoSuchProcess = NoSuchProcess
    Error = Exception
    STATUS_ZOMBIE = "zombie"

    def __init__(self) -> None:
        self.table: dict[int, FakeProcess] = {}
        self.signals: list[tuple[str, int, int]] = []

    def add(self, pid: int, pgid: int, create_time: float = 100.0, ignores: set[int] | None = None):
        self.table[pid] = FakeProcess(pid, create_time, pgid, ignores or set())
        return self.table[pid]

    def Process(self, pid: int) -> Any:
        if pid not in self.table:
            raise NoSuchProcess(pid)
        entry = self.table[pid]

        class Handle:
            def __init__(self) -> None:
                self.pid = entry.pid
                self.info = {"pid": entry.pid, "create_time": entry.create_time}

            def create_time(self) -> float:
                return entry.create_time

            def status(self) -> str:
                return entry.status

        return Handle()

    def start_time(self, pid: int) -> float:
        """What `process_start.start_time` answers in production."""
        if pid not in self.table:
            raise NoSuchProcess(pid)
        return self.table[pid].create_time

    def process_iter(self, attrs: list[str] | None = None) -> list[Any]:
        return [self.Process(pid) for pid in list(self.table)]

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


def info(
    pid: int, pgid: int, role: ProcessRole, create_time: float = 100.0, stage: int | None = None
):
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
