"""The shared vocabulary: what flows from probes to detector to policy to actuators.

Probes only produce `Observation`s, the detector only turns them into `StageStatus`es
and `Verdict`s, the policy only turns verdicts into ladder steps, and only
`policy/actuators.py` touches processes or the admin endpoint. Exporters read all of it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol


class StageState(str, enum.Enum):
    """What the detector believes about one stage replica."""

    STARTING = "starting"
    HEALTHY = "healthy"
    DEGRADED = "degraded"
    STALLED = "stalled"
    DEAD = "dead"
    UNKNOWN = "unknown"


class EvidenceKind(str, enum.Enum):
    """One independent reason to believe a stage is not making progress."""

    HEARTBEAT_LOST = "heartbeat_lost"
    SPAN_OVERDUE = "span_overdue"
    PROGRESS_FLAT = "progress_flat"
    HEALTH_FAILED = "health_failed"
    CANARY_FAILED = "canary_failed"
    PROCESS_EXIT = "process_exit"
    PROCESS_STUCK = "process_stuck"
    GPU_HELD = "gpu_held"


class ProcessRole(str, enum.Enum):
    """What a process of the target's tree is for."""

    API = "api"
    STAGE = "stage"
    ENGINE = "engine"
    WORKER = "worker"
    HELPER = "helper"


class ProcessStatus(str, enum.Enum):
    """The scheduler state of a process, reduced to what detection needs."""

    RUNNING = "running"
    SLEEPING = "sleeping"
    STOPPED = "stopped"
    DISK_SLEEP = "disk_sleep"
    ZOMBIE = "zombie"
    EXITED = "exited"


class HealthOutcome(str, enum.Enum):
    """How one call to the server's `/health` (or one canary request) ended."""

    OK = "ok"
    UNHEALTHY = "unhealthy"
    TIMEOUT = "timeout"
    REFUSED = "refused"
    ERROR = "error"


@dataclass(frozen=True, order=True)
class StageRef:
    """One replica of one pipeline stage; plain vLLM is stage 0, replica 0."""

    stage_id: int
    replica: int = 0

    def __str__(self) -> str:
        return f"{self.stage_id}.{self.replica}"


@dataclass(frozen=True)
class Stage:
    """A stage of the pipeline as the topology describes it."""

    stage_id: int
    name: str
    replicas: int = 1
    devices: tuple[int, ...] = ()
    gpu_memory_utilization: float | None = None
    upstream: tuple[int, ...] = ()
    downstream: tuple[int, ...] = ()
    final_output: bool = False

    def refs(self) -> tuple[StageRef, ...]:
        return tuple(StageRef(self.stage_id, replica) for replica in range(self.replicas))


class TopologyOrigin(enum.IntEnum):
    """How a topology was learned, from least to best informed.

    Without a stage config given to the watchdog, a better-informed origin replaces a
    poorer one; a given one (`EXPLICIT`) is never replaced.
    """

    DEFAULT = 0  # nothing seen yet: plain vLLM, one stage
    METRICS = 1  # stage and replica labels of the server's /metrics: ids and replicas
    TITLES = 2  # the stage replicas' process titles: ids and replicas of every process
    SERVER_CONFIG = 3  # the stage config file the server itself was started with
    PLUGIN = 4  # the pipeline the server runs, as the instrument plugin read it there
    EXPLICIT = 5  # the stage config given to the watchdog


@dataclass(frozen=True)
class Topology:
    """The stage graph of a served pipeline; `source` says where it came from."""

    stages: tuple[Stage, ...]
    source: str = "default"
    origin: TopologyOrigin = TopologyOrigin.EXPLICIT

    def stage(self, stage_id: int) -> Stage | None:
        return next((s for s in self.stages if s.stage_id == stage_id), None)

    def refs(self) -> tuple[StageRef, ...]:
        return tuple(ref for stage in self.stages for ref in stage.refs())

    def entry_stages(self) -> tuple[int, ...]:
        return tuple(s.stage_id for s in self.stages if not s.upstream)

    def default_path(self) -> tuple[int, ...]:
        """Stage ids a request visits, in order, following the first edge out of each."""
        path: list[int] = []
        current = self.entry_stages()[:1]
        while current and current[0] not in path:
            path.append(current[0])
            stage = self.stage(current[0])
            current = stage.downstream[:1] if stage else ()
        return tuple(path)


@dataclass(frozen=True, order=True)
class ProcessIdentity:
    """A process as the kernel names it for life: pid alone is reused, pid + start is not."""

    pid: int
    create_time: float


@dataclass(frozen=True)
class ProcessInfo:
    """One process of the target's tree, as the processes probe saw it."""

    pid: int
    create_time: float
    ppid: int
    pgid: int
    sid: int
    title: str
    status: ProcessStatus
    cpu_seconds: float
    role: ProcessRole
    stage: StageRef | None = None
    orphaned: bool = False

    @property
    def identity(self) -> ProcessIdentity:
        return ProcessIdentity(self.pid, self.create_time)


class ObservationKind(str, enum.Enum):
    """What an observation reports; see `Observation` for the fields each kind fills."""

    HEARTBEAT = "heartbeat"
    REQUEST_ADMITTED = "request_admitted"
    REQUEST_ABANDONED = "request_abandoned"
    REQUEST_FINISHED = "request_finished"
    STAGE_SPAN = "stage_span"
    PROGRESS = "progress"
    LOAD = "load"
    HEALTH = "health"
    CANARY = "canary"
    PROCESS = "process"
    GPU_PROCESS = "gpu_process"
    GPU_DEVICE = "gpu_device"
    TOPOLOGY = "topology"


@dataclass(frozen=True)
class Observation:
    """One fact a probe saw at `time` (monotonic seconds of the injected clock).

    Fields by kind:
    - HEARTBEAT: `stage`.
    - REQUEST_ADMITTED: `request_id`, `path` (expected stage ids, in order).
    - REQUEST_ABANDONED: `request_id` (no stage will send a span for it any more).
    - STAGE_SPAN: `stage`, `request_id`, `value` = duration in seconds,
      `outcome` = "ok" or "error", `detail` = the error text.
    - PROGRESS: `stage`, `value` = a cumulative progress counter (tokens, iterations).
    - LOAD: `stage`, `value` = requests running plus waiting on the stage.
    - HEALTH, CANARY: `outcome` = a `HealthOutcome` value, `value` = latency in seconds,
      `detail` = status code or error text.
    - PROCESS: `process`; `outcome` = its `ProcessStatus` value (also EXITED once gone).
    - GPU_PROCESS: `pid`, `gpu`, `value` = bytes of device memory the pid holds,
      `stage` when the pid is mapped to one.
    - GPU_DEVICE: `gpu`, `value` = used bytes, `utilization` = 0..1.
    - TOPOLOGY: `topology` = the stage graph a source learned from the server; the app
      decides whether it replaces the current one.
    """

    kind: ObservationKind
    time: float
    stage: StageRef | None = None
    value: float = 0.0
    outcome: str = ""
    detail: str = ""
    request_id: str = ""
    path: tuple[int, ...] = ()
    process: ProcessInfo | None = None
    pid: int | None = None
    gpu: int | None = None
    utilization: float | None = None
    topology: Topology | None = None


@dataclass(frozen=True)
class Evidence:
    """One reason, held since `since`, for the state of one stage."""

    kind: EvidenceKind
    stage: StageRef
    since: float
    detail: str


@dataclass(frozen=True)
class StageStatus:
    """The detector's current view of one stage replica."""

    stage: StageRef
    name: str
    state: StageState
    since: float
    evidence: tuple[Evidence, ...] = ()


@dataclass(frozen=True)
class Verdict:
    """A confirmed `stalled` or `dead` judgement; the only thing the policy acts on."""

    stage: StageRef
    state: StageState
    time: float
    evidence: tuple[Evidence, ...]


class Mode(str, enum.Enum):
    """How far the policy may go: look, say what it would do, or do it."""

    OBSERVE = "observe"
    DRY_RUN = "dry-run"
    ENFORCE = "enforce"


class StepName(str, enum.Enum):
    """The rungs of the remediation ladder, in order."""

    CAPTURE = "capture"
    SHUTDOWN = "shutdown"
    TERMINATE = "terminate"
    KILL = "kill"
    VERIFY = "verify"


class StepOutcome(str, enum.Enum):
    """How one ladder step ended."""

    OK = "ok"
    RECOVERED = "recovered"
    NOT_RECOVERED = "not_recovered"
    UNREACHABLE = "unreachable"
    REFUSED = "refused"
    TIMEOUT = "timeout"
    SKIPPED = "skipped"
    PLANNED = "planned"
    FAILED = "failed"


class IncidentOutcome(str, enum.Enum):
    """How an incident ended."""

    OPEN = "open"
    RECOVERED_BY_SHUTDOWN = "recovered_by_shutdown"
    RECOVERED_BY_TERM = "recovered_by_term"
    RECOVERED_BY_KILL = "recovered_by_kill"
    CRASHED = "crashed"
    LEAKED = "leaked"
    UNKILLABLE = "unkillable"
    FAILED = "failed"
    PLANNED = "planned"
    OBSERVED = "observed"


@dataclass(frozen=True)
class StepResult:
    """What one ladder step did and how long it took (wall-clock `started`)."""

    step: StepName
    outcome: StepOutcome
    started: float
    duration: float
    detail: str = ""
    targets: tuple[int, ...] = ()


@dataclass(frozen=True)
class Incident:
    """One episode from verdict (or crash) to the end of the ladder."""

    incident_id: str
    target: str
    mode: Mode
    opened: float
    cause: str
    verdicts: tuple[Verdict, ...] = ()
    steps: tuple[StepResult, ...] = ()
    outcome: IncidentOutcome = IncidentOutcome.OPEN
    closed: float | None = None
    bundle_dir: str | None = None
    timeline: Mapping[str, float] = field(default_factory=dict)


class Clock(Protocol):
    """Time as the watchdog sees it: `monotonic` for deadlines, `wall` for records."""

    def monotonic(self) -> float: ...

    def wall(self) -> float: ...


class Probe(Protocol):
    """A source of observations; a failure raises, and the caller reports it."""

    name: str

    async def collect(self) -> Sequence[Observation]: ...


class SpanSenders(Protocol):
    """Whom a span may speak for: the target's recorded processes and its stages.

    A span is evidence only when its sender is a process of the target's current tree
    (named by pid and start, so a forger or a reused pid is not), and only for a stage the
    topology or the tree itself names: spans never create stages.
    """

    def owns(self, pid: int | None, start_ticks: int | None) -> bool:
        """The sender is a live recorded process of the current target (True when no
        process table is in view, so that nothing could be checked)."""
        ...

    def knows(self, stage: StageRef) -> bool:
        """The stage replica is one of the topology's or one the tree's processes serve."""
        ...

    def maps(self, stage: StageRef) -> bool:
        """A live recorded process serves the stage replica (or no process table is in view)."""
        ...


class ProbeError(RuntimeError):
    """A probe could not look this time; the reason is reported and the others go on."""
