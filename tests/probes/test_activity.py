"""Reading what a process does from /proc and py-spy, on processes the tests start."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from deadline import wait_for, wait_until

from omni_watchdog.clock import FakeClock
from omni_watchdog.detector.causes import COMPARED_SPAN, process_cause
from omni_watchdog.policy.capture import find_py_spy
from omni_watchdog.probes.activity import (
    STACK_EVERY,
    ActivityProbe,
    ProcessTableReading,
    StackError,
    parse_py_spy_json,
    read_activity,
    sample_stacks,
)
from omni_watchdog.process_start import CLOCK_TICKS
from omni_watchdog.types import (
    Observation,
    ProcessActivity,
    ProcessInfo,
    ProcessRole,
    ProcessStatus,
    SilenceCause,
    StageRef,
)

# A parent that waits on a child busy-looping: how a stage waits on a compiler.
PARENT_OF_A_BUSY_CHILD = (
    "import subprocess, sys;subprocess.run([sys.executable, '-c', 'while True: pass'])"
)
SPINNER = "def spin_here():\n    while True: pass\nspin_here()"
DEADLINE_S = 20.0


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    processes: list[subprocess.Popen[bytes]] = []
    yield processes
    for process in processes:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def start(processes: list[subprocess.Popen[bytes]], code: str) -> int:
    process = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    processes.append(process)
    return process.pid


def reading(pid: int) -> ProcessActivity:
    activity = read_activity(pid, time.monotonic())
    assert activity is not None
    return activity


def read_until_child_ran(pid: int, first: ProcessActivity, seconds: float) -> ProcessActivity:
    """Readings until some descendant has run `seconds` more than at `first`."""
    before = {c.pid: c.cpu_seconds for c in first.children}

    def ran() -> ProcessActivity | None:
        later = reading(pid)
        worked = any(c.cpu_seconds - before.get(c.pid, 0.0) >= seconds for c in later.children)
        return later if worked else None

    return wait_until(ran, DEADLINE_S, f"a descendant of {pid} running {seconds}s", 0.05)


def reading_with_children(pid: int) -> ProcessActivity:
    """The first reading of `pid` that shows a child of it."""

    def with_children() -> ProcessActivity | None:
        activity = reading(pid)
        return activity if activity.children else None

    return wait_until(with_children, DEADLINE_S, f"a child of {pid} started", 0)


def reading_in_state(pid: int, state: str, of_child: bool = False) -> ProcessActivity:
    """The first reading of `pid` whose main thread, or first child, is in `state`."""

    def in_state() -> ProcessActivity | None:
        activity = reading(pid)
        now = activity.children[0].state if of_child else activity.threads[0].state
        return activity if now == state else None

    return wait_until(in_state, DEADLINE_S, f"{pid} in state {state}", 0)


def test_a_parent_waiting_on_a_busy_child_is_waiting_on_work(
    started: list[subprocess.Popen[bytes]],
) -> None:
    pid = start(started, PARENT_OF_A_BUSY_CHILD)
    first = reading_with_children(pid)
    later = read_until_child_ran(pid, first, 0.3)
    finding = process_cause(first, later)
    assert finding.cause is SilenceCause.WAITING_ON_CHILD and finding.working, finding
    assert f"pid {first.children[0].pid}" in finding.detail
    assert [t.wait_channel for t in later.threads if t.tid == pid] == ["do_wait"]


# A compiler driver: its pass, a child of its own, works 0.6 s and ends; the driver then
# sleeps, as g++ does between cc1plus and as, having used next to no CPU itself.
DRIVER_OF_ONE_PASS = (
    "import subprocess, sys, time\n"
    "subprocess.run([sys.executable, '-c',"
    " 'import time\\ne = time.monotonic() + 0.6\\nwhile time.monotonic() < e: pass'])\n"
    "time.sleep(600)"
)


def test_a_child_whose_own_child_worked_and_ended_between_readings_advanced(
    started: list[subprocess.Popen[bytes]],
) -> None:
    pid = start(
        started,
        f"import subprocess, sys; subprocess.run([sys.executable, '-c', {DRIVER_OF_ONE_PASS!r}])",
    )
    first = reading_with_children(pid)
    driver = first.children[0].pid
    # Until the pass has come and gone, and the readings span enough to judge.
    pass_seen = len(first.children) > 1

    def pass_ended() -> ProcessActivity | None:
        nonlocal pass_seen
        later = reading(pid)
        pass_seen = pass_seen or len(later.children) > 1
        judged = len(later.children) == 1 and later.time - first.time >= COMPARED_SPAN
        return later if pass_seen and judged else None

    later = wait_until(pass_ended, DEADLINE_S, "the driver's pass come and gone", 0.05)
    assert [c.pid for c in later.children] == [driver], later.children
    finding = process_cause(first, later)
    assert finding.cause is SilenceCause.WAITING_ON_CHILD and finding.working, finding
    assert f"pid {driver}" in finding.detail, finding


def test_a_parent_waiting_on_a_stopped_child_waits_on_work_stopped(
    started: list[subprocess.Popen[bytes]],
) -> None:
    pid = start(started, PARENT_OF_A_BUSY_CHILD)
    first = reading_with_children(pid)
    # Stopped before it has exec'd, the child would hold its parent in vfork's wait.
    wait_until(
        lambda: reading(pid).threads[0].wait_channel == "do_wait",
        DEADLINE_S,
        "the parent waiting on its child",
        0.05,
    )
    child = first.children[0].pid
    os.kill(child, signal.SIGSTOP)
    stopped = reading_in_state(pid, "T", of_child=True)
    # Readings a moment apart, the child stopped through both.
    later = reading(pid)
    while later.time - stopped.time < 0.2:
        later = reading(pid)
    finding = process_cause(stopped, later)
    assert finding.cause is SilenceCause.WAITING_ON_CHILD and not finding.working, finding
    assert f"pid {child}: stopped (T)" in finding.detail


def test_a_stopped_process_is_stopped(started: list[subprocess.Popen[bytes]]) -> None:
    pid = start(started, SPINNER)
    os.kill(pid, signal.SIGSTOP)
    first = reading_in_state(pid, "T")
    later = reading(pid)
    while later.time - first.time < 0.1:
        later = reading(pid)
    assert process_cause(first, later).cause is SilenceCause.STOPPED


def test_a_gone_process_reads_as_none() -> None:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    assert read_activity(process.pid, time.monotonic()) is None


def test_py_spy_sees_a_spinning_thread_in_its_frame(
    started: list[subprocess.Popen[bytes]],
) -> None:
    py_spy = find_py_spy()
    if py_spy is None:
        pytest.fail("py-spy is not installed: make test installs it")
    pid = start(started, SPINNER)

    async def run(argv: list[str], timeout: float) -> tuple[int, str]:
        completed = await asyncio.to_thread(
            subprocess.run, argv, capture_output=True, text=True, timeout=timeout
        )
        return completed.returncode, completed.stdout + completed.stderr

    seen: list[tuple[str, ...]] = []

    async def spinning() -> tuple[str, ...] | None:
        """A sample of the main thread that shows it spinning (it starts by importing)."""
        try:
            stacks = await sample_stacks(py_spy, pid, 10.0, run)
        except StackError as error:
            # A sample taken without pausing the process may be torn, as the probe
            # knows: it has no stacks then and samples again later.
            seen.append((f"failed: {error}",))
            return None
        seen.append(stacks[pid].frames if pid in stacks else ())
        return seen[-1] if seen[-1] and seen[-1][0].startswith("spin_here (") else None

    frames = asyncio.run(
        wait_for(
            spinning,
            DEADLINE_S,
            "py-spy showing the main thread spinning",
            0,
            seen=lambda: seen[-3:],
        )
    )
    assert frames[0] == "spin_here (<string>:2)", frames


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("Process 1: python", "not JSON"),
        ('{"pid": 1}', "not a list"),
        ("[1]", "not an object"),
        ('[{"frames": []}]', "without os_thread_id"),
    ],
)
def test_a_py_spy_dump_that_cannot_be_read_says_why(text: str, reason: str) -> None:
    with pytest.raises(StackError, match=reason):
        parse_py_spy_json(text)


def test_the_probe_reads_only_silent_stages_and_samples_stacks_at_its_pace(
    started: list[subprocess.Popen[bytes]],
) -> None:
    pid = start(started, SPINNER)
    clock = FakeClock()
    silent: list[StageRef] = []
    info = ProcessInfo(
        pid,
        1.0,
        os.getpid(),
        pid,
        pid,
        "worker",
        ProcessStatus.RUNNING,
        0.0,
        ProcessRole.WORKER,
        StageRef(1),
    )
    samples: list[list[str]] = []
    answers = [
        (0, json.dumps([{"os_thread_id": pid, "frames": [{"name": "spin_here"}]}])),
        (1, "Error: failed to read the stack"),
    ]

    async def run(argv: list[str], timeout: float) -> tuple[int | None, str]:
        samples.append(argv)
        return answers[len(samples) - 1]

    probe = ActivityProbe(clock, lambda now: tuple(silent), lambda: [info], "py-spy", run)

    async def rounds() -> list[list[Observation]]:
        seen = [list(await probe.collect())]  # the stage beats: nothing is read
        silent.append(StageRef(1))
        seen.append(list(await probe.collect()))  # read, with a stack sample
        clock.advance(STACK_EVERY / 2)
        seen.append(list(await probe.collect()))  # read, its stacks not due yet
        clock.advance(STACK_EVERY)
        seen.append(list(await probe.collect()))  # read; the sample fails
        return seen

    quiet, first, second, third = asyncio.run(rounds())
    assert quiet == [] and len(samples) == 2
    for (observation,) in (first, second, third):
        assert observation.stage == StageRef(1) and observation.activity is not None
        assert observation.activity.pid == pid
    assert first[0].activity is not None and first[0].activity.stacks_read
    main = next(t for t in first[0].activity.threads if t.tid == pid)
    assert main.frames == ("spin_here (?:?)",)
    assert second[0].activity is not None and not second[0].activity.stacks_read
    assert third[0].activity is not None and not third[0].activity.stacks_read
    assert probe.stack_failures == 1 and "failed to read the stack" in probe.last_stack_error


def test_a_stage_process_under_another_is_read_for_itself_not_as_its_parents_work() -> None:
    def stat(state: str, parent: int, ticks: int, reaped_ticks: int = 0) -> list[str]:
        fields = [state, str(parent)] + ["0"] * 13
        fields[11] = str(ticks)
        fields[13] = str(reaped_ticks)
        return fields

    table = ProcessTableReading(
        {
            100: [(101, "VLLM::Worker", stat("R", 100, 500)), (102, "cc1plus", stat("R", 100, 90))],
            101: [(103, "python", stat("R", 101, 70))],
        }
    )
    assert [c.pid for c in table.descendants(100)] == [101, 102, 103]
    # The engine core's worker is a stage process: it and what works for it are its own.
    assert [(c.pid, c.name) for c in table.descendants(100, apart={101})] == [(102, "cc1plus")]
    assert [c.name for c in table.descendants(101)] == ["python"]


def test_a_child_s_cpu_time_holds_that_of_the_children_it_reaped() -> None:
    fields = ["S", "100"] + ["0"] * 13
    fields[11], fields[12], fields[13], fields[14] = "2", "1", "300", "40"
    table = ProcessTableReading({100: [(101, "g++", fields)]})
    (driver,) = table.descendants(100)
    assert driver.cpu_seconds * CLOCK_TICKS == pytest.approx(343)


def test_a_slow_stack_sample_never_makes_a_round_of_kernel_readings_stale(
    started: list[subprocess.Popen[bytes]],
) -> None:
    """On a loaded host py-spy can take seconds per process: the kernel is read first, for
    every process at one moment, and the stacks of all of them are sampled at once after."""
    pids = [start(started, SPINNER), start(started, SPINNER)]
    clock = FakeClock()
    infos = [
        ProcessInfo(
            pid, 1.0, os.getpid(), pid, pid, "worker", ProcessStatus.RUNNING, 0.0,
            ProcessRole.WORKER, StageRef(1, replica),
        )
        for replica, pid in enumerate(pids)
    ]  # fmt: skip
    in_flight: list[int] = []
    most_in_flight = 0

    async def slow_run(argv: list[str], timeout: float) -> tuple[int | None, str]:
        nonlocal most_in_flight
        pid = int(argv[-1])
        in_flight.append(pid)
        most_in_flight = max(most_in_flight, len(in_flight))
        await asyncio.sleep(0.05)
        clock.advance(1.5)  # what this sample cost on a loaded host
        in_flight.remove(pid)
        return 0, json.dumps([{"os_thread_id": pid, "frames": [{"name": "spin_here"}]}])

    silent = tuple(info.stage for info in infos if info.stage is not None)
    probe = ActivityProbe(clock, lambda now: silent, lambda: infos, "py-spy", slow_run)
    before = clock.monotonic()
    observations = asyncio.run(probe.collect())
    assert sorted(o.activity.pid for o in observations if o.activity) == sorted(pids)
    for observation in observations:
        assert observation.time == before and observation.activity is not None
        assert observation.activity.time == before and observation.activity.stacks_read
    assert most_in_flight == 2
