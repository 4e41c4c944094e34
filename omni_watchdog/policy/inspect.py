"""What the kernel says a process is doing: its scheduler state, whether SIGKILL has
reached it, and its wait channel.

A process that outlives SIGKILL is either on its way out (the signal is pending or the
kernel runs its exit, and it needs only CPU time: a busy core, a large address space to
free) or in uninterruptible sleep inside the kernel, most often in the GPU driver. Its
state, its pending signals and exit flag, and the kernel function it waits in
(`/proc/<pid>/wchan`) tell the two apart, and are what an operator needs to decide between
waiting, a GPU reset and a reboot.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import psutil

from omni_watchdog.types import ProcessIdentity, ProcessTable

PROC = Path("/proc")
# What /proc/<pid>/wchan reads for a process that is not waiting in the kernel, and for
# every process where the kernel does not show wait channels.
NOT_WAITING = "0"
# PF_EXITING in the flags field of /proc/<pid>/stat: the kernel has begun the exit.
_PF_EXITING = 0x4
# The flags are the seventh field after the command name's closing parenthesis.
_FLAGS_FIELD = 6
# SIGKILL's bit in the pending-signal masks of /proc/<pid>/status.
_SIGKILL_BIT = 1 << (9 - 1)
# A kill(2) pends on the process (ShdPnd); the kernel marks each thread's own set (SigPnd).
_PENDING_FIELDS = ("SigPnd", "ShdPnd")


@dataclass(frozen=True)
class ProcessCondition:
    """A process's scheduler state (psutil's name), its kernel wait channel ("" unreadable),
    whether SIGKILL is pending on it and whether the kernel runs its exit, and its CPU time
    so far, its threads and its resident memory (each None unreadable)."""

    pid: int
    state: str
    wait_channel: str
    kill_pending: bool = False
    exiting: bool = False
    cpu_seconds: float | None = None
    threads: int | None = None
    rss_bytes: int | None = None

    @property
    def runnable(self) -> bool:
        """Running or waiting for a CPU: whatever it has left to do, it is not held."""
        return self.state == "running"

    def advanced_since(self, before: ProcessCondition) -> bool:
        """It ran, a thread of it left, or it freed memory since `before` was read."""
        return (
            _rose(before.cpu_seconds, self.cpu_seconds)
            or _rose(self.threads, before.threads)
            or _rose(self.rss_bytes, before.rss_bytes)
        )

    @property
    def dying(self) -> bool:
        """SIGKILL has reached it and it is not held in an uninterruptible wait: it is gone
        once it gets the CPU time to act on the signal and free what it holds."""
        return (self.kill_pending or self.exiting) and self.state not in ("disk-sleep", "gone")

    def describe(self) -> str:
        """The state and where it waits, e.g. `disk-sleep, SIGKILL pending in nvidia_wait`."""
        state = self.state
        if self.kill_pending:
            state += ", SIGKILL pending"
        if self.exiting:
            state += ", exiting"
        if self.wait_channel == NOT_WAITING:
            if self.state == "running":
                return f"{state}, not waiting in the kernel"
            return f"{state}, wait channel hidden by the kernel"
        if not self.wait_channel:
            return f"{state}, wait channel unreadable"
        return f"{state} in {self.wait_channel}"


def read_condition(
    identity: ProcessIdentity, process_table: ProcessTable = psutil, proc: Path = PROC
) -> ProcessCondition:
    """What the kernel shows of a process, as far as this user may read it."""
    try:
        process = process_table.Process(identity.pid)
        state = process.status()
    except process_table.NoSuchProcess:
        state = "gone"
    except process_table.Error:
        state = "unknown"
    cpu_seconds: float | None = None
    if state not in ("gone", "unknown"):
        try:
            times = process.cpu_times()
            cpu_seconds = times.user + times.system
        except process_table.Error:
            pass
    directory = proc / str(identity.pid)
    try:
        wait_channel = (directory / "wchan").read_text().strip()
    except OSError:
        wait_channel = ""
    status = _status(directory)
    rss_kib = _number(status.get("VmRSS", ""))
    return ProcessCondition(
        identity.pid,
        state,
        wait_channel,
        kill_pending=any(
            _number(status.get(field, ""), 16) & _SIGKILL_BIT for field in _PENDING_FIELDS
        ),
        exiting=_exiting(directory),
        cpu_seconds=cpu_seconds,
        threads=_number(status.get("Threads", "")) if "Threads" in status else None,
        rss_bytes=rss_kib * 1024 if "VmRSS" in status else None,
    )


def _status(process_dir: Path) -> dict[str, str]:
    """The fields of /proc/<pid>/status, {} where it cannot be read."""
    try:
        lines = (process_dir / "status").read_text().splitlines()
    except OSError:
        return {}
    return {name: value.strip() for name, _, value in (line.partition(":") for line in lines)}


def _number(text: str, base: int = 10) -> int:
    """The leading number of a status field ("123 kB" is 123), 0 where there is none."""
    try:
        return int(text.split()[0], base) if text else 0
    except ValueError:
        return 0


def _exiting(process_dir: Path) -> bool:
    try:
        stat = (process_dir / "stat").read_text()
        flags = int(stat.rpartition(")")[2].split()[_FLAGS_FIELD])
    except (OSError, ValueError, IndexError):
        return False
    return bool(flags & _PF_EXITING)


def _rose(low: float | None, high: float | None) -> bool:
    """`high` is above `low`, both read."""
    return low is not None and high is not None and high > low
