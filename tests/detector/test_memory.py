"""Table tests of how a stage's memory reads against its timeouts: its heartbeat timeout
stretched by its rhythm or its denoising steps, and its load while fresh."""

from __future__ import annotations

import pytest

from omni_watchdog.config import DetectionConfig
from omni_watchdog.detector.memory import (
    BEAT_GAPS_TRUSTED,
    StageMemory,
    heartbeat_timeout,
    load,
    progressing,
)
from omni_watchdog.types import DenoisingRequest

# heartbeat_timeout 3 s, rhythm_multiplier 2, heartbeat_timeout_max 30 s, stale_after 3 s,
# progress_timeout 3 s.
CONFIG = DetectionConfig()


def stage(gaps: list[float], steps: list[float], denoising: bool) -> StageMemory:
    memory = StageMemory()
    for gap in gaps:
        memory.beat_gaps.add(gap)
    for seconds in steps:
        memory.step_seconds.add(seconds)
    if denoising:
        memory.denoising["r"] = DenoisingRequest("r", 1, 20, 0.0)
    return memory


@pytest.mark.parametrize(
    ("gaps", "steps", "denoising", "timeout"),
    [
        pytest.param([], [], False, 3.0, id="configured"),
        pytest.param([1.0] * BEAT_GAPS_TRUSTED, [], False, 3.0, id="beats-every-second"),
        pytest.param([2.5] * BEAT_GAPS_TRUSTED, [], False, 5.0, id="its-rhythm"),
        pytest.param([2.5] * (BEAT_GAPS_TRUSTED - 1), [], False, 3.0, id="too-few-gaps"),
        pytest.param([20.0] * BEAT_GAPS_TRUSTED, [], False, 30.0, id="at-most-the-max"),
        pytest.param([], [4.0], True, 8.0, id="short-steps-twice-over"),
        pytest.param([], [40.0], True, 50.0, id="long-steps-plus-slack"),
        pytest.param([], [40.0], False, 3.0, id="steps-count-only-while-denoising"),
    ],
)
def test_a_stage_heartbeat_timeout_stretches_with_its_rhythm_and_steps(
    gaps: list[float], steps: list[float], denoising: bool, timeout: float
) -> None:
    assert heartbeat_timeout(CONFIG, stage(gaps, steps, denoising)) == timeout


@pytest.mark.parametrize(
    ("load_at", "moved_at", "span_at", "on_stage", "moving"),
    [
        (None, None, None, 0.0, False),
        (18.0, 18.0, None, 2.0, True),
        (16.0, None, 18.0, 0.0, True),  # load read 4 s ago is too old to say
        (17.0, 16.0, 16.0, 2.0, False),
    ],
)
def test_load_and_progress_count_while_fresh(
    load_at: float | None,
    moved_at: float | None,
    span_at: float | None,
    on_stage: float,
    moving: bool,
) -> None:
    memory = StageMemory(
        load=2.0, load_at=load_at, progress_moved_at=moved_at, last_span_ok=span_at
    )
    assert load(CONFIG, memory, 20.0) == on_stage
    assert progressing(CONFIG, memory, 20.0) is moving
