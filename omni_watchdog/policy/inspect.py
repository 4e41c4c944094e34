"""What the kernel says a process is doing: its scheduler state, whether it is exiting,
and its wait channel.

A process that outlives SIGKILL is either still being torn down (the kernel runs its exit,
slowed by a large address space or a CPU it must share) or in uninterruptible sleep inside
the kernel, most often in the GPU driver. Its state, its exit flag and the kernel function
it waits in (`/proc/<pid>/wchan`) are what tell the two apart, and what an operator needs
to decide between waiting, a GPU reset and a reboot.
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


@dataclass(frozen=True)
class ProcessCondition:
    """A process's scheduler state (psutil's name), whether the kernel is running its exit,
    and its kernel wait channel ("" unreadable)."""

    pid: int
    state: str
    wait_channel: str
    exiting: bool = False

    @property
    def tearing_down(self) -> bool:
        """The kernel is running its exit and it is not stuck in an uninterruptible wait:
        it will be gone once it gets the CPU time to free what it holds."""
        return self.exiting and self.state not in ("disk-sleep", "gone")

    def describe(self) -> str:
        """The state and where it waits, e.g. `disk-sleep in nvidia_wait`."""
        state = f"{self.state}, exiting" if self.exiting else self.state
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
    """The state, exit flag and wait channel of a process, as far as this user may read them."""
    try:
        state = process_table.Process(identity.pid).status()
    except process_table.NoSuchProcess:
        state = "gone"
    except process_table.Error:
        state = "unknown"
    try:
        wait_channel = (proc / str(identity.pid) / "wchan").read_text().strip()
    except OSError:
        wait_channel = ""
    return ProcessCondition(identity.pid, state, wait_channel, _exiting(proc / str(identity.pid)))


def _exiting(process_dir: Path) -> bool:
    try:
        stat = (process_dir / "stat").read_text()
        flags = int(stat.rpartition(")")[2].split()[_FLAGS_FIELD])
    except (OSError, ValueError, IndexError):
        return False
    return bool(flags & _PF_EXITING)
