"""What the detector keeps of the attached server: a memory per stage replica, the
target-wide facts beside them, and how a stage's memory reads against its timeouts.

Intake (`detector/intake.py`) is the only writer of what was observed; the rest of the
detector reads these, and writes back only what it judged (a stage's state, its cause).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from omni_watchdog.config import DetectionConfig
from omni_watchdog.detector.causes import (
    SAMPLES_KEPT,
    CauseFinding,
    compared_reading,
    process_cause,
)
from omni_watchdog.detector.expectations import BlindSpells, PendingRequests, RollingQuantile
from omni_watchdog.types import (
    DenoisingRequest,
    ProcessActivity,
    ProcessInfo,
    StageCause,
    StageRef,
    StageState,
    Topology,
)

# Stage replicas tracked beyond the topology (named by process titles), and processes per
# stage replica: a tree that names thousands must not make thousands of series.
MAX_EXTRA_STAGES = 64
MAX_PROCESSES_PER_STAGE = 512
# A stage's rhythm: its latest healthy beat gaps, and how many before they are trusted to
# stretch its heartbeat timeout (a p99 of twenty is their longest).
BEAT_GAPS_KEPT = 256
BEAT_GAPS_TRUSTED = 20
# Readings of a stage process kept to compare the next with one `COMPARED_SPAN` before it
# (detector/causes.py): enough at the shortest probe interval (50 ms), a bound whatever
# the clock does.
READINGS_KEPT = 64
# A denoising step is late this long past its learned step time (p99 of the stage's recent
# steps) at most, or `rhythm_multiplier` times it for short steps: a blocked step of a 3 s
# image is judged ~6 s into it, one of a 60 s video frame 10 s late.
STEP_SLACK = 10.0
# Step times learned per diffusion stage: its latest, so a new image size is soon its own.
STEPS_KEPT = 64
# Requests in flight at one diffusion stage that are tracked; the oldest give way.
MAX_DENOISING = 64
# Errored requests remembered per stage, so that one told by two spans counts once.
ERRORED_KEPT = 256
# Readings of its CPU wait kept per process: enough to span the starved window
# (detector/starved.py) at any interval.
WAIT_READINGS = 32


@dataclass
class ProcessMemory:
    """What the detector keeps of one recorded process of a stage."""

    info: ProcessInfo
    status_since: float
    cpu_changed_at: float
    exited_at: float | None = None
    runnable_seen_at: float | None = None
    seen_at: float = 0.0
    # Its time spent waiting for a CPU, as last read before its stage's loop last beat,
    # and when that was read; then its latest readings, (when, time waited).
    wait_at_beat: float = 0.0
    seen_at_beat: float = 0.0
    cpu_at_beat: float = 0.0
    waits: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=WAIT_READINGS))


@dataclass
class ActivityMemory:
    """The readings of one stage process while its stage is silent: the latest, those
    before it back to the one it is compared with (`compared_reading`), the latest ones
    with stacks (for telling a spin), and what the latest comparison said."""

    latest: ProcessActivity
    earlier: deque[ProcessActivity] = field(default_factory=lambda: deque(maxlen=READINGS_KEPT))
    sampled: deque[ProcessActivity] = field(default_factory=lambda: deque(maxlen=SAMPLES_KEPT))
    finding: CauseFinding | None = None

    def add(self, reading: ProcessActivity) -> None:
        """Compare `reading` with the one COMPARED_SPAN before it, and keep it."""
        self.earlier.append(self.latest)
        before = compared_reading(self.earlier, reading)
        # Those before it are no use to any later reading.
        while self.earlier[0] is not before:
            self.earlier.popleft()
        self.finding = process_cause(before, reading, tuple(self.sampled))
        self.latest = reading


@dataclass
class StageMemory:
    """What the detector keeps of one stage replica."""

    first_heartbeat: float | None = None
    last_heartbeat: float | None = None
    progress_value: float | None = None
    progress_changed_at: float | None = None
    progress_moved_at: float | None = None
    progress_seen_at: float | None = None
    counts_steps: bool = False
    load: float = 0.0
    load_at: float | None = None
    load_positive_since: float | None = None
    last_span_ok: float | None = None
    durations: RollingQuantile = field(default_factory=RollingQuantile)
    # Gaps between its loop's beats that ended within its heartbeat timeout: its rhythm.
    beat_gaps: RollingQuantile = field(default_factory=lambda: RollingQuantile(BEAT_GAPS_KEPT))
    processes: dict[int, ProcessMemory] = field(default_factory=dict)
    gpu_bytes: dict[int, float] = field(default_factory=dict)
    # When each pid was last listed holding memory by a GPU reading.
    gpu_seen_at: dict[int, float] = field(default_factory=dict)
    state: StageState = StageState.STARTING
    since: float = 0.0
    last_error: str = ""
    activity: dict[int, ActivityMemory] = field(default_factory=dict)
    cause: StageCause | None = None
    # Since when its findings have said, without a break, that its work advances.
    working_since: float | None = None
    # When its excused work last ended by itself (not stopped): see `silence.excused`.
    work_ended_at: float | None = None
    # A diffusion stage's requests in flight, by id, at the step each last started; the
    # seconds its steps took; the requests it failed (counted, and the latest ids).
    denoising: dict[str, DenoisingRequest] = field(default_factory=dict)
    step_seconds: RollingQuantile = field(default_factory=lambda: RollingQuantile(STEPS_KEPT))
    request_errors: int = 0
    errored: deque[str] = field(default_factory=lambda: deque(maxlen=ERRORED_KEPT))
    # When it last ended a request it was owed (its span, or its denoising's end): a span
    # of a request it was not owed says nothing of its loop (anyone with the token can
    # send one).
    owed_ended_at: float = 0.0

    def shows_itself(self) -> bool:
        """Whether it gave a signal of its own (a heartbeat, progress, a live process
        mapped to it): a replica no source names is real while it does."""
        return (
            self.last_heartbeat is not None
            or self.progress_value is not None
            or bool(self.processes)
        )


@dataclass
class TargetMemory:
    """What the detector keeps of one attached server: its stages and what the server as a
    whole said (/health, the canary, its root process, the link to a master)."""

    topology: Topology
    # Stage ids that run on other hosts, judged from their spans and /health only.
    remote: frozenset[int]
    # The watchdog's own blind spells: the same ledger across re-attaches.
    blind: BlindSpells
    # When the server was found: `startup_timeout` counts from then.
    attached: float
    stages: dict[StageRef, StageMemory]
    names: dict[StageRef, str]
    names_of_topology: frozenset[StageRef]
    pending: PendingRequests = field(default_factory=PendingRequests)
    pid_stage: dict[int, StageRef] = field(default_factory=dict)
    first_healthy: float | None = None
    # Stage processes seen to exit while their server lived, each once.
    stage_exits: int = 0
    health_failures: int = 0
    health_failed_since: float = 0.0
    health_confirmed_at: float = 0.0
    health_detail: str = ""
    # The latest failed /health was an answer (a 503), not a timeout or refusal.
    health_answered: bool = False
    canary_failed_at: float | None = None
    # The latest canary answered in time: every request that reached a stage before it
    # was not in its way.
    canary_passed_at: float = float("-inf")
    # The latest failed /health (not refused) and canary, while they go on failing.
    health_unwell: tuple[float, str] | None = None
    canary_last_failed: float | None = None
    canary_detail: str = ""
    root: ProcessInfo | None = None
    # A process of the target runs a diffusion model (its title says so).
    diffusion_seen: bool = False
    root_exited_at: float | None = None
    exit_reported: bool = False
    # What looked wrong lately, by time: what makes an exit a crash (`exits.target_exit`).
    unhealthy_signs: list[tuple[float, str]] = field(default_factory=list)
    # When any stage's counters last moved.
    last_progress: float | None = None
    # The time of the latest GPU reading, whichever pids it listed.
    gpu_read_at: float | None = None
    # A headless stage's link to its master: down since, and what the last check said.
    link_down_since: float | None = None
    link_detail: str = ""
    # The remote stage whose missing replica has kept the server unhealthy past
    # `remote_grace`, once judged: the head's own verdict is given once per spell.
    head_judged_for: StageRef | None = None
    # The target as a whole, judged while its failing /health or canary is charged to no
    # stage (`rules.pipeline_status`); healthy while there is nothing to judge.
    pipeline_state: StageState = StageState.HEALTHY
    pipeline_since: float = 0.0

    def root_alive(self) -> bool:
        return self.root_exited_at is None


def attach(
    topology: Topology, start: float, remote: Iterable[int], blind: BlindSpells
) -> TargetMemory:
    """A fresh memory of a server of `topology`, judged from `start`."""
    names = {ref: stage_name(topology, ref) for ref in topology.refs()}
    return TargetMemory(
        topology=topology,
        remote=frozenset(remote),
        blind=blind,
        attached=start,
        stages={ref: StageMemory(since=start) for ref in topology.refs()},
        names=names,
        names_of_topology=frozenset(names),
        pipeline_since=start,
    )


def stage_name(topology: Topology, ref: StageRef) -> str:
    stage = topology.stage(ref.stage_id)
    return stage.name if stage else f"stage{ref.stage_id}"


def heartbeat_timeout(config: DetectionConfig, memory: StageMemory) -> float:
    """`heartbeat_timeout`, stretched by the stage's own rhythm: a loop that its steps
    block for seconds at a time, healthy, is not silent before `rhythm_multiplier` of its
    longest healthy gaps (their p99), at most `heartbeat_timeout_max`. A loop that beats
    every second keeps the configured timeout, and its hangs are judged as fast."""
    timeout = config.heartbeat_timeout
    p99 = memory.beat_gaps.quantile(0.99)
    if p99 is not None and len(memory.beat_gaps) >= BEAT_GAPS_TRUSTED:
        stretched = min(config.rhythm_multiplier * p99, config.heartbeat_timeout_max)
        timeout = max(timeout, stretched)
    return max(timeout, step_allowance(config, memory) or 0.0)


def step_allowance(config: DetectionConfig, memory: StageMemory) -> float | None:
    """A diffusion stage beats once a denoising step while it works: while a request is
    in its steps, its silence is measured against the steps it learned to take."""
    step = memory.step_seconds.quantile(0.99) if memory.denoising else None
    if step is None:
        return None
    return min(config.rhythm_multiplier * step, step + STEP_SLACK)


def load(config: DetectionConfig, memory: StageMemory, now: float) -> float:
    """Requests on the stage, or 0 when the last scrape is too old to say."""
    if memory.load_at is None or now - memory.load_at > config.stale_after:
        return 0.0
    return memory.load


def progressing(config: DetectionConfig, memory: StageMemory, now: float) -> bool:
    """Its counters moved, or one of its spans succeeded, within `progress_timeout`."""
    window = config.progress_timeout
    moved = memory.progress_moved_at is not None and now - memory.progress_moved_at <= window
    spans = memory.last_span_ok is not None and now - memory.last_span_ok <= window
    return moved or spans
