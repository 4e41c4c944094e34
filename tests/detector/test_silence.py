"""Table tests of a stage's silence and its cause: when a stage is read for a cause, what
its advancing work excuses, and when CPU contention speaks for it (`starved`)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from omni_watchdog.config import DetectionConfig
from omni_watchdog.detector.expectations import BlindSpells
from omni_watchdog.detector.memory import ProcessMemory, StageMemory, TargetMemory, attach
from omni_watchdog.detector.silence import EXCUSED_BY_WORK, excused, silent, update_cause
from omni_watchdog.detector.starved import contended, stage_starved
from omni_watchdog.types import (
    EvidenceKind,
    ProcessInfo,
    ProcessRole,
    ProcessStatus,
    SilenceCause,
    Stage,
    StageCause,
    StageRef,
    StageState,
    Topology,
)

# heartbeat_timeout 3 s (silent after half of it), progress_timeout 3 s, health_failures 3,
# work budgets 600 s.
CONFIG = DetectionConfig()
S0 = StageRef(0)
NOW = 20.0
Setup = Callable[[TargetMemory], None]


def beat_at(at: float) -> Setup:
    def setup(target: TargetMemory) -> None:
        target.stages[S0].last_heartbeat = at

    return setup


def health_failing(target: TargetMemory) -> None:
    target.health_failures = CONFIG.health_failures


def health_failing_but_progressing(target: TargetMemory) -> None:
    health_failing(target)
    target.stages[S0].progress_moved_at = 19.0


def judged_stalled(target: TargetMemory) -> None:
    target.stages[S0].last_heartbeat = 19.5
    target.stages[S0].state = StageState.STALLED


@pytest.mark.parametrize(
    ("setup", "is_silent"),
    [
        pytest.param(beat_at(19.0), False, id="beat-1s-ago"),
        pytest.param(beat_at(18.0), True, id="beat-2s-ago-past-half-its-timeout"),
        pytest.param(health_failing, True, id="never-beat-and-the-target-fails"),
        pytest.param(health_failing_but_progressing, False, id="never-beat-but-progressing"),
        pytest.param(judged_stalled, True, id="judged-stalled"),
    ],
)
def test_a_stage_is_read_for_a_cause_once_silent(setup: Setup, is_silent: bool) -> None:
    target = attach(Topology((Stage(0, "engine"),)), 0.0, (), BlindSpells())
    setup(target)
    assert silent(CONFIG, target, S0, target.stages[S0], NOW) is is_silent


@pytest.mark.parametrize(
    ("working_since", "work_ended_at", "excuses"),
    [
        pytest.param(None, None, frozenset(), id="no-work"),
        pytest.param(10.0, None, EXCUSED_BY_WORK, id="working-within-its-budget"),
        pytest.param(-600.0, None, frozenset(), id="working-past-its-budget"),
        pytest.param(None, 18.0, EXCUSED_BY_WORK, id="work-ended-2s-ago"),
        pytest.param(None, 16.0, frozenset(), id="work-ended-4s-ago"),
    ],
)
def test_advancing_work_excuses_lateness_until_its_budget_runs_out(
    working_since: float | None, work_ended_at: float | None, excuses: frozenset[EvidenceKind]
) -> None:
    memory = StageMemory(working_since=working_since, work_ended_at=work_ended_at)
    if working_since is not None:
        memory.cause = StageCause(SilenceCause.COMPILING, working_since, True, "", working_since)
    assert excused(CONFIG, memory, NOW) == excuses
    assert EvidenceKind.HEALTH_FAILED not in excuses


def engine(waited: float, status: ProcessStatus = ProcessStatus.RUNNING) -> ProcessMemory:
    """An engine read every second since the stage's beat at 17 s, having waited `waited`
    seconds for a CPU since then."""
    info = ProcessInfo(
        200, 2.0, 1, 1, 1, "engine", status, 1.0, ProcessRole.ENGINE, S0, cpu_wait_seconds=waited
    )
    process = ProcessMemory(info, 0.0, 0.0, seen_at=NOW, seen_at_beat=17.0)
    process.waits.extend((at, waited * (at - 17.0) / 3.0) for at in (18.0, 19.0, NOW))
    return process


@pytest.mark.parametrize(
    ("waited", "status", "starved"),
    [
        pytest.param(0.0, ProcessStatus.RUNNING, False, id="never-waited"),
        pytest.param(0.6, ProcessStatus.RUNNING, True, id="waited-a-fifth"),
        pytest.param(0.6, ProcessStatus.STOPPED, False, id="a-stopped-stage-is-never-starved"),
    ],
)
def test_a_stage_whose_process_waited_for_a_cpu_is_starved(
    waited: float, status: ProcessStatus, starved: bool
) -> None:
    memory = StageMemory(last_heartbeat=17.0, processes={200: engine(waited, status)})
    finding = stage_starved(CONFIG, memory)
    assert (finding is not None) is starved
    if finding is not None:
        assert finding.cause is SilenceCause.STARVED


@pytest.mark.parametrize(
    ("cause", "waited", "speaks"),
    [
        pytest.param(None, 0.0, True, id="nothing-read-closer"),
        pytest.param(SilenceCause.UNKNOWN, 0.0, True, id="read-but-unexplained"),
        pytest.param(SilenceCause.LOCK_OR_QUEUE_WAIT, 0.5, False, id="asleep-on-its-own"),
        pytest.param(SilenceCause.LOCK_OR_QUEUE_WAIT, 1.5, True, id="waited-half-its-silence"),
    ],
)
def test_cpu_contention_speaks_only_where_nothing_closer_explains_the_silence(
    cause: SilenceCause | None, waited: float, speaks: bool
) -> None:
    memory = StageMemory(last_heartbeat=17.0, processes={200: engine(waited)})
    if cause is not None:
        memory.cause = StageCause(cause, 18.0, False, "")
    assert contended(memory, NOW) is speaks


def test_a_silent_stage_without_closer_readings_is_named_starved_from_its_cpu_waits() -> None:
    target = attach(Topology((Stage(0, "engine"),)), 0.0, (), BlindSpells())
    memory = target.stages[S0]
    memory.last_heartbeat = 17.0
    memory.processes[200] = engine(0.6)
    cause = update_cause(CONFIG, target, S0, memory, NOW)
    assert cause is not None
    assert (cause.cause, cause.since, cause.working) == (SilenceCause.STARVED, NOW, False)
    # Beating again: no cause, and none kept.
    memory.last_heartbeat = NOW
    assert update_cause(CONFIG, target, S0, memory, NOW) is None
    assert memory.cause is None
