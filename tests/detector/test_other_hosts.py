"""Table tests of the detector for stages on other hosts: a headless stage's link to its
master (its own watchdog's view), and a remote stage seen from the head (spans and the
server's /health only), over a fake clock."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

from omni_watchdog.clock import FakeClock
from omni_watchdog.config import DetectionConfig
from omni_watchdog.detector import Detector
from omni_watchdog.types import (
    DetectorReport,
    EvidenceKind,
    HealthOutcome,
    Observation,
    ObservationKind,
    ProcessInfo,
    ProcessRole,
    ProcessStatus,
    Stage,
    StageRef,
    StageState,
    Topology,
    Verdict,
)

CONFIG = DetectionConfig(link_grace=10.0, remote_grace=30.0)
S0, S1 = StageRef(0), StageRef(1)
TWO_STAGES = Topology((Stage(0, "thinker", downstream=(1,)), Stage(1, "talker", upstream=(0,))))
ONE_STAGE = Topology((Stage(1, "talker"),))
ROOT = ProcessInfo(100, 1.0, 1, 100, 100, "vllm", ProcessStatus.SLEEPING, 1.0, ProcessRole.API)


def engine(stage: StageRef, cpu: float) -> ProcessInfo:
    return ProcessInfo(
        200, 2.0, 100, 100, 100, "engine", ProcessStatus.SLEEPING, cpu, ProcessRole.ENGINE, stage
    )


@dataclass
class HeadlessHost:
    """A headless stage 1's host, each second: its processes, heartbeats and master link."""

    link: HealthOutcome = HealthOutcome.OK
    beating: bool = True

    def tick(self, now: float, second: int) -> list[Observation]:
        out = [
            Observation(ObservationKind.PROCESS, now, process=ROOT, outcome=ProcessStatus.SLEEPING),
            Observation(
                ObservationKind.PROCESS,
                now,
                process=engine(S1, float(second)),
                outcome=ProcessStatus.SLEEPING,
            ),
            Observation(ObservationKind.LINK, now, outcome=self.link, detail="master 10.0.0.1"),
        ]
        if self.beating:
            out.append(Observation(ObservationKind.HEARTBEAT, now, stage=S1))
        return out


@dataclass
class Head:
    """The head, each second: its local stage 0, the remote stage 1's spans, /health."""

    health: HealthOutcome = HealthOutcome.OK
    remote_beating: bool = True
    local_beating: bool = True
    heard: set[StageRef] = field(default_factory=set)

    def tick(self, now: float, second: int) -> list[Observation]:
        out = [
            Observation(ObservationKind.HEALTH, now, outcome=self.health, detail="503"),
            Observation(ObservationKind.PROCESS, now, process=ROOT, outcome=ProcessStatus.SLEEPING),
            Observation(
                ObservationKind.PROCESS,
                now,
                process=engine(S0, float(second)),
                outcome=ProcessStatus.SLEEPING,
            ),
        ]
        if self.local_beating:
            out.append(Observation(ObservationKind.HEARTBEAT, now, stage=S0))
        if self.remote_beating:
            out.append(Observation(ObservationKind.HEARTBEAT, now, stage=S1))
        return out


def run(
    detector: Detector,
    clock: FakeClock,
    world: HeadlessHost | Head,
    seconds: int,
) -> list[DetectorReport]:
    reports = []
    for second in range(seconds):
        detector.observe(world.tick(clock.monotonic(), second))
        reports.append(detector.evaluate(clock.monotonic()))
        clock.advance(1.0)
    return reports


def state_of(report: DetectorReport, ref: StageRef) -> StageState:
    return next(s.state for s in report.statuses if s.stage == ref)


def verdicts(reports: list[DetectorReport]) -> list[tuple[int, Verdict]]:
    return [(second, v) for second, r in enumerate(reports) for v in r.verdicts]


# ---- a headless stage's own watchdog --------------------------------------------------


def headless() -> tuple[Detector, FakeClock]:
    clock = FakeClock()
    return Detector(CONFIG, ONE_STAGE, clock.monotonic()), clock


@pytest.mark.parametrize(
    ("down", "why"),
    [
        (HealthOutcome.REFUSED, "the master's port refuses: the head is gone"),
        (HealthOutcome.UNHEALTHY, "reachable, but the stage is no longer connected to it"),
        (HealthOutcome.TIMEOUT, "the master does not answer"),
    ],
)
def test_a_link_down_past_its_grace_makes_the_orphaned_stage_dead(
    down: HealthOutcome, why: str
) -> None:
    detector, clock = headless()
    world = HeadlessHost()
    run(detector, clock, world, 10)
    world.link = down
    reports = run(detector, clock, world, 15)
    found = verdicts(reports)
    assert len(found) == 1, why
    second, verdict = found[0]
    assert verdict.state is StageState.DEAD and verdict.stage == S1
    assert not verdict.remote
    assert {e.kind for e in verdict.evidence} == {EvidenceKind.LINK_LOST}
    # Down from second 0 of the fault; judged on the first evaluation past the grace.
    assert second == 11, why


def test_a_link_blip_shorter_than_its_grace_is_no_verdict() -> None:
    detector, clock = headless()
    world = HeadlessHost()
    run(detector, clock, world, 10)
    world.link = HealthOutcome.REFUSED
    run(detector, clock, world, 9)
    world.link = HealthOutcome.OK
    reports = run(detector, clock, world, 20)
    assert verdicts(reports) == []
    assert state_of(reports[-1], S1) is StageState.HEALTHY


def test_a_headless_stage_is_warm_once_registered_with_its_master() -> None:
    """A headless stage has no /health: the first good link ends its start-up wait."""
    detector, clock = headless()
    world = HeadlessHost(link=HealthOutcome.REFUSED)
    reports = run(detector, clock, world, 30)
    assert not reports[-1].warmed_up
    world.link = HealthOutcome.OK
    reports = run(detector, clock, world, 6)
    assert reports[-1].warmed_up


def test_a_headless_stage_that_never_registers_is_judged_after_the_startup_timeout() -> None:
    config = DetectionConfig(link_grace=10.0, startup_timeout=20.0)
    clock = FakeClock()
    detector = Detector(config, ONE_STAGE, clock.monotonic())
    reports = run(detector, clock, HeadlessHost(link=HealthOutcome.REFUSED), 25)
    assert [v.state for _, v in verdicts(reports)] == [StageState.DEAD]
    assert verdicts(reports)[0][0] == 20


# ---- the head's watchdog, with stage 1 on another host --------------------------------


def head(config: DetectionConfig = CONFIG) -> tuple[Detector, FakeClock]:
    clock = FakeClock()
    return Detector(config, TWO_STAGES, clock.monotonic(), remote_stages=(1,)), clock


def test_a_remote_stage_is_marked_remote_and_healthy_while_its_spans_come() -> None:
    detector, clock = head()
    reports = run(detector, clock, Head(), 10)
    status = next(s for s in reports[-1].statuses if s.stage == S1)
    assert status.remote and status.state is StageState.HEALTHY
    assert not next(s for s in reports[-1].statuses if s.stage == S0).remote


def test_a_remote_stage_whose_spans_stop_while_the_server_is_healthy_is_unknown() -> None:
    """The spans may be lost between the hosts: silence alone judges nothing."""
    detector, clock = head()
    world = Head()
    run(detector, clock, world, 10)
    world.remote_beating = False
    reports = run(detector, clock, world, 60)
    assert state_of(reports[-1], S1) is StageState.UNKNOWN
    assert verdicts(reports) == []


def test_a_remote_stage_never_heard_is_unknown_and_never_blamed() -> None:
    detector, clock = head()
    reports = run(detector, clock, Head(remote_beating=False), 60)
    assert state_of(reports[-1], S1) is StageState.UNKNOWN
    assert verdicts(reports) == []


def test_a_remote_stage_without_a_live_replica_is_judged_dead_as_remote() -> None:
    """Its spans stop and the server answers 503 while the local stage beats: the remote
    stage has no live replica. The verdict is marked remote: shown, never acted on."""
    detector, clock = head()
    world = Head()
    run(detector, clock, world, 10)
    world.remote_beating = False
    world.health = HealthOutcome.UNHEALTHY
    reports = run(detector, clock, world, 20)
    found = verdicts(reports)
    assert [(v.stage, v.state, v.remote) for _, v in found] == [(S1, StageState.DEAD, True)]
    assert state_of(reports[-1], S0) is StageState.HEALTHY


def test_the_head_is_judged_once_its_server_stays_unhealthy_past_the_remote_grace() -> None:
    detector, clock = head()
    world = Head()
    run(detector, clock, world, 10)
    world.remote_beating = False
    world.health = HealthOutcome.UNHEALTHY
    reports = run(detector, clock, world, 60)
    head_verdicts = [(s, v) for s, v in verdicts(reports) if not v.remote]
    assert len(head_verdicts) == 1
    second, verdict = head_verdicts[0]
    # /health failed from second 0; remote_grace 30 s.
    assert second == 30
    assert verdict.state is StageState.DEAD
    assert "every local stage is well" in verdict.evidence[0].detail


def test_a_remote_stage_that_comes_back_within_the_grace_spares_the_head() -> None:
    """Its own host's watchdog ended it and Kubernetes started it again: it registers,
    /health is 200 again, and the head is left alone (no double remediation)."""
    detector, clock = head()
    world = Head()
    run(detector, clock, world, 10)
    world.remote_beating = False
    world.health = HealthOutcome.UNHEALTHY
    reports = run(detector, clock, world, 25)
    world.remote_beating = True
    world.health = HealthOutcome.OK
    reports += run(detector, clock, world, 60)
    assert all(v.remote for _, v in verdicts(reports))
    assert state_of(reports[-1], S1) is StageState.HEALTHY


def test_a_local_stage_unwell_is_judged_on_its_own_not_by_the_remote_grace() -> None:
    detector, clock = head()
    world = Head()
    run(detector, clock, world, 10)
    world.remote_beating = False
    world.local_beating = False
    world.health = HealthOutcome.UNHEALTHY
    reports = run(detector, clock, world, 60)
    local = [(s, v) for s, v in verdicts(reports) if v.stage == S0]
    assert local and not local[0][1].remote
    assert local[0][0] < 30


@dataclass
class BlockedForward(HeadlessHost):
    """The stage's loop blocks at second `at`: no heartbeats; CPU moves or not."""

    at: int = 10
    cpu_moves: bool = False
    runnable: bool = False

    def tick(self, now: float, second: int) -> list[Observation]:
        self.beating = second < self.at
        out = super().tick(now, second)
        cpu = float(second if second < self.at or self.cpu_moves else self.at)
        status = ProcessStatus.RUNNING if self.runnable else ProcessStatus.SLEEPING
        stage_engine = dataclasses.replace(engine(S1, cpu), status=status)
        return [*out[:1], Observation(ObservationKind.PROCESS, now, process=stage_engine), *out[2:]]


@pytest.mark.parametrize(
    ("world", "judged_at"),
    [
        (BlockedForward(), 13),  # heartbeat timeout 3 s, CPU flat 2 s: two kinds at once
        (BlockedForward(cpu_moves=True), 22),  # CPU moving: heartbeat lost alone, confirmed
        (BlockedForward(runnable=True), 22),  # starved of CPU: runnable is not stuck
    ],
    ids=["silent and idle", "silent but burning CPU", "silent and runnable"],
)
def test_a_headless_stage_whose_loop_blocks_is_stalled(
    world: BlockedForward, judged_at: int
) -> None:
    """A headless stage serves no load gauges: a silent loop in processes that use no CPU
    is stuck; one that burns CPU or waits for one is judged on its silence alone."""
    detector, clock = headless()
    reports = run(detector, clock, world, 30)
    found = verdicts(reports)
    assert found and found[0][1].state is StageState.STALLED
    # The last beat at second 9; heartbeat_timeout 3 s, confirm_timeout 10 s.
    assert found[0][0] == judged_at
