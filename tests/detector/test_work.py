"""Table tests of a stage's owed work: a request waiting at it with its step counters
flat, a denoising step left, and what says it is held up whatever its spans say."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from omni_watchdog.config import DetectionConfig
from omni_watchdog.detector.expectations import BlindSpells
from omni_watchdog.detector.memory import ProcessMemory, StageMemory, TargetMemory, attach
from omni_watchdog.detector.work import held_up, step_left, waiting_unworked
from omni_watchdog.types import (
    STAGE_TYPE_DIFFUSION,
    DenoisingRequest,
    Evidence,
    EvidenceKind,
    ProcessInfo,
    ProcessRole,
    ProcessStatus,
    SilenceCause,
    Stage,
    StageCause,
    StageRef,
    Topology,
)

CONFIG = DetectionConfig()  # heartbeat_timeout 3 s, progress/stale 3 s, stuck_timeout 2 s
S0 = StageRef(0)
NOW = 20.0
Setup = Callable[[TargetMemory], None]


def counting(target: TargetMemory) -> None:
    """Fresh step counters, last moved at 5 s; request "r" reached the stage at 8 s."""
    memory = target.stages[S0]
    memory.counts_steps, memory.progress_seen_at, memory.progress_changed_at = True, 19.0, 5.0
    target.pending.admit("r", (0,), 8.0)


def also(*setups: Setup) -> Setup:
    def setup(target: TargetMemory) -> None:
        for each in setups:
            each(target)

    return setup


def per_request_counters(target: TargetMemory) -> None:
    target.stages[S0].counts_steps = False


def stale_counters(target: TargetMemory) -> None:
    target.stages[S0].progress_seen_at = 15.0


def canary_passed_after(target: TargetMemory) -> None:
    target.canary_passed_at = 9.0


def seen_runnable(target: TargetMemory) -> None:
    info = ProcessInfo(
        200, 2.0, 1, 1, 1, "engine", ProcessStatus.RUNNING, 1.0, ProcessRole.ENGINE, S0
    )
    target.stages[S0].processes[200] = ProcessMemory(info, 0.0, 0.0, runnable_seen_at=12.0)


def two_replicas(target: TargetMemory) -> None:
    target.stages[StageRef(0, 1)] = StageMemory()


def a_diffusion_stage(target: TargetMemory) -> None:
    target.topology = Topology((Stage(0, "dit", stage_type=STAGE_TYPE_DIFFUSION),))


@pytest.mark.parametrize(
    ("setup", "flat_from"),
    [
        pytest.param(counting, 8.0, id="waiting-since-it-arrived"),
        pytest.param(also(counting, per_request_counters), None, id="counters-per-request"),
        pytest.param(also(counting, stale_counters), None, id="counters-stale"),
        pytest.param(also(counting, canary_passed_after), None, id="the-canary-went-through"),
        pytest.param(also(counting, seen_runnable), 12.0, id="runnable-since"),
        pytest.param(also(counting, two_replicas), None, id="which-replica-unknown"),
        pytest.param(also(counting, a_diffusion_stage), None, id="steps-tell-a-diffusion-stage"),
    ],
)
def test_a_request_waits_unworked_while_the_step_counters_stay_flat(
    setup: Setup, flat_from: float | None
) -> None:
    target = attach(Topology((Stage(0, "engine"),)), 0.0, (), BlindSpells())
    setup(target)
    unworked = waiting_unworked(CONFIG, target, S0, target.stages[S0], NOW)
    assert (None if unworked is None else unworked[1]) == flat_from
    if unworked is not None:
        assert unworked[0].request_id == "r"


def in_a_step(cause: SilenceCause, working: bool = False) -> Setup:
    """A diffusion stage owing request "r" (arrived 8 s, its step 3 told at 10 s)."""

    def setup(target: TargetMemory) -> None:
        a_diffusion_stage(target)
        target.pending.admit("r", (0,), 8.0)
        memory = target.stages[S0]
        memory.denoising["r"] = DenoisingRequest("r", 3, 20, 10.0)
        memory.cause = StageCause(cause, 12.0, working, "")

    return setup


@pytest.mark.parametrize(
    ("setup", "left"),
    [
        pytest.param(in_a_step(SilenceCause.LOCK_OR_QUEUE_WAIT), True, id="asleep-on-a-lock"),
        pytest.param(in_a_step(SilenceCause.SPINNING), True, id="spinning"),
        pytest.param(in_a_step(SilenceCause.DEVICE_WAIT), False, id="waiting-on-its-device"),
        pytest.param(in_a_step(SilenceCause.COMPUTING, True), False, id="computing"),
    ],
)
def test_a_stage_left_its_step_when_late_and_read_not_running_it(setup: Setup, left: bool) -> None:
    target = attach(Topology((Stage(0, "engine"),)), 0.0, (), BlindSpells())
    setup(target)
    assert step_left(CONFIG, target, S0, target.stages[S0], NOW) is left
    # Not late yet: 1 s after its step was told.
    assert step_left(CONFIG, target, S0, target.stages[S0], 11.0) is False


def stopped_since(since: float) -> Setup:
    def setup(target: TargetMemory) -> None:
        info = ProcessInfo(
            200, 2.0, 1, 1, 1, "engine", ProcessStatus.STOPPED, 1.0, ProcessRole.ENGINE, S0
        )
        target.stages[S0].processes[200] = ProcessMemory(info, since, since)

    return setup


def nothing(target: TargetMemory) -> None:
    pass


@pytest.mark.parametrize(
    ("setup", "kinds", "held"),
    [
        pytest.param(nothing, [], False, id="nothing"),
        pytest.param(nothing, [EvidenceKind.PROGRESS_FLAT], True, id="flat-under-load"),
        pytest.param(nothing, [EvidenceKind.SPAN_OVERDUE], False, id="a-span-late-alone"),
        pytest.param(counting, [EvidenceKind.SPAN_OVERDUE], True, id="late-and-unworked"),
        pytest.param(stopped_since(15.0), [], True, id="stopped-5s"),
        pytest.param(stopped_since(19.0), [], False, id="stopped-1s"),
        pytest.param(in_a_step(SilenceCause.STOPPED), [], True, id="left-its-step"),
    ],
)
def test_a_stage_is_held_up_by_what_the_watchdog_reads_for_itself(
    setup: Setup, kinds: list[EvidenceKind], held: bool
) -> None:
    target = attach(Topology((Stage(0, "engine"),)), 0.0, (), BlindSpells())
    setup(target)
    evidence = [Evidence(kind, S0, 15.0, "") for kind in kinds]
    assert held_up(CONFIG, target, S0, target.stages[S0], evidence, NOW) is held
