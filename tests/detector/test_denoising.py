"""Table tests: a diffusion stage told by its denoising steps.

A diffusion request is one call of the pipeline with its whole denoising loop inside, so
the stage's loop beats once a step while it works. The steps it learned to take set how
long a step may stay silent (`rhythm_multiplier` times their p99, at most `STEP_SLACK`
past it); a request that one stage fails is a request error, counted once, never a verdict.
"""

from __future__ import annotations

import pytest

from omni_watchdog.clock import FakeClock
from omni_watchdog.config import DetectionConfig
from omni_watchdog.detector import Detector
from omni_watchdog.detector.core import STEP_SLACK
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
    ProcessInfo,
    ProcessRole,
    ProcessStatus,
    SpanOutcome,
    Stage,
    StageRef,
    StageState,
    Topology,
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
