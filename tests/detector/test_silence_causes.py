"""Table tests: a stage falls silent on a request; what it is doing decides the verdict.

The talker of a three-stage pipeline gets a request and stops beating. The activity probe
reads its process while it is silent (every half second, stacks every second), as the
watchdog does; the canary, queued behind the request, times out. Work that advances (a
compiler child, a step whose frames move) is never worse than `degraded` until its
budget runs out; work that stops advancing, a blocked loop and a spin are judged, each
as fast as its cause allows, and every verdict names its cause.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

from omni_watchdog.clock import FakeClock
from omni_watchdog.config import DetectionConfig
from omni_watchdog.detector import Detector
from omni_watchdog.detector.silence import SILENT_SHARE
from omni_watchdog.types import (
    STEP_COUNTERS,
    ChildActivity,
    DetectorReport,
    HealthOutcome,
    Observation,
    ObservationKind,
    ProcessActivity,
    ProcessInfo,
    ProcessRole,
    ProcessStatus,
    SilenceCause,
    SpanOutcome,
    Stage,
    StageRef,
    StageState,
    ThreadActivity,
    Topology,
    Verdict,
)

S0, S1, S2 = StageRef(0), StageRef(1), StageRef(2)
PIPELINE = Topology(
    (
        Stage(0, "thinker", downstream=(1,)),
        Stage(1, "talker", upstream=(0,), downstream=(2,)),
        Stage(2, "code2wav", upstream=(1,), final_output=True),
    )
)
ROOT = ProcessInfo(100, 1.0, 1, 100, 100, "api", ProcessStatus.SLEEPING, 1.0, ProcessRole.API)
WORKER = ProcessInfo(
    201, 2.0, 100, 100, 100, "worker", ProcessStatus.SLEEPING, 1.0, ProcessRole.WORKER, S1
)
ENGINE = ProcessInfo(
    202, 2.0, 100, 100, 100, "engine", ProcessStatus.SLEEPING, 1.0, ProcessRole.ENGINE, S1
)
COMPILER_PID = 300
STEP = 0.25
ADMITTED_AT = 8.0  # warm from 5 s (first healthy /health at 0 s + 5 s grace)
AT_TALKER = 9.0  # the thinker's span: the request now waits at the talker
FORWARD = "forward (/models/tiny.py:{line})"
EXECUTE = "execute_model (/venv/vllm/v1/worker/gpu_model_runner.py:1800)"
INDUCTOR = "codegen (/venv/torch/_inductor/codegen/cpp.py:900)"


@dataclass
class Work:
    """What the talker does with the request, from its arrival, for `lasts` seconds (then
    it beats again and sends its span); forever when `lasts` is None."""

    # "block", "spin", "compile", "steps"; "starved-compile": a compiler given a CPU
    # only now and then, its time moving by a tick a second (a loaded host); "inductor":
    # the worker's own thread generates a compile's code, in Inductor's frames, running
    # `cpu_share` of the time and waiting for a CPU `cpu_wait_share` of it
    kind: str
    lasts: float | None = None
    # The compiler child is stopped (SIGSTOP) this long after the arrival.
    child_stopped_at: float | None = None
    # The stage's engine core, asleep on its queue, is read too; the worker's readings stop
    # coming this long after the arrival (a probe round that could not read it).
    with_engine: bool = False
    # The talker's load gauge says 1 from the arrival until this long after the work ends
    # (a scrape that has not caught up), its counters flat; None: no load gauge at all.
    load_lingers: float | None = None
    # Through its silence its processes wait this share of the time for a CPU (side
    # threads woken beside the watchdog's own stack samples on a small host).
    cpu_wait_share: float = 0.0
    # Through its silence the worker gains this share of the time on a CPU (its turns on a
    # loaded host), however it is read between them.
    cpu_share: float = 0.0
    worker_unread_from: float | None = None
    history: list[DetectorReport] = field(default_factory=list)

    def busy(self, since: float) -> bool:
        return self.kind in ("spin", "steps") and self.working(since)

    def working(self, since: float) -> bool:
        return since >= 0 and (self.lasts is None or since < self.lasts)

    def activity(self, now: float, since: float, stacks: bool) -> ProcessActivity:
        """What /proc (and py-spy, with `stacks`) shows of the worker `since` the arrival."""
        worked = max(0.0, since) if self.working(since) else 0.0
        if self.kind in ("spin", "steps"):
            # A spin moves between the lines of its loop holding the GIL; a step of tensor
            # work moves between them too, in native calls that release it.
            frames = (FORWARD.format(line=10 + int(since) % 7), EXECUTE) if stacks else ()
            spinning = stacks and self.kind == "spin"
            main = ThreadActivity(201, "R", "", 5.0 + worked, 0.1, frames, owns_gil=spinning)
            return ProcessActivity(201, now, (main,), (), stacks)
        if self.kind == "inductor" and self.working(since):
            frames = (INDUCTOR, EXECUTE) if stacks else ()
            ran, waited = self.cpu_share * since, self.cpu_wait_share * since
            main = ThreadActivity(201, "R", "", 5.0 + ran, 0.1 + waited, frames)
            return ProcessActivity(201, now, (main,), (), stacks)
        frames = ("wait (/usr/lib/python3.11/threading.py:327)", EXECUTE) if stacks else ()
        compiling = self.kind in ("compile", "starved-compile")
        channel = "do_wait" if compiling else "futex_do_wait"
        main = ThreadActivity(201, "S", channel, 5.0, 0.1, frames)
        children: tuple[ChildActivity, ...] = ()
        if self.kind == "starved-compile" and self.working(since):
            ticks = 0.05 * int(since)
            children = (ChildActivity(COMPILER_PID, "cc1plus", "S", ticks),)
        elif compiling and self.working(since):
            stopped = self.child_stopped_at is not None and since >= self.child_stopped_at
            ran = min(since, self.child_stopped_at) if stopped and self.child_stopped_at else since
            state = "T" if stopped else "R"
            children = (ChildActivity(COMPILER_PID, "cc1plus", state, 0.9 * ran),)
        return ProcessActivity(201, now, (main,), children, stacks)


def drive(
    work: Work, seconds: float, config: DetectionConfig, detector: Detector | None = None
) -> list[DetectorReport]:
    """The reports of `seconds` of `work`, judged by `detector` (a new one by default)."""
    clock = FakeClock()
    start = clock.monotonic()
    detector = detector or Detector(config, PIPELINE, start)
    for tick in range(int(seconds / STEP) + 1):
        now = clock.monotonic()
        elapsed = now - start
        since = elapsed - AT_TALKER
        out = [Observation(ObservationKind.PROCESS, now, process=ROOT, outcome=ROOT.status)]
        talker_silent = work.working(since)
        if tick % 4 == 0:  # each second: /health, heartbeats, a scrape
            out.append(Observation(ObservationKind.HEALTH, now, outcome=HealthOutcome.OK))
            for ref in (S0, S1, S2):
                if ref != S1 or not talker_silent:
                    out.append(Observation(ObservationKind.HEARTBEAT, now, stage=ref))
                out.append(
                    Observation(ObservationKind.PROGRESS, now, ref, 10.0, detail=STEP_COUNTERS)
                )
        if talker_silent and since >= 2.0 and tick % 8 == 0:
            # The canary, queued behind the request, times out every two seconds.
            out.append(
                Observation(ObservationKind.CANARY, now, value=2.0, outcome=HealthOutcome.TIMEOUT)
            )
        elif work.load_lingers is not None and since >= 2.0 and tick % 12 == 0:
            # Once the request is done, the next canary (every three seconds) is answered.
            out.append(
                Observation(ObservationKind.CANARY, now, value=0.1, outcome=HealthOutcome.OK)
            )
        if work.load_lingers is not None and tick % 4 == 0:
            ends = None if work.lasts is None else work.lasts + work.load_lingers
            running = since >= 0.0 and (ends is None or since < ends)
            out.append(Observation(ObservationKind.LOAD, now, S1, 1.0 if running else 0.0))
        busy = work.busy(since)
        status = ProcessStatus.RUNNING if busy else ProcessStatus.SLEEPING
        cpu = 5.0 + max(0.0, since) * (1.0 if busy else work.cpu_share)
        waited = work.cpu_wait_share * max(0.0, since)
        worker = dataclasses.replace(
            WORKER, status=status, cpu_seconds=cpu, cpu_wait_seconds=waited
        )
        out.append(Observation(ObservationKind.PROCESS, now, process=worker, outcome=status))
        if work.with_engine:
            out.append(Observation(ObservationKind.PROCESS, now, process=ENGINE, outcome=status))
        if tick % 2 == 0 and S1 in detector.silent_stages(now):
            stacks = tick % 4 == 0
            if work.worker_unread_from is None or since < work.worker_unread_from:
                reading = work.activity(now, since, stacks)
                out.append(Observation(ObservationKind.ACTIVITY, now, S1, activity=reading))
            if work.with_engine:
                queue = ("get (/usr/lib/python3.11/queue.py:171)",) if stacks else ()
                asleep = ThreadActivity(202, "S", "futex_do_wait", 3.0, 0.1, queue)
                engine = ProcessActivity(202, now, (asleep,), (), stacks)
                out.append(Observation(ObservationKind.ACTIVITY, now, S1, activity=engine))
        if elapsed == ADMITTED_AT:
            out.append(
                Observation(ObservationKind.REQUEST_ADMITTED, now, request_id="r1", path=(0, 1, 2))
            )
        done_at = None if work.lasts is None else AT_TALKER + work.lasts
        for ref, at in ((S0, AT_TALKER), (S1, done_at), (S2, done_at)):
            if elapsed == at:
                out.append(
                    Observation(
                        ObservationKind.STAGE_SPAN, now, ref, 0.5, SpanOutcome.OK, request_id="r1"
                    )
                )
        detector.observe(out)
        work.history.append(dataclasses.replace(detector.evaluate(now), time=elapsed))
        clock.advance(STEP)
    return work.history


def first_verdict(reports: list[DetectorReport]) -> tuple[float, Verdict] | None:
    for report in reports:
        for verdict in report.verdicts:
            return report.time - AT_TALKER, verdict
    return None


def talker_states(reports: list[DetectorReport]) -> set[StageState]:
    return {s.state for r in reports if r.warmed_up for s in r.statuses if s.stage == S1}


def causes_shown(reports: list[DetectorReport]) -> set[SilenceCause]:
    return {
        s.cause.cause for r in reports for s in r.statuses if s.stage == S1 and s.cause is not None
    }


DEFAULTS = DetectionConfig()

# name, work, the cause the verdict names, judged within (s after the arrival)
JUDGED = [
    ("its loop blocked, asleep on a lock", Work("block"), SilenceCause.LOCK_OR_QUEUE_WAIT, 4.0),
    ("its loop spinning in one frame", Work("spin"), SilenceCause.SPINNING, 15.0),
    (
        "its compiler child stopped half-way",
        Work("compile", child_stopped_at=20.0),
        SilenceCause.WAITING_ON_CHILD,
        20.0 + 2.0,
    ),
]


@pytest.mark.parametrize(
    ("work", "cause", "within"), [j[1:] for j in JUDGED], ids=[j[0] for j in JUDGED]
)
def test_a_silence_without_work_advancing_is_judged_as_fast_as_its_cause_allows(
    work: Work, cause: SilenceCause, within: float
) -> None:
    found = first_verdict(drive(work, AT_TALKER + 60.0, DEFAULTS))
    assert found is not None, causes_shown(work.history)
    moment, verdict = found
    assert verdict.stage == S1 and verdict.state is StageState.STALLED, verdict
    assert verdict.cause is not None and verdict.cause.cause is cause, verdict.cause
    assert not verdict.cause.working and verdict.cause.working_since is None
    assert moment <= within, (moment, verdict)


def test_a_stopped_compiler_is_judged_only_once_it_stopped() -> None:
    work = Work("compile", child_stopped_at=20.0)
    found = first_verdict(drive(work, AT_TALKER + 40.0, DEFAULTS))
    assert found is not None
    assert found[0] >= 20.0, found
    assert "cc1plus pid 300: stopped (T)" in (found[1].cause.detail if found[1].cause else "")


def test_a_loop_read_asleep_on_a_lock_is_judged_fast_whatever_its_side_threads_waited() -> None:
    """The CPU-contention rules speak only where nothing closer explained the silence: a
    worker whose loop was read asleep on a lock is blocked, even where its processes waited
    for a CPU a tenth of the time (measured in a benchmark on two cores: a blocked
    forward judged at 12.2 s, not 3.3 s, before this)."""
    found = first_verdict(drive(Work("block", cpu_wait_share=0.12), AT_TALKER + 30.0, DEFAULTS))
    assert found is not None
    moment, verdict = found
    assert verdict.cause is not None and verdict.cause.cause is SilenceCause.LOCK_OR_QUEUE_WAIT
    assert moment <= 4.0, (moment, verdict)


def test_a_stage_waiting_for_a_cpu_through_most_of_its_silence_is_starved_not_blocked() -> None:
    """Its engine asleep on the queue and its worker read asleep between turns on a CPU,
    but the worker waited for one through 70 % of the silence: the host's doing (measured
    in a soak of two real pipelines on two cores: a healthy text stage judged stalled, its
    server shut down). A real hang on such a host is still judged, its waits not counted."""
    starved = Work("block", lasts=8.0, with_engine=True, cpu_wait_share=0.7, cpu_share=0.1)
    reports = drive(starved, AT_TALKER + 20.0, DEFAULTS)
    assert first_verdict(reports) is None
    assert talker_states(reports) <= {StageState.HEALTHY, StageState.DEGRADED}
    hung = Work("block", with_engine=True, cpu_wait_share=0.7, cpu_share=0.1)
    found = first_verdict(drive(hung, AT_TALKER + 60.0, DEFAULTS))
    assert found is not None
    moment, verdict = found
    assert verdict.state is StageState.STALLED
    # Judged once the time it could run reached `confirm_timeout`, not before.
    assert moment >= DEFAULTS.confirm_timeout, (moment, verdict)


# name, work: legit work that ends by itself; never worse than degraded, its cause shown
LEGIT = [
    ("a compiler child at full CPU for 60 s", Work("compile", lasts=60.0), SilenceCause.COMPILING),
    ("a step whose frames move, for 30 s", Work("steps", lasts=30.0), SilenceCause.COMPUTING),
    # Read every 0.5 s, it gains nothing between every other pair of readings: measured on
    # the real vLLM-Omni under two busy loops, a g++ judged stopped from readings 0.3 s
    # apart got its server shut down.
    (
        "a compiler on a loaded host, its CPU time moving a tick a second, for 40 s",
        Work("starved-compile", lasts=40.0),
        SilenceCause.COMPILING,
    ),
    # Measured in CI: a `torch.compile` in the talker's forward, two real servers on two
    # cores; its server was shut down mid-compile. Waiting for a CPU slows work down; it
    # does not make it another thing.
    (
        "a compile's code generated in-process, waiting for a CPU longer than it runs, 60 s",
        Work("inductor", lasts=60.0, with_engine=True, cpu_share=0.35, cpu_wait_share=0.6),
        SilenceCause.COMPILING,
    ),
]


@pytest.mark.parametrize(("work", "cause"), [w[1:] for w in LEGIT], ids=[w[0] for w in LEGIT])
def test_legit_work_that_advances_is_never_worse_than_degraded(
    work: Work, cause: SilenceCause
) -> None:
    assert work.lasts is not None
    reports = drive(work, AT_TALKER + work.lasts + 20.0, DEFAULTS)
    assert first_verdict(reports) is None
    assert talker_states(reports) <= {StageState.HEALTHY, StageState.DEGRADED}
    assert cause in causes_shown(reports)
    # Once it beats again its cause is gone with its silence.
    last = next(s for s in reports[-1].statuses if s.stage == S1)
    assert last.state is StageState.HEALTHY and last.cause is None, last


def test_an_engine_asleep_on_its_queue_speaks_for_itself_not_for_its_compiling_worker() -> None:
    read = Work("compile", lasts=60.0, with_engine=True)
    reports = drive(read, AT_TALKER + 80.0, DEFAULTS)
    assert first_verdict(reports) is None and SilenceCause.COMPILING in causes_shown(reports)
    # The worker's readings stop: the engine's sleep must not become the stage's cause.
    unread = Work("compile", lasts=60.0, with_engine=True, worker_unread_from=5.0)
    found = first_verdict(drive(unread, AT_TALKER + 80.0, DEFAULTS))
    assert found is not None
    assert found[1].cause is not None and found[1].cause.cause is SilenceCause.UNKNOWN, found
    assert "pid 201 not read lately" in found[1].cause.detail


def test_what_piled_up_while_work_was_excused_is_not_a_verdict_the_moment_it_ends() -> None:
    """The build ends and the stage beats again; for a moment its failed canary and a load
    gauge not yet scraped back to 0 still stand. They were the work's, and are not counted."""
    work = Work("compile", lasts=30.0, load_lingers=2.0)
    reports = drive(work, AT_TALKER + 50.0, DEFAULTS)
    assert first_verdict(reports) is None, first_verdict(reports)
    assert talker_states(reports) <= {StageState.HEALTHY, StageState.DEGRADED}


@pytest.mark.parametrize(
    ("config", "budget"),
    [
        (DetectionConfig(work_timeout=60.0), 60.0),
        (DetectionConfig(work_timeouts={"compiling": "30s"}), 30.0),
    ],
    ids=["work_timeout", "a compiling bound of its own"],
)
def test_work_longer_than_its_budget_is_judged_naming_the_work(
    config: DetectionConfig, budget: float
) -> None:
    work = Work("compile")
    found = first_verdict(drive(work, AT_TALKER + budget + 20.0, config))
    assert found is not None
    moment, verdict = found
    assert verdict.cause is not None and verdict.cause.cause is SilenceCause.COMPILING
    assert verdict.cause.working and f"past its {budget:g}s budget" in verdict.cause.detail
    # What the work is charged from goes with the cause, for /metrics to set beside the budget.
    assert verdict.cause.working_since is not None
    assert verdict.time - verdict.cause.working_since >= budget
    # The silence is read from half the heartbeat timeout after the last beat.
    assert budget < moment <= budget + 3.0, moment


def test_only_a_silent_stage_is_read() -> None:
    clock = FakeClock()
    detector = Detector(DEFAULTS, PIPELINE, clock.monotonic())
    beat_until = 10.0
    read: list[tuple[float, tuple[StageRef, ...]]] = []
    start = clock.monotonic()
    for _ in range(int(14.0 / STEP)):
        now = clock.monotonic()
        elapsed = now - start
        if elapsed <= beat_until and elapsed % 1.0 == 0:
            detector.observe([Observation(ObservationKind.HEARTBEAT, now, stage=S1)])
        read.append((elapsed, detector.silent_stages(now)))
        clock.advance(STEP)
    silence_read_from = beat_until + 0.5 * DEFAULTS.heartbeat_timeout
    # S0 and S2 never beat: nothing tells of their silence, so nothing reads them.
    assert all(stages == () for now, stages in read if now <= silence_read_from)
    assert all(stages == (S1,) for now, stages in read if now > silence_read_from)


def test_a_gap_the_stage_shows_as_a_matter_of_course_is_not_a_silence() -> None:
    """Beats every second arrive in bodies every half second: gaps of 1.8 s now and then
    are routine, and reading the stage's processes (stacks and all) for each would be the
    watchdog's cost at idle. Once its gaps are learned, its rhythm stretches its timeout,
    and only a quiet longer than they are is read."""
    clock = FakeClock()
    detector = Detector(DEFAULTS, PIPELINE, clock.monotonic())
    start = clock.monotonic()
    beat_at = 0.0
    beats = 0
    read_at: list[float] = []
    for tick in range(int(60.0 / 0.1)):
        elapsed = tick * 0.1
        now = start + elapsed
        if elapsed >= beat_at - 1e-9:
            detector.observe([Observation(ObservationKind.HEARTBEAT, now, stage=S1)])
            beats += 1
            # Every fifth gap is 1.8 s, the others 1 s.
            beat_at = elapsed + (1.8 if beats % 5 == 0 else 1.0)
        if elapsed > 30.0 and S1 in detector.silent_stages(now):
            read_at.append(elapsed)
    assert read_at == []
    # Silent for real: read from just past its longest routine gap.
    quiet_from = start + beat_at
    detector.observe([Observation(ObservationKind.HEARTBEAT, quiet_from, stage=S1)])
    assert S1 not in detector.silent_stages(quiet_from + 1.75)
    assert S1 in detector.silent_stages(quiet_from + 1.85)


def test_a_beating_stage_with_a_stale_load_gauge_and_no_request_on_it_is_not_read() -> None:
    """vLLM-Omni 0.30 leaves a stage's load gauge at its last batch's count: an idle stage
    that beats shows 1 running and flat counters. Its spans say no request is on it, so it
    is not silent; a request admitted and waiting at it makes the same readings a silence."""
    clock = FakeClock()
    detector = Detector(DEFAULTS, PIPELINE, clock.monotonic())
    start = clock.monotonic()
    read: list[float] = []
    for tick in range(int(20.0 / STEP)):
        now = start + tick * STEP
        out = [Observation(ObservationKind.LOAD, now, S1, 1.0)]
        if tick % 4 == 0:
            out.append(Observation(ObservationKind.HEARTBEAT, now, stage=S1))
            out.append(Observation(ObservationKind.PROGRESS, now, S1, 10.0, detail=STEP_COUNTERS))
        if tick * STEP == 12.0:
            out.append(
                Observation(ObservationKind.REQUEST_ADMITTED, now, request_id="r1", path=(1,))
            )
        detector.observe(out)
        if S1 in detector.silent_stages(now):
            read.append(tick * STEP)
    assert read and min(read) > 12.0 + SILENT_SHARE * DEFAULTS.progress_timeout, read
