"""What the kernel says a process is doing: its scheduler state and its wait channel.

A process that outlives SIGKILL is in uninterruptible sleep inside the kernel, most often
in the GPU driver; its state and the kernel function it waits in (`/proc/<pid>/wchan`)
are what an operator needs to decide between waiting, a GPU reset and a reboot.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import psutil

from omni_watchdog.types import ProcessIdentity, ProcessTable

PROC = Path("/proc")
# What /proc/<pid>/wchan reads for a process that is not waiting in the kernel.
NOT_WAITING = "0"


@dataclass(frozen=True)
class ProcessCondition:
    """A process's scheduler state (psutil's name) and kernel wait channel ("" unreadable)."""

    pid: int
    state: str
    wait_channel: str

    def describe(self) -> str:
        """The state and where it waits, e.g. `disk-sleep in nvidia_wait`."""
        if self.wait_channel == NOT_WAITING:
            return f"{self.state}, not waiting in the kernel"
        if not self.wait_channel:
            return f"{self.state}, wait channel unreadable"
        return f"{self.state} in {self.wait_channel}"


def read_condition(
    identity: ProcessIdentity, process_table: ProcessTable = psutil, proc: Path = PROC
) -> ProcessCondition:
    """The state and wait channel of a process, as far as this user may read them."""
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
    return ProcessCondition(identity.pid, state, wait_channel)
