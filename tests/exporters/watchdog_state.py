"""A watchdog's state built from fakes and a fake clock, for the exposition tests and benchmark.

The detector is the real one, fed a scripted story: every stage warms up and beats, then
stage 1 falls silent with requests waiting for it (stalled, with a verdict), the first
stage's second replica never shows a sign (unknown, heartbeat age NaN). The tracker,
receiver and policy are small fakes with the attributes the exposition reads; GPU readings
and incidents reach the stats the way the app feeds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omni_watchdog.app import INTERNAL_ERROR_LOOPS, ProbeHealth, Watchdog
from omni_watchdog.clock import FakeClock
from omni_watchdog.config import WatchdogConfig
from omni_watchdog.detector import Detector, DetectorReport
from omni_watchdog.exporters.prometheus import MetricsExposition, WatchdogStats
from omni_watchdog.policy.core import LockStatus
from omni_watchdog.policy.incidents import StateWriteErrors
from omni_watchdog.probes.spans import REJECTION_REASONS, RESPONSE_STATUSES, ReceiverStats
from omni_watchdog.serving import Listener
from omni_watchdog.types import (
    HealthOutcome,
    Incident,
    IncidentOutcome,
    Mode,
    Observation,
    ObservationKind,
    ProcessInfo,
    ProcessRole,
    ProcessStatus,
    Stage,
    StageRef,
    StepName,
    StepOutcome,
    StepResult,
    Topology,
)

START = 1000.0
WALL_OFFSET = 1_700_000_000.0
ROOT_PID = 100
UNMAPPED_PID = 99_999
STALLED_STAGE = 1
GIB = 2**30


@dataclass
class FakeTracker:
    """The process tracker's query side over a fixed list of processes."""

    processes: list[ProcessInfo]
    target_alive: bool = True

    def live(self) -> tuple[ProcessInfo, ...]:
        return tuple(p for p in self.processes if p.status is not ProcessStatus.EXITED)

    def recorded(self) -> tuple[ProcessInfo, ...]:
        return tuple(self.processes)


@dataclass
class FakeReceiver:
    stats: ReceiverStats


@dataclass
class FakePolicy:
    busy: bool = False
    remaining: int = 2
    budget_exhausted_total: int = 1
    lock_conflict: str = "held by another watchdog (pid 7)"

    def budget_remaining(self) -> int:
        return self.remaining

    def lock_status(self) -> LockStatus:
        return LockStatus(False, self.lock_conflict, None)


@dataclass
class FakeWatchdog:
    """The attributes of `omni_watchdog.app.Watchdog` that the exporters read."""

    config: WatchdogConfig
    clock: FakeClock
    topology: Topology
    detector: Detector
    tracker: FakeTracker
    receiver: FakeReceiver
    policy: FakePolicy
    stats: WatchdogStats
    probe_health: dict[str, ProbeHealth] = field(default_factory=dict)
    last_report: DetectorReport | None = None
    last_health: Observation | None = None
    internal_errors: dict[str, int] = field(
        default_factory=lambda: {**dict.fromkeys(INTERNAL_ERROR_LOOPS, 0), "ingest": 1}
    )
    listeners: dict[str, Listener] = field(default_factory=dict)
    write_errors: StateWriteErrors = field(default_factory=StateWriteErrors)
    exposition: MetricsExposition = field(init=False)
    # The real rule, over the fakes above.
    target_up = Watchdog.target_up

    def __post_init__(self) -> None:
        self.exposition = MetricsExposition(self, self.stats)  # type: ignore[arg-type]

    def evaluation_age(self) -> float:
        return 0.25


def chain_topology(stages: int, first_replicas: int) -> Topology:
    return Topology(
        tuple(
            Stage(
                stage_id,
                f"stage-{stage_id}" if stage_id else 'thinker "main"',
                replicas=first_replicas if stage_id == 0 else 1,
                upstream=(stage_id - 1,) if stage_id else (),
                downstream=(stage_id + 1,) if stage_id + 1 < stages else (),
            )
            for stage_id in range(stages)
        ),
        source="test",
    )


def _processes(topology: Topology, pids_per_replica: int) -> list[ProcessInfo]:
    def info(pid: int, role: ProcessRole, stage: StageRef | None, **extra: object) -> ProcessInfo:
        fields: dict[str, object] = {
            "ppid": ROOT_PID,
            "pgid": ROOT_PID,
            "sid": ROOT_PID,
            "status": ProcessStatus.SLEEPING,
            "orphaned": False,
        }
        fields.update(extra)
        return ProcessInfo(
            pid=pid,
            create_time=50.0 + pid,
            title=f"{role.value}-{pid}",
            cpu_seconds=1.0,
            role=role,
            stage=stage,
            **fields,  # type: ignore[arg-type]
        )

    processes = [info(ROOT_PID, ProcessRole.API, None, ppid=1)]
    pid = 1000
    for ref in topology.refs():
        roles = [ProcessRole.STAGE, ProcessRole.ENGINE]
        roles += [ProcessRole.WORKER] * (pids_per_replica - len(roles))
        for role in roles[:pids_per_replica]:
            processes.append(info(pid, role, ref, status=ProcessStatus.RUNNING))
            pid += 1
    processes.append(info(pid, ProcessRole.HELPER, None, status=ProcessStatus.ZOMBIE))
    processes.append(info(pid + 1, ProcessRole.HELPER, None, ppid=1, orphaned=True))
    processes.append(info(pid + 2, ProcessRole.HELPER, None, status=ProcessStatus.EXITED))
    return processes


def _gpu_run(
    processes: list[ProcessInfo], gpus: int, now: float, silent: StageRef
) -> list[Observation]:
    """One GPU probe run: each stage replica's processes on the device of its stage."""
    held: dict[int, list[tuple[int, float, StageRef | None]]] = {g: [] for g in range(gpus)}
    for process in processes:
        if process.stage is not None and process.status is ProcessStatus.RUNNING:
            used = float((1 + process.pid % 7) * GIB)
            held[process.stage.stage_id % gpus].append((process.pid, used, process.stage))
    held[0].append((UNMAPPED_PID, float(GIB // 2), None))
    run: list[Observation] = []
    for gpu, pids in held.items():
        # Only the silent stage's device idles; one device reports no utilization at all.
        utilization = (
            None if gpu == gpus - 1 and gpus > 2 else 0.0 if gpu == silent.stage_id else 0.5
        )
        run.append(
            Observation(
                ObservationKind.GPU_DEVICE,
                now,
                gpu=gpu,
                value=sum(used for _, used, _ in pids) + 256 * 2**20,
                utilization=utilization,
            )
        )
        run.extend(
            Observation(ObservationKind.GPU_PROCESS, now, pid=pid, gpu=gpu, value=used, stage=stage)
            for pid, used, stage in pids
        )
    return run


def scripted_incidents() -> list[Incident]:
    opened = START + WALL_OFFSET + 15.0
    enforced = Incident(
        incident_id="20231114T221335Z-a1b2c3",
        target="http://127.0.0.1:8000",
        mode=Mode.ENFORCE,
        opened=opened,
        cause="stage 1.0 stalled",
        steps=(
            StepResult(StepName.CAPTURE, StepOutcome.OK, opened, 0.8, "4 stacks"),
            StepResult(StepName.SHUTDOWN, StepOutcome.UNREACHABLE, opened + 0.8, 1.0, "refused"),
            StepResult(StepName.TERMINATE, StepOutcome.RECOVERED, opened + 1.8, 2.2, "", (100,)),
            StepResult(StepName.VERIFY, StepOutcome.OK, opened + 4.0, 3.5, "memory back"),
        ),
        outcome=IncidentOutcome.RECOVERED_BY_TERM,
        closed=opened + 7.5,
        timeline={"opened": opened, "verdict": opened - 0.1, "released": opened + 7.5},
    )
    planned = Incident(
        incident_id="20231114T221400Z-d4e5f6",
        target="http://127.0.0.1:8000",
        mode=Mode.DRY_RUN,
        opened=opened + 30.0,
        cause="stage 1.0 stalled",
        steps=(
            StepResult(StepName.CAPTURE, StepOutcome.OK, opened + 30.0, 0.6),
            StepResult(StepName.TERMINATE, StepOutcome.PLANNED, opened + 30.6, 0.0),
        ),
        outcome=IncidentOutcome.PLANNED,
        closed=opened + 30.6,
        timeline={"opened": opened + 30.0, "verdict": opened + 29.9},
    )
    still_open = Incident(
        incident_id="20231114T221500Z-0789ab",
        target="http://127.0.0.1:8000",
        mode=Mode.ENFORCE,
        opened=opened + 60.0,
        cause="stage 1.0 stalled",
    )
    return [enforced, planned, still_open]


def fake_watchdog(
    stages: int = 3,
    first_replicas: int = 2,
    gpus: int = 3,
    pids_per_replica: int = 2,
    requests: int = 6,
) -> FakeWatchdog:
    """The scripted state; the defaults are small enough to read in a golden file."""
    config = WatchdogConfig()
    clock = FakeClock(START, WALL_OFFSET)
    topology = chain_topology(stages, first_replicas)
    detector = Detector(config.detection, topology, clock.monotonic())
    stats = WatchdogStats()
    processes = _processes(topology, pids_per_replica)
    silent = StageRef(STALLED_STAGE)
    never_seen = StageRef(0, 1) if first_replicas > 1 else None
    path = topology.default_path()

    def feed(observations: list[Observation]) -> None:
        detector.observe(observations)
        stats.observe(observations)

    def beats(now: float, skip: tuple[StageRef | None, ...]) -> list[Observation]:
        return [
            Observation(ObservationKind.HEARTBEAT, now, stage=ref)
            for ref in topology.refs()
            if ref not in skip
        ]

    now = clock.monotonic()
    feed([Observation(ObservationKind.HEALTH, now, outcome=HealthOutcome.OK.value, value=0.01)])
    feed(
        [
            Observation(ObservationKind.PROCESS, now, process=p, outcome=p.status.value)
            for p in processes
            if p.stage != never_seen
        ]
    )
    feed(beats(now, (never_seen,)))
    feed(
        [
            Observation(ObservationKind.PROGRESS, now, stage=ref, value=0.0)
            for ref in topology.refs()
            if ref != never_seen
        ]
    )
    feed(
        [
            Observation(ObservationKind.REQUEST_ADMITTED, now, request_id=f"req-{n}", path=path)
            for n in range(requests)
        ]
    )
    first = detector.evaluate(now)

    now = clock.advance(2.0)
    # Stage 0 finishes every request, which then waits for the stalled stage.
    feed(
        [
            Observation(
                ObservationKind.STAGE_SPAN,
                now,
                stage=StageRef(0),
                request_id=f"req-{n}",
                value=0.02 * (n + 1),
                outcome="ok",
            )
            for n in range(requests)
        ]
    )
    feed(
        [
            Observation(ObservationKind.PROGRESS, now, stage=ref, value=float(requests))
            for ref in topology.refs()
            if ref not in (silent, never_seen)
        ]
    )

    now = clock.advance(13.0)
    feed([Observation(ObservationKind.HEALTH, now, outcome=HealthOutcome.OK.value, value=0.01)])
    feed(beats(now, (never_seen, silent)))
    feed(_gpu_run(processes, gpus, now, silent))
    report = detector.evaluate(now)
    stats.count_verdicts(first.verdicts)
    stats.count_verdicts(report.verdicts)
    stats.count_incidents(scripted_incidents())

    rejected = dict.fromkeys(REJECTION_REASONS, 0)
    rejected["decode_error"] = 2
    receiver = FakeReceiver(
        ReceiverStats(
            spans_accepted=4321,
            spans_rejected=rejected,
            requests=dict.fromkeys(RESPONSE_STATUSES, 0),
            forwarded=0,
            forward_dropped=0,
            queue_depth=0,
        )
    )
    probe_health = {name: ProbeHealth(name, last_duration=0.004) for name in config.probes.enabled}
    probe_health["canary"] = ProbeHealth(
        "canary", up=False, errors_total=3, last_error="timeout", last_duration=5.0
    )
    return FakeWatchdog(
        config=config,
        clock=clock,
        topology=topology,
        detector=detector,
        tracker=FakeTracker(processes),
        receiver=receiver,
        policy=FakePolicy(busy=True),
        stats=stats,
        probe_health=probe_health,
        last_report=report,
        last_health=Observation(
            ObservationKind.HEALTH, now, outcome=HealthOutcome.OK.value, value=0.01
        ),
    )
