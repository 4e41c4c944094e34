"""Table tests: a stage's own rhythm stretches its heartbeat timeout, and only its own.

A stage's loop beats once a second when free; a stage whose steps block its loop for
seconds beats once a step. Its healthy gaps, learned, stretch its timeout to
`rhythm_multiplier` times their p99 (at most `heartbeat_timeout_max`); a stage beating
every second keeps the configured timeout, and a hang of it is seen as fast as ever.
"""

from __future__ import annotations

import pytest

from omni_watchdog.clock import FakeClock
from omni_watchdog.config import DetectionConfig
from omni_watchdog.detector import Detector
from omni_watchdog.types import (
    Evidence,
    EvidenceKind,
    HealthOutcome,
    Observation,
    ObservationKind,
    Stage,
    StageRef,
    Topology,
)

S0 = StageRef(0)
ONE_STAGE = Topology((Stage(0, "diffusion", final_output=True),))
STEP = 0.25
LEARNING_S = 120.0  # beats before the stage's loop blocks for good


def heartbeat_evidence(gap: float, config: DetectionConfig, watched: float) -> list[Evidence]:
    """The stage beats every `gap` seconds for LEARNING_S, then never again; its heartbeat
    evidence as it stands `watched` seconds after its last beat."""
    clock = FakeClock()
    start = clock.monotonic()
    detector = Detector(config, ONE_STAGE, start)
    last_beat = start
    for _ in range(int((LEARNING_S + watched) / STEP) + 1):
        now = clock.monotonic()
        elapsed = now - start
        out = [Observation(ObservationKind.HEALTH, now, outcome=HealthOutcome.OK)]
        if elapsed <= LEARNING_S and elapsed >= last_beat - start + gap - 1e-9:
            out.append(Observation(ObservationKind.HEARTBEAT, now, stage=S0))
            last_beat = now
        detector.observe(out)
        report = detector.evaluate(now)
        clock.advance(STEP)
    (status,) = report.statuses
    assert now - last_beat == pytest.approx(watched, abs=STEP)
    return [e for e in status.evidence if e.kind is EvidenceKind.HEARTBEAT_LOST]


DEFAULTS = DetectionConfig()  # heartbeat_timeout 3 s, rhythm_multiplier 2


@pytest.mark.parametrize(
    ("gap", "silent_for", "lost"),
    [
        (1.0, 3.5, True),  # beats every second: the configured 3 s
        (2.5, 3.5, False),  # steps of 2.5 s: 5 s allowed
        (2.5, 5.5, True),
        (20.0, 25.0, True),  # gaps past the timeout were silences, never its rhythm
    ],
    ids=["every second", "long steps within", "long steps past", "silences not learned"],
)
def test_the_heartbeat_timeout_follows_the_stages_own_rhythm(
    gap: float, silent_for: float, lost: bool
) -> None:
    found = heartbeat_evidence(gap, DEFAULTS, silent_for)
    assert bool(found) is lost, found
    if found and gap == 2.5:
        assert "its rhythm: healthy gaps up to 2.5s, so 5.0s allowed" in found[0].detail


def test_the_stretch_is_bounded_by_config() -> None:
    config = DetectionConfig(heartbeat_timeout_max=4.0)
    assert heartbeat_evidence(2.5, config, 4.5)  # 5 s learned, 4 s at most
    assert not heartbeat_evidence(2.5, config, 3.75)
