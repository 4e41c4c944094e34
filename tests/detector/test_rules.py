"""Table tests of the rules that decide: evidence and times -> confirmed or not, a stage's
state, a remote stage's state, start-up over or not, the head's own verdict."""

from __future__ import annotations

import pytest

from omni_watchdog.config import DetectionConfig
from omni_watchdog.detector.expectations import BlindSpells
from omni_watchdog.detector.memory import StageMemory, TargetMemory, attach
from omni_watchdog.detector.rules import (
    confirmed,
    decide,
    decide_remote,
    head_verdict,
    stood,
    warmed_up,
)
from omni_watchdog.types import (
    Evidence,
    EvidenceKind,
    Stage,
    StageRef,
    StageState,
    StageStatus,
    Topology,
)

CONFIG = DetectionConfig()  # confirm_timeout 10 s, progress_timeout 3 s, heartbeat 3 s
S0, S1 = StageRef(0), StageRef(1)
NOW = 100.0
BEAT = EvidenceKind.HEARTBEAT_LOST
SPAN = EvidenceKind.SPAN_OVERDUE
CANARY = EvidenceKind.CANARY_FAILED
FLAT = EvidenceKind.PROGRESS_FLAT
STUCK = EvidenceKind.PROCESS_STUCK
EXIT = EvidenceKind.PROCESS_EXIT
HEALTH = EvidenceKind.HEALTH_FAILED
LINK = EvidenceKind.LINK_LOST
GPU = EvidenceKind.GPU_HELD


def evidence(*held: tuple[EvidenceKind, float]) -> list[Evidence]:
    """Each kind with how long before NOW it has stood."""
    return [Evidence(kind, S0, NOW - held_for, "") for kind, held_for in held]


def target(health_answered: bool = False) -> TargetMemory:
    memory = attach(Topology((Stage(0, "engine"),)), 0.0, (), BlindSpells())
    memory.health_answered = health_answered
    return memory


@pytest.mark.parametrize(
    ("held", "busy", "expected"),
    [
        pytest.param([(BEAT, 5.0)], False, False, id="one-kind-fresh"),
        pytest.param([(BEAT, 10.0)], False, True, id="one-kind-stood"),
        pytest.param([(SPAN, 90.0)], False, False, id="an-overdue-span-never-alone"),
        pytest.param([(BEAT, 1.0), (FLAT, 1.0)], False, True, id="two-kinds"),
        pytest.param([(BEAT, 1.0), (GPU, 1.0)], False, False, id="a-consequence-counts-not"),
        pytest.param([(BEAT, 1.0), (CANARY, 1.0)], True, False, id="busy-lateness-is-one-kind"),
        pytest.param([(BEAT, 1.0), (STUCK, 1.0)], True, True, id="busy-lateness-and-another"),
        pytest.param([(BEAT, 1.0), (CANARY, 1.0)], False, True, id="idle-lateness-two-kinds"),
    ],
)
def test_a_verdict_needs_two_kinds_or_one_that_stood(
    held: list[tuple[EvidenceKind, float]], busy: bool, expected: bool
) -> None:
    assert confirmed(CONFIG, evidence(*held), NOW, busy=busy) is expected


@pytest.mark.parametrize(
    ("held_for", "waited", "expected"),
    [(9.9, 0.0, False), (10.0, 0.0, True), (15.0, 5.0, True), (15.0, 5.1, False)],
)
def test_time_spent_waiting_for_a_cpu_is_not_time_stood(
    held_for: float, waited: float, expected: bool
) -> None:
    assert stood(CONFIG, evidence((BEAT, held_for)), NOW, waited) is expected


def stage(beat: float | None = None, moved: float | None = None) -> StageMemory:
    return StageMemory(last_heartbeat=beat, progress_moved_at=moved)


@pytest.mark.parametrize(
    ("memory", "held", "stuck", "set_aside", "answered", "state"),
    [
        pytest.param(stage(99.0), [], False, False, False, StageState.HEALTHY, id="healthy"),
        pytest.param(stage(), [], False, False, False, StageState.UNKNOWN, id="no-signal"),
        pytest.param(stage(99.0), [], False, True, False, StageState.DEGRADED, id="excused"),
        pytest.param(stage(), [(LINK, 0.0)], False, False, False, StageState.DEAD, id="orphan"),
        pytest.param(stage(), [(EXIT, 10.0)], False, False, False, StageState.DEAD, id="exit"),
        pytest.param(
            stage(), [(EXIT, 1.0)], False, False, False, StageState.DEGRADED, id="exit-fresh"
        ),
        pytest.param(stage(), [(HEALTH, 10.0)], False, False, True, StageState.DEAD, id="503"),
        pytest.param(
            stage(), [(HEALTH, 10.0)], False, False, False, StageState.STALLED, id="health-timeouts"
        ),
        pytest.param(
            stage(80.0), [(BEAT, 10.0)], False, False, False, StageState.STALLED, id="hang"
        ),
        pytest.param(
            stage(80.0, moved=99.0),
            [(BEAT, 10.0)],
            False,
            False,
            False,
            StageState.DEGRADED,
            id="slow-but-progressing",
        ),
        pytest.param(
            stage(80.0, moved=99.0),
            [(BEAT, 10.0)],
            True,
            False,
            False,
            StageState.STALLED,
            id="progress-told-but-held-up",
        ),
        pytest.param(
            stage(95.0), [(BEAT, 2.0)], False, False, False, StageState.DEGRADED, id="late"
        ),
    ],
)
def test_a_local_stage_is_decided_by_its_evidence(
    memory: StageMemory,
    held: list[tuple[EvidenceKind, float]],
    stuck: bool,
    set_aside: bool,
    answered: bool,
    state: StageState,
) -> None:
    decided = decide(CONFIG, target(answered), memory, evidence(*held), NOW, stuck, set_aside)
    assert decided is state


@pytest.mark.parametrize(
    ("memory", "held", "state"),
    [
        pytest.param(stage(), [(HEALTH, 10.0)], StageState.DEAD, id="no-replica-confirmed"),
        pytest.param(stage(), [(HEALTH, 1.0)], StageState.UNKNOWN, id="no-spans-fresh-503"),
        pytest.param(stage(90.0), [], StageState.UNKNOWN, id="spans-stopped"),
        pytest.param(stage(99.0), [], StageState.HEALTHY, id="spans-coming"),
        pytest.param(stage(99.0), [(SPAN, 1.0)], StageState.DEGRADED, id="one-late"),
        pytest.param(stage(99.0), [(SPAN, 1.0), (CANARY, 1.0)], StageState.STALLED, id="stalled"),
    ],
)
def test_a_remote_stage_is_decided_by_its_spans_and_the_servers_word(
    memory: StageMemory, held: list[tuple[EvidenceKind, float]], state: StageState
) -> None:
    assert decide_remote(CONFIG, target(), memory, evidence(*held), NOW) is state


@pytest.mark.parametrize(
    ("first_healthy", "stage_exits", "now", "warm"),
    [
        (None, 0, 119.0, False),
        (None, 0, 120.0, True),  # startup_timeout after attach
        (None, 1, 1.0, True),  # a stage process exited: broken for sure
        (10.0, 0, 14.9, False),
        (10.0, 0, 15.0, True),  # startup_grace after the first healthy /health
    ],
)
def test_start_up_ends_on_health_a_timeout_or_a_stage_exit(
    first_healthy: float | None, stage_exits: int, now: float, warm: bool
) -> None:
    memory = target()
    memory.first_healthy, memory.stage_exits = first_healthy, stage_exits
    assert warmed_up(CONFIG, memory, now) is warm


@pytest.mark.parametrize(
    ("failed_for", "local", "remote", "verdicts"),
    [
        pytest.param(120.0, StageState.HEALTHY, StageState.UNKNOWN, 1, id="remote-missing"),
        pytest.param(119.0, StageState.HEALTHY, StageState.UNKNOWN, 0, id="within-grace"),
        pytest.param(120.0, StageState.STALLED, StageState.UNKNOWN, 0, id="a-local-stage-unwell"),
        pytest.param(120.0, StageState.HEALTHY, StageState.HEALTHY, 0, id="remote-well"),
    ],
)
def test_the_head_is_judged_dead_only_for_a_remote_stage_missing_past_its_grace(
    failed_for: float, local: StageState, remote: StageState, verdicts: int
) -> None:
    memory = target()
    memory.health_failures = CONFIG.health_failures
    memory.health_failed_since = NOW - failed_for
    statuses = [
        StageStatus(S0, "engine", local, 0.0),
        StageStatus(S1, "", remote, 0.0, remote=True),
    ]
    found = head_verdict(CONFIG, memory, statuses, NOW)
    assert [(v.stage, v.state) for v in found] == [(S1, StageState.DEAD)] * verdicts
    # Once per spell.
    assert head_verdict(CONFIG, memory, statuses, NOW) == []
