"""Table tests: the sidecar alone (no plugin: no heartbeats, no spans) and a failing canary.

A canary or /health that fails says the target is unwell, not which stage. Without
heartbeats no stage can show it is fine, so blaming every stage that does not would mark a
whole healthy pipeline stalled for one stall. A stage is blamed only where its own
readings prove it is the one (a process stopped, counters flat with a request on it, a
cause that is no work); otherwise the target gets one verdict, "stage unknown".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from omni_watchdog.clock import FakeClock
from omni_watchdog.config import DetectionConfig
from omni_watchdog.detector import Detector
from omni_watchdog.types import (
    PIPELINE,
    ChildActivity,
    DetectorReport,
    EvidenceKind,
    HealthOutcome,
    Observation,
    ObservationKind,
    ProcessActivity,
    ProcessInfo,
    ProcessRole,
    ProcessStatus,
    SilenceCause,
    Stage,
    StageRef,
    StageState,
    ThreadActivity,
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
S0, S1, S2 = StageRef(0), StageRef(1), StageRef(2)
ROOT = ProcessInfo(100, 1.0, 1, 100, 100, "api", ProcessStatus.SLEEPING, 1.0, ProcessRole.API)
FAULT_AT = 10  # warm from 5 s: first healthy /health at 0 s + 5 s grace
SPIN_FRAMES = ("spin (/models/tiny.py:10)", "execute_model (/vllm/worker.py:1800)")


def engine_pid(ref: StageRef) -> int:
    return 200 + ref.stage_id


@dataclass
class Server:
    """What a served pipeline shows the sidecar each second; a fault changes it."""

    health: HealthOutcome = HealthOutcome.OK
    canary: HealthOutcome | None = None
    engines: dict[StageRef, ProcessStatus] = field(
        default_factory=lambda: dict.fromkeys((S0, S1, S2), ProcessStatus.SLEEPING)
    )
    # Stages whose gauges say requests are on them; their counters stay where they are.
    load: dict[StageRef, float] = field(default_factory=dict)
    # Stages whose loops beat: the plugin is there.
    heartbeats: set[StageRef] = field(default_factory=set)
    # What stage 0's engine does, as the processes and activity probes read it: "asleep",
    # "busy" (on a CPU, its stack not read), "spin", "compile".
    stage0_doing: str = "asleep"

    def tick(self, detector: Detector, now: float, second: int) -> list[Observation]:
        out = [
            Observation(ObservationKind.HEALTH, now, outcome=self.health),
            Observation(ObservationKind.PROCESS, now, process=ROOT, outcome=ROOT.status),
        ]
        for ref, status in self.engines.items():
            busy = ref == S0 and self.stage0_doing in ("busy", "spin", "compile")
            cpu = 1.0 + (second if busy else 0.0)
            state = ProcessStatus.RUNNING if busy else status
            info = ProcessInfo(
                engine_pid(ref), 2.0, 100, 100, 100, "engine", state, cpu, ProcessRole.ENGINE, ref
            )
            out.append(Observation(ObservationKind.PROCESS, now, process=info, outcome=state))
        for ref, load in self.load.items():
            out.append(Observation(ObservationKind.PROGRESS, now, ref, 10.0))
            out.append(Observation(ObservationKind.LOAD, now, ref, load))
        out += [Observation(ObservationKind.HEARTBEAT, now, stage=ref) for ref in self.heartbeats]
        if self.canary is not None:
            out.append(Observation(ObservationKind.CANARY, now, outcome=self.canary))
        if S0 in detector.silent_stages(now):
            out.append(Observation(ObservationKind.ACTIVITY, now, S0, activity=self.stage0(now)))
        return out

    def stage0(self, now: float) -> ProcessActivity:
        pid = engine_pid(S0)
        if self.stage0_doing in ("busy", "spin"):
            spin = self.stage0_doing == "spin"
            frames = SPIN_FRAMES if spin else ()
            running = ThreadActivity(pid, "R", "", now, 0.0, frames, owns_gil=spin)
            return ProcessActivity(pid, now, (running,), (), stacks_read=spin)
        if self.stage0_doing == "compile":
            waiting = ThreadActivity(pid, "S", "do_wait", 1.0, 0.0)
            compiler = ChildActivity(300, "cc1plus", "R", 0.9 * now)
            return ProcessActivity(pid, now, (waiting,), (compiler,))
        asleep = ThreadActivity(pid, "S", "futex_do_wait", 1.0, 0.0)
        return ProcessActivity(pid, now, (asleep,))


def run(server: Server, fault: Callable[[Server], None], seconds: int) -> list[DetectorReport]:
    clock = FakeClock()
    detector = Detector(CONFIG, THREE_STAGES, clock.monotonic())
    reports = []
    for second in range(seconds):
        if second == FAULT_AT:
            fault(server)
        detector.observe(server.tick(detector, clock.monotonic(), second))
        reports.append(detector.evaluate(clock.monotonic()))
        clock.advance(1.0)
    return reports


def verdicts(reports: list[DetectorReport]) -> list[Verdict]:
    return [v for r in reports for v in r.verdicts]


def states_of(reports: list[DetectorReport], ref: StageRef) -> set[StageState]:
    return {s.state for r in reports for s in r.statuses if s.stage == ref}


def canary_fails(server: Server) -> None:
    server.canary = HealthOutcome.TIMEOUT


def stage0_stopped(server: Server) -> None:
    canary_fails(server)
    server.engines[S0] = ProcessStatus.STOPPED


def stage0_flat_with_a_request(server: Server) -> None:
    """On a CPU all the while, so only its counters say it does not advance."""
    canary_fails(server)
    server.load[S0] = 1
    server.stage0_doing = "busy"


def stage0_spins(server: Server) -> None:
    canary_fails(server)
    server.stage0_doing = "spin"


def stage0_compiles(server: Server) -> None:
    canary_fails(server)
    server.stage0_doing = "compile"


def stage1_exits_and_health_503(server: Server) -> None:
    server.health = HealthOutcome.UNHEALTHY
    server.canary = HealthOutcome.ERROR
    server.engines[S1] = ProcessStatus.EXITED


def health_503(server: Server) -> None:
    server.health = HealthOutcome.UNHEALTHY
    server.canary = HealthOutcome.ERROR


def stage1_stops_beating(server: Server) -> None:
    canary_fails(server)
    server.heartbeats.discard(S1)


# name, server, fault, who is judged, its state, the evidence it needs, judged by (s)
PROVED = [
    (
        "stage 0's process stopped",
        Server(),
        stage0_stopped,
        S0,
        StageState.STALLED,
        {EvidenceKind.PROCESS_STUCK, EvidenceKind.CANARY_FAILED},
        FAULT_AT + 4,
    ),
    (
        "stage 0's counters flat with a request on it",
        Server(load={S0: 0.0}),
        stage0_flat_with_a_request,
        S0,
        StageState.STALLED,
        {EvidenceKind.PROGRESS_FLAT, EvidenceKind.CANARY_FAILED},
        FAULT_AT + 5,
    ),
    (
        # A spin is no work and no idle stage shows it; the canary alone confirms it.
        "stage 0 spinning",
        Server(),
        stage0_spins,
        S0,
        StageState.STALLED,
        {EvidenceKind.CANARY_FAILED},
        FAULT_AT + int(CONFIG.confirm_timeout) + 1,
    ),
    (
        "stage 1's process exited, /health 503",
        Server(),
        stage1_exits_and_health_503,
        S1,
        StageState.DEAD,
        {EvidenceKind.PROCESS_EXIT},
        FAULT_AT + 1,
    ),
    (
        "nothing provable: the canary fails",
        Server(),
        canary_fails,
        PIPELINE,
        StageState.STALLED,
        {EvidenceKind.CANARY_FAILED},
        FAULT_AT + int(CONFIG.confirm_timeout) + 1,
    ),
    (
        "nothing provable: /health 503 and the canary fail",
        Server(),
        health_503,
        PIPELINE,
        StageState.DEAD,
        {EvidenceKind.HEALTH_FAILED, EvidenceKind.CANARY_FAILED},
        FAULT_AT + CONFIG.health_failures,
    ),
    (
        # The plugin's heartbeats: a stage that beats is cleared, one that stops is blamed.
        "with the plugin, stage 1 stops beating",
        Server(heartbeats={S0, S1, S2}),
        stage1_stops_beating,
        S1,
        StageState.STALLED,
        {EvidenceKind.HEARTBEAT_LOST, EvidenceKind.CANARY_FAILED},
        FAULT_AT + int(CONFIG.heartbeat_timeout) + 2,
    ),
]


@pytest.mark.parametrize(
    ("server", "fault", "judged", "state", "kinds", "by"),
    [p[1:] for p in PROVED],
    ids=[p[0] for p in PROVED],
)
def test_only_a_stage_its_readings_prove_is_blamed_else_the_pipeline(
    server: Server,
    fault: Callable[[Server], None],
    judged: StageRef,
    state: StageState,
    kinds: set[EvidenceKind],
    by: int,
) -> None:
    reports = run(server, fault, FAULT_AT + 30)
    found = verdicts(reports)
    assert [(v.stage, v.state) for v in found] == [(judged, state)]
    assert kinds <= {e.kind for e in found[0].evidence}
    assert found[0].time - reports[0].time <= by
    others = {S0, S1, S2} - {judged}
    for ref in others:
        assert not states_of(reports, ref) & {StageState.STALLED, StageState.DEAD}, ref
    if judged == PIPELINE:
        # One verdict for the target; no stage is worse than unknown.
        assert found[0].describe() == f"target {state.value}, stage unknown"
        last = reports[-1]
        assert last.pipeline is not None and last.pipeline.state is state
        assert {s.state for s in last.statuses} == {StageState.UNKNOWN}
    else:
        # Late only while no stage answered yet, never judged as a whole.
        pipeline = {r.pipeline.state for r in reports if r.pipeline is not None}
        assert pipeline <= {StageState.DEGRADED}
        assert reports[-1].pipeline is None


def test_a_stage_whose_work_advances_explains_the_failing_canary() -> None:
    """A compile without the plugin: its compiler child works for it, so the canary it
    holds up is excused until its budget runs out, for the pipeline as for the stage."""
    reports = run(Server(), stage0_compiles, FAULT_AT + 30)
    assert verdicts(reports) == []
    assert {s.cause.cause for r in reports for s in r.statuses if s.cause} == {
        SilenceCause.COMPILING
    }
    assert all(r.pipeline is None or r.pipeline.state is StageState.DEGRADED for r in reports)


def test_the_pipeline_verdict_gives_way_to_a_stage_proved_later() -> None:
    """Judged as a whole first, then stage 0's process is seen stopped: stage 0 is judged,
    and the pipeline no longer stands beside it, nor does any other stage."""

    def stops_later(server: Server, second: int) -> None:
        if second == FAULT_AT + 15:
            server.engines[S0] = ProcessStatus.STOPPED

    clock = FakeClock()
    detector = Detector(CONFIG, THREE_STAGES, clock.monotonic())
    server = Server()
    reports = []
    for second in range(FAULT_AT + 25):
        if second == FAULT_AT:
            canary_fails(server)
        stops_later(server, second)
        detector.observe(server.tick(detector, clock.monotonic(), second))
        reports.append(detector.evaluate(clock.monotonic()))
        clock.advance(1.0)
    assert [(v.stage, v.state) for v in verdicts(reports)] == [
        (PIPELINE, StageState.STALLED),
        (S0, StageState.STALLED),
    ]
    last = reports[-1]
    assert last.pipeline is None
    assert {s.stage: s.state for s in last.statuses} == {
        S0: StageState.STALLED,
        S1: StageState.HEALTHY,
        S2: StageState.HEALTHY,
    }
