"""Table tests of intake: observation sequences -> what the detector's memory keeps."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from omni_watchdog.config import DetectionConfig
from omni_watchdog.detector.expectations import BlindSpells
from omni_watchdog.detector.intake import fold, stage_memory, take_topology, unseen_timeout
from omni_watchdog.detector.memory import MAX_EXTRA_STAGES, TargetMemory, attach
from omni_watchdog.types import (
    STEP_COUNTERS,
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

CONFIG = DetectionConfig()  # health_failures 3, heartbeat_timeout 3 s, crash_window 30 s
S0 = StageRef(0)
Kind = ObservationKind
OK, TIMEOUT, REFUSED = HealthOutcome.OK, HealthOutcome.TIMEOUT, HealthOutcome.REFUSED


def health(time: float, outcome: HealthOutcome) -> Observation:
    return Observation(Kind.HEALTH, time, outcome=outcome, detail="x")


def beat(time: float) -> Observation:
    return Observation(Kind.HEARTBEAT, time, S0)


def progress(time: float, value: float) -> Observation:
    return Observation(Kind.PROGRESS, time, S0, value, detail=STEP_COUNTERS)


def load(time: float, value: float) -> Observation:
    return Observation(Kind.LOAD, time, S0, value)


def process(time: float, role: ProcessRole, status: ProcessStatus) -> Observation:
    stage = None if role is ProcessRole.API else S0
    info = ProcessInfo(200, 2.0, 1, 1, 1, role.value, status, 1.0, role, stage)
    return Observation(Kind.PROCESS, time, process=info, outcome=status)


def step(time: float, request: str, number: int) -> Observation:
    return Observation(Kind.DENOISE_STEP, time, S0, 0.5, request_id=request, step=number)


def span(time: float, request: str, outcome: SpanOutcome) -> Observation:
    return Observation(Kind.STAGE_SPAN, time, S0, 0.2, outcome, "boom", request_id=request)


def folded(observations: list[Observation]) -> TargetMemory:
    target = attach(Topology((Stage(0, "engine"),)), 0.0, (), BlindSpells())
    for obs in observations:
        fold(CONFIG, target, obs)
    return target


ROWS: list[tuple[str, list[Observation], Callable[[TargetMemory], object], object]] = [
    (
        "a healthy /health starts the grace",
        [health(1.0, OK), health(2.0, OK)],
        lambda t: t.first_healthy,
        1.0,
    ),
    (
        "the Nth failure in a row confirms, from then",
        [health(1.0, TIMEOUT), health(2.0, TIMEOUT), health(3.0, TIMEOUT)],
        lambda t: (t.health_failures, t.health_failed_since, t.health_confirmed_at),
        (3, 1.0, 3.0),
    ),
    (
        "a healthy answer breaks the run",
        [health(1.0, TIMEOUT), health(2.0, OK), health(3.0, TIMEOUT)],
        lambda t: (t.health_failures, t.health_failed_since, t.health_unwell),
        (1, 3.0, (3.0, "timeout x")),
    ),
    (
        "a refused /health is no sign of a crash",
        [health(1.0, REFUSED)],
        lambda t: (t.health_failures, t.health_unwell, t.unhealthy_signs),
        (1, None, []),
    ),
    (
        "the first progress sample is a baseline",
        [progress(1.0, 10.0), progress(2.0, 10.0)],
        lambda t: (t.last_progress, t.stages[S0].progress_changed_at, t.stages[S0].counts_steps),
        (None, 1.0, True),
    ),
    (
        "a change after it is movement",
        [progress(1.0, 10.0), progress(2.0, 15.0)],
        lambda t: (t.last_progress, t.stages[S0].progress_moved_at),
        (2.0, 2.0),
    ),
    (
        "load counts as positive from its first positive sample",
        [load(1.0, 0.0), load(2.0, 2.0), load(3.0, 1.0)],
        lambda t: (t.stages[S0].load, t.stages[S0].load_positive_since),
        (1.0, 2.0),
    ),
    (
        "beat gaps within the timeout are the stage's rhythm",
        [beat(1.0), beat(2.0), beat(4.0), beat(9.0)],
        lambda t: (len(t.stages[S0].beat_gaps), t.stages[S0].last_heartbeat),
        (2, 9.0),
    ),
    (
        "a late beat does not move the latest back",
        [beat(5.0), beat(4.0)],
        lambda t: t.stages[S0].last_heartbeat,
        5.0,
    ),
    (
        "an engine exiting while its server lives is news",
        [
            process(1.0, ProcessRole.API, ProcessStatus.SLEEPING),
            process(2.0, ProcessRole.ENGINE, ProcessStatus.EXITED),
        ],
        lambda t: (t.stage_exits, t.stages[S0].processes[200].exited_at, len(t.unhealthy_signs)),
        (1, 2.0, 1),
    ),
    (
        "a helper exiting is not",
        [process(2.0, ProcessRole.HELPER, ProcessStatus.EXITED)],
        lambda t: (t.stage_exits, t.stages[S0].processes[200].exited_at),
        (0, 2.0),
    ),
    (
        "a zombie server is gone",
        [process(3.0, ProcessRole.API, ProcessStatus.ZOMBIE)],
        lambda t: (t.root_exited_at, t.root_alive()),
        (3.0, False),
    ),
    (
        "a late span of an earlier step keeps the later step",
        [step(1.0, "r", 5), step(1.5, "r", 4)],
        lambda t: (t.stages[S0].denoising["r"].step, t.stages[S0].progress_moved_at),
        (5, 1.5),
    ),
    (
        "a failed request counts once, however many spans tell it",
        [span(1.0, "r", SpanOutcome.ERROR), span(1.1, "r", SpanOutcome.ERROR)],
        lambda t: (t.stages[S0].request_errors, t.stages[S0].last_error),
        (1, "boom"),
    ),
    (
        "signs older than the crash window go",
        [health(1.0, TIMEOUT), health(40.0, TIMEOUT)],
        lambda t: [time for time, _ in t.unhealthy_signs],
        [40.0],
    ),
]


@pytest.mark.parametrize(
    ("observations", "read", "expected"),
    [pytest.param(obs, read, expected, id=name) for name, obs, read, expected in ROWS],
)
def test_intake_keeps_what_each_observation_says(
    observations: list[Observation], read: Callable[[TargetMemory], object], expected: object
) -> None:
    assert read(folded(observations)) == expected


@pytest.mark.parametrize(
    ("outcome", "blind", "unseen"),
    [
        pytest.param(TIMEOUT, (9.5, 9.8), True, id="a-timeout-blind-for-part-of-it"),
        pytest.param(TIMEOUT, (5.0, 6.0), False, id="a-timeout-seen-throughout"),
        pytest.param(HealthOutcome.UNHEALTHY, (9.5, 9.8), False, id="an-answer-is-an-answer"),
    ],
)
def test_a_timeout_the_watchdog_was_blind_for_is_set_aside(
    outcome: HealthOutcome, blind: tuple[float, float], unseen: bool
) -> None:
    spells = BlindSpells()
    spells.add(*blind)
    # Timed out at 10 s after waiting 2 s for its answer.
    obs = Observation(Kind.HEALTH, 10.0, value=2.0, outcome=outcome)
    assert unseen_timeout(obs, spells) is unseen


def test_stage_replicas_beyond_the_topology_are_bounded() -> None:
    target = folded([])
    made = [stage_memory(target, StageRef(0, replica)) for replica in range(1, 100)]
    assert sum(memory is not None for memory in made) == MAX_EXTRA_STAGES
    assert len(target.stages) == 1 + MAX_EXTRA_STAGES
    assert target.names[StageRef(0, 1)] == "engine"


def mapped(time: float, stage: StageRef) -> Observation:
    info = ProcessInfo(
        300, 3.0, 1, 1, 1, "python", ProcessStatus.SLEEPING, 1.0, ProcessRole.STAGE, stage
    )
    return Observation(Kind.PROCESS, time, process=info, outcome=info.status)


@pytest.mark.parametrize(
    ("also_beat", "stage_0_kept"),
    [
        # A headless stage 1: its process mapped by spawn order to the default stage 0,
        # then its config names stage 1 and the process moves: no stage 0 is left.
        (False, False),
        # A stage 0 that beat by itself is real, whatever names it.
        (True, True),
    ],
)
def test_a_replica_kept_for_its_process_goes_when_the_process_moves(
    also_beat: bool, stage_0_kept: bool
) -> None:
    target = folded([mapped(1.0, S0), *([beat(1.5)] if also_beat else [])])
    take_topology(target, Topology((Stage(1, "talker"),)), 2.0)
    assert S0 in target.stages
    fold(CONFIG, target, mapped(2.5, StageRef(1)))
    assert (S0 in target.stages) is stage_0_kept
    assert (S0 in target.names) is stage_0_kept
    assert set(target.stages[StageRef(1)].processes) == {300}


def remote_beat(time: float, replica: int) -> Observation:
    return Observation(Kind.HEARTBEAT, time, StageRef(1, replica))


@pytest.mark.parametrize(
    ("beats", "left"),
    [
        # 0.30 evicted replica 0 and its replacement registered as replica 1.
        ([remote_beat(1.0, 0), remote_beat(2.0, 0), remote_beat(20.0, 1)], {1}),
        # Both beat: the stage runs more replicas than its config says.
        ([remote_beat(1.0, 0), remote_beat(2.0, 1), remote_beat(2.5, 0)], {0, 1}),
        # Replica 0 went silent beside replica 1, which beat all along: kept, it is silent.
        ([remote_beat(1.0, 0), remote_beat(1.5, 1), remote_beat(10.0, 1)], {0, 1}),
        # The replica the config names never beat; the one the master numbered does, for
        # longer than a heartbeat timeout.
        ([remote_beat(5.0, 2)], {0, 2}),
        ([remote_beat(5.0, 2), remote_beat(9.0, 2)], {2}),
        # Replica 0 starts a second after replica 1: both stay.
        ([remote_beat(1.0, 1), remote_beat(2.0, 0), remote_beat(9.0, 1)], {0, 1}),
        # Silence alone retires nothing: no replacement beats.
        ([remote_beat(1.0, 0)], {0}),
        # A higher replica never retires a lower one that comes back later.
        ([remote_beat(5.0, 1), remote_beat(6.0, 0), remote_beat(7.0, 1)], {0, 1}),
    ],
)
def test_a_replica_replaced_by_another_is_retired(beats: list[Observation], left: set[int]) -> None:
    topology = Topology((Stage(0, "thinker"), Stage(1, "talker")))
    target = attach(topology, 0.0, (1,), BlindSpells())
    for obs in beats:
        fold(CONFIG, target, obs)
    assert {ref.replica for ref in target.stages if ref.stage_id == 1} == left
    assert {ref.replica for ref in target.names if ref.stage_id == 1} == left
    assert S0 in target.stages


def test_a_replica_that_starts_after_its_sibling_keeps_its_place() -> None:
    """Replicas register a moment apart: the later one was never retired in between (it
    would come back last, and the stages are judged and shown in their order)."""
    topology = Topology((Stage(0, "thinker"), Stage(1, "talker", replicas=2)))
    target = attach(topology, 0.0, (1,), BlindSpells())
    for obs in (remote_beat(10.0, 1), remote_beat(11.5, 0), remote_beat(20.0, 1)):
        fold(CONFIG, target, obs)
    assert list(target.stages) == [S0, StageRef(1, 0), StageRef(1, 1)]


def test_a_silent_replica_with_processes_is_never_retired() -> None:
    """A hung local replica keeps its processes: it is judged, never dropped."""
    topology = Topology((Stage(0, "thinker", replicas=2),))
    target = attach(topology, 0.0, (), BlindSpells())
    fold(CONFIG, target, mapped(0.5, S0))
    for obs in (beat(1.0), Observation(Kind.HEARTBEAT, 20.0, StageRef(0, 1))):
        fold(CONFIG, target, obs)
    assert set(target.stages) == {S0, StageRef(0, 1)}
