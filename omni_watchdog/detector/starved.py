"""The `starved` cause: a stage silent because its neighbours hold the CPUs.

On a loaded host a healthy stage waits for a CPU, runnable, and its loop beats late: its
lost heartbeats, late spans and failed canary are then the host's doing as much as its
own. They count only once one of them has held for `confirm_timeout` of the time the
stage could run (`rules.stood`, less `longest_wait`). This is read from what the process
probe gives every round (each process's CPU time and its time runnable waiting for a
CPU), so it holds without the activity probe too; the activity probe's own `starved`
finding (a thread that waited longer than it ran) says the same from a closer look.
"""

from __future__ import annotations

from collections.abc import Iterable

from omni_watchdog.config import DetectionConfig
from omni_watchdog.detector.causes import CauseFinding
from omni_watchdog.detector.memory import ProcessMemory, StageMemory, heartbeat_timeout
from omni_watchdog.types import ProcessStatus, SilenceCause

# A process that waited for a CPU at least this share of the time its latest readings cover
# since its stage's loop last beat was starved by its neighbours: its silence says nothing
# about its own loop. The readings looked at span this share of the stage's heartbeat
# timeout: at the defaults, a beat's interval and its export delay, what a stage given a
# CPU needs to be heard again.
STARVED_WAIT_SHARE = 0.1
STARVED_WINDOW_SHARE = 0.5
# Less CPU wait than this, since a stage's last beat, goes unsaid in its evidence; this
# much or more, and the stage's lateness is one kind of evidence, not several.
WAIT_WORTH_SAYING = 0.1
# A process that used a CPU at least this share of the time since its stage's loop last
# beat is running: its lateness is one kind of evidence too. Measured on the real vLLM-Omni
# beside a second server on two cores: a worker blocked in its forward used 1 % of a core
# through 11 s of silence; workers in forwards used 19 % to 82 % through silences of 1 s
# to 1.7 s.
RUNNING_SHARE = 0.1
# A stage one of whose processes waited for a CPU through this share of its silence is
# starved, whatever a closer reading of its other processes found them doing.
STARVED_SILENCE_SHARE = 0.5


def contended(memory: StageMemory, now: float) -> bool:
    """The CPU-contention rules may speak for the stage: no closer look has explained
    its silence, or one of its processes waited for a CPU through most of it.

    A stage whose processes were read asleep on a lock, stopped, spinning or waiting
    on the device is silent on its own, whatever its side threads waited for a CPU
    meanwhile: in a benchmark on two cores, a blocked forward's threads waited 0.7 s
    for one through 13 s (beside the watchdog's own stack samples), and the contention
    rules held its verdict back by 9 s. But an engine asleep on its worker's answer
    while that worker waits for a CPU is the host's doing: in a soak of two pipelines
    on two cores, a text stage's worker waited 6.3 s of its 9 s silence, its engine was
    read asleep in poll, and a healthy server was shut down."""
    cause = memory.cause
    if cause is None or cause.cause in (SilenceCause.STARVED, SilenceCause.UNKNOWN):
        return True
    beat = memory.last_heartbeat
    if beat is None or now <= beat:
        return False
    return longest_wait(memory.processes.values()) >= STARVED_SILENCE_SHARE * (now - beat)


def stage_starved(config: DetectionConfig, memory: StageMemory) -> CauseFinding | None:
    """The `starved` cause of a stage whose live process waited for a CPU in its latest
    readings since its loop last beat (see `starved_finding`)."""
    window = STARVED_WINDOW_SHARE * heartbeat_timeout(config, memory)
    return starved_finding(memory.processes.values(), window)


def starved_finding(processes: Iterable[ProcessMemory], window: float) -> CauseFinding | None:
    """`starved` when a live process of the stage waited for a CPU at least
    `STARVED_WAIT_SHARE` of the time its latest readings cover since its loop last beat,
    looking back `window` at most. The readings are the latest there are: a loaded host
    lets the probe run when it can. A stage given a CPU for the window and still silent is
    silent on its own: a moment's wait as the request that blocks it wakes it counts no
    longer. A stage with a stopped process is never starved."""
    live = [p for p in processes if p.exited_at is None]
    if any(p.info.status is ProcessStatus.STOPPED for p in live):
        return None
    for process in live:
        start = max(process.seen_at_beat, process.seen_at - window)
        base_at, base_wait = process.seen_at_beat, process.wait_at_beat
        for at, waited in process.waits:
            if base_at < at <= start:
                base_at, base_wait = at, waited
        covered = process.seen_at - base_at
        waited = process.info.cpu_wait_seconds - base_wait
        if covered > 0 and waited >= STARVED_WAIT_SHARE * covered:
            return CauseFinding(
                SilenceCause.STARVED,
                False,
                f"pid {process.info.pid} waited {waited:.1f}s of its last {covered:.1f}s for a CPU",
            )
    return None


def longest_wait(processes: Iterable[ProcessMemory]) -> float:
    """The longest any live process of the stage has waited for a CPU since its loop last
    beat. A stage stuck in a spin loop waits too, on a loaded host, so it is still judged:
    once `confirm_timeout` has passed without it waiting."""
    waiter = busiest_waiter(processes)
    return waiter[1] if waiter else 0.0


def busiest_waiter(processes: Iterable[ProcessMemory]) -> tuple[int, float] | None:
    """The live process that has waited longest for a CPU since its stage's loop last beat,
    and how long."""
    waits = [
        (p.info.pid, p.info.cpu_wait_seconds - p.wait_at_beat)
        for p in processes
        if p.exited_at is None
    ]
    return max(waits, key=lambda wait: wait[1], default=None)


def busiest_runner(processes: Iterable[ProcessMemory]) -> tuple[int, float] | None:
    """The live process that used the largest share of a CPU since its stage's loop last
    beat, and the CPU seconds it used, when that share is `RUNNING_SHARE` or more."""
    runners = [
        (p.info.pid, used, used / covered)
        for p in processes
        if p.exited_at is None
        and (covered := p.seen_at - p.seen_at_beat) > 0
        and (used := p.info.cpu_seconds - p.cpu_at_beat) >= RUNNING_SHARE * covered
    ]
    runner = max(runners, key=lambda run: run[2], default=None)
    return None if runner is None else (runner[0], runner[1])


def cpu_note(processes: Iterable[ProcessMemory]) -> str:
    """What a silent stage's processes did with a CPU meanwhile, when it is enough to say:
    on-call reads a busy host or a long step in the verdict, not only in the host's graphs."""
    kept = list(processes)
    notes = []
    waiter = busiest_waiter(kept)
    if waiter is not None and waiter[1] >= WAIT_WORTH_SAYING:
        notes.append(f"; pid {waiter[0]} waited {waiter[1]:.1f}s for a CPU since")
    runner = busiest_runner(kept)
    if runner is not None:
        notes.append(f"; pid {runner[0]} ran {runner[1]:.1f}s on a CPU since")
    return "".join(notes)
