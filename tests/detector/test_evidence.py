"""Table tests of evidence: a stage's memory and a time -> the evidence against it, each
kind with the moment it began to stand."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from omni_watchdog.config import DetectionConfig
from omni_watchdog.detector.evidence import deadline, own_evidence, target_evidence
from omni_watchdog.detector.expectations import BlindSpells
from omni_watchdog.detector.memory import ProcessMemory, TargetMemory, attach
from omni_watchdog.types import (
    EvidenceKind,
    ProcessInfo,
    ProcessRole,
    ProcessStatus,
    Stage,
    StageRef,
    Topology,
)

# heartbeat_timeout 3 s, progress_timeout 3 s, stuck_timeout 2 s, link_grace 10 s,
# overdue_floor 10 s, overdue_multiplier 4.
CONFIG = DetectionConfig()
S0 = StageRef(0)
NOW = 20.0


def engine(status: ProcessStatus, since: float) -> ProcessMemory:
    info = ProcessInfo(200, 2.0, 1, 1, 1, "engine", status, 1.0, ProcessRole.ENGINE, S0)
    return ProcessMemory(info, status_since=since, cpu_changed_at=since, seen_at=since)


def silent_since(at: float) -> Callable[[TargetMemory], None]:
    def setup(target: TargetMemory) -> None:
        target.stages[S0].last_heartbeat = at

    return setup


def blind_then_silent(target: TargetMemory) -> None:
    target.stages[S0].last_heartbeat = 15.0
    target.blind.add(16.0, 18.0)


def loaded_and_flat(target: TargetMemory) -> None:
    memory = target.stages[S0]
    memory.load, memory.load_at, memory.load_positive_since = 2.0, NOW, 10.0
    memory.progress_changed_at = 12.0


def stopped(target: TargetMemory) -> None:
    target.stages[S0].processes[200] = engine(ProcessStatus.STOPPED, 15.0)


def stopped_lately(target: TargetMemory) -> None:
    target.stages[S0].processes[200] = engine(ProcessStatus.STOPPED, 19.0)


def exited(target: TargetMemory) -> None:
    process = engine(ProcessStatus.SLEEPING, 1.0)
    process.exited_at = 17.0
    target.stages[S0].processes[200] = process


def silent_without_cpu(target: TargetMemory) -> None:
    # No load gauges (a headless stage): no beat and no CPU time gained since 10 s.
    target.stages[S0].last_heartbeat = 10.0
    target.stages[S0].processes[200] = engine(ProcessStatus.SLEEPING, 10.0)


def link_down(target: TargetMemory) -> None:
    target.link_down_since, target.link_detail = 5.0, "master gone"


@pytest.mark.parametrize(
    ("setup", "found"),
    [
        pytest.param(silent_since(19.0), [], id="beating"),
        pytest.param(silent_since(15.0), [(EvidenceKind.HEARTBEAT_LOST, 18.0)], id="silent-5s"),
        pytest.param(blind_then_silent, [], id="silent-5s-of-which-2s-unseen"),
        pytest.param(loaded_and_flat, [(EvidenceKind.PROGRESS_FLAT, 15.0)], id="flat-under-load"),
        pytest.param(stopped, [(EvidenceKind.PROCESS_STUCK, 17.0)], id="stopped-5s"),
        pytest.param(stopped_lately, [], id="stopped-1s"),
        pytest.param(exited, [(EvidenceKind.PROCESS_EXIT, 17.0)], id="engine-exited"),
        pytest.param(
            silent_without_cpu,
            [(EvidenceKind.HEARTBEAT_LOST, 13.0), (EvidenceKind.PROCESS_STUCK, 12.0)],
            id="silent-and-no-cpu",
        ),
        pytest.param(link_down, [(EvidenceKind.LINK_LOST, 15.0)], id="orphaned"),
    ],
)
def test_a_stage_own_signals_become_evidence_from_when_they_ran_out(
    setup: Callable[[TargetMemory], None], found: list[tuple[EvidenceKind, float]]
) -> None:
    target = attach(Topology((Stage(0, "engine"),)), 0.0, (), BlindSpells())
    setup(target)
    evidence = own_evidence(CONFIG, target, S0, target.stages[S0], NOW)
    assert [(e.kind, e.since) for e in evidence] == found


def test_the_silence_the_watchdog_did_not_see_is_said_apart() -> None:
    target = attach(Topology((Stage(0, "engine"),)), 0.0, (), BlindSpells())
    target.stages[S0].last_heartbeat = 14.0
    target.blind.add(16.0, 17.0)
    (lost,) = own_evidence(CONFIG, target, S0, target.stages[S0], NOW)
    assert lost.detail == (
        "no loop heartbeat for 5.0s (and 1.0s the watchdog itself could not look)"
    )


@pytest.mark.parametrize(
    ("failures", "canary_failed_at", "found"),
    [
        (2, None, []),
        (3, None, [(EvidenceKind.HEALTH_FAILED, 7.0)]),
        (0, 9.0, [(EvidenceKind.CANARY_FAILED, 9.0)]),
        (4, 9.0, [(EvidenceKind.HEALTH_FAILED, 7.0), (EvidenceKind.CANARY_FAILED, 9.0)]),
    ],
)
def test_the_target_fails_once_health_failed_n_times_or_the_canary_failed(
    failures: int, canary_failed_at: float | None, found: list[tuple[EvidenceKind, float]]
) -> None:
    target = attach(Topology((Stage(0, "engine"),)), 0.0, (), BlindSpells())
    target.health_failures, target.health_confirmed_at = failures, 7.0
    target.canary_failed_at = canary_failed_at
    assert [(kind, since) for kind, since, _ in target_evidence(CONFIG, target, NOW)] == found


@pytest.mark.parametrize(
    ("durations", "expected"),
    [([], 10.0), ([1.0] * 10, 10.0), ([5.0] * 10, 20.0)],
)
def test_a_span_deadline_is_learned_from_the_stage_durations_above_a_floor(
    durations: list[float], expected: float
) -> None:
    target = attach(Topology((Stage(0, "engine"),)), 0.0, (), BlindSpells())
    for seconds in durations:
        target.stages[S0].durations.add(seconds)
    assert deadline(CONFIG, target, 0) == expected
