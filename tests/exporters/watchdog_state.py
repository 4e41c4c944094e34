"""A watchdog's state built from a scripted story and a fake clock, for the exposition
tests and the scrape benchmark.

The detector and the stats are the real ones, fed the story: every stage warms up and
beats, then stage 1 falls silent with requests waiting for it (stalled, with a verdict),
the first stage's second replica never shows a sign (unknown, heartbeat age NaN). The last
stage runs on another host (a vLLM-Omni 0.30 headless stage): it has no process or GPU pid
here, and is marked remote on its spans' host as the state assembler marks it. The
processes, GPU reading, receiver counters and incidents are written out as a state.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from omni_watchdog.clock import FakeClock
from omni_watchdog.config import WORKING_CAUSES, WatchdogConfig
from omni_watchdog.detector import Detector
from omni_watchdog.exporters.prometheus import MetricsExposition
from omni_watchdog.probes.gpu import observations_of
from omni_watchdog.probes.otlp_transport import RESPONSE_STATUSES
from omni_watchdog.probes.spans import REJECTION_REASONS
from omni_watchdog.stats import WatchdogStats
from omni_watchdog.types import (
    GpuDevice,
    GpuProcess,
    GpuReading,
    HealthOutcome,
    Incident,
    IncidentOutcome,
    LockStatus,
    MaintenancePause,
    MasterLink,
    Mode,
    Observation,
    ObservationKind,
    ProbeHealth,
    ProcessActivity,
    ProcessInfo,
    ProcessRole,
    ProcessStatus,
    ReceiverStats,
    RemediationView,
    SelfHealth,
    SilenceCause,
    SpanOutcome,
    Stage,
    StageCause,
    StageRef,
    StepName,
    StepOutcome,
    StepResult,
    TargetView,
    ThreadActivity,
    Topology,
    WatchdogState,
)

START = 1000.0
WALL_OFFSET = 1_700_000_000.0
ROOT_PID = 100
UNMAPPED_PID = 99_999
STALLED_STAGE = 1
GIB = 2**30
HOST = "gpu-node-a"
# The defaults, but for compiling: a JIT build's budget raised, as the runbook suggests.
WORK_BUDGETS = {
    cause: 1800.0 if cause is SilenceCause.COMPILING else 600.0 for cause in WORKING_CAUSES
}
REMOTE_HOST = "gpu-node-b"


@dataclass(frozen=True)
class Scripted:
    """The scripted state, the clock it was made at, and an exposition over both."""

    state: WatchdogState
    clock: FakeClock

    def exposition(self) -> MetricsExposition:
        return MetricsExposition(self.clock, self.state, WORK_BUDGETS)

    def rendered(self) -> str:
        return self.exposition().render().decode()


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


def _processes(topology: Topology, pids_per_replica: int, remote: int | None) -> list[ProcessInfo]:
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
        if ref.stage_id == remote:
            continue
        roles = [ProcessRole.STAGE, ProcessRole.ENGINE]
        roles += [ProcessRole.WORKER] * (pids_per_replica - len(roles))
        for role in roles[:pids_per_replica]:
            processes.append(info(pid, role, ref, status=ProcessStatus.RUNNING))
            pid += 1
    processes.append(info(pid, ProcessRole.HELPER, None, status=ProcessStatus.ZOMBIE))
    processes.append(info(pid + 1, ProcessRole.HELPER, None, ppid=1, orphaned=True))
    processes.append(info(pid + 2, ProcessRole.HELPER, None, status=ProcessStatus.EXITED))
    return processes


def _gpu_reading(
    processes: list[ProcessInfo], gpus: int, now: float, silent: StageRef
) -> GpuReading:
    """One GPU probe run: each stage replica's processes on the device of its stage."""
    held: dict[int, list[GpuProcess]] = {g: [] for g in range(gpus)}
    for process in processes:
        if process.stage is not None and process.status is ProcessStatus.RUNNING:
            used = float((1 + process.pid % 7) * GIB)
            gpu = process.stage.stage_id % gpus
            held[gpu].append(GpuProcess(gpu, process.pid, used, process.stage))
    held[0].append(GpuProcess(0, UNMAPPED_PID, float(GIB // 2), None))
    devices = tuple(
        GpuDevice(
            gpu,
            sum(p.used_bytes for p in pids) + 256.0 * 2**20,
            80.0 * GIB,
            # Only the silent stage's device idles; one device reports no utilization.
            None if gpu == gpus - 1 and gpus > 2 else 0.0 if gpu == silent.stage_id else 0.5,
        )
        for gpu, pids in held.items()
    )
    return GpuReading(now, devices, tuple(p for pids in held.values() for p in pids))


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


def scripted_state(
    stages: int = 3,
    first_replicas: int = 2,
    gpus: int = 3,
    pids_per_replica: int = 2,
    requests: int = 6,
    with_remote: bool = True,
) -> Scripted:
    """The scripted state; the defaults are small enough to read in a golden file.
    `with_remote`: its last stage runs on another host (when it is not the stalled one)."""
    config = WatchdogConfig()
    clock = FakeClock(START, WALL_OFFSET)
    topology = chain_topology(stages, first_replicas)
    detector = Detector(config.detection, topology, clock.monotonic())
    stats = WatchdogStats()
    # The last stage is remote once there is one beyond the stalled stage.
    remote = stages - 1 if with_remote and stages - 1 > STALLED_STAGE else None
    processes = _processes(topology, pids_per_replica, remote)
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
    feed([Observation(ObservationKind.HEALTH, now, outcome=HealthOutcome.OK, value=0.01)])
    feed(
        [
            Observation(ObservationKind.PROCESS, now, process=p, outcome=p.status)
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
                outcome=SpanOutcome.OK,
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
    # One request that stage 0 failed (the server answered it with an error), and one it
    # denoises, as a diffusion stage tells its steps.
    feed(
        [
            Observation(
                ObservationKind.STAGE_SPAN,
                now,
                stage=StageRef(0),
                request_id="req-failed",
                value=0.5,
                outcome=SpanOutcome.ERROR,
                detail="RuntimeError: injected",
            ),
            Observation(
                ObservationKind.DENOISE_STEP,
                now,
                stage=StageRef(0),
                request_id="req-image",
                step=1,
                steps=50,
            ),
        ]
    )

    now = clock.advance(13.0)
    health = Observation(ObservationKind.HEALTH, now, outcome=HealthOutcome.OK, value=0.01)
    feed([health])
    feed(
        [
            Observation(
                ObservationKind.DENOISE_STEP,
                now,
                stage=StageRef(0),
                request_id="req-image",
                step=37,
                steps=50,
                value=0.35,
            )
        ]
    )
    feed(beats(now, (never_seen, silent)))
    gpu = _gpu_reading(processes, gpus, now, silent)
    feed(observations_of(gpu))
    # What the silent stage's processes do, as the activity probe reads them: asleep on a
    # lock, nothing working for them.
    for process in processes:
        if process.stage == silent:
            for at in (now - 1.0, now):
                asleep = ThreadActivity(process.pid, "S", "futex_do_wait", 1.0, 0.0)
                reading = ProcessActivity(process.pid, at, (asleep,))
                feed([Observation(ObservationKind.ACTIVITY, at, silent, activity=reading)])
    report = detector.evaluate(now)
    report = dataclasses.replace(
        report,
        statuses=tuple(
            dataclasses.replace(status, remote=True, host=REMOTE_HOST)
            if status.stage.stage_id == remote
            else dataclasses.replace(status, host=HOST)
            for status in report.statuses
        ),
    )
    stats.count_verdicts(first.verdicts)
    stats.count_verdicts(report.verdicts)
    incidents = scripted_incidents()
    stats.count_incidents(incidents)

    rejected = dict.fromkeys(REJECTION_REASONS, 0)
    rejected["decode_error"] = 2
    failed_probes = {
        "canary": ProbeHealth(
            "canary", up=False, errors_total=3, last_error="timeout", last_duration=5.0
        ),
        # Up, with two stack samples of the silent stage that py-spy could not take.
        "activity": ProbeHealth(
            "activity",
            last_duration=0.004,
            stack_sample_errors_total=2,
            last_stack_sample_error="pid 1002: py-spy gave no dump in 2s: ",
        ),
    }
    probes = tuple(
        failed_probes.get(name) or ProbeHealth(name, last_duration=0.004)
        for name in sorted(config.probes.enabled)
    )
    state = WatchdogState(
        made_at=now,
        wall_at=clock.wall(),
        target=TargetView(
            url=config.target,
            root=processes[0],
            up=True,
            by_process=True,
            generation=1,
            health=health,
        ),
        topology=topology,
        report=report,
        processes=tuple(processes),
        gpu=gpu,
        probes=probes,
        receiver=ReceiverStats(
            spans_accepted=4321,
            spans_rejected=rejected,
            requests=dict.fromkeys(RESPONSE_STATUSES, 0),
        ),
        remediation=RemediationView(
            mode=Mode.ENFORCE,
            busy=True,
            budget_remaining=2,
            budget_exhausted_total=1,
            records_exhausted_total=4,
            lock=LockStatus(False, "held by another watchdog (pid 7)", None),
            incidents=tuple(incidents),
            pause=MaintenancePause(1_700_000_000.0, 1_700_001_800.0, "driver upgrade"),
            operator_actions={("pause", "accepted"): 1, ("remediate", "unauthorized"): 2},
        ),
        counters=stats.counters(),
        self_health=SelfHealth(
            last_evaluation=now - 0.25,
            internal_errors={"evaluate": 0, "ingest": 1, "ladder": 0, "listener": 0},
            state_write_errors=0,
            last_state_write_error="",
            connections_closed={},
            blind_seconds=3.25,
            blind_spells=4,
            set_aside={"canary": 0, "health": 2},
        ),
        host=HOST,
    )
    return Scripted(state, clock)


def headless_state() -> Scripted:
    """The watchdog beside the scripted remote stage, on that stage's host: the stage is
    its own (local), the others are not its to show, and its link to the master has been
    down for 5 s. Its stage's processes and GPU pids are not scripted."""
    scripted = scripted_state()
    state = scripted.state
    assert state.report is not None
    remote = state.topology.stages[-1].stage_id
    topology = Topology(tuple(s for s in state.topology.stages if s.stage_id == remote), "test")
    statuses = tuple(
        dataclasses.replace(status, remote=False)
        for status in state.report.statuses
        if status.stage.stage_id == remote
    )
    link = MasterLink("10.0.0.1", 29500, False, state.made_at - 5.0, "connection refused")
    headless = dataclasses.replace(
        state,
        topology=topology,
        report=dataclasses.replace(state.report, statuses=statuses, requests={}),
        processes=(),
        gpu=None,
        host=REMOTE_HOST,
        link=link,
    )
    return Scripted(headless, scripted.clock)


def working_state() -> Scripted:
    """The scripted story with its stalled stage's work advancing (a JIT build) past its
    budget: the only series of `stage_work_seconds`."""
    scripted = scripted_state()
    state = scripted.state
    assert state.report is not None
    now = scripted.clock.monotonic()
    building = StageCause(
        SilenceCause.WAITING_ON_CHILD, now - 100.0, True, "g++ pid 7 at 98 %", now - 700.0
    )
    statuses = tuple(
        dataclasses.replace(s, cause=building) if s.stage == StageRef(STALLED_STAGE) else s
        for s in state.report.statuses
    )
    report = dataclasses.replace(state.report, statuses=statuses)
    return Scripted(dataclasses.replace(state, report=report), scripted.clock)
