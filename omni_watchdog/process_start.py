"""When a process started, on a clock that stepping the wall clock does not move.

A process is named for life by its pid and its start. psutil's `create_time()` gives the
start as clock ticks after boot plus the boot time as /proc/stat states it at the moment
of the call, and that boot time moves whenever the wall clock is stepped (NTP, a VM
resumed after a pause). Every process recorded before such a step would then look like
a stranger holding a recorded pid: counted as exited while it lives on with its GPU
memory, and never signalled. Here the ticks are read from /proc and the boot time is the
one this process read first, so a start time stays the same for the watchdog's life.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import psutil

from omni_watchdog.semconv import HOST_BOOT_ID, PROCESS_START_TICKS

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PROC = Path("/proc")
# Fields of /proc/<pid>/stat counted after the command name: state is 0, starttime 19.
_STARTTIME_FIELD = 19
BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")
LAST_PID_PATH = Path("/proc/sys/kernel/ns_last_pid")


def start_ticks(pid: int, proc: Path = PROC) -> int:
    """When `pid` started, in clock ticks after boot; psutil.NoSuchProcess once it is gone."""
    try:
        stat = (proc / str(pid) / "stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        raise psutil.NoSuchProcess(pid) from None
    # The command name, in parentheses, may itself hold spaces and parentheses.
    fields = stat[stat.rindex(b")") + 2 :].split()
    return int(fields[_STARTTIME_FIELD])


def seconds_after_boot(pid: int, proc: Path = PROC) -> float:
    """When `pid` started, in seconds after boot; psutil.NoSuchProcess once it is gone."""
    return start_ticks(pid, proc) / CLOCK_TICKS


@functools.cache
def first_boot_time() -> float:
    """The boot time as this process first read it; later reads move with the clock."""
    return float(psutil.boot_time())


def start_time_of_ticks(ticks: int) -> float:
    """The start time, as `start_time` gives it, of a process that started `ticks` after boot."""
    return first_boot_time() + ticks / CLOCK_TICKS


def start_time(pid: int) -> float:
    """When `pid` started, in seconds since the epoch, the same value for this process's
    life; psutil.NoSuchProcess once it is gone."""
    return start_time_of_ticks(start_ticks(pid))


@functools.cache
def boot_id() -> str:
    """The kernel's random id of this boot; two hosts (or two boots) never share one."""
    try:
        return BOOT_ID_PATH.read_text().strip()
    except OSError:
        return ""


def last_pid() -> int:
    """The pid this kernel handed out last in the reader's pid namespace. A fork in any
    namespace below it takes a pid here too, so while this number stands no process was
    born anywhere this /proc shows; OSError where the kernel does not tell it."""
    return int(LAST_PID_PATH.read_text())


def sender_attributes(pid: int) -> dict[str, int | str]:
    """The resource attributes that name `pid` for life on this host; empty if unreadable."""
    try:
        return {PROCESS_START_TICKS: start_ticks(pid), HOST_BOOT_ID: boot_id()}
    except (psutil.Error, OSError, ValueError, IndexError):
        return {}
