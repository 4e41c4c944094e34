"""Table tests: when the server is at rest, so that the watchdog may judge less often.

A two-stage server beats every second and answers /health; each row adds one thing that
must keep the watchdog looking at its full pace; the report of the evaluation at the
row's moment says whether the server is at rest, the stages judged at every tick before
it as the watchdog does.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from omni_watchdog.clock import FakeClock
from omni_watchdog.config import DetectionConfig
from omni_watchdog.detector import Detector
from omni_watchdog.types import (
    HealthOutcome,
    Observation,
    ObservationKind,
    ProcessInfo,
    ProcessRole,
    ProcessStatus,
    SpanOutcome,
    Stage,
    StageRef,
    Topology,
)

CONFIG = DetectionConfig()  # startup_grace 5 s, heartbeat_timeout 3 s
S0, S1 = StageRef(0), StageRef(1)
PIPELINE = Topology((Stage(0, "thinker", downstream=(1,)), Stage(1, "talker", upstream=(0,))))
ROOT = ProcessInfo(100, 1.0, 1, 100, 100, "api", ProcessStatus.SLEEPING, 1.0, ProcessRole.API)
TICK = 0.25
ASKED_AT = 12.0

Extra = Callable[[float], list[Observation]]


def nothing(now: float) -> list[Observation]:
    return []


def admitted_at(moment: float) -> Extra:
    def extra(now: float) -> list[Observation]:
        if now != moment:
            return []
        return [Observation(ObservationKind.REQUEST_ADMITTED, now, request_id="r", path=(0, 1))]

    return extra


def served_at(admitted: float, ended: float) -> Extra:
    def extra(now: float) -> list[Observation]:
        spans = [
            Observation(ObservationKind.STAGE_SPAN, now, ref, 0.5, SpanOutcome.OK, request_id="r")
            for ref in (S0, S1)
        ]
        return admitted_at(admitted)(now) + (spans if now == ended else [])

    return extra


def answer_from(kind: ObservationKind, moment: float, outcome: HealthOutcome) -> Extra:
    def extra(now: float) -> list[Observation]:
        return [Observation(kind, now, value=0.1, outcome=outcome)] if now >= moment else []

    return extra


def denoising_from(moment: float) -> Extra:
    def extra(now: float) -> list[Observation]:
        if now < moment or now % 1.0:
            return []
        step = int(now - moment)
        return [
            Observation(
                ObservationKind.DENOISE_STEP,
                now,
                stage=S1,
                request_id="image",
                step=step,
                steps=50,
                value=0.0 if step == 0 else 1.0,
            )
        ]

    return extra


ROWS = {
    "idle and beating": (nothing, frozenset[StageRef](), ASKED_AT, True),
    "still warming up": (nothing, frozenset[StageRef](), 3.0, False),
    "a request owed": (admitted_at(10.0), frozenset[StageRef](), ASKED_AT, False),
    "a request served": (served_at(10.0, 11.0), frozenset[StageRef](), ASKED_AT, True),
    "a stage stopped beating": (nothing, frozenset({S1}), ASKED_AT, False),
    "/health failing": (
        answer_from(ObservationKind.HEALTH, 11.0, HealthOutcome.UNHEALTHY),
        frozenset[StageRef](),
        ASKED_AT,
        False,
    ),
    "the canary failing": (
        answer_from(ObservationKind.CANARY, 11.0, HealthOutcome.TIMEOUT),
        frozenset[StageRef](),
        ASKED_AT,
        False,
    ),
    "an image in its steps": (denoising_from(10.0), frozenset[StageRef](), ASKED_AT, False),
}


@pytest.mark.parametrize(
    ("extra", "silent_from_8s", "asked_at", "at_rest"), ROWS.values(), ids=ROWS.keys()
)
def test_at_rest_only_while_the_server_is_idle_and_well(
    extra: Extra, silent_from_8s: frozenset[StageRef], asked_at: float, at_rest: bool
) -> None:
    clock = FakeClock(start=0.0)
    start = clock.monotonic()
    detector = Detector(CONFIG, PIPELINE, start)
    detector.attached(start)
    while (now := clock.monotonic()) < asked_at:
        elapsed = now
        out = [Observation(ObservationKind.PROCESS, now, process=ROOT, outcome=ROOT.status)]
        if elapsed % 1.0 == 0:
            out.append(Observation(ObservationKind.HEALTH, now, outcome=HealthOutcome.OK))
            out += [
                Observation(ObservationKind.HEARTBEAT, now, stage=ref)
                for ref in (S0, S1)
                if elapsed < 8.0 or ref not in silent_from_8s
            ]
        detector.observe(out + extra(now))
        report = detector.evaluate(now)
        clock.advance(TICK)
    assert report.at_rest is at_rest
