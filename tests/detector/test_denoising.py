"""Table tests: a diffusion stage told by its denoising steps.

A diffusion request is one call of the pipeline with its whole denoising loop inside, so
the stage's loop beats once a step while it works. The steps it learned to take set how
long a step may stay silent (`rhythm_multiplier` times their p99, at most `STEP_SLACK`
past it); a request that one stage fails is a request error, counted once, never a verdict.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

from omni_watchdog.clock import FakeClock
from omni_watchdog.config import DetectionConfig
from omni_watchdog.detector import Detector
from omni_watchdog.detector.memory import STEP_SLACK
from omni_watchdog.types import (
    DIFFUSION_WORKER_TITLE,
    STAGE_TYPE_DIFFUSION,
    STAGE_TYPE_LLM,
    CanaryPlan,
    DetectorReport,
    EvidenceKind,
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

S0 = StageRef(0)
ONE_STAGE = Topology((Stage(0, "dit", final_output=True),))
TICK = 0.25
DEFAULTS = DetectionConfig()  # heartbeat_timeout 3 s, rhythm_multiplier 2


def step(now: float, request: str, index: int, steps: int, previous: float) -> list[Observation]:
    """A step span as the receiver reads it: a beat of the stage, and the step."""
    return [
        Observation(ObservationKind.HEARTBEAT, now, stage=S0),
        Observation(
            ObservationKind.DENOISE_STEP,
            now,
            stage=S0,
            request_id=request,
            step=index,
            steps=steps,
            value=previous,
        ),
    ]


def run(step_seconds: float, steps: int, silent_for: float) -> DetectorReport:
    """The stage beats while idle, denoises one image of `steps` steps of `step_seconds`,
    then a second image whose second step never ends; the report `silent_for` seconds
    into that step."""
    clock = FakeClock()
    detector = Detector(DEFAULTS, ONE_STAGE, clock.monotonic())
    script: list[tuple[float, list[Observation]]] = []
    at = 0.0
    for _ in range(5):  # idle, beating every second
        script.append((at, [Observation(ObservationKind.HEARTBEAT, 0.0, stage=S0)]))
        at += 1.0
    for request, count in (("img-1", steps), ("img-2", 2)):
        for index in range(1, count + 1):
            previous = 0.0 if index == 1 else step_seconds
            script.append((at, step(0.0, request, index, count, previous)))
            if request == "img-2" and index == 2:
                break
            at += step_seconds
        else:
            script.append(
                (
                    at,
                    [
                        Observation(
                            ObservationKind.STAGE_SPAN,
                            0.0,
                            stage=S0,
                            request_id=request,
                            value=steps * step_seconds,
                            outcome=SpanOutcome.OK,
                        )
                    ],
                )
            )
    end = at + silent_for
    start = clock.monotonic()
    report = detector.evaluate(start)
    while clock.monotonic() - start <= end + 1e-9:
        now = clock.monotonic()
        elapsed = now - start
        due = [obs for when, batch in script if when <= elapsed for obs in batch]
        script = [(when, batch) for when, batch in script if when > elapsed]
        health = Observation(ObservationKind.HEALTH, now, outcome=HealthOutcome.OK)
        detector.observe([health, *(_at(obs, now) for obs in due)])
        report = detector.evaluate(now)
        clock.advance(TICK)
    return report


def _at(obs: Observation, now: float) -> Observation:
    return Observation(**{**obs.__dict__, "time": now})


def lost(report: DetectorReport) -> list[str]:
    (status,) = report.statuses
    return [e.detail for e in status.evidence if e.kind is EvidenceKind.HEARTBEAT_LOST]


@pytest.mark.parametrize(
    ("step_seconds", "silent_for", "judged"),
    [
        (3.0, 5.0, False),  # steps of 3 s: 6 s allowed
        (3.0, 6.5, True),
        (0.5, 2.5, False),  # fast steps keep the configured 3 s
        (0.5, 3.5, True),
        (20.0, 29.0, False),  # a 20 s step: allowed 10 s past it, not twice it
        (20.0, 30.5, True),
    ],
    ids=["3s within", "3s past", "fast within", "fast past", "20s within", "20s past"],
)
def test_a_step_that_does_not_end_is_silent_past_the_steps_it_learned(
    step_seconds: float, silent_for: float, judged: bool
) -> None:
    found = lost(run(step_seconds, 4, silent_for))
    assert bool(found) is judged, found
    if found and step_seconds == 3.0:
        assert "its denoising steps take up to 3.0s, so 6.0s allowed" in found[0]
    if found and step_seconds == 20.0:
        assert f"so {20.0 + STEP_SLACK:.1f}s allowed" in found[0]


def test_the_status_shows_each_request_at_its_step_and_the_stage_s_pace() -> None:
    report = run(3.0, 4, 1.0)
    (status,) = report.statuses
    # The first image's span ended its tracking; the second is at step 2 of 2.
    assert [(r.request_id, r.step, r.steps) for r in status.denoising] == [("img-2", 2, 2)]
    assert status.seconds_per_step == pytest.approx(3.0)


def test_images_done_between_two_looks_teach_the_stage_s_pace_by_their_spans() -> None:
    """The plugin tells no step of an image done within a heartbeat interval: its request
    span says how long its steps took on average."""
    clock = FakeClock()
    detector = Detector(DEFAULTS, ONE_STAGE, clock.monotonic())
    for index in range(3):
        now = clock.advance(0.05)
        detector.observe(
            [
                Observation(ObservationKind.HEARTBEAT, now, stage=S0),
                Observation(
                    ObservationKind.DENOISE_DONE, now, S0, 0.0008, request_id=f"img-{index}"
                ),
            ]
        )
    (status,) = detector.evaluate(clock.monotonic()).statuses
    assert status.seconds_per_step == pytest.approx(0.0008)
    assert status.denoising == ()


def test_without_steps_in_flight_the_learned_steps_stretch_nothing() -> None:
    clock = FakeClock()
    detector = Detector(DEFAULTS, ONE_STAGE, clock.monotonic())
    now = clock.monotonic()
    detector.observe(step(now, "img", 1, 2, 0.0))
    now = clock.advance(10.0)
    detector.observe(step(now, "img", 2, 2, 10.0))
    detector.observe(
        [Observation(ObservationKind.REQUEST_FINISHED, now, stage=S0, request_id="img")]
    )
    now = clock.advance(3.5)
    assert lost(detector.evaluate(now))


def test_a_failed_request_is_counted_once_and_judges_nothing() -> None:
    clock = FakeClock()
    detector = Detector(DEFAULTS, ONE_STAGE, clock.monotonic())
    for _ in range(12):
        now = clock.advance(0.5)
        failed = Observation(
            ObservationKind.STAGE_SPAN,
            now,
            stage=S0,
            request_id="img-bad",
            value=0.1,
            outcome=SpanOutcome.ERROR,
            detail="RuntimeError: fault injected into a denoising step",
        )
        detector.observe(
            [
                Observation(ObservationKind.HEARTBEAT, now, stage=S0),
                Observation(ObservationKind.HEALTH, now, outcome=HealthOutcome.OK),
                # The orchestrator's span and the diffusion request's tell the same failure.
                *([failed, failed] if _ == 0 else []),
            ]
        )
        report = detector.evaluate(now)
    (status,) = report.statuses
    assert status.request_errors == 1
    assert status.state is StageState.HEALTHY
    assert not report.verdicts


TEXT_THEN_DIT = Topology(
    (
        Stage(0, "text", downstream=(1,), stage_type=STAGE_TYPE_LLM),
        Stage(1, "dit", upstream=(0,), final_output=True, stage_type=STAGE_TYPE_DIFFUSION),
    )
)
ONE_DIT = Topology((Stage(0, "dit", final_output=True, stage_type=STAGE_TYPE_DIFFUSION),))


def root(title: str) -> Observation:
    info = ProcessInfo(100, 1.0, 1, 100, 100, title, ProcessStatus.SLEEPING, 0.0, ProcessRole.API)
    return Observation(ObservationKind.PROCESS, 0.0, process=info, outcome=info.status)


@pytest.mark.parametrize(
    ("topology", "beating", "seen", "plan"),
    [
        (Topology((Stage(0, "thinker", final_output=True),)), (S0,), [], CanaryPlan.TEXT),
        (ONE_DIT, (S0,), [], CanaryPlan.NONE),
        (ONE_DIT, (), [], CanaryPlan.IMAGE),
        (TEXT_THEN_DIT, (S0, StageRef(1)), [], CanaryPlan.NONE),
        (TEXT_THEN_DIT, (S0,), [], CanaryPlan.IMAGE_CHAT),
        # No plugin to say what runs the stage: its process's title says it denoises.
        (
            Topology((Stage(0, "stage0", final_output=True),)),
            (),
            [root(DIFFUSION_WORKER_TITLE)],
            CanaryPlan.IMAGE,
        ),
        # Denoising an image: a canary would wait behind it.
        (ONE_DIT, (), step(0.0, "img", 1, 4, 0.0)[1:], CanaryPlan.NONE),
    ],
    ids=[
        "llm",
        "dit beating",
        "dit silent",
        "text and dit beating",
        "text beating, dit not",
        "titled dit",
        "denoising",
    ],
)
def test_the_canary_follows_the_pipeline(
    topology: Topology, beating: tuple[StageRef, ...], seen: list[Observation], plan: CanaryPlan
) -> None:
    clock = FakeClock()
    detector = Detector(DEFAULTS, topology, clock.monotonic())
    now = clock.advance(1.0)
    detector.observe([Observation(ObservationKind.HEARTBEAT, now, stage=ref) for ref in beating])
    detector.observe([Observation(**{**obs.__dict__, "time": now}) for obs in seen])
    assert detector.canary_plan(now) is plan


@pytest.mark.parametrize("beats_spoke", [False, True])
def test_a_canary_failure_lapses_once_the_beats_speak_for_the_server(beats_spoke: bool) -> None:
    # A canary failed once (a text request an image server refused, before the plugin's
    # beats came); while every stage beats no canary goes out to clear it.
    clock = FakeClock()
    detector = Detector(DEFAULTS, ONE_DIT, clock.monotonic())
    for _ in range(40):
        now = clock.advance(0.5)
        detector.observe(
            [
                Observation(ObservationKind.HEALTH, now, outcome=HealthOutcome.OK),
                Observation(ObservationKind.HEARTBEAT, now, stage=S0),
            ]
        )
        detector.evaluate(now)
    detector.observe(
        [Observation(ObservationKind.CANARY, now, outcome=HealthOutcome.UNHEALTHY, detail="500")]
    )
    if beats_spoke:
        assert detector.canary_plan(now) is CanaryPlan.NONE
    # Then a long step: the stage is silent past its timeout.
    for _ in range(8):
        now = clock.advance(0.5)
        detector.observe([Observation(ObservationKind.HEALTH, now, outcome=HealthOutcome.OK)])
        report = detector.evaluate(now)
    (status,) = report.statuses
    kinds = {e.kind for e in status.evidence}
    assert EvidenceKind.HEARTBEAT_LOST in kinds
    assert (EvidenceKind.CANARY_FAILED in kinds) is not beats_spoke


DIT_WORKER = ProcessInfo(
    201, 2.0, 100, 100, 100, "dit", ProcessStatus.SLEEPING, 1.0, ProcessRole.WORKER, S0
)
WAIT_FRAMES = ("wait (/usr/lib/python3.11/threading.py:327)", "step (/models/dit.py:40)")


def dit_reading(now: float, asleep: bool) -> Observation:
    """The DiT worker as /proc and its stack show it: asleep on a lock in the same frames,
    or computing its step (running, its CPU time and frames moving)."""
    if asleep:
        thread = ThreadActivity(201, "S", "futex_do_wait", 5.0, 0.1, WAIT_FRAMES)
    else:
        frames = (f"forward (/models/dit.py:{10 + int(now * 4) % 7})", "step (/models/dit.py:40)")
        thread = ThreadActivity(201, "R", "", 5.0 + now, 0.1, frames)
    activity = ProcessActivity(201, now, (thread,), (), True)
    return Observation(ObservationKind.ACTIVITY, now, S0, activity=activity)


@dataclass
class Dit:
    """A one-stage DiT that gets one image at 6 s. Beats and successful spans of other
    requests keep coming in its name every second (a holder of the OTLP token)."""

    # Its process is read asleep on a lock from 7 s, or running its step.
    asleep: bool = True
    # The steps of the image told (0.5 s apart), the first at 6 s.
    steps_told: int = 2
    # The image's span comes this long after its last step told; never, unless given.
    span_after: float | None = None
    # Every canary the detector plans (one each 2 s at most) passes, or times out.
    canary_passes: bool = False
    canaries: list[float] = field(default_factory=list)

    def drive(self, seconds: float) -> list[DetectorReport]:
        clock = FakeClock()
        detector = Detector(DEFAULTS, ONE_DIT, clock.monotonic())
        start = clock.monotonic()
        reports: list[DetectorReport] = []
        last_step = 6.0 + 0.5 * (self.steps_told - 1)
        for tick in range(int(seconds / TICK) + 1):
            now = clock.monotonic()
            elapsed = now - start
            out = [
                Observation(ObservationKind.HEALTH, now, outcome=HealthOutcome.OK),
                Observation(
                    ObservationKind.PROCESS, now, process=DIT_WORKER, outcome=DIT_WORKER.status
                ),
            ]
            if tick % 4 == 0:
                out.append(Observation(ObservationKind.HEARTBEAT, now, stage=S0))
                out.append(
                    Observation(
                        ObservationKind.STAGE_SPAN,
                        now,
                        S0,
                        0.5,
                        SpanOutcome.OK,
                        request_id=f"forged-{tick}",
                    )
                )
            if elapsed == 6.0:
                out.append(
                    Observation(ObservationKind.REQUEST_ADMITTED, now, request_id="img", path=(0,))
                )
            index = int((elapsed - 6.0) * 2) + 1
            if elapsed >= 6.0 and elapsed % 0.5 == 0 and index <= self.steps_told:
                out += step(now, "img", index, 4, 0.5)[1:]
            if self.span_after is not None and elapsed == last_step + self.span_after:
                out.append(
                    Observation(
                        ObservationKind.STAGE_SPAN, now, S0, 2.0, SpanOutcome.OK, request_id="img"
                    )
                )
            if elapsed >= 7.0 and tick % 2 == 0:
                out.append(dit_reading(now, self.asleep))
            # From the image on: before its first beat, a DiT gets a canary anyway.
            planned = elapsed >= 6.0 and detector.canary_plan(now) is not CanaryPlan.NONE
            if planned and (not self.canaries or elapsed - self.canaries[-1] >= 2.0):
                self.canaries.append(elapsed)
                outcome = HealthOutcome.OK if self.canary_passes else HealthOutcome.TIMEOUT
                out.append(Observation(ObservationKind.CANARY, now, value=2.0, outcome=outcome))
            detector.observe(out)
            reports.append(dataclasses.replace(detector.evaluate(now), time=elapsed))
            clock.advance(TICK)
        return reports


def verdicts_of(reports: list[DetectorReport]) -> list[Verdict]:
    return [v for r in reports for v in r.verdicts]


@pytest.mark.parametrize(
    "dit",
    [Dit(steps_told=2), Dit(steps_told=0)],
    ids=["its steps stop at step 2", "it stops before its first step"],
)
def test_a_step_left_for_a_lock_is_judged_whatever_beats_come_in_the_stage_s_name(
    dit: Dit,
) -> None:
    """Its steps, which only its denoising loop tells, stop; its process sleeps on a lock;
    the canary, planned once its step is late, times out behind the image."""
    reports = dit.drive(25.0)
    (verdict,) = verdicts_of(reports)
    assert verdict.state is StageState.STALLED
    kinds = {e.kind for e in verdict.evidence}
    assert kinds >= {EvidenceKind.CANARY_FAILED, EvidenceKind.SPAN_OVERDUE}
    assert verdict.cause is not None
    assert verdict.cause.cause is SilenceCause.LOCK_OR_QUEUE_WAIT
    # Overdue from 16 s (the 10 s floor); the canary failing by then.
    assert reports[-1].time >= 6.0 + DEFAULTS.overdue_floor
    (judged_at,) = [r.time for r in reports if r.verdicts]
    assert judged_at <= 6.0 + DEFAULTS.overdue_floor + 1.0
    assert dit.canaries and dit.canaries[0] <= 6.5 + 2 * DEFAULTS.heartbeat_timeout


def test_a_step_that_computes_is_never_judged_for_a_failing_canary() -> None:
    """A long step, its process running and its frames moving: work that advances,
    however late its step, within the work budget; no canary is sent behind it."""
    dit = Dit(asleep=False)
    reports = dit.drive(40.0)
    assert not verdicts_of(reports)
    assert {s.state for s in reports[-1].statuses} <= {StageState.HEALTHY, StageState.DEGRADED}
    assert dit.canaries == []


def test_an_image_whose_span_was_lost_costs_one_canary_and_no_verdict() -> None:
    """The image's steps are all told and its span never comes; the stage sleeps, idle. It
    owes the image as far as the watchdog knows: one canary goes, passes through it, and
    says the image was not in its way."""
    dit = Dit(steps_told=4, canary_passes=True)
    reports = dit.drive(60.0)
    assert not verdicts_of(reports)
    assert len(dit.canaries) == 1, dit.canaries


def test_an_image_that_ends_costs_no_canary() -> None:
    dit = Dit(steps_told=4, span_after=0.5)
    reports = dit.drive(30.0)
    assert not verdicts_of(reports)
    assert dit.canaries == []
