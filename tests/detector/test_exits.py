"""Table tests of exit classification: what the server went through before it exited ->
crash or clean stop, and what confirms that a stage process's exit killed its stage."""

from __future__ import annotations

import pytest

from omni_watchdog.config import DetectionConfig
from omni_watchdog.detector.exits import after_exit, released_after_exit, target_exit
from omni_watchdog.detector.expectations import BlindSpells
from omni_watchdog.detector.memory import ProcessMemory, StageMemory, TargetMemory, attach
from omni_watchdog.types import (
    Evidence,
    EvidenceKind,
    ProcessInfo,
    ProcessRole,
    ProcessStatus,
    Stage,
    StageRef,
    StageState,
    Topology,
)

CONFIG = DetectionConfig()  # crash_window 30 s
S0 = StageRef(0)
EXITED_AT = 100.0


def target(
    signs: tuple[tuple[float, str], ...] = (),
    state: StageState = StageState.HEALTHY,
    root_exited_at: float | None = EXITED_AT,
) -> TargetMemory:
    memory = attach(Topology((Stage(0, "engine"),)), 0.0, (), BlindSpells())
    memory.stages[S0].state = state
    memory.unhealthy_signs = list(signs)
    memory.root_exited_at = root_exited_at
    return memory


@pytest.mark.parametrize(
    ("signs", "state", "crashed", "reasons"),
    [
        pytest.param([], StageState.HEALTHY, False, (), id="nothing-wrong-a-clean-stop"),
        pytest.param(
            [(90.0, "/health timeout")],
            StageState.HEALTHY,
            True,
            ("/health timeout",),
            id="a-sign-10s-before",
        ),
        pytest.param(
            [(99.5, "/health unhealthy 503")],
            StageState.HEALTHY,
            False,
            (),
            id="a-sign-within-the-settle-of-a-clean-stop",
        ),
        pytest.param(
            [(60.0, "canary timeout")],
            StageState.HEALTHY,
            False,
            (),
            id="a-sign-past-the-crash-window",
        ),
        pytest.param(
            [],
            StageState.STALLED,
            True,
            ("stage 0.0 was stalled",),
            id="a-stage-judged-stalled",
        ),
        pytest.param(
            [(80.0, "canary timeout"), (95.0, "/health refused")],
            StageState.DEGRADED,
            True,
            ("stage 0.0 was degraded", "canary timeout", "/health refused"),
            id="states-first-then-signs-in-time-order",
        ),
    ],
)
def test_an_exit_is_a_crash_when_something_was_wrong_before_it(
    signs: list[tuple[float, str]],
    state: StageState,
    crashed: bool,
    reasons: tuple[str, ...],
) -> None:
    memory = target(tuple(signs), state)
    told = target_exit(CONFIG, memory)
    assert told is not None
    assert (told.time, told.crashed, told.reasons) == (EXITED_AT, crashed, reasons)
    # Told once.
    assert target_exit(CONFIG, memory) is None


def test_a_live_server_has_no_exit_to_tell() -> None:
    assert target_exit(CONFIG, target(root_exited_at=None)) is None


def exited_engine(pid: int, exited_at: float) -> ProcessMemory:
    info = ProcessInfo(
        pid, 2.0, 1, 1, 1, "engine", ProcessStatus.SLEEPING, 1.0, ProcessRole.ENGINE, S0
    )
    return ProcessMemory(info, 0.0, 0.0, exited_at=exited_at)


@pytest.mark.parametrize(
    ("health_unwell", "canary_failed", "already", "kinds"),
    [
        pytest.param(None, None, (), [], id="nothing-said-after"),
        pytest.param((51.0, "unhealthy 503"), None, (), [EvidenceKind.HEALTH_FAILED], id="503"),
        pytest.param((49.0, "unhealthy 503"), None, (), [], id="health-failed-before-the-exit"),
        pytest.param(None, 52.0, (), [EvidenceKind.CANARY_FAILED], id="canary-after"),
        pytest.param(
            (51.0, "timeout"),
            52.0,
            (EvidenceKind.HEALTH_FAILED,),
            [EvidenceKind.CANARY_FAILED],
            id="health-failed-counted-once",
        ),
    ],
)
def test_what_the_server_said_after_a_stage_exit_confirms_it(
    health_unwell: tuple[float, str] | None,
    canary_failed: float | None,
    already: tuple[EvidenceKind, ...],
    kinds: list[EvidenceKind],
) -> None:
    memory = target(root_exited_at=None)
    memory.health_unwell = health_unwell
    memory.canary_last_failed = canary_failed
    evidence = [Evidence(EvidenceKind.PROCESS_EXIT, S0, 50.0, "engine exited")]
    evidence += [Evidence(kind, S0, 50.0, "") for kind in already]
    found = after_exit(memory, S0, memory.stages[S0], evidence, 60.0)
    assert [e.kind for e in found] == kinds
    assert all(e.since > 50.0 for e in found)


def test_without_an_exit_nothing_after_it_counts() -> None:
    memory = target(root_exited_at=None)
    memory.health_unwell = (51.0, "unhealthy 503")
    assert after_exit(memory, S0, memory.stages[S0], [], 60.0) == []


@pytest.mark.parametrize(
    ("read_at", "seen_at", "root_alive", "released"),
    [
        pytest.param(60.0, 40.0, True, [(60.0, 7)], id="read-after-the-exit-without-it"),
        pytest.param(50.5, 40.0, True, [(51.0, 7)], id="counts-once-the-exit-settled"),
        pytest.param(60.0, 60.0, True, [], id="still-listed"),
        pytest.param(45.0, 40.0, True, [], id="read-before-the-exit"),
        pytest.param(60.0, 40.0, False, [], id="the-server-went-too"),
        pytest.param(None, 40.0, True, [], id="never-read"),
    ],
)
def test_the_gpu_letting_go_of_an_exited_process_counts_from_its_reading(
    read_at: float | None, seen_at: float, root_alive: bool, released: list[tuple[float, int]]
) -> None:
    memory = target(root_exited_at=None if root_alive else 55.0)
    memory.gpu_read_at = read_at
    stage = StageMemory(processes={7: exited_engine(7, 50.0)})
    stage.gpu_bytes[7] = 2.0**30
    stage.gpu_seen_at[7] = seen_at
    assert released_after_exit(memory, stage) == released
