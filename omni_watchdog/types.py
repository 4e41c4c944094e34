"""The shared vocabulary: what flows from probes to detector to policy to actuators.

Probes only produce `Observation`s, the detector only turns them into `StageStatus`es
and `Verdict`s, the policy only turns verdicts into ladder steps, and only
`policy/actuators.py` touches processes or the admin endpoint. Exporters read all of it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar, runtime_checkable


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
    GPU_RELEASED = "gpu_released"
    LINK_LOST = "link_lost"


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


class SilenceCause(str, enum.Enum):
    """What a stage is doing while it is silent, read without its help (docs/design.md,
    Why a stage is silent)."""

    COMPILING = "compiling"
    WAITING_ON_CHILD = "waiting_on_child"
    LOADING = "loading"
    COMPUTING = "computing"
    DEVICE_WAIT = "device_wait"
    LOCK_OR_QUEUE_WAIT = "lock_or_queue_wait"
    SPINNING = "spinning"
    STOPPED = "stopped"
    STARVED = "starved"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class ThreadActivity:
    """One thread as the kernel shows it: its state letter (`R`, `S`, `D`, `T`, `t`, `Z`),
    the kernel function it sleeps in ("" where not shown), its CPU time and its time spent
    runnable waiting for a CPU; and where its stack was sampled, its Python frames,
    innermost first (`function (file:line)`), and whether it held the GIL."""

    tid: int
    state: str
    wait_channel: str
    cpu_seconds: float
    cpu_wait_seconds: float
    frames: tuple[str, ...] = ()
    # It held Python's GIL when its stack was sampled: running Python code, not waiting in
    # a native call (a tensor operation releases the GIL; a loop in Python never does).
    owns_gil: bool = False


@dataclass(frozen=True)
class ChildActivity:
    """A descendant of a stage process: its command name, state letter and CPU time, that
    of its children it has reaped included (a compiler driver's passes end in turn)."""

    pid: int
    name: str
    state: str
    cpu_seconds: float


@dataclass(frozen=True)
class ProcessActivity:
    """One reading of what a stage process and its descendants are doing, at `time`
    (monotonic); `stacks_read` says whether its threads' frames were sampled."""

    pid: int
    time: float
    threads: tuple[ThreadActivity, ...]
    children: tuple[ChildActivity, ...] = ()
    stacks_read: bool = False


@dataclass(frozen=True)
class ProcessReadings:
    """What the detector keeps of one stage process while its stage is silent: its latest
    reading, its latest ones with Python stacks (oldest first), and the cause it found in
    them (None before a second reading), in the words of that finding."""

    latest: ProcessActivity
    sampled: tuple[ProcessActivity, ...] = ()
    cause: SilenceCause | None = None
    working: bool = False
    detail: str = ""


class SpanOutcome(str, enum.Enum):
    """How the request a stage span covers ended at that stage."""

    OK = "ok"
    ERROR = "error"


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

    @property
    def whole_pipeline(self) -> bool:
        """This is `PIPELINE`: the target as a whole, no stage of it in particular."""
        return self.stage_id < 0

    def __str__(self) -> str:
        return "pipeline" if self.whole_pipeline else f"{self.stage_id}.{self.replica}"


# What a verdict, a status or evidence names when it concerns the target but no stage of it
# could be proved the one: a canary or /health that fails while every stage's own readings
# neither clear nor blame it (the sidecar without the plugin: no heartbeats, no spans).
# Blaming every such stage would mark healthy ones stalled; this says "stage unknown".
PIPELINE = StageRef(-1)


class CanaryPlan(str, enum.Enum):
    """Which canary request the server gets when one is due, if any.

    TEXT: one text token (an LLM pipeline). A pipeline with a diffusion stage answers a
    text-only request 400, and an image is work, not a probe: IMAGE is the cheapest image
    (one denoising step, the smallest size) where the first stage denoises, IMAGE_CHAT the
    pipeline's own image request where an LLM stage feeds it, and NONE while every stage
    beats (their beats show them alive) or a stage is visibly denoising (a canary would
    wait behind its image)."""

    TEXT = "text"
    IMAGE = "image"
    IMAGE_CHAT = "image_chat"
    NONE = "none"


# vLLM-Omni 0.30's stage types: an LLM engine (its `LLM_AR` and `LLM_GENERATION` stages) or
# a diffusion engine (`DIFFUSION`: an image, video or audio model).
STAGE_TYPE_LLM = "llm"
STAGE_TYPE_DIFFUSION = "diffusion"
STAGE_TYPES = (STAGE_TYPE_LLM, STAGE_TYPE_DIFFUSION)
# The title vLLM-Omni 0.30 gives every process that runs a diffusion model: a one-stage
# server's API process (its engine runs inline), a multi-stage pipeline's diffusion stage
# process, and the mp executor's workers. It names no stage.
DIFFUSION_WORKER_TITLE = "vLLM-Omni::DiffusionWorker"
# The title of every LLM stage's engine process, `...stage{S}_replica{R}_DP{n}` after it.
LLM_STAGE_TITLE = "VLLM::StageEngineCoreProc_stage"


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
    # What runs it, as vLLM-Omni 0.30 says (`STAGE_TYPES`); "" where nothing said.
    stage_type: str = ""

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


# A start time (psutil's create_time(), `process_start.start_time`) is a float made of the
# boot time plus /proc's start ticks, which count 1/100 s: one start read twice differs by
# float rounding at most, while two processes that held one pid started a tick apart at
# least. Half a tick tells the two apart.
START_TIME_TOLERANCE = 0.005


@dataclass(frozen=True, order=True)
class ProcessIdentity:
    """A process as the kernel names it for life: pid alone is reused, pid + start is not."""

    pid: int
    create_time: float

    def matches(self, other: ProcessIdentity) -> bool:
        """`other` is this same process: the same pid, started in the same tick."""
        return (
            self.pid == other.pid
            and abs(self.create_time - other.create_time) < START_TIME_TOLERANCE
        )


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
    # How long it has waited, runnable, for a CPU (the kernel's run-queue delay); 0 where
    # the kernel does not say.
    cpu_wait_seconds: float = 0.0

    @property
    def identity(self) -> ProcessIdentity:
        return ProcessIdentity(self.pid, self.create_time)

    @property
    def runs_stage_work(self) -> bool:
        """Its silence is its stage's: a stage process, or the API server that runs a stage
        itself (a one-stage vLLM-Omni diffusion server: the API server is the diffusion
        worker). The API server of any other pipeline and its helpers have no work of a
        stage."""
        if self.role in (ProcessRole.STAGE, ProcessRole.ENGINE, ProcessRole.WORKER):
            return True
        return self.role is ProcessRole.API and self.stage is not None


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
    LINK = "link"
    ACTIVITY = "activity"
    DENOISE_STEP = "denoise_step"
    DENOISE_DONE = "denoise_done"
    PROCESS_STAGE = "process_stage"


# PROGRESS `detail` of a stage whose counters move at every engine step (tokens, iterations).
STEP_COUNTERS = "steps"


@dataclass(frozen=True)
class Observation:
    """One fact a probe saw at `time` (monotonic seconds of the injected clock).

    Fields by kind:
    - HEARTBEAT: `stage`.
    - REQUEST_ADMITTED: `request_id`, `path` (expected stage ids, in order).
    - REQUEST_ABANDONED: `request_id` (no stage will send a span for it any more).
    - STAGE_SPAN: `stage`, `request_id`, `value` = duration in seconds,
      `outcome` = a `SpanOutcome`, `detail` = the error text.
    - PROGRESS: `stage`, `value` = a cumulative progress counter (tokens, iterations);
      `detail` = `STEP_COUNTERS` when it counts every engine step, so that it moves
      within one step of work, not only when a request completes.
    - LOAD: `stage`, `value` = requests running plus waiting on the stage.
    - HEALTH, CANARY: `outcome` = a `HealthOutcome`, `value` = latency in seconds,
      `detail` = status code or error text.
    - PROCESS: `process`; `outcome` = its `ProcessStatus` (also EXITED once gone).
    - GPU_PROCESS: `pid`, `gpu`, `value` = bytes of device memory the pid holds,
      `stage` when the pid is mapped to one.
    - GPU_DEVICE: `gpu`, `value` = used bytes, `utilization` = 0..1.
    - TOPOLOGY: `topology` = the stage graph a source learned from the server; the app
      decides whether it replaces the current one.
    - ACTIVITY: `stage`, `activity` = what one of its processes was doing (read only while
      the stage is silent).
    - DENOISE_STEP: `stage`, `request_id`, `step` of `steps` = the denoising step that just
      started (1-based, `steps` 0 when unknown), `value` = seconds the step before it
      took (0 for the first).
    - DENOISE_DONE: `stage`, `request_id` = a request whose denoising the stage ended
      (its pipeline call returned or raised), `value` = seconds its steps took on average
      (0 when unknown).
    - PROCESS_STAGE: `pid`, `stage` = the stage a span resource says that process serves,
      `detail` = the process kind it names ("" when none); sent when it is news, for the
      process tracker to map the process by.
    """

    kind: ObservationKind
    time: float
    stage: StageRef | None = None
    value: float = 0.0
    outcome: HealthOutcome | SpanOutcome | ProcessStatus | None = None
    detail: str = ""
    request_id: str = ""
    path: tuple[int, ...] = ()
    process: ProcessInfo | None = None
    pid: int | None = None
    gpu: int | None = None
    utilization: float | None = None
    topology: Topology | None = None
    activity: ProcessActivity | None = None
    step: int = 0
    steps: int = 0


@dataclass(frozen=True)
class Evidence:
    """One reason, held since `since`, for the state of one stage."""

    kind: EvidenceKind
    stage: StageRef
    since: float
    detail: str


@dataclass(frozen=True)
class StageCause:
    """Why a silent stage is silent, as the detector last found it: the cause, since when
    it holds, whether its work visibly advances, and the readings behind it."""

    cause: SilenceCause
    since: float
    working: bool
    detail: str
    # Since when its work has advanced without a break, whatever it did meanwhile (a
    # compile, then the compiler child it waits on): its work budget counts from then.
    # None while its work does not advance.
    working_since: float | None = None


@dataclass(frozen=True)
class DenoisingRequest:
    """A request in flight at a diffusion stage: the denoising step it is in, of how many,
    and since when (monotonic)."""

    request_id: str
    step: int
    steps: int
    since: float


@dataclass(frozen=True)
class StageStatus:
    """The detector's current view of one stage replica."""

    stage: StageRef
    name: str
    state: StageState
    since: float
    evidence: tuple[Evidence, ...] = ()
    # Monotonic times of its last loop heartbeat and of its progress counter's last
    # change; None while none was seen.
    last_heartbeat: float | None = None
    last_progress: float | None = None
    # A stage on another host (a vLLM-Omni 0.30 headless stage): judged from its spans and
    # the server's word, never signalled by this watchdog. `host` is where it runs, as its
    # spans say ("" while none said; a local stage is on the watchdog's own host).
    remote: bool = False
    host: str = ""
    # What the stage is doing while it is silent; None while it is not (or nothing read).
    cause: StageCause | None = None
    # A diffusion stage's requests in flight with their denoising steps, and the seconds
    # its recent steps took (the median); empty and None for a stage that does not denoise.
    denoising: tuple[DenoisingRequest, ...] = ()
    seconds_per_step: float | None = None
    # Requests the stage failed (an error span) since the watchdog started: a request
    # error, not a stage that stopped.
    request_errors: int = 0


@dataclass(frozen=True)
class Verdict:
    """A confirmed `stalled` or `dead` judgement; the only thing the policy acts on."""

    stage: StageRef
    state: StageState
    time: float
    evidence: tuple[Evidence, ...]
    # About a stage on another host: shown and alerted on, never acted on by this watchdog.
    remote: bool = False
    # What the stage was doing when judged stalled (None for a death, or nothing read).
    cause: StageCause | None = None

    def describe(self) -> str:
        """The verdict as people read it: "stage 0.0 stalled", or for `PIPELINE`
        "target stalled, stage unknown"."""
        if self.stage.whole_pipeline:
            return f"target {self.state.value}, stage unknown"
        return f"stage {self.stage} {self.state.value}"


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
    """One episode from verdict (or crash) to the end of the ladder.

    `opened`, `closed`, the steps' `started` and the timeline are wall-clock times; the
    verdicts' and their evidence's times are on the monotonic clock, which
    `opened_monotonic` read at `opened`: a monotonic time `t` was the wall-clock time
    `opened - (opened_monotonic - t)`.
    """

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
    # The server went away by itself: before the watchdog saw it go (the incident opened
    # on its exit), or before the ladder's shutdown step reached it.
    crashed: bool = False
    # The monotonic clock, read with `opened` as the incident was made; None in incidents
    # journaled before it was recorded, whose verdict times have no wall time.
    opened_monotonic: float | None = None


@dataclass(frozen=True)
class TargetExit:
    """The server's root process went away by itself, and whether that was a crash."""

    time: float
    crashed: bool
    reasons: tuple[str, ...]
    root: ProcessIdentity | None = None


@dataclass(frozen=True)
class StageRequests:
    """Admitted requests owed a span by one stage, how many of them are overdue, and how
    long one may stay at the stage before it is (seconds: the floor, or learned)."""

    in_flight: int
    overdue: int
    deadline: float


@dataclass(frozen=True)
class DetectorReport:
    """One evaluation: every stage's status, the verdicts that are new, and a target exit."""

    time: float
    warmed_up: bool
    statuses: tuple[StageStatus, ...]
    verdicts: tuple[Verdict, ...]
    target_exit: TargetExit | None = None
    requests: Mapping[int, StageRequests] = field(default_factory=dict)
    # The target as a whole (`PIPELINE`) while /health or the canary fails and no stage's
    # own readings answer for it; None otherwise.
    pipeline: StageStatus | None = None
    # The server is idle and well (`rules.at_rest`): the watchdog judges less often.
    at_rest: bool = False


@dataclass(frozen=True)
class GpuDevice:
    """One device as NVML reported it in one reading."""

    index: int
    used_bytes: float
    total_bytes: float
    utilization: float | None  # 0..1; None where the device does not report it


@dataclass(frozen=True)
class GpuProcess:
    """Device memory one pid held on one device, and the stage replica it serves if known."""

    gpu: int
    pid: int
    used_bytes: float
    stage: StageRef | None = None


@dataclass(frozen=True)
class GpuReading:
    """Every device and the memory each pid held on it, read at one moment (monotonic)."""

    time: float
    devices: tuple[GpuDevice, ...]
    processes: tuple[GpuProcess, ...] = ()

    @property
    def used_by_device(self) -> dict[int, float]:
        return {device.index: device.used_bytes for device in self.devices}

    @property
    def used_by_pid(self) -> dict[int, float]:
        totals: dict[int, float] = {}
        for held in self.processes:
            totals[held.pid] = totals.get(held.pid, 0.0) + held.used_bytes
        return totals


@dataclass(frozen=True)
class ProbeHealth:
    """How one probe is doing: whether its last run succeeded, and its failures."""

    name: str
    up: bool = True
    errors_total: int = 0
    last_error: str = ""
    last_duration: float = 0.0
    # Python stack samples (py-spy) that runs of the probe could not take, for a probe that
    # takes them (the activity probe; None for the others): each run went on with the
    # kernel's view only, so it stays up while its causes lose their frames.
    stack_sample_errors_total: int | None = None
    last_stack_sample_error: str = ""


@dataclass(frozen=True)
class ReceiverStats:
    """The OTLP receiver's counters; `spans_rejected` counts spans for `malformed_id` and
    request bodies for the other reasons, whose spans were never decoded."""

    spans_accepted: int
    spans_rejected: Mapping[str, int]
    requests: Mapping[int, int]
    forwarded: int = 0
    forward_dropped: int = 0
    queue_depth: int = 0


@dataclass(frozen=True)
class MaintenancePause:
    """An operator's hold on the watchdog's actions, from `since` to `until` (wall)."""

    since: float
    until: float
    reason: str


# What an operator may ask of the watchdog, and how a request can end: the label values
# of `omni_watchdog_operator_actions_total`, every one present from start.
OPERATOR_ACTIONS = ("remediate", "pause", "resume")
ACTION_OUTCOMES = (
    "accepted",
    "refused",
    "bad_request",
    "unauthorized",
    "forbidden",
    "rate_limited",
)


@dataclass(frozen=True)
class OperatorAction:
    """One action an operator asked of the watchdog, done or refused, as journaled."""

    time: float  # wall
    action: str
    outcome: str
    incident_id: str | None
    detail: str
    # The pause a `pause` action opened, so a restarted watchdog keeps it.
    pause: MaintenancePause | None = None


@dataclass(frozen=True)
class TargetSnapshot:
    """What an incident acts on, fixed when it opens."""

    target: str
    root: ProcessIdentity | None
    processes: tuple[ProcessInfo, ...]
    gpu_baseline: Mapping[int, float] | None
    server_reports_failure: bool = False
    gpu_held_at_open: float = 0.0
    # False for a server known to stay up after a stage death (vLLM-Omni 0.30): waiting for
    # it to exit by itself would only hold the ladder back.
    may_exit_by_itself: bool = True

    @property
    def identities(self) -> tuple[ProcessIdentity, ...]:
        return tuple(p.identity for p in self.processes)

    def pgids(self) -> tuple[int, ...]:
        return tuple(sorted({p.pgid for p in self.processes}))


@dataclass(frozen=True)
class JournalEntry:
    """An incident as the journal knows it, with the processes it was about."""

    incident: Incident
    root: ProcessIdentity | None
    processes: tuple[ProcessIdentity, ...]
    pgids: tuple[int, ...]
    # What each device should read once the processes' memory is freed, when NVML was read.
    gpu_baseline: Mapping[int, float] | None


@dataclass(frozen=True)
class LockStatus:
    """The target lock: held, or why not (`conflict`, empty if none), and its file."""

    held: bool
    conflict: str
    path: str | None


@dataclass(frozen=True)
class HistogramCounts:
    """One histogram series at one moment: the count in each bucket (not cumulative; the
    last one is above every bound), and the sum of the values."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total: float


@dataclass(frozen=True)
class Counters:
    """What needs history to be told: counted as it happened, since the watchdog started."""

    stage_durations: Mapping[int, HistogramCounts]
    verdicts: Mapping[tuple[int, StageState, EvidenceKind], int]
    incidents: Mapping[IncidentOutcome, int]
    ladder_steps: Mapping[tuple[StepName, StepOutcome], int]
    step_durations: Mapping[StepName, HistogramCounts]
    verdict_to_release: HistogramCounts


@dataclass(frozen=True)
class TargetView:
    """The target server as a whole: where it is, whether it is up, what /health said."""

    url: str
    root: ProcessInfo | None
    up: bool
    # Whether `up` means the root process is alive (the process probe runs), or only that
    # /health answers (no process table in view).
    by_process: bool
    generation: int
    health: Observation | None


@dataclass(frozen=True)
class RemediationView:
    """What the policy may still do, and what it did."""

    mode: Mode
    # A ladder is running now.
    busy: bool
    budget_remaining: int
    budget_exhausted_total: int
    # Verdicts that opened no incident: the hour's bound of those acting on nothing reached.
    records_exhausted_total: int
    lock: LockStatus
    incidents: tuple[Incident, ...]
    # Closed by the evaluation that made this state: exported once, as they close.
    closed_now: tuple[Incident, ...] = ()
    # Actions held by an operator until its end; None when none is in force.
    pause: MaintenancePause | None = None
    # Operator action requests, by (action, outcome).
    operator_actions: Mapping[tuple[str, str], int] = field(default_factory=dict)

    @property
    def open_incident(self) -> Incident | None:
        return next((i for i in reversed(self.incidents) if i.closed is None), None)


@dataclass(frozen=True)
class SelfHealth:
    """The watchdog's own condition: whether it still judges, and what went wrong in it."""

    last_evaluation: float | None  # monotonic; None before the first
    internal_errors: Mapping[str, int]
    state_write_errors: int
    last_state_write_error: str
    # Per listener, connections it closed, by reason.
    connections_closed: Mapping[str, Mapping[str, int]]
    # Time its own event loop could not run, in how many spells, and the /health and
    # canary timeouts set aside for it, by probe.
    blind_seconds: float
    blind_spells: int
    set_aside: Mapping[str, int]
    # Reads of incident bundles the API refused (503): too many in hand at once.
    bundle_reads_refused: int = 0


@dataclass(frozen=True)
class MasterLink:
    """A headless stage's link to its master (the head's coordinator), as last checked."""

    address: str
    port: int
    up: bool
    since: float  # monotonic: when `up` last changed
    detail: str = ""


@dataclass(frozen=True)
class WatchdogState:
    """Everything the exporters show, made by one evaluation and never changed after.

    The evaluation loop pushes each new state to every `Exporter`; exporters render the
    latest one they were given and hold no reference to the watchdog itself.
    """

    made_at: float  # monotonic
    wall_at: float  # the wall clock at `made_at`
    target: TargetView
    topology: Topology
    report: DetectorReport | None
    processes: tuple[ProcessInfo, ...]
    gpu: GpuReading | None
    probes: tuple[ProbeHealth, ...]
    receiver: ReceiverStats
    remediation: RemediationView
    counters: Counters
    self_health: SelfHealth
    # The host this watchdog runs on: every stage series carries it, or its stage's own.
    host: str = ""
    # A watchdog of a headless stage: the link to its master, None elsewhere.
    link: MasterLink | None = None

    def wall(self, monotonic_time: float) -> float:
        """A monotonic time of this state as wall-clock time."""
        return self.wall_at - (self.made_at - monotonic_time)


class Exporter(Protocol):
    """Shows the watchdog's state somewhere (Prometheus, the JSON API, traces)."""

    def export(self, state: WatchdogState) -> None:
        """Take the newest state; called by the evaluation loop, so it must not block."""
        ...


class IncidentBundles(Protocol):
    """An incident's evidence files, by their names relative to its bundle."""

    def names(self, incident_id: str) -> list[str]: ...

    def read(self, incident_id: str) -> dict[str, str]: ...


class Clock(Protocol):
    """Time as the watchdog sees it: `monotonic` for deadlines, `wall` for records."""

    def monotonic(self) -> float: ...

    def wall(self) -> float: ...


class Probe(Protocol):
    """A source of observations; a failure raises, and the caller reports it."""

    name: str

    async def collect(self) -> Sequence[Observation]: ...


@runtime_checkable
class RestingProbe(Probe, Protocol):
    """A probe that knows better than its period when it next has something to read: it
    rests until then, or until what it watches wakes it."""

    async def rest(self, seconds: float) -> None:
        """Return when the probe should look again; `seconds` is what its period leaves."""
        ...


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

    def live_pids(self) -> list[int]:
        """The pids of the live recorded processes (none when no table is in view)."""
        ...


class SocketAddress(Protocol):
    """One end of a socket, as psutil names it."""

    @property
    def ip(self) -> str: ...

    @property
    def port(self) -> int: ...


class ProcessSocket(Protocol):
    """One socket of a process; `laddr` is empty for a socket bound to no address."""

    @property
    def status(self) -> str: ...

    @property
    def laddr(self) -> SocketAddress | tuple[()]: ...

    @property
    def raddr(self) -> SocketAddress | tuple[()]: ...


class HeldSocket(ProcessSocket, Protocol):
    """One socket of the system-wide table, with the pid that holds it (None if hidden)."""

    @property
    def pid(self) -> int | None: ...


class CpuTimes(Protocol):
    """CPU seconds a process has spent, in user and in kernel mode."""

    @property
    def user(self) -> float: ...

    @property
    def system(self) -> float: ...


class ProcessHandle(Protocol):
    """One process as `psutil.Process` presents it: exactly the calls the watchdog makes.

    A call raises the table's `NoSuchProcess` once the process is gone, and its
    `ZombieProcess` or `AccessDenied` where the process cannot be read.
    """

    @property
    def pid(self) -> int: ...

    def oneshot(self) -> AbstractContextManager[None]: ...

    def status(self) -> str: ...

    def ppid(self) -> int: ...

    def name(self) -> str: ...

    def cmdline(self) -> list[str]: ...

    def environ(self) -> dict[str, str]: ...

    def cpu_times(self) -> CpuTimes: ...

    def children(self, recursive: bool) -> Sequence[ProcessHandle]: ...

    def parents(self) -> Sequence[ProcessHandle]: ...

    def net_connections(self, kind: str) -> Sequence[ProcessSocket]: ...


class ProcessTable(Protocol):
    """The process table as the psutil module presents it: exactly what the watchdog uses,
    so that a test's fake table stands in for psutil itself."""

    @property
    def Error(self) -> type[Exception]: ...

    @property
    def NoSuchProcess(self) -> type[Exception]: ...

    @property
    def ZombieProcess(self) -> type[Exception]: ...

    @property
    def AccessDenied(self) -> type[Exception]: ...

    @property
    def STATUS_ZOMBIE(self) -> str: ...

    @property
    def CONN_LISTEN(self) -> str: ...

    @property
    def CONN_ESTABLISHED(self) -> str: ...

    def Process(self, pid: int) -> ProcessHandle: ...

    def process_iter(self, attrs: list[str]) -> Iterable[ProcessHandle]: ...

    def net_connections(self, kind: str) -> Sequence[HeldSocket]: ...


class CpuWaits(Protocol):
    """How long a process's threads have waited, runnable, for a CPU: a counter per pid,
    in seconds, that only grows (`processes.ThreadWaits` reads this kernel's), read once
    a scan for each process of the process table it goes with."""

    def __call__(self, pid: int, runnable: bool, /) -> float:
        """The counter for `pid`; 0 when nothing says. `runnable`: its main thread is in
        state R now (running or waiting for a CPU)."""
        ...


class ExitWatch(Protocol):
    """The kernel's word that a watched process exited, as it happens
    (`probes.exits.ExitNotices` holds a pidfd for each of this kernel's)."""

    def watch(self, identities: Iterable[ProcessIdentity]) -> None:
        """Watch `identities` (running processes), and none other."""
        ...

    async def rest(self, seconds: float) -> None:
        """Return after `seconds`, or as soon as a watched process exits."""
        ...

    def scanning(self) -> None:
        """A scan of the process table starts now: it sees every exit noticed so far."""
        ...

    def close(self) -> None:
        """Stop watching every process."""
        ...


class SocketHolders(Protocol):
    """Which process holds a connection's other end, from the socket tables and descriptor
    links of this kernel (`probes.peers.SocketOwners`)."""

    def peer_inode(self, peer: tuple[str, int], local: tuple[str, int]) -> int | None:
        """The inode of the socket at `peer` connected to `local`; None if it is not in this
        network namespace. OSError: the tables cannot be read."""
        ...

    def holders(self, inode: int, pids: Iterable[int]) -> tuple[set[int], set[int]]:
        """Those of `pids` that hold the socket `inode`, and those whose descriptors this
        process may not read."""
        ...


@dataclass(frozen=True)
class ProcessHost:
    """The host whose processes are watched: its process table and the readers that go
    with that table's pids.

    The optional parts read what only the kernel that runs the processes can answer: a
    table of another world (a test's fake, whose pids are not this kernel's) has none of
    them, and what needs one is then not done. `exit_notices`: exits noticed as they
    happen, else found by the next scan. `socket_owners`: a loopback span sender's pid
    checked against its connection, else not checked. `activity_proc`: the /proc where a
    silent stage's processes are read (and, by pid, py-spy samples their stacks), else no
    activity probe runs. `last_pid`: the pid handed out last, which stands while no
    process is born, so a scan reads the tree it knows rather than the whole table (a fork
    is the only way into a tree), else every scan lists the whole table. A host's readers
    keep what they read of its processes: one host goes with one watchdog.
    """

    process_table: ProcessTable
    cpu_waits: CpuWaits
    start_time: Callable[[int], float]
    exit_notices: ExitWatch | None = None
    socket_owners: SocketHolders | None = None
    activity_proc: Path | None = None
    last_pid: Callable[[], int] | None = None


class NvmlMemory(Protocol):
    """`nvmlDeviceGetMemoryInfo`: bytes of one device."""

    @property
    def total(self) -> int: ...

    @property
    def used(self) -> int: ...


class NvmlUtilization(Protocol):
    """`nvmlDeviceGetUtilizationRates`: how busy one device is, in percent."""

    @property
    def gpu(self) -> int: ...


class NvmlProcess(Protocol):
    """One entry of `nvmlDeviceGetComputeRunningProcesses`; some drivers report no
    per-process figure (None)."""

    @property
    def pid(self) -> int: ...

    @property
    def usedGpuMemory(self) -> int | None: ...


NvmlDevice = TypeVar("NvmlDevice")


class Nvml(Protocol[NvmlDevice]):
    """NVML as the pynvml module presents it: exactly the calls the GPU probe makes.

    A device is named by a handle of the binding's own type (pynvml's is a C pointer, the
    simulator's a dataclass) that only that binding takes back; every call raises
    `NVMLError` when the driver cannot answer.
    """

    @property
    def NVMLError(self) -> type[Exception]: ...

    def nvmlInit(self) -> None: ...

    def nvmlDeviceGetCount(self) -> int: ...

    def nvmlDeviceGetHandleByIndex(self, index: int, /) -> NvmlDevice: ...

    def nvmlDeviceGetMemoryInfo(self, handle: NvmlDevice, /) -> NvmlMemory: ...

    def nvmlDeviceGetUtilizationRates(self, handle: NvmlDevice, /) -> NvmlUtilization: ...

    def nvmlDeviceGetComputeRunningProcesses(
        self, handle: NvmlDevice, /
    ) -> Sequence[NvmlProcess]: ...


class ProbeError(RuntimeError):
    """A probe could not look this time; the reason is reported and the others go on."""
