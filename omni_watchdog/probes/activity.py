"""What a stage process is doing, read from outside: its threads, its descendants, and
(only while its stage is silent) its Python stacks.

Everything here reads /proc or runs py-spy once, bounded; nothing keeps state. The
detector compares two readings (`detector/causes.py`).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

from omni_watchdog import process_start
from omni_watchdog.types import (
    ChildActivity,
    Clock,
    Observation,
    ObservationKind,
    ProcessActivity,
    ProcessInfo,
    ProcessStatus,
    StageRef,
    ThreadActivity,
)

# Bounds on one reading: a process with more threads, or a tree with more descendants,
# is read in part (the first by id), never without end.
MAX_THREADS_READ = 256
MAX_CHILDREN_READ = 64
# Python frames kept per thread, innermost first: enough for the markers of a compile, a
# load or a device wait, which sit near the top of the stack.
MAX_FRAMES_KEPT = 48
# Fields of /proc/<pid>/stat after the command name: state 0, ppid 1, utime 11, stime 12.
_STATE, _PPID, _UTIME, _STIME, _CUTIME, _CSTIME = 0, 1, 11, 12, 13, 14

# Stage processes read per round, and how often each one's stacks are sampled while its
# stage is silent, each sample bounded in time: py-spy reads a process's memory without
# pausing it, about a tenth of a second of one core for a vLLM worker.
MAX_PROCESSES_READ = 16
STACK_EVERY = 1.0
STACK_TIMEOUT = 2.0

StackRunner = Callable[[list[str], float], Awaitable[tuple[int | None, str]]]


class ThreadStack(NamedTuple):
    """One thread's sample: its Python frames, innermost first, and whether it held the GIL."""

    frames: tuple[str, ...]
    owns_gil: bool


class StackError(ValueError):
    """py-spy's output could not be read as its JSON dump, with the reason."""


def read_activity(
    pid: int,
    now: float,
    proc: Path = process_start.PROC,
    table: ProcessTableReading | None = None,
    apart: Collection[int] = (),
) -> ProcessActivity | None:
    """One reading of `pid`'s threads and descendants at `now`, without stacks; None once
    it is gone. `table`, a pass over the process table already made for this round (one is
    made when not given); `apart`, processes read for themselves, left out of the
    descendants with theirs."""
    threads = _threads(pid, proc)
    if not threads:
        return None
    children = (table or read_process_table(proc)).descendants(pid, apart)
    return ProcessActivity(pid, now, threads, children)


async def sample_stacks(
    py_spy: str, pid: int, timeout: float, run: StackRunner
) -> dict[int, ThreadStack]:
    """The Python frames of each thread of `pid`, innermost first, without pausing it
    (py-spy's non-blocking dump: a sample may be torn, never the stage held)."""
    code, output = await run(
        [py_spy, "dump", "--json", "--nonblocking", "--pid", str(pid)], timeout
    )
    if code is None:
        raise StackError(f"py-spy gave no dump in {timeout:g}s: {output.strip()[-200:]}")
    if code != 0:
        raise StackError(f"py-spy exited with {code}: {output.strip()[-200:]}")
    return parse_py_spy_json(output)


class ActivityProbe:
    """Reads what the processes of each silent stage are doing, and samples their stacks
    (py-spy, non-blocking) at most every `stack_every` each. A stage that beats reads
    nothing: the watchdog's idle cost does not grow. A sample that fails leaves that reading
    without stacks, is counted, and the next one is tried in its time."""

    name = "activity"

    def __init__(
        self,
        clock: Clock,
        silent_stages: Callable[[float], Sequence[StageRef]],
        live: Callable[[], Sequence[ProcessInfo]],
        py_spy: str | None,
        run: StackRunner,
        *,
        stack_every: float = STACK_EVERY,
        stack_timeout: float = STACK_TIMEOUT,
        proc: Path = process_start.PROC,
    ) -> None:
        self._clock = clock
        self._silent_stages = silent_stages
        self._live = live
        self._py_spy = py_spy
        self._run = run
        self._stack_every = stack_every
        self._stack_timeout = stack_timeout
        self._proc = proc
        self._sampled_at: dict[int, float] = {}
        self.stack_failures = 0
        self.last_stack_error = ""

    async def collect(self) -> Sequence[Observation]:
        silent = set(self._silent_stages(self._clock.monotonic()))
        if not silent:
            self._sampled_at.clear()
            return []
        live = self._live()
        stage_processes = frozenset(info.pid for info in live if info.runs_stage_work)
        readable = [
            info
            for info in live
            if info.stage in silent
            and info.runs_stage_work
            and info.status not in (ProcessStatus.ZOMBIE, ProcessStatus.EXITED)
        ]
        chosen = readable[:MAX_PROCESSES_READ]
        # The kernel's view of every chosen process first, in one pass, every round: their
        # CPU times and their children's are read at one moment, and a round stays fresh
        # however slow py-spy is on a loaded host. Then the stacks that are due, all at
        # once, the round bounded by one `stack_timeout`; each thread's frames join the
        # reading they follow by a fraction of a second.
        now = self._clock.monotonic()

        def read_all() -> list[ProcessActivity | None]:
            # Each reading is timed when it is read, not when the round began: on a loaded
            # host the thread that reads may wait seconds for a CPU, and a thread's CPU
            # waits were then set against too short an interval (measured: "waited 7.3s
            # of 2.6s for a CPU").
            table = read_process_table(self._proc)
            return [
                read_activity(i.pid, self._clock.monotonic(), self._proc, table, stage_processes)
                for i in chosen
            ]

        readings = await asyncio.to_thread(read_all)
        due = [
            info.pid
            for info, reading in zip(chosen, readings, strict=True)
            if reading is not None and self._stacks_due(info.pid, now)
        ]
        stacks = await asyncio.gather(*(self._stacks(pid) for pid in due))
        sampled = dict(zip(due, stacks, strict=True))
        observations = [
            Observation(
                ObservationKind.ACTIVITY,
                now,
                info.stage,
                activity=with_stacks(reading, sampled.get(info.pid)),
            )
            for info, reading in zip(chosen, readings, strict=True)
            if reading is not None
        ]
        kept = {info.pid for info in readable}
        self._sampled_at = {pid: at for pid, at in self._sampled_at.items() if pid in kept}
        return observations

    def _stacks_due(self, pid: int, now: float) -> bool:
        last = self._sampled_at.get(pid)
        if self._py_spy is None or (last is not None and now - last < self._stack_every):
            return False
        self._sampled_at[pid] = now
        return True

    async def _stacks(self, pid: int) -> dict[int, ThreadStack] | None:
        assert self._py_spy is not None  # only asked for when due, which needs py-spy
        try:
            return await sample_stacks(self._py_spy, pid, self._stack_timeout, self._run)
        except StackError as error:
            self.stack_failures += 1
            self.last_stack_error = f"pid {pid}: {error}"
            return None


def with_stacks(
    reading: ProcessActivity, stacks: Mapping[int, ThreadStack] | None
) -> ProcessActivity:
    """`reading` with each thread's sampled frames, where a sample was taken."""
    if stacks is None:
        return reading
    threads = tuple(
        replace(thread, frames=stacks[thread.tid].frames, owns_gil=stacks[thread.tid].owns_gil)
        if thread.tid in stacks
        else thread
        for thread in reading.threads
    )
    return replace(reading, threads=threads, stacks_read=True)


def parse_py_spy_json(text: str) -> dict[int, ThreadStack]:
    """py-spy's `dump --json` as {os thread id: its sample}."""
    try:
        document: Any = json.loads(text)
    except json.JSONDecodeError as error:
        raise StackError(f"not JSON: {error}") from None
    if not isinstance(document, list):
        raise StackError("not a list of threads")
    stacks: dict[int, ThreadStack] = {}
    for thread in document:
        if not isinstance(thread, dict):
            raise StackError("a thread that is not an object")
        tid = thread.get("os_thread_id")
        frames = thread.get("frames")
        if not isinstance(tid, int) or not isinstance(frames, list):
            raise StackError("a thread without os_thread_id or frames")
        named = tuple(
            f"{frame.get('name', '?')} ({frame.get('filename', '?')}:{frame.get('line', '?')})"
            for frame in frames[:MAX_FRAMES_KEPT]
            if isinstance(frame, dict)
        )
        stacks[tid] = ThreadStack(named, thread.get("owns_gil") is True)
    return stacks


def _threads(pid: int, proc: Path) -> tuple[ThreadActivity, ...]:
    tasks = proc / str(pid) / "task"
    try:
        tids = sorted(int(name) for name in os.listdir(tasks))
    except (OSError, ValueError):
        return ()
    threads = []
    for tid in tids[:MAX_THREADS_READ]:
        directory = tasks / str(tid)
        fields = _stat_fields(directory)
        run_and_wait = _schedstat(directory)
        if fields is None or run_and_wait is None:
            continue  # the thread ended between the listing and the read
        threads.append(
            ThreadActivity(
                tid,
                fields[_STATE],
                _wait_channel(directory),
                run_and_wait[0],
                run_and_wait[1],
            )
        )
    return tuple(threads)


class ProcessTableReading:
    """One pass over /proc: each process's command name, state and CPU time, by parent."""

    def __init__(self, by_parent: Mapping[int, Sequence[tuple[int, str, list[str]]]]) -> None:
        self._by_parent = by_parent

    def descendants(self, pid: int, apart: Collection[int] = ()) -> tuple[ChildActivity, ...]:
        """Every descendant of `pid`, nearest first, at most `MAX_CHILDREN_READ`, leaving
        out those in `apart` and their own descendants: a stage process under another (vLLM's
        worker under its engine core) is read for itself, not as work done for its parent."""
        found: list[ChildActivity] = []
        parents = [pid]
        while parents and len(found) < MAX_CHILDREN_READ:
            below: list[int] = []
            for parent in parents:
                for child, command, fields in sorted(self._by_parent.get(parent, ())):
                    if child in apart:
                        continue
                    # With what its reaped children used: a g++ driver gains no CPU of
                    # its own, and cc1plus, done between two readings, is gone by the next.
                    ticks = sum(int(fields[i]) for i in (_UTIME, _STIME, _CUTIME, _CSTIME))
                    seconds = ticks / process_start.CLOCK_TICKS
                    found.append(ChildActivity(child, command, fields[_STATE], seconds))
                    below.append(child)
            parents = below
        return tuple(found[:MAX_CHILDREN_READ])


def read_process_table(proc: Path = process_start.PROC) -> ProcessTableReading:
    by_parent: dict[int, list[tuple[int, str, list[str]]]] = {}
    try:
        names = os.listdir(proc)
    except OSError:
        names = []
    for name in names:
        if not name.isdigit():
            continue
        read = _stat_with_name(proc / name)
        if read is not None:
            command, fields = read
            by_parent.setdefault(int(fields[_PPID]), []).append((int(name), command, fields))
    return ProcessTableReading(by_parent)


def _stat_fields(directory: Path) -> list[str] | None:
    read = _stat_with_name(directory)
    return read[1] if read is not None else None


def _stat_with_name(directory: Path) -> tuple[str, list[str]] | None:
    """The command name and the fields after it of a /proc stat file; None if unreadable."""
    try:
        stat = (directory / "stat").read_bytes()
    except OSError:
        return None
    # The command name, in parentheses, may itself hold spaces and parentheses.
    opening, closing = stat.find(b"("), stat.rfind(b")")
    if opening < 0 or closing < opening:
        return None
    fields = stat[closing + 2 :].decode(errors="replace").split()
    if len(fields) <= _CSTIME:
        return None
    return stat[opening + 1 : closing].decode(errors="replace"), fields


def _schedstat(directory: Path) -> tuple[float, float] | None:
    """Seconds on a CPU and seconds runnable waiting for one, to the ns."""
    try:
        fields = (directory / "schedstat").read_text().split()
        return int(fields[0]) / 1e9, int(fields[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def _wait_channel(directory: Path) -> str:
    try:
        channel = (directory / "wchan").read_text().strip()
    except OSError:
        return ""
    # The kernel writes 0 for a thread that is not waiting, and where it hides channels.
    return "" if channel == "0" else channel
