"""Table tests of the detector: observation sequences over a fake clock -> states, verdicts."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from omni_watchdog.clock import FakeClock
from omni_watchdog.config import DetectionConfig
from omni_watchdog.detector import Detector
from omni_watchdog.detector.expectations import (
    EARLY_SPANS_PER_REQUEST,
    BlindSpells,
    PendingRequests,
)
from omni_watchdog.detector.memory import MAX_EXTRA_STAGES, MAX_PROCESSES_PER_STAGE
from omni_watchdog.probes.processes import ThreadWaits
from omni_watchdog.types import (
    PIPELINE,
    DetectorReport,
    EvidenceKind,
    HealthOutcome,
    Observation,
    ObservationKind,
    ProcessInfo,
    ProcessRole,
    ProcessStatus,
    SilenceCause,
    SpanOutcome,
    Stage,
    StageRef,
    StageState,
    Topology,
    Verdict,
)

CONFIG = DetectionConfig()
THREE_STAGES = Topology(
    (
        Stage(0, "thinker", downstream=(1,)),
        Stage(1, "talker", upstream=(0,), downstream=(2,)),
        Stage(2, "code2wav", upstream=(1,), final_output=True),
    )
)
ONE_STAGE = Topology((Stage(0, "engine"),))
S0, S1, S2 = StageRef(0), StageRef(1), StageRef(2)
ROOT = ProcessInfo(100, 1.0, 1, 100, 100, "api", ProcessStatus.SLEEPING, 1.0, ProcessRole.API)


def process(
    pid: int,
    stage: StageRef,
    role: ProcessRole,
    status: ProcessStatus,
    cpu: float = 1.0,
    cpu_wait: float = 0.0,
) -> ProcessInfo:
    return ProcessInfo(
        pid, 2.0, 100, 100, 100, role.value, status, cpu, role, stage, cpu_wait_seconds=cpu_wait
    )


@dataclass
class World:
    """What the server does each second; tests switch parts of it off."""

    heartbeats: set[StageRef] = field(default_factory=lambda: {S0, S1, S2})
    progressing: set[StageRef] = field(default_factory=set)
    load: dict[StageRef, float] = field(default_factory=dict)
    health: HealthOutcome = HealthOutcome.OK
    engines: dict[StageRef, ProcessStatus] = field(default_factory=dict)
    cpu_moving: bool = True
    canary: HealthOutcome | None = None
    tokens: dict[StageRef, float] = field(default_factory=dict)
    # Stage spans each second, as a forger could send them for any stage.
    spans: set[StageRef] = field(default_factory=set)
    # Stages whose engines wait for a CPU `wait_share` of each second (of the seconds
    # `starved_in`, when given): neighbours load the host.
    starved: set[StageRef] = field(default_factory=set)
    wait_share: float = 0.5
    starved_in: range | None = None
    waited: dict[StageRef, float] = field(default_factory=dict)
    # From this second on the processes probe gets no turn to read the engines.
    engines_unread_from: int | None = None

    def tick(self, now: float, second: int) -> list[Observation]:
        out: list[Observation] = [
            Observation(ObservationKind.HEALTH, now, outcome=self.health),
            Observation(ObservationKind.PROCESS, now, process=ROOT, outcome=ProcessStatus.SLEEPING),
        ]
        for ref in self.heartbeats:
            out.append(Observation(ObservationKind.HEARTBEAT, now, stage=ref))
        for ref in set(self.load) | set(self.tokens) | self.progressing:
            if ref in self.progressing:
                self.tokens[ref] = self.tokens.get(ref, 0.0) + 5
            out.append(Observation(ObservationKind.PROGRESS, now, ref, self.tokens.get(ref, 0.0)))
            out.append(Observation(ObservationKind.LOAD, now, ref, self.load.get(ref, 0.0)))
        unread = self.engines_unread_from is not None and second >= self.engines_unread_from
        for pid, (ref, status) in enumerate({} if unread else self.engines.items(), start=200):
            cpu = float(second) if self.cpu_moving and status is ProcessStatus.RUNNING else 1.0
            if ref in self.starved and (self.starved_in is None or second in self.starved_in):
                self.waited[ref] = self.waited.get(ref, 0.0) + self.wait_share
            info = process(pid, ref, ProcessRole.ENGINE, status, cpu, self.waited.get(ref, 0.0))
            out.append(Observation(ObservationKind.PROCESS, now, process=info, outcome=status))
        if self.canary is not None:
            out.append(Observation(ObservationKind.CANARY, now, outcome=self.canary))
        for ref in self.spans:
            out.append(Observation(ObservationKind.STAGE_SPAN, now, ref, 0.1, SpanOutcome.OK))
        return out


def run(
    topology: Topology,
    world: World,
    seconds: int,
    change: Callable[[World, int], None] | None = None,
    config: DetectionConfig = CONFIG,
) -> list[DetectorReport]:
    clock = FakeClock()
    detector = Detector(config, topology, clock.monotonic())
    reports = []
    for second in range(seconds):
        if change:
            change(world, second)
        detector.observe(world.tick(clock.monotonic(), second))
        reports.append(detector.evaluate(clock.monotonic()))
        clock.advance(1.0)
    return reports


def state_of(report: DetectorReport, ref: StageRef) -> StageState:
    return next(s.state for s in report.statuses if s.stage == ref)


def kinds_of(report: DetectorReport, ref: StageRef) -> set[EvidenceKind]:
    return {e.kind for s in report.statuses if s.stage == ref for e in s.evidence}


def first_verdict(reports: list[DetectorReport]) -> tuple[int, Verdict] | None:
    return next(((i, v) for i, r in enumerate(reports) for v in r.verdicts), None)


WARM = 7  # first healthy /health at 0 s + 5 s grace


def after(second: int, action: Callable[[World], None]) -> Callable[[World, int], None]:
    def change(world: World, now: int) -> None:
        if now == second:
            action(world)

    return change


def engine_dies(world: World) -> None:
    world.engines[S1] = ProcessStatus.EXITED
    world.heartbeats.discard(S1)
    world.health = HealthOutcome.TIMEOUT


def stage_deadlocks(world: World) -> None:
    world.heartbeats.discard(S1)
    world.load[S1] = 1
    world.progressing.discard(S1)
    world.cpu_moving = False


def slows_down(world: World) -> None:
    world.load[S1] = 1
    world.progressing.add(S1)
    world.cpu_moving = False


def engine_frozen(world: World) -> None:
    world.engines[S0] = ProcessStatus.STOPPED
    world.load[S0] = 1
    world.progressing.discard(S0)
    world.canary = HealthOutcome.TIMEOUT


SCENARIOS = [
    # name, topology, change, seconds, stage, final state, verdict expected, kinds required
    (
        "engine-dead-hang",
        THREE_STAGES,
        after(10, engine_dies),
        16,
        S1,
        StageState.DEAD,
        True,
        {EvidenceKind.PROCESS_EXIT, EvidenceKind.HEARTBEAT_LOST},
    ),
    (
        "silent-stall",
        THREE_STAGES,
        after(10, stage_deadlocks),
        20,
        S1,
        StageState.STALLED,
        True,
        {EvidenceKind.HEARTBEAT_LOST, EvidenceKind.PROGRESS_FLAT},
    ),
    (
        "slow-but-alive",
        THREE_STAGES,
        after(10, slows_down),
        40,
        S1,
        StageState.HEALTHY,
        False,
        set(),
    ),
    (
        "frozen-engine, plain vLLM without plugin",
        ONE_STAGE,
        after(10, engine_frozen),
        20,
        S0,
        StageState.STALLED,
        True,
        {EvidenceKind.PROCESS_STUCK, EvidenceKind.CANARY_FAILED},
    ),
]


@pytest.mark.parametrize(
    ("topology", "change", "seconds", "stage", "final", "verdict", "kinds"),
    [s[1:] for s in SCENARIOS],
    ids=[s[0] for s in SCENARIOS],
)
def test_scenarios(
    topology: Topology,
    change: Callable[[World, int], None],
    seconds: int,
    stage: StageRef,
    final: StageState,
    verdict: bool,
    kinds: set[EvidenceKind],
) -> None:
    world = World(heartbeats=set(topology.refs()) if topology is THREE_STAGES else set())
    if topology is THREE_STAGES:
        world.engines = {S0: ProcessStatus.SLEEPING, S1: ProcessStatus.SLEEPING}
    else:
        world.engines = {S0: ProcessStatus.SLEEPING}
    reports = run(topology, world, seconds, change)
    assert state_of(reports[-1], stage) is final
    assert kinds <= kinds_of(reports[-1], stage)
    found = first_verdict(reports)
    if verdict:
        assert found is not None and found[1].stage == stage and found[1].state is final
        assert len({e.kind for e in found[1].evidence} - {EvidenceKind.GPU_HELD}) >= 2
    else:
        assert found is None


def test_engine_dead_hang_is_judged_within_five_seconds_of_the_fault() -> None:
    world = World(engines={S0: ProcessStatus.SLEEPING, S1: ProcessStatus.SLEEPING})
    reports = run(THREE_STAGES, world, 20, after(10, engine_dies))
    found = first_verdict(reports)
    assert found is not None
    second, verdict = found
    assert verdict.stage == S1 and verdict.state is StageState.DEAD
    assert second - 10 <= 5
    # The neighbours keep beating: the starved /health is not charged to them.
    assert state_of(reports[-1], S0) is StageState.HEALTHY
    assert state_of(reports[-1], S2) is StageState.HEALTHY


def test_nothing_is_judged_during_start_up() -> None:
    world = World(health=HealthOutcome.TIMEOUT, heartbeats=set())
    world.engines = {S1: ProcessStatus.STOPPED}
    world.load = {S1: 3}
    reports = run(THREE_STAGES, world, 60)
    assert all(state_of(r, ref) is StageState.STARTING for r in reports for ref in (S0, S1, S2))
    assert first_verdict(reports) is None


def test_grace_counts_from_the_first_healthy_answer() -> None:
    def healthy_at_20(world: World, second: int) -> None:
        world.health = HealthOutcome.OK if second >= 20 else HealthOutcome.REFUSED

    reports = run(THREE_STAGES, World(), 40, healthy_at_20)
    assert state_of(reports[24], S0) is StageState.STARTING
    assert state_of(reports[26], S0) is StageState.HEALTHY


def test_one_kind_alone_needs_confirm_timeout() -> None:
    def beat_lost(world: World) -> None:
        world.heartbeats.discard(S2)

    reports = run(THREE_STAGES, World(), 30, after(10, beat_lost))
    # heartbeat_lost from 13 s (3 s timeout); confirmed alone 10 s later.
    assert state_of(reports[15], S2) is StageState.DEGRADED
    found = first_verdict(reports)
    assert found is not None
    second, verdict = found
    assert verdict.stage == S2 and verdict.state is StageState.STALLED
    assert 22 <= second <= 24


def test_two_stages_failing_independently() -> None:
    def both(world: World, second: int) -> None:
        if second == 10:
            stage_deadlocks(world)
        if second == 14:
            world.heartbeats.discard(S2)
            world.load[S2] = 2

    world = World(engines={S1: ProcessStatus.SLEEPING})
    reports = run(THREE_STAGES, world, 30, both)
    stalled = {v.stage for r in reports for v in r.verdicts}
    assert stalled == {S1, S2}
    assert state_of(reports[-1], S0) is StageState.HEALTHY


def test_a_stage_that_recovers_goes_back_to_healthy() -> None:
    def stall_then_recover(world: World, second: int) -> None:
        if second == 10:
            stage_deadlocks(world)
        if second == 22:
            world.heartbeats.add(S1)
            world.progressing.add(S1)
            world.cpu_moving = True
        if second == 26:
            world.load[S1] = 0
            world.progressing.discard(S1)

    reports = run(THREE_STAGES, World(), 32, stall_then_recover)
    assert state_of(reports[20], S1) is StageState.STALLED
    assert state_of(reports[-1], S1) is StageState.HEALTHY


def test_slow_but_alive_never_stalls_however_late() -> None:
    """A soak: a stage 10x slower with overdue requests, heartbeats and tokens flowing."""
    clock = FakeClock()
    detector = Detector(CONFIG, THREE_STAGES, clock.monotonic())
    tokens = 0.0
    for second in range(600):
        now = clock.monotonic()
        detector.observe(
            [
                Observation(ObservationKind.HEALTH, now, outcome=HealthOutcome.OK),
                *[Observation(ObservationKind.HEARTBEAT, now, stage=r) for r in (S0, S1, S2)],
                Observation(
                    ObservationKind.REQUEST_ADMITTED, now, request_id=f"r{second}", path=(0, 1, 2)
                ),
                Observation(
                    ObservationKind.STAGE_SPAN,
                    now,
                    S0,
                    0.1,
                    SpanOutcome.OK,
                    request_id=f"r{second}",
                ),
                Observation(ObservationKind.PROGRESS, now, S1, tokens),
                Observation(ObservationKind.LOAD, now, S1, 4.0),
            ]
        )
        if second % 40 == 0:
            detector.observe(
                [
                    Observation(
                        ObservationKind.STAGE_SPAN,
                        now,
                        S1,
                        40.0,
                        SpanOutcome.OK,
                        request_id=f"r{second - 40}",
                    ),
                    Observation(
                        ObservationKind.STAGE_SPAN,
                        now,
                        S2,
                        0.1,
                        SpanOutcome.OK,
                        request_id=f"r{second - 40}",
                    ),
                ]
            )
        tokens += 1
        report = detector.evaluate(now)
        assert not report.verdicts
        assert all(
            s.state in (StageState.HEALTHY, StageState.DEGRADED, StageState.STARTING)
            for s in report.statuses
        )
        clock.advance(1.0)
    assert EvidenceKind.SPAN_OVERDUE in kinds_of(report, S1)
    assert state_of(report, S1) is StageState.DEGRADED


def test_span_deadline_adapts_to_the_stage_p99() -> None:
    clock = FakeClock()
    detector = Detector(CONFIG, THREE_STAGES, clock.monotonic())
    for i in range(100):
        detector.observe(
            [
                Observation(
                    ObservationKind.STAGE_SPAN,
                    0.0,
                    S1,
                    5.0 + i * 0.01,
                    SpanOutcome.OK,
                    request_id="x",
                )
            ]
        )
    assert detector.deadline(1) == pytest.approx(4.0 * 5.99)
    assert detector.deadline(0) == CONFIG.overdue_floor
    # The report tells each stage's deadline: how long before a waiting request is overdue.
    requests = detector.evaluate(clock.monotonic()).requests
    assert requests[1].deadline == pytest.approx(4.0 * 5.99)
    assert requests[0].deadline == CONFIG.overdue_floor


def test_overdue_span_is_evidence_on_the_stage_the_request_waits_at() -> None:
    clock = FakeClock()
    detector = Detector(CONFIG, THREE_STAGES, clock.monotonic())
    now = clock.monotonic()
    detector.observe(
        [
            Observation(ObservationKind.HEALTH, now, outcome=HealthOutcome.OK),
            Observation(ObservationKind.REQUEST_ADMITTED, now, request_id="a", path=(0, 1, 2)),
            Observation(
                ObservationKind.STAGE_SPAN, now + 1, S0, 1.0, SpanOutcome.OK, request_id="a"
            ),
        ]
    )
    report = detector.evaluate(now + 12.5)
    assert EvidenceKind.SPAN_OVERDUE in kinds_of(report, S1)
    assert EvidenceKind.SPAN_OVERDUE not in kinds_of(report, S0)
    assert detector.in_flight(1) == 1 and detector.overdue_count(1, now + 12.5) == 1


def test_stage_spans_that_arrive_before_the_admission_count() -> None:
    """The stages' exporters can beat the API's: an idle pipeline must not look stalled."""
    clock = FakeClock()
    detector = Detector(CONFIG, THREE_STAGES, clock.monotonic())
    now = clock.monotonic()
    detector.observe(
        [
            Observation(ObservationKind.HEALTH, now, outcome=HealthOutcome.OK),
            *[
                Observation(
                    ObservationKind.STAGE_SPAN, now, ref, 0.1, SpanOutcome.OK, request_id="fast"
                )
                for ref in (S0, S1)
            ],
            Observation(
                ObservationKind.REQUEST_ADMITTED, now + 0.4, request_id="fast", path=(0, 1, 2)
            ),
            Observation(
                ObservationKind.STAGE_SPAN,
                now + 0.5,
                S0,
                0.1,
                SpanOutcome.ERROR,
                request_id="failed-early",
            ),
            Observation(
                ObservationKind.REQUEST_ADMITTED,
                now + 0.6,
                request_id="failed-early",
                path=(0, 1, 2),
            ),
        ]
    )
    assert detector.in_flight(0) == 0 and detector.in_flight(1) == 0
    assert detector.in_flight(2) == 1  # stage 2's span is still to come
    for second in range(1, 60):
        clock.advance(1.0)
        now = clock.monotonic()
        detector.observe(
            [Observation(ObservationKind.HEARTBEAT, now, stage=ref) for ref in (S0, S1, S2)]
        )
        if second == 2:
            detector.observe(
                [
                    Observation(
                        ObservationKind.STAGE_SPAN, now, S2, 0.1, SpanOutcome.OK, request_id="fast"
                    )
                ]
            )
        report = detector.evaluate(now)
        assert not report.verdicts
    assert {s.state for s in report.statuses} == {StageState.HEALTHY}
    assert [detector.in_flight(stage) for stage in (0, 1, 2)] == [0, 0, 0]


def test_a_finished_request_is_owed_no_span_by_a_stage_that_sent_none() -> None:
    """vLLM-Omni 0.30 ends a request whose last stage produced no processed output (a raw
    terminal) without a stage span for that stage; its finish must end the wait, or the
    idle last stage is judged stalled once the deadline passes (seen on the real server)."""
    clock = FakeClock()
    detector = Detector(CONFIG, THREE_STAGES, clock.monotonic())
    now = clock.monotonic()
    detector.observe(
        [
            Observation(ObservationKind.HEALTH, now, outcome=HealthOutcome.OK),
            Observation(ObservationKind.REQUEST_ADMITTED, now, request_id="quiet", path=(0, 1, 2)),
            Observation(
                ObservationKind.STAGE_SPAN, now + 0.1, S0, 0.1, SpanOutcome.OK, request_id="quiet"
            ),
            Observation(
                ObservationKind.STAGE_SPAN, now + 2, S1, 1.9, SpanOutcome.OK, request_id="quiet"
            ),
            Observation(ObservationKind.REQUEST_FINISHED, now + 2.1, request_id="quiet"),
        ]
    )
    assert [detector.in_flight(stage) for stage in (0, 1, 2)] == [0, 0, 0]
    for _ in range(60):
        clock.advance(1.0)
        now = clock.monotonic()
        detector.observe(
            [Observation(ObservationKind.HEARTBEAT, now, stage=ref) for ref in (S0, S1, S2)]
        )
        report = detector.evaluate(now)
        assert not any(kinds_of(report, ref) for ref in (S0, S1, S2)), report
    assert {status.state for status in report.statuses} == {StageState.HEALTHY}


def test_abandoned_requests_leave_every_stage_queue() -> None:
    """A client that goes away mid-pipeline: the stages after its current one never see it."""
    clock = FakeClock()
    detector = Detector(CONFIG, THREE_STAGES, clock.monotonic())
    now = clock.monotonic()
    detector.observe(
        [
            Observation(ObservationKind.HEALTH, now, outcome=HealthOutcome.OK),
            *[
                Observation(ObservationKind.REQUEST_ADMITTED, now, request_id=rid, path=(0, 1, 2))
                for rid in ("gone-at-0", "gone-at-1", "stays")
            ],
            Observation(
                ObservationKind.STAGE_SPAN, now + 1, S0, 1.0, SpanOutcome.OK, request_id="gone-at-1"
            ),
            Observation(ObservationKind.REQUEST_ABANDONED, now + 2, request_id="gone-at-0"),
            Observation(ObservationKind.REQUEST_ABANDONED, now + 2, request_id="gone-at-1"),
            # Abandoned before it was seen, or twice: nothing to forget.
            Observation(ObservationKind.REQUEST_ABANDONED, now + 2, request_id="unknown"),
            Observation(ObservationKind.REQUEST_ABANDONED, now + 2, request_id="gone-at-1"),
        ]
    )
    assert [detector.in_flight(stage) for stage in (0, 1, 2)] == [1, 0, 0]
    for second in range(3, 16):
        clock.advance(1.0)
        now = clock.monotonic()
        detector.observe(
            [Observation(ObservationKind.HEARTBEAT, now, stage=ref) for ref in (S0, S1, S2)]
        )
        if second == 3:
            # The stage the request had reached may still finish it; nothing waits for it.
            detector.observe(
                [
                    Observation(
                        ObservationKind.STAGE_SPAN,
                        now,
                        S1,
                        1.0,
                        SpanOutcome.OK,
                        request_id="gone-at-1",
                    )
                ]
            )
        report = detector.evaluate(now)
    assert [detector.in_flight(stage) for stage in (0, 1, 2)] == [1, 0, 0]
    # Past the 10 s deadline: only the request nobody abandoned is owed, by stage 0.
    overdue = [
        e.detail for s in report.statuses for e in s.evidence if e.kind is EvidenceKind.SPAN_OVERDUE
    ]
    assert overdue == ["1 request(s) past the 10.0s deadline, oldest stays"]
    assert not kinds_of(report, S1) and not kinds_of(report, S2)


def test_early_stage_spans_are_kept_within_a_bound() -> None:
    pending = PendingRequests(early_requests=3)
    for index in range(5):
        for _ in range(EARLY_SPANS_PER_REQUEST + 4):
            pending.stage_done(f"r{index}", 0, 0.0, False)
    pending.stage_done("", 0, 0.0, False)  # a span without a request id waits for nothing
    for index in range(5):
        pending.admit(f"r{index}", (0, 1), 1.0)
    # r0 and r1 were dropped for later ones: they wait at stage 0, the kept ones at stage 1.
    assert pending.in_flight(0) == 2 and pending.in_flight(1) == 3
    assert [p.request_id for p in pending.overdue(1, 0.0, 2.0, BlindSpells())] == ["r2", "r3", "r4"]


def test_zombie_helper_is_reported_not_judged() -> None:
    world = World()
    zombie = process(300, S1, ProcessRole.HELPER, ProcessStatus.ZOMBIE)

    clock = FakeClock()
    detector = Detector(CONFIG, THREE_STAGES, clock.monotonic())
    for _ in range(30):
        now = clock.monotonic()
        detector.observe(world.tick(now, 0))
        detector.observe(
            [
                Observation(
                    ObservationKind.PROCESS, now, process=zombie, outcome=ProcessStatus.ZOMBIE
                )
            ]
        )
        report = detector.evaluate(now)
        clock.advance(1.0)
    assert state_of(report, S1) is StageState.HEALTHY


def test_server_exit_after_engine_death_is_a_crash() -> None:
    clock = FakeClock()
    detector = Detector(CONFIG, ONE_STAGE, clock.monotonic())
    engine = process(200, S0, ProcessRole.ENGINE, ProcessStatus.SLEEPING)
    for second in range(12):
        now = clock.monotonic()
        health = HealthOutcome.OK if second < 8 else HealthOutcome.UNHEALTHY
        detector.observe([Observation(ObservationKind.HEALTH, now, outcome=health, detail="503")])
        detector.observe(
            [
                Observation(
                    ObservationKind.PROCESS, now, process=ROOT, outcome=ProcessStatus.SLEEPING
                )
            ]
        )
        outcome = ProcessStatus.SLEEPING if second < 8 else ProcessStatus.EXITED
        detector.observe(
            [Observation(ObservationKind.PROCESS, now, process=engine, outcome=outcome)]
        )
        assert detector.evaluate(now).target_exit is None
        clock.advance(1.0)
    detector.observe(
        [
            Observation(
                ObservationKind.PROCESS,
                clock.monotonic(),
                process=ROOT,
                outcome=ProcessStatus.EXITED,
            )
        ]
    )
    report = detector.evaluate(clock.monotonic())
    assert report.target_exit is not None and report.target_exit.crashed
    assert any("503" in reason for reason in report.target_exit.reasons)
    assert any("exited" in reason for reason in report.target_exit.reasons)
    assert not report.verdicts
    assert state_of(report, S0) is StageState.DEAD
    assert detector.evaluate(clock.monotonic()).target_exit is None


def test_clean_stop_is_not_a_crash() -> None:
    clock = FakeClock()
    detector = Detector(CONFIG, ONE_STAGE, clock.monotonic())
    engine = process(200, S0, ProcessRole.ENGINE, ProcessStatus.SLEEPING)
    for _ in range(10):
        now = clock.monotonic()
        detector.observe([Observation(ObservationKind.HEALTH, now, outcome=HealthOutcome.OK)])
        detector.observe(
            [
                Observation(
                    ObservationKind.PROCESS, now, process=engine, outcome=ProcessStatus.SLEEPING
                )
            ]
        )
        detector.observe(
            [
                Observation(
                    ObservationKind.PROCESS, now, process=ROOT, outcome=ProcessStatus.SLEEPING
                )
            ]
        )
        detector.evaluate(now)
        clock.advance(1.0)
    now = clock.monotonic()
    detector.observe(
        [
            Observation(ObservationKind.HEALTH, now, outcome=HealthOutcome.REFUSED),
            Observation(ObservationKind.PROCESS, now, process=engine, outcome=ProcessStatus.EXITED),
            Observation(
                ObservationKind.PROCESS, now + 0.2, process=ROOT, outcome=ProcessStatus.EXITED
            ),
        ]
    )
    exit_ = detector.evaluate(now + 0.5).target_exit
    assert exit_ is not None and not exit_.crashed


def stop_engine(stage: StageRef) -> Callable[[World], None]:
    def action(world: World) -> None:
        world.engines[stage] = ProcessStatus.STOPPED
        world.canary = HealthOutcome.TIMEOUT

    return action


def flatten(stage: StageRef) -> Callable[[World], None]:
    def action(world: World) -> None:
        world.progressing.discard(stage)
        world.canary = HealthOutcome.TIMEOUT

    return action


@pytest.mark.parametrize(
    ("name", "world", "change", "expected"),
    [
        (
            "a stopped engine under forged heartbeats and spans",
            World(engines={S1: ProcessStatus.SLEEPING}, spans={S1}),
            after(10, stop_engine(S1)),
            {StageState.STALLED},
        ),
        (
            "counters flat with work queued under forged heartbeats and spans",
            World(progressing={S1}, load={S1: 2.0}, spans={S1}),
            after(10, flatten(S1)),
            {StageState.STALLED},
        ),
        (
            "slow but alive: counters still moving with work queued",
            World(progressing={S1}, load={S1: 2.0}, spans={S1}),
            after(10, lambda world: setattr(world, "canary", HealthOutcome.TIMEOUT)),
            {StageState.HEALTHY, StageState.DEGRADED},
        ),
    ],
)
def test_spans_never_outweigh_the_world(
    name: str, world: World, change: Callable[[World, int], None], expected: set[StageState]
) -> None:
    reports = run(THREE_STAGES, world, 30, change)
    assert state_of(reports[-1], S1) in expected, name
    # A neighbour that beats and has nothing queued is not blamed.
    assert state_of(reports[-1], S0) in (StageState.HEALTHY, StageState.DEGRADED)


def test_a_stopped_engine_is_stalled_within_seconds_whatever_its_heartbeats() -> None:
    world = World(engines={S1: ProcessStatus.SLEEPING}, spans={S1})
    found = first_verdict(run(THREE_STAGES, world, 30, after(10, stop_engine(S1))))
    assert found is not None
    second, verdict = found
    assert (verdict.stage, verdict.state) == (S1, StageState.STALLED)
    # stuck_timeout (2 s) plus the canary's failure, not confirm_timeout (10 s).
    assert second <= 10 + CONFIG.stuck_timeout + 2


BROKEN_AT_ATTACH = DetectionConfig(startup_timeout=30.0)


@pytest.mark.parametrize(
    ("name", "world", "change", "earliest", "latest", "judged", "state"),
    [
        (
            # The server's 503 says an engine is dead (0.30: a stage has no live replica);
            # no stage beats or has a process to show, so which one is unknown.
            "/health 503 since attach: judged once startup_timeout has passed",
            World(health=HealthOutcome.UNHEALTHY, heartbeats=set(), canary=HealthOutcome.ERROR),
            None,
            30,
            31,
            PIPELINE,
            StageState.DEAD,
        ),
        (
            "/health timing out since attach: judged once startup_timeout has passed",
            World(health=HealthOutcome.TIMEOUT, heartbeats=set(), canary=HealthOutcome.ERROR),
            None,
            30,
            31,
            PIPELINE,
            StageState.STALLED,
        ),
        (
            "a recorded stage process exits: judged at once",
            World(
                health=HealthOutcome.UNHEALTHY,
                heartbeats={S0, S2},
                engines={S1: ProcessStatus.SLEEPING},
            ),
            after(3, lambda world: world.engines.update({S1: ProcessStatus.EXITED})),
            3,
            4,
            S1,
            StageState.DEAD,
        ),
    ],
)
def test_a_target_broken_at_attach_is_judged(
    name: str,
    world: World,
    change: Callable[[World, int], None] | None,
    earliest: int,
    latest: int,
    judged: StageRef,
    state: StageState,
) -> None:
    reports = run(THREE_STAGES, world, 40, change, BROKEN_AT_ATTACH)
    assert not any(r.warmed_up for r in reports[:earliest]), name
    found = first_verdict(reports)
    assert found is not None, name
    second, verdict = found
    assert earliest <= second <= latest, name
    assert (verdict.stage, verdict.state) == (judged, state), name
    # One verdict: a stage its readings cannot prove is never judged for the target.
    assert [v.stage for r in reports for v in r.verdicts] == [judged], name


def test_a_slow_start_is_not_judged_before_startup_timeout() -> None:
    world = World(health=HealthOutcome.TIMEOUT, heartbeats=set(), canary=HealthOutcome.TIMEOUT)
    reports = run(THREE_STAGES, world, 100, config=DetectionConfig(startup_timeout=120.0))
    assert [r.verdicts for r in reports if r.verdicts] == []
    assert {state_of(reports[-1], ref) for ref in (S0, S1, S2)} == {StageState.STARTING}


def test_stage_replicas_beyond_the_topology_are_bounded() -> None:
    detector = Detector(CONFIG, ONE_STAGE, 0.0)
    detector.observe(
        Observation(
            ObservationKind.PROCESS,
            1.0,
            process=process(
                1000 + n, StageRef(n % 500, n // 500), ProcessRole.ENGINE, ProcessStatus.SLEEPING
            ),
            outcome=ProcessStatus.SLEEPING,
        )
        for n in range(5000)
    )
    report = detector.evaluate(2.0)
    assert len(report.statuses) == 1 + MAX_EXTRA_STAGES


def test_processes_per_stage_are_bounded() -> None:
    detector = Detector(CONFIG, ONE_STAGE, 0.0)
    detector.observe(
        Observation(
            ObservationKind.PROCESS,
            1.0,
            process=process(1000 + n, S0, ProcessRole.WORKER, ProcessStatus.SLEEPING),
            outcome=ProcessStatus.SLEEPING,
        )
        for n in range(5 * MAX_PROCESSES_PER_STAGE)
    )
    detector.observe([Observation(ObservationKind.HEARTBEAT, 1.5, S0)])
    assert len(detector._target.stages[S0].processes) == MAX_PROCESSES_PER_STAGE


def test_a_learned_topology_keeps_what_is_known_of_the_stages_that_stay() -> None:
    clock = FakeClock()
    detector = Detector(CONFIG, ONE_STAGE, clock.monotonic())
    world = World(heartbeats={S0, S1}, engines={S1: ProcessStatus.SLEEPING})
    for second in range(WARM + 2):
        detector.observe(world.tick(clock.monotonic(), second))
        detector.evaluate(clock.monotonic())
        clock.advance(1.0)
    beat = detector.last_heartbeat(S0)
    assert beat is not None
    # A stage the titles named but no source lists any more is kept while it is real.
    learned = Topology((Stage(0, "thinker"), Stage(2, "code2wav", replicas=2)))
    detector.set_topology(learned, clock.monotonic())
    report = detector.evaluate(clock.monotonic())
    assert detector.last_heartbeat(S0) == beat
    assert {(s.stage, s.name): s.state for s in report.statuses} == {
        (S0, "thinker"): StageState.HEALTHY,
        (S1, "stage1"): StageState.HEALTHY,
        (S2, "code2wav"): StageState.UNKNOWN,
        (StageRef(2, 1), "code2wav"): StageState.UNKNOWN,
    }
    assert report.warmed_up
    # The stage that stays is still judged on its history: silence since the last beat.
    world.heartbeats.discard(S0)
    for second in range(int(CONFIG.heartbeat_timeout) + 2):
        detector.observe(world.tick(clock.monotonic(), second))
        clock.advance(1.0)
    assert EvidenceKind.HEARTBEAT_LOST in kinds_of(detector.evaluate(clock.monotonic()), S0)


def test_a_dropped_stage_without_a_signal_of_its_own_is_forgotten() -> None:
    detector = Detector(CONFIG, THREE_STAGES, 0.0)
    detector.set_topology(ONE_STAGE, 1.0)
    assert [s.stage for s in detector.evaluate(2.0).statuses] == [S0]


def warmed_with_an_engine(clock: FakeClock) -> tuple[Detector, ProcessInfo]:
    """A one-stage server, healthy and beating for 10 s: past warm-up, nothing judged."""
    detector = Detector(CONFIG, ONE_STAGE, clock.monotonic())
    engine = process(200, S0, ProcessRole.ENGINE, ProcessStatus.SLEEPING)
    for _ in range(10):
        now = clock.monotonic()
        detector.observe(
            [
                Observation(ObservationKind.HEALTH, now, outcome=HealthOutcome.OK),
                Observation(ObservationKind.HEARTBEAT, now, stage=S0),
                Observation(ObservationKind.PROCESS, now, process=ROOT, outcome=ROOT.status),
                Observation(ObservationKind.PROCESS, now, process=engine, outcome=engine.status),
            ]
        )
        assert not detector.evaluate(now).verdicts
        clock.advance(1.0)
    return detector, engine


@pytest.mark.parametrize(
    ("kind", "outcome", "dead"),
    [
        (ObservationKind.HEALTH, HealthOutcome.TIMEOUT, True),
        (ObservationKind.HEALTH, HealthOutcome.UNHEALTHY, True),
        (ObservationKind.CANARY, HealthOutcome.TIMEOUT, True),
        (ObservationKind.CANARY, HealthOutcome.ERROR, True),
        # What a server that stops on purpose shows first: no confirmation.
        (ObservationKind.HEALTH, HealthOutcome.REFUSED, False),
        (ObservationKind.HEALTH, HealthOutcome.OK, False),
    ],
)
def test_a_death_is_confirmed_by_the_first_failed_answer_after_it(
    kind: ObservationKind, outcome: HealthOutcome, dead: bool
) -> None:
    clock = FakeClock()
    detector, engine = warmed_with_an_engine(clock)
    exited_at = clock.advance(0.1)
    detector.observe(
        [
            Observation(
                ObservationKind.PROCESS, exited_at, process=engine, outcome=ProcessStatus.EXITED
            )
        ]
    )
    # The heartbeats are still fresh: the exit alone is one kind, not a verdict.
    assert state_of(detector.evaluate(exited_at), S0) is StageState.DEGRADED
    answered = clock.advance(0.3)
    detector.observe([Observation(kind, answered, outcome=outcome, detail="x")])
    report = detector.evaluate(answered)
    if dead:
        (verdict,) = report.verdicts
        assert verdict.stage == S0 and verdict.state is StageState.DEAD
        assert any(e.detail.endswith("after the exit") for e in verdict.evidence)
    else:
        assert not report.verdicts
        assert state_of(report, S0) is StageState.DEGRADED


def test_a_failed_health_before_the_exit_does_not_confirm_it() -> None:
    clock = FakeClock()
    detector, engine = warmed_with_an_engine(clock)
    failed_at = clock.advance(0.1)
    detector.observe(
        [Observation(ObservationKind.HEALTH, failed_at, outcome=HealthOutcome.TIMEOUT)]
    )
    exited_at = clock.advance(0.2)
    detector.observe(
        [
            Observation(
                ObservationKind.PROCESS, exited_at, process=engine, outcome=ProcessStatus.EXITED
            )
        ]
    )
    report = detector.evaluate(exited_at)
    assert not report.verdicts and state_of(report, S0) is StageState.DEGRADED


def test_the_next_judgement_is_due_when_a_timeout_runs_out() -> None:
    clock = FakeClock()
    detector, engine = warmed_with_an_engine(clock)
    last_beat = clock.monotonic() - 1.0
    assert detector.next_due(clock.monotonic()) == last_beat + CONFIG.heartbeat_timeout
    stopped_at = clock.monotonic()
    frozen = dataclasses.replace(engine, status=ProcessStatus.STOPPED)
    detector.observe(
        [Observation(ObservationKind.PROCESS, stopped_at, process=frozen, outcome=frozen.status)]
    )
    assert detector.next_due(stopped_at) == min(
        last_beat + CONFIG.heartbeat_timeout, stopped_at + CONFIG.stuck_timeout
    )
    loaded_at = clock.advance(0.5)
    detector.observe(
        [
            Observation(ObservationKind.PROGRESS, loaded_at, S0, 7.0),
            Observation(ObservationKind.LOAD, loaded_at, S0, 1.0),
        ]
    )
    assert detector.next_due(stopped_at + CONFIG.stuck_timeout) == (
        loaded_at + CONFIG.progress_timeout
    )
    # Run out already: nothing more is due from what is known.
    assert detector.next_due(stopped_at + 10.0) is None


def test_the_first_attach_keeps_the_warm_up_a_new_server_starts_it_over() -> None:
    clock = FakeClock()
    detector, _ = warmed_with_an_engine(clock)
    now = clock.monotonic()
    assert detector.warmed_up(now)
    # The first scan found the server that had been answering: what it said stands.
    detector.attached(now)
    assert detector.warmed_up(now)
    detector.observe([Observation(ObservationKind.HEALTH, now, outcome=HealthOutcome.UNHEALTHY)])
    assert detector.warmed_up(now + 1.0)
    # A new server on the target (a later generation) is judged afresh.
    detector.reset(ONE_STAGE, now)
    assert not detector.warmed_up(now + 1.0)


@dataclass
class ReplicaDeath:
    """Stage 1 of two replicas: replica 0's engine (pid 300, 6 GiB) exits at `exit_at`
    while replica 1 serves on and /health stays 200; GPU readings every `read_every` s,
    listing pid 300 until the driver lets go of it `freed_after` s after the exit."""

    exit_at: float = 10.0
    freed_after: float | None = 0.1
    read_every: float = 0.5
    held: float = 6 * 2**30
    server_stops_at: float | None = None

    def observations(self, now: float, read: bool) -> list[Observation]:
        root_gone = self.server_stops_at is not None and now >= self.server_stops_at
        root_status = ProcessStatus.EXITED if root_gone else ProcessStatus.SLEEPING
        out = [
            Observation(ObservationKind.HEALTH, now, outcome=HealthOutcome.OK),
            Observation(ObservationKind.PROCESS, now, process=ROOT, outcome=root_status),
        ]
        for pid, ref in ((300, StageRef(1, 0)), (301, StageRef(1, 1))):
            gone = pid == 300 and now >= self.exit_at
            status = ProcessStatus.EXITED if gone else ProcessStatus.SLEEPING
            info = process(pid, ref, ProcessRole.ENGINE, status, cpu=now)
            out.append(Observation(ObservationKind.PROCESS, now, process=info, outcome=status))
            if not gone:
                out.append(Observation(ObservationKind.HEARTBEAT, now, stage=ref))
        if read:
            out.append(Observation(ObservationKind.GPU_DEVICE, now, gpu=0, value=self.held))
            freed = self.freed_after is not None and now >= self.exit_at + self.freed_after
            listed = [301] if freed else [300, 301]
            for pid in listed:
                ref = StageRef(1, pid - 300)
                out.append(
                    Observation(ObservationKind.GPU_PROCESS, now, ref, self.held, pid=pid, gpu=0)
                )
        return out


def replica_death(world: ReplicaDeath, until: float = 20.0) -> list[Verdict]:
    """Drive the world in 0.05 s steps, judging at every step; the verdicts given."""
    two_replicas = Topology((Stage(0, "thinker"), Stage(1, "talker", replicas=2)))
    clock = FakeClock()
    start = clock.monotonic()
    detector = Detector(CONFIG, two_replicas, start)
    found: list[Verdict] = []
    step, next_read = 0.05, 0.0
    while clock.monotonic() - start < until:
        now = clock.monotonic()
        elapsed = now - start
        read = elapsed >= next_read
        if read:
            next_read += world.read_every
        stops_at = world.server_stops_at
        shifted = dataclasses.replace(
            world,
            exit_at=start + world.exit_at,
            server_stops_at=None if stops_at is None else start + stops_at,
        )
        detector.observe(shifted.observations(now, read))
        for verdict in detector.evaluate(now).verdicts:
            found.append(dataclasses.replace(verdict, time=verdict.time - start))
        clock.advance(step)
    return found


def test_a_replica_whose_memory_the_gpu_let_go_after_its_exit_is_dead_at_once() -> None:
    """/health stays 200 (its sibling serves): the exit and the driver's release of its
    memory are two independent kinds, so the verdict comes a settle after the exit, not
    after the heartbeat timeout."""
    (verdict,) = replica_death(ReplicaDeath())
    assert verdict.stage == StageRef(1, 0) and verdict.state is StageState.DEAD
    kinds = {e.kind for e in verdict.evidence}
    assert {EvidenceKind.PROCESS_EXIT, EvidenceKind.GPU_RELEASED} <= kinds
    assert EvidenceKind.HEARTBEAT_LOST not in kinds
    # The exit at 10 s; a clean stop would have taken the server down within 1 s.
    assert 11.0 <= verdict.time < 11.2


@pytest.mark.parametrize(
    ("world", "why"),
    [
        (ReplicaDeath(freed_after=None), "the driver still lists the pid: nothing released"),
        (ReplicaDeath(held=0.0), "it held no GPU memory: nothing to let go of"),
    ],
)
def test_no_gpu_release_leaves_the_exit_to_be_confirmed_otherwise(
    world: ReplicaDeath, why: str
) -> None:
    found = replica_death(world)
    assert found, why
    assert EvidenceKind.GPU_RELEASED not in {e.kind for e in found[0].evidence}, why
    # Confirmed by its silence instead: the heartbeat timeout after its last beat.
    assert found[0].time > 10.0 + CONFIG.heartbeat_timeout - 0.1, why


def test_a_clean_stop_that_frees_the_memory_is_no_verdict() -> None:
    """The server stops on purpose: the engine goes a moment before the server, and the
    memory with it; no verdict."""
    assert replica_death(ReplicaDeath(server_stops_at=10.4)) == []


SILENT_FROM = 10  # the talker's loop last beats at second 9; warm from second 5


def talker_silent_from(
    second_of_silence: int, back_at: int | None = None
) -> Callable[[World, int], None]:
    """The talker stops beating and the canary times out from `second_of_silence`; both
    come back at `back_at`, if given."""

    def change(world: World, second: int) -> None:
        silent = second >= second_of_silence and (back_at is None or second < back_at)
        world.heartbeats = {S0, S2} if silent else {S0, S1, S2}
        world.canary = HealthOutcome.TIMEOUT if silent else HealthOutcome.OK

    return change


def woken_then_asleep(wait: float) -> World:
    """The talker's engine waits `wait` s for a CPU in the first second of its silence, as
    the request that blocks it wakes it, then sleeps."""
    return World(
        engines={S1: ProcessStatus.SLEEPING},
        # Its load gauge says it is served: silence and quiet CPUs are no process_stuck.
        load={S1: 0.0},
        starved={S1},
        wait_share=wait,
        starved_in=range(SILENT_FROM, SILENT_FROM + 1),
    )


# name, world, seconds, the first verdict on the talker (second, state) or None
STARVATION = [
    (
        "silent, the canary failing, waiting for no CPU: stalled at the heartbeat timeout",
        World(engines={S1: ProcessStatus.SLEEPING}),
        30,
        None,
        (SILENT_FROM + 3, StageState.STALLED),
    ),
    (
        "the same, its engine waiting for a CPU half the time: stalled once the canary's"
        " failure stood 10 s of the time it could run",
        World(engines={S1: ProcessStatus.RUNNING}, starved={S1}),
        40,
        None,
        # At second n it has waited 0.5 s a second since its reading before the beat at 9:
        # n - 10 - (n - 8) / 2 >= 10.
        (SILENT_FROM + 22, StageState.STALLED),
    ),
    (
        "starved and silent for 8 s, then beating again: no verdict",
        World(engines={S1: ProcessStatus.RUNNING}, starved={S1}),
        40,
        SILENT_FROM + 8,
        None,
    ),
    (
        "starved once, early in its silence, and never read again: still starved, by the"
        " second it was seen to wait",
        World(
            engines={S1: ProcessStatus.RUNNING}, starved={S1}, engines_unread_from=SILENT_FROM + 1
        ),
        30,
        None,
        (SILENT_FROM + 11, StageState.STALLED),
    ),
    (
        "waiting a moment as the request that blocks it wakes it, then asleep: the wait"
        " leaves the window, but its lateness is one kind on a loaded host: stalled once"
        " the canary's failure stood 10 s",
        woken_then_asleep(0.2),
        30,
        None,
        (SILENT_FROM + 10, StageState.STALLED),
    ),
    (
        "the same, beating again after 5 s: no verdict (a healthy real talker beside a"
        " second server, silent 3.7 s with 0.3 s waited, was judged and shut down)",
        woken_then_asleep(0.3),
        30,
        SILENT_FROM + 5,
        None,
    ),
    (
        "starved for the first 6 s of its silence, then given its CPU and still silent:"
        " no longer starved, its lateness one kind, stalled once the canary's failure"
        " stood 10 s",
        World(
            engines={S1: ProcessStatus.RUNNING},
            starved={S1},
            starved_in=range(SILENT_FROM, SILENT_FROM + 6),
        ),
        30,
        None,
        (SILENT_FROM + 10, StageState.STALLED),
    ),
    (
        "running all through its silence, waiting for no CPU (a long step, a spin): its"
        " lateness is one kind, stalled once the canary's failure stood 10 s",
        World(engines={S1: ProcessStatus.RUNNING}, load={S1: 0.0}),
        30,
        None,
        (SILENT_FROM + 10, StageState.STALLED),
    ),
    (
        "the same, beating again after 5 s: no verdict (a healthy real thinker whose worker"
        " ran a forward slowed by a second server was judged and shut down)",
        World(engines={S1: ProcessStatus.RUNNING}, load={S1: 0.0}),
        30,
        SILENT_FROM + 5,
        None,
    ),
    (
        "starved, but its engine stopped (SIGSTOP): stalled as the canary fails",
        World(engines={S1: ProcessStatus.STOPPED}, starved={S1}),
        30,
        None,
        (SILENT_FROM, StageState.STALLED),
    ),
]


@pytest.mark.parametrize(
    ("world", "seconds", "back_at", "verdict"),
    [row[1:] for row in STARVATION],
    ids=[row[0] for row in STARVATION],
)
def test_a_stage_starved_of_cpu_is_judged_only_once_its_silence_stood(
    world: World,
    seconds: int,
    back_at: int | None,
    verdict: tuple[int, StageState] | None,
) -> None:
    """Measured: a real vLLM-Omni under load lost 2-4 s of heartbeats in two stages at once
    while another server started beside it on two cores, and the canary timed out with
    them; both were well again a second later. A stage that waits for a CPU is not stuck."""
    world.canary = HealthOutcome.OK
    reports = run(THREE_STAGES, world, seconds, talker_silent_from(SILENT_FROM, back_at))
    found = first_verdict(reports)
    assert (found and (found[0], found[1].stage, found[1].state)) == (
        verdict and (verdict[0], S1, verdict[1])
    )


def test_a_late_stage_on_a_loaded_host_is_judged_at_once_with_a_sign_of_another_kind() -> None:
    """Lateness is one kind of evidence where the stage waited for a CPU; the server's own
    503 is not lateness, and with it the verdict comes at the heartbeat timeout: `dead`, as
    the 503 says."""
    world = woken_then_asleep(0.3)
    world.canary = HealthOutcome.OK
    silent = talker_silent_from(SILENT_FROM)

    def change(world: World, second: int) -> None:
        silent(world, second)
        world.health = HealthOutcome.UNHEALTHY if second >= SILENT_FROM else HealthOutcome.OK

    found = first_verdict(run(THREE_STAGES, world, 30, change))
    assert found is not None
    assert (found[0], found[1].stage, found[1].state) == (
        SILENT_FROM + 3,
        S1,
        StageState.DEAD,
    )
    assert {EvidenceKind.HEARTBEAT_LOST, EvidenceKind.HEALTH_FAILED} <= {
        e.kind for e in found[1].evidence
    }


def test_a_stalled_stage_seen_waiting_for_a_cpu_afterwards_stays_stalled_with_one_verdict() -> None:
    """Measured: a real vLLM-Omni talker blocked in its forward, on two cores shared with
    a second server, was judged stalled three times in 6 s, its engine's threads seen
    waiting after each verdict. In dry-run each verdict was a new plan, and one of them,
    still capturing, made the watchdog refuse on-call's approval of the first."""
    world = World(
        engines={S1: ProcessStatus.SLEEPING},
        starved={S1},
        starved_in=range(SILENT_FROM + 4, SILENT_FROM + 8),
    )
    world.canary = HealthOutcome.OK
    reports = run(THREE_STAGES, world, 30, talker_silent_from(SILENT_FROM))
    verdicts = [(i, v.state) for i, r in enumerate(reports) for v in r.verdicts if v.stage == S1]
    assert verdicts == [(SILENT_FROM + 3, StageState.STALLED)]
    after_verdict = {state_of(r, S1) for r in reports[SILENT_FROM + 3 :]}
    assert after_verdict == {StageState.STALLED}


def held_off_its_core(
    tmp_path: Path, through_thread_waits: bool, seconds: float = 24.0, step: float = 0.25
) -> list[DetectorReport]:
    """The talker's engine, as the real vLLM-Omni's worker under load was read: runnable
    throughout, held off its core from second 10 to 18 but for a slice every 1.5 s, its
    kernel figures standing still between slices; the talker silent and the canary
    failing meanwhile. Read `through_thread_waits`, or the main thread's figure alone."""
    config = dataclasses.replace(CONFIG, heartbeat_timeout=2.0, confirm_timeout=6.0)
    clock = FakeClock(start=0.0)
    waits = ThreadWaits(tmp_path, clock.monotonic)
    detector = Detector(config, THREE_STAGES, clock.monotonic())
    ran, waited, last_slice = 1.0, 0.5, 0.0
    reports = []
    while clock.monotonic() < seconds:
        now = clock.monotonic()
        held_off = 10.0 <= now < 18.0
        if not held_off or now - last_slice >= 1.5:
            waited += now - last_slice - 0.01 if held_off else 0.0
            ran, last_slice = ran + 0.01, now
        task = tmp_path / "200" / "task" / "200"
        task.mkdir(parents=True, exist_ok=True)
        (task / "schedstat").write_text(f"{int(ran * 1e9)} {int(waited * 1e9)} 9\n")
        wait = waits(200, True) if through_thread_waits else waited
        engine = process(200, S1, ProcessRole.ENGINE, ProcessStatus.RUNNING, ran, wait)
        silent = held_off and now >= 10.5
        observations = [
            Observation(ObservationKind.HEALTH, now, outcome=HealthOutcome.OK),
            Observation(ObservationKind.PROCESS, now, process=ROOT, outcome=ProcessStatus.SLEEPING),
            Observation(ObservationKind.PROCESS, now, process=engine, outcome=engine.status),
            Observation(
                ObservationKind.CANARY,
                now,
                outcome=HealthOutcome.TIMEOUT if silent else HealthOutcome.OK,
            ),
        ]
        observations += [
            Observation(ObservationKind.HEARTBEAT, now, stage=ref)
            for ref in ({S0, S2} if silent else {S0, S1, S2})
        ]
        detector.observe(observations)
        reports.append(detector.evaluate(now))
        clock.advance(step)
    return reports


@pytest.mark.parametrize(
    ("through_thread_waits", "verdict"),
    [
        pytest.param(True, None, id="through-thread-waits-starved-until-its-core-is-back"),
        pytest.param(
            False, StageState.STALLED, id="the-kernels-figure-alone-judged-it-stalled-as-measured"
        ),
    ],
)
def test_an_engine_held_off_its_core_is_starved_before_the_kernel_says_it_waited(
    tmp_path: Path, through_thread_waits: bool, verdict: StageState | None
) -> None:
    """Measured: in `make test`, a healthy real vLLM-Omni was judged stalled and shut down
    while a second server started beside it on two cores. A real worker read on such a
    host, runnable, had its run-queue delay stand still for 1.25 s, then jump by 1.6 s:
    while it stood still, the starvation rule saw no wait."""
    reports = held_off_its_core(tmp_path, through_thread_waits)
    found = first_verdict(reports)
    assert (found and found[1].state) == verdict
    if verdict is None:
        assert StageState.DEGRADED in {state_of(r, S1) for r in reports}
        assert state_of(reports[-1], S1) is StageState.HEALTHY


@pytest.mark.parametrize(
    ("world", "said"),
    [
        pytest.param(
            World(engines={S1: ProcessStatus.SLEEPING}),
            "no loop heartbeat for 4.0s",
            id="no-wait-goes-unsaid",
        ),
        pytest.param(
            World(engines={S1: ProcessStatus.RUNNING}, starved={S1}, cpu_moving=False),
            "no loop heartbeat for 23.0s; pid 200 waited 12.0s for a CPU since",
            id="a-starved-engine-is-named-with-its-wait",
        ),
        pytest.param(
            World(engines={S1: ProcessStatus.RUNNING}),
            "no loop heartbeat for 11.0s; pid 200 ran 12.0s on a CPU since",
            id="a-running-engine-is-named-with-the-cpu-it-used",
        ),
    ],
)
def test_a_lost_heartbeat_says_what_the_stage_did_with_a_cpu_meanwhile(
    world: World, said: str
) -> None:
    world.canary = HealthOutcome.OK
    found = first_verdict(run(THREE_STAGES, world, 40, talker_silent_from(SILENT_FROM, None)))
    assert found is not None
    details = [e.detail for e in found[1].evidence if e.kind is EvidenceKind.HEARTBEAT_LOST]
    assert details == [said]


def test_a_stage_held_back_by_its_neighbours_is_named_starved() -> None:
    """The CPU-contention rule is a cause like any other: while it holds a silent stage
    back from a verdict, the stage says it is starved, and which process waited."""
    world = World(engines={S1: ProcessStatus.RUNNING}, starved={S1})
    world.canary = HealthOutcome.OK
    reports = run(THREE_STAGES, world, SILENT_FROM + 8, talker_silent_from(SILENT_FROM))
    assert first_verdict(reports) is None
    named = [
        status.cause
        for report in reports[SILENT_FROM:]
        for status in report.statuses
        if status.stage == S1 and status.cause is not None
    ]
    assert named and all(cause.cause is SilenceCause.STARVED for cause in named), named
    assert "for a CPU" in named[-1].detail and not named[-1].working
