"""The detector: observations and a clock in, per-stage states and verdicts out, no I/O.

The rules (docs/design.md, Detection):
- nothing is judged before the first healthy /health plus `startup_grace`, or before
  `startup_timeout` after attach for a server that never answers healthy, unless a
  recorded stage process exits first;
- `stalled` needs no progress, not slowness: a stage whose counters or spans moved within
  `progress_timeout` is `degraded` at worst, however late its requests are;
- spans never outweigh the world: a stage with a stopped (T) process, with counters flat
  while work is queued or waits at it, or read asleep in a denoising step no longer told,
  is judged on that whatever its heartbeats and spans say; and only counters hold the
  canary back;
- a verdict needs two independent kinds of evidence, or one held for `confirm_timeout`
  (never an overdue span alone);
- `dead` needs a stage process to have exited while the server lives, or a confirmed
  /health 503 charged to the stage (the server's word that an engine is dead); a /health
  that failed (503 or timeout, not refused) or a canary that failed after the exit
  confirms it at once: a hard fact and the server's own word, each from its own probe;
- target-wide evidence (/health, the canary) is charged to the beating stages that show no
  liveness of their own, and to a stage that never beat (no plugin) only where its own
  readings prove it is the one; with no stage to charge, the target as a whole
  (`PIPELINE`) is judged instead, so a healthy stage is not blamed for its neighbour;
- the watchdog's own blindness is not the server's silence: heartbeat and span silence
  count only the time in which the watchdog could look, and a /health or canary timeout
  that it was blind for part of says nothing either way.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from omni_watchdog.config import DetectionConfig
from omni_watchdog.detector.causes import (
    SAMPLES_KEPT,
    CauseFinding,
    compared_reading,
    process_cause,
    stage_cause,
)
from omni_watchdog.detector.expectations import (
    BlindSpells,
    PendingRequest,
    PendingRequests,
    RollingQuantile,
)
from omni_watchdog.detector.starved import (
    STARVED_WINDOW_SHARE,
    WAIT_WORTH_SAYING,
    ProcessMemory,
    busiest_runner,
    cpu_note,
    longest_wait,
    starved_finding,
)
from omni_watchdog.types import (
    DIFFUSION_WORKER_TITLE,
    LLM_STAGE_TITLE,
    PIPELINE,
    STAGE_TYPE_DIFFUSION,
    STAGE_TYPE_LLM,
    STEP_COUNTERS,
    CanaryPlan,
    DenoisingRequest,
    DetectorReport,
    Evidence,
    EvidenceKind,
    HealthOutcome,
    Observation,
    ObservationKind,
    ProcessActivity,
    ProcessInfo,
    ProcessReadings,
    ProcessRole,
    ProcessStatus,
    SilenceCause,
    SpanOutcome,
    StageCause,
    StageRef,
    StageRequests,
    StageState,
    StageStatus,
    TargetExit,
    Topology,
    Verdict,
)

# Roles whose exit means the stage lost its engine; a helper child exiting is only reported.
_STAGE_ROLES = (ProcessRole.STAGE, ProcessRole.ENGINE, ProcessRole.WORKER)
# gpu_held follows from a state, so it is shown but never counted towards one.
_CONSEQUENCES = (EvidenceKind.GPU_HELD,)
# Evidence that never confirms a verdict alone, however long it stands: a request whose
# span is late or lost says as much of the exporter, the network or the receiver as of
# the stage (CI: a healthy, idle, beating real vLLM-Omni stage judged stalled, and ended,
# on one overdue request alone). It confirms beside another kind.
_NEVER_ALONE = frozenset({EvidenceKind.SPAN_OVERDUE})
# Evidence that says only that a stage answered late. Where the stage was seen running or
# waiting for a CPU meanwhile (a long step, a loaded host), that explains them all at once:
# they are one kind there, and a stall confirmed by them alone waits for `confirm_timeout`.
_LATENESS = frozenset(
    {EvidenceKind.HEARTBEAT_LOST, EvidenceKind.SPAN_OVERDUE, EvidenceKind.CANARY_FAILED}
)
# What a stage whose work visibly advances (a compile, a child building for it, a step
# whose frames move) is excused from until its work budget runs out: each says only that
# it is late or quiet, which such work is. A stopped or exited process, a failed /health
# and a lost link are never excused: a stage doing legit work shows none of them.
_EXCUSED_BY_WORK = frozenset(
    {
        EvidenceKind.HEARTBEAT_LOST,
        EvidenceKind.SPAN_OVERDUE,
        EvidenceKind.CANARY_FAILED,
        EvidenceKind.PROGRESS_FLAT,
        EvidenceKind.PROCESS_STUCK,
    }
)
# Causes that are no work and that an idle stage never shows: a stage that never beat (no
# plugin) and shows one answers for the target's failing /health or canary. Asleep on a
# lock or a queue is what every idle stage shows, so it proves nothing; neither does a wait
# on a child, which an idle engine may show on its worker's pipe.
_BLOCKED_CAUSES = frozenset({SilenceCause.STOPPED, SilenceCause.SPINNING, SilenceCause.DEVICE_WAIT})
# Causes that say a stage in the middle of a denoising step is not running it: a step
# computes or waits on its device; asleep on a lock or a queue, stopped, or spinning in
# one frame, the stage has left it, whatever beats come in its name.
_STEP_NOT_RUNNING = frozenset(
    {SilenceCause.LOCK_OR_QUEUE_WAIT, SilenceCause.STOPPED, SilenceCause.SPINNING}
)
# Causes that say the work a stage was excused for stopped advancing (its child stopped or
# idle, its process stopped, its loop spinning): judged at once. Any other end of the work
# (the stage beats again, or sleeps as its loop picks the result up) is the work done.
_WORK_STOPPED = frozenset(
    {SilenceCause.STOPPED, SilenceCause.WAITING_ON_CHILD, SilenceCause.SPINNING}
)
# A stage is silent, and its processes are read for a cause, once its loop has not beaten
# for this share of `heartbeat_timeout`, or its counters have stayed flat under load for
# this share of `progress_timeout`: two readings are in by the time evidence stands.
SILENT_SHARE = 0.5
# A clean stop takes its engine down a moment before the server itself (vLLM: all gone in
# under 0.5 s), so only signs older than this before the exit can make it a crash.
_EXIT_SETTLE = 1.0
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
# A stage one of whose processes waited for a CPU through this share of its silence is
# starved, whatever a closer reading of its other processes found them doing.
STARVED_SILENCE_SHARE = 0.5
# Errored requests remembered per stage, so that one told by two spans counts once.
ERRORED_KEPT = 256


@dataclass
class _ActivityMemory:
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
class _StageMemory:
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
    activity: dict[int, _ActivityMemory] = field(default_factory=dict)
    cause: StageCause | None = None
    # Since when its findings have said, without a break, that its work advances.
    working_since: float | None = None
    # When its excused work last ended by itself (not stopped): see `_excused`.
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


class Detector:
    """Per-stage state machine over observations; pure, so tests drive it with a fake clock."""

    def __init__(
        self,
        config: DetectionConfig,
        topology: Topology,
        start: float,
        remote_stages: Iterable[int] = (),
    ) -> None:
        """`remote_stages`: stage ids that run on other hosts (vLLM-Omni 0.30 headless
        stages), judged from their spans and the server's /health only."""
        self._config = config
        self._remote = frozenset(remote_stages)
        # The watchdog's, not the target's: kept across a re-attach.
        self._blind = BlindSpells()
        self.set_aside = dict.fromkeys((ObservationKind.HEALTH, ObservationKind.CANARY), 0)
        # Stage processes seen to exit while their server lived, each once: news to act on.
        self.stage_exits = 0
        self.reset(topology, start)

    def reset(self, topology: Topology, start: float) -> None:
        """Forget everything and judge `topology` afresh from `start`: a new server was
        attached. The detector stays the same object, so whatever reads it keeps reading."""
        self._topology = topology
        self._names = {ref: self._stage_name(ref) for ref in topology.refs()}
        self._names_of_topology = frozenset(self._names)
        self._stages: dict[StageRef, _StageMemory] = {
            ref: _StageMemory(since=start) for ref in topology.refs()
        }
        self._pending = PendingRequests()
        self._pid_stage: dict[int, StageRef] = {}
        self._attached = start
        self._first_healthy: float | None = None
        self._stage_exit_seen = False
        self._health_failures = 0
        self._health_failed_since = 0.0
        self._health_confirmed_at = 0.0
        self._health_detail = ""
        # The latest failed /health was an answer (a 503), not a timeout or refusal.
        self._health_answered = False
        self._canary_failed_at: float | None = None
        # The latest canary answered in time: every request that reached a stage before
        # it was not in its way.
        self._canary_passed_at = float("-inf")
        # The latest failed /health (not refused) and canary, while they go on failing.
        self._health_unwell: tuple[float, str] | None = None
        self._canary_last_failed: float | None = None
        self._canary_detail = ""
        self._root: ProcessInfo | None = None
        # A process of the target runs a diffusion model (its title says so).
        self._diffusion_seen = False
        self._root_exited_at: float | None = None
        self._exit_reported = False
        self._unhealthy_signs: list[tuple[float, str]] = []
        self._last_progress: float | None = None
        # A headless stage's link to its master: down since, and what the last check said.
        # The time of the latest GPU reading, whichever pids it listed.
        self._gpu_read_at: float | None = None
        self._link_down_since: float | None = None
        self._link_detail = ""
        # The remote stage whose missing replica has kept the server unhealthy past
        # `remote_grace`, once judged: the head's own verdict is given once per spell.
        self._head_judged_for: StageRef | None = None
        # The target as a whole, judged while its failing /health or canary is charged to
        # no stage (`_pipeline_status`); healthy while there is nothing to judge.
        self._pipeline_state = StageState.HEALTHY
        self._pipeline_since = start

    def attached(self, now: float) -> None:
        """The first server was found on the target: `startup_timeout` counts from now, and
        everything observed so far, which came from it, stays."""
        self._attached = now

    def set_topology(self, topology: Topology, now: float) -> None:
        """Judge the stages of `topology` from now on, keeping what is known of every stage
        replica that stays. One it drops is kept while it shows a signal of its own (a
        process, a heartbeat, progress): it is real, even if no source names it."""
        self._topology = topology
        kept = {
            ref: memory
            for ref, memory in self._stages.items()
            if memory.last_heartbeat is not None
            or memory.progress_value is not None
            or memory.processes
        }
        refs = topology.refs()
        self._stages = {ref: self._stages.get(ref) or _StageMemory(since=now) for ref in refs}
        self._stages |= {ref: memory for ref, memory in kept.items() if ref not in refs}
        self._names = {ref: self._stage_name(ref) for ref in self._stages}
        self._names_of_topology = frozenset(topology.refs())
        self._pid_stage = {pid: ref for pid, ref in self._pid_stage.items() if ref in self._stages}

    # ---- observations -------------------------------------------------------------

    def blind(self, start: float, end: float) -> None:
        """The watchdog could not look from `start` to `end` (its own loop ran late)."""
        self._blind.add(start, end)

    def _blind_during(self, obs: Observation) -> bool:
        """A timeout the watchdog was blind for part of: its answer may have waited unread
        while the timer ran. Counted, and set aside as neither success nor failure."""
        if obs.outcome is not HealthOutcome.TIMEOUT:
            return False
        if self._blind.within(obs.time - obs.value, obs.time) <= 0:
            return False
        self.set_aside[obs.kind] += 1
        return True

    def observe(self, observations: Iterable[Observation]) -> None:
        for obs in observations:
            handler = self._HANDLERS.get(obs.kind)
            if handler is not None:
                handler(self, obs)

    def _on_heartbeat(self, obs: Observation) -> None:
        memory = self._memory(obs.stage)
        if memory is not None:
            previous = memory.last_heartbeat
            if previous is not None and 0 < obs.time - previous <= self._heartbeat_timeout(memory):
                memory.beat_gaps.add(obs.time - previous)
            # Spans of a sender the tracker had not recorded yet arrive late, and older.
            memory.last_heartbeat = max(obs.time, previous or obs.time)
            for known in memory.processes.values():
                known.wait_at_beat, known.seen_at_beat = known.info.cpu_wait_seconds, known.seen_at
                known.cpu_at_beat = known.info.cpu_seconds

    def _on_admitted(self, obs: Observation) -> None:
        self._pending.admit(obs.request_id, obs.path, obs.time)

    def _on_request_ended(self, obs: Observation) -> None:
        self._pending.abandon(obs.request_id)
        for memory in self._stages.values():
            memory.denoising.pop(obs.request_id, None)

    def _on_denoise_done(self, obs: Observation) -> None:
        memory = self._memory(obs.stage)
        if memory is not None and obs.stage is not None:
            if self._pending.waits_at(obs.request_id, obs.stage.stage_id):
                memory.owed_ended_at = max(memory.owed_ended_at, obs.time)
            memory.denoising.pop(obs.request_id, None)
            if obs.value > 0:
                memory.step_seconds.add(obs.value)

    def canary_plan(self, now: float) -> CanaryPlan:
        """The canary this server gets when one is due (see `CanaryPlan`).

        Asked by the canary probe when one is due. Where the answer is that the stages'
        beats speak for the server, a canary failure from before lapses: no canary will
        come to clear it, and it is no longer what tells this server's state."""
        # A stage that left its step is no reason to wait: the canary is what proves it.
        step_left = any(self._step_left(ref, memory, now) for ref, memory in self._stages.items())
        if not step_left and any(memory.denoising for memory in self._stages.values()):
            return CanaryPlan.NONE
        types = {stage.stage_id: stage.stage_type for stage in self._topology.stages}
        if not self._diffusion_seen and STAGE_TYPE_DIFFUSION not in types.values():
            return CanaryPlan.TEXT
        if not step_left and all(
            memory.last_heartbeat is not None
            and now - memory.last_heartbeat <= self._heartbeat_timeout(memory)
            for memory in self._stages.values()
        ):
            self._canary_failed_at = self._canary_last_failed = None
            self._canary_detail = ""
            return CanaryPlan.NONE
        entry = [types.get(stage_id, "") for stage_id in self._topology.entry_stages()]
        titles = [p.info.title for m in self._stages.values() for p in m.processes.values()]
        if STAGE_TYPE_LLM in entry or any(LLM_STAGE_TITLE in title for title in titles):
            return CanaryPlan.IMAGE_CHAT
        return CanaryPlan.IMAGE

    def _step_silence(self, ref: StageRef, memory: _StageMemory, now: float) -> float:
        """Seconds a diffusion stage's denoising loop has not shown itself at work on the
        requests it owes: since the latest of a step of one of them told, one of them
        ended, and the oldest of them reaching it (a newer arrival, which anyone with the
        token can make up, shows no work). 0 while it owes none that reached it after the
        latest canary passed (one before that, its span lost, was not in the canary's
        way), and for a stage that does not denoise."""
        if not self._denoises(ref, memory):
            return 0.0
        oldest = self._pending.oldest_since(ref.stage_id, self._canary_passed_at)
        if oldest is None:
            return 0.0
        steps = (
            request.since
            for request in memory.denoising.values()
            if self._pending.waits_at(request.request_id, ref.stage_id)
        )
        return now - max(memory.owed_ended_at, oldest.due_since, *steps)

    def _step_late(
        self, ref: StageRef, memory: _StageMemory, now: float, share: float = 1.0
    ) -> bool:
        """The stage owes requests and has shown no work on them for `share` of its
        allowance. Its beats may still come (a holder of the OTLP token can send them in
        its name); its steps of the requests it owes, which only its denoising loop tells,
        have stopped."""
        return self._step_silence(ref, memory, now) > share * self._heartbeat_timeout(memory)

    def _step_left(self, ref: StageRef, memory: _StageMemory, now: float) -> bool:
        """Its step is late and its process was read not running it: asleep on a lock or a
        queue, stopped, or spinning in one frame. A step that computes or waits on its
        device is work, however late (a 3 s step of a stage that learned 40 ms ones)."""
        cause = memory.cause
        return (
            cause is not None
            and not cause.working
            and cause.cause in _STEP_NOT_RUNNING
            and self._step_late(ref, memory, now)
        )

    def _denoises(self, ref: StageRef, memory: _StageMemory) -> bool:
        """A diffusion stage: the topology says so, or it told denoising steps."""
        if len(memory.step_seconds) or memory.denoising:
            return True
        return any(
            stage.stage_id == ref.stage_id and stage.stage_type == STAGE_TYPE_DIFFUSION
            for stage in self._topology.stages
        )

    def _on_denoise_step(self, obs: Observation) -> None:
        """A diffusion stage started a denoising step: it works, and how fast."""
        memory = self._memory(obs.stage)
        if memory is None:
            return
        memory.progress_moved_at = obs.time
        if obs.value > 0:
            memory.step_seconds.add(obs.value)
        known = memory.denoising.get(obs.request_id)
        if known is not None and known.step > obs.step:
            return  # a late span of an earlier step
        if known is None and len(memory.denoising) >= MAX_DENOISING:
            memory.denoising.pop(next(iter(memory.denoising)))
        memory.denoising[obs.request_id] = DenoisingRequest(
            obs.request_id, obs.step, obs.steps, obs.time
        )

    def _on_stage_span(self, obs: Observation) -> None:
        failed = obs.outcome is SpanOutcome.ERROR
        memory = self._memory(obs.stage)
        if obs.stage is not None:
            if memory is not None and self._pending.waits_at(obs.request_id, obs.stage.stage_id):
                memory.owed_ended_at = max(memory.owed_ended_at, obs.time)
            self._pending.stage_done(obs.request_id, obs.stage.stage_id, obs.time, failed)
        if memory is None:
            return
        memory.denoising.pop(obs.request_id, None)
        if failed:
            memory.last_error = obs.detail
            if not obs.request_id or obs.request_id not in memory.errored:
                # A failed request, not a stopped stage: vLLM-Omni answers it 500 and serves
                # the next (a raise inside one diffusion request, measured).
                memory.request_errors += 1
                memory.errored.append(obs.request_id)
            self._sign(obs.time, f"stage {obs.stage} request failed: {obs.detail}")
        else:
            memory.last_span_ok = obs.time
            memory.durations.add(obs.value)

    def _on_progress(self, obs: Observation) -> None:
        memory = self._memory(obs.stage)
        if memory is None:
            return
        memory.progress_seen_at = obs.time
        memory.counts_steps = obs.detail == STEP_COUNTERS
        if memory.progress_value is None or obs.value != memory.progress_value:
            # The first sample is only a baseline; movement is a change after it.
            if memory.progress_value is not None:
                self._last_progress = obs.time
                memory.progress_moved_at = obs.time
            memory.progress_value = obs.value
            memory.progress_changed_at = obs.time

    def _on_load(self, obs: Observation) -> None:
        memory = self._memory(obs.stage)
        if memory is None:
            return
        if obs.value > 0 and memory.load <= 0:
            memory.load_positive_since = obs.time
        elif obs.value <= 0:
            memory.load_positive_since = None
        memory.load = obs.value
        memory.load_at = obs.time

    def _on_health(self, obs: Observation) -> None:
        if self._blind_during(obs):
            return
        if obs.outcome is HealthOutcome.OK:
            if self._first_healthy is None:
                self._first_healthy = obs.time
            self._health_failures = 0
            self._health_unwell = None
            return
        self._health_failures += 1
        if self._health_failures == 1:
            self._health_failed_since = obs.time
        if self._health_failures == self._config.health_failures:
            self._health_confirmed_at = obs.time
        self._health_detail = f"{_word(obs)} {obs.detail}".strip()
        self._health_answered = obs.outcome is HealthOutcome.UNHEALTHY
        # A refused connection is what any stopping server shows; it says nothing of a crash.
        if obs.outcome is not HealthOutcome.REFUSED:
            self._sign(obs.time, f"/health {self._health_detail}")
            self._health_unwell = (obs.time, self._health_detail)

    def _on_link(self, obs: Observation) -> None:
        if obs.outcome is HealthOutcome.OK:
            # A headless stage has no /health: registered with its master is its "ready".
            if self._first_healthy is None:
                self._first_healthy = obs.time
            self._link_down_since = None
            return
        if self._link_down_since is None:
            self._link_down_since = obs.time
            self._sign(obs.time, f"link to the master down: {obs.detail}")
        self._link_detail = obs.detail

    def _on_canary(self, obs: Observation) -> None:
        if self._blind_during(obs):
            return
        if obs.outcome is HealthOutcome.OK:
            self._canary_passed_at = obs.time
            self._canary_failed_at = None
            self._canary_last_failed = None
            self._canary_detail = ""
            return
        if self._canary_failed_at is None:
            self._canary_failed_at = obs.time
        self._canary_last_failed = obs.time
        self._canary_detail = f"canary {_word(obs)} {obs.detail}".strip()
        self._sign(obs.time, self._canary_detail)

    def _on_process(self, obs: Observation) -> None:
        info = obs.process
        if info is None:
            return
        exited = obs.outcome is ProcessStatus.EXITED
        if DIFFUSION_WORKER_TITLE in info.title:
            self._diffusion_seen = True
        if info.role is ProcessRole.API and not info.orphaned:
            self._root = info
            # An unreaped server is as gone as a reaped one: it holds nothing and serves nothing.
            gone = exited or info.status is ProcessStatus.ZOMBIE
            if gone and self._root_exited_at is None:
                self._root_exited_at = obs.time
        if info.stage is None:
            return
        previous = self._pid_stage.get(info.pid)
        if previous is not None and previous != info.stage and previous in self._stages:
            # Mapped by spawn order first, by title or spans later: the later map wins.
            self._stages[previous].processes.pop(info.pid, None)
        self._pid_stage[info.pid] = info.stage
        memory = self._memory(info.stage)
        if memory is None:
            return
        known = memory.processes.get(info.pid)
        if known is None and len(memory.processes) >= MAX_PROCESSES_PER_STAGE:
            return
        if known is None or not known.info.identity.matches(info.identity):
            known = ProcessMemory(info, obs.time, obs.time, seen_at=obs.time)
            known.wait_at_beat, known.seen_at_beat = info.cpu_wait_seconds, obs.time
            known.cpu_at_beat = info.cpu_seconds
            memory.processes[info.pid] = known
        if exited or info.status is ProcessStatus.ZOMBIE:
            if known.exited_at is None:
                known.exited_at = obs.time
                if info.role in _STAGE_ROLES and self._root_alive():
                    self._stage_exit_seen = True
                    self.stage_exits += 1
                    self._sign(obs.time, f"{info.role.value} pid {info.pid} of stage exited")
            known.info = info
            return
        if info.status is not known.info.status:
            known.status_since = obs.time
        if info.cpu_seconds != known.info.cpu_seconds:
            known.cpu_changed_at = obs.time
        if info.status is ProcessStatus.RUNNING:
            known.runnable_seen_at = obs.time
        known.seen_at = obs.time
        known.waits.append((obs.time, info.cpu_wait_seconds))
        known.info = info

    def _on_activity(self, obs: Observation) -> None:
        memory = self._memory(obs.stage)
        reading = obs.activity
        if memory is None or reading is None:
            return
        known = memory.activity.get(reading.pid)
        if known is None:
            if len(memory.activity) >= MAX_PROCESSES_PER_STAGE:
                return
            known = memory.activity[reading.pid] = _ActivityMemory(reading)
        elif reading.time > known.latest.time:
            known.add(reading)
        if reading.stacks_read:
            known.sampled.append(reading)

    def _on_gpu_process(self, obs: Observation) -> None:
        memory = self._memory(obs.stage)
        if memory is not None and obs.pid is not None:
            memory.gpu_bytes[obs.pid] = obs.value
            memory.gpu_seen_at[obs.pid] = obs.time

    def _on_gpu_device(self, obs: Observation) -> None:
        # A reading lists its devices first, then every pid holding memory on them.
        self._gpu_read_at = obs.time

    _HANDLERS = {
        ObservationKind.HEARTBEAT: _on_heartbeat,
        ObservationKind.REQUEST_ADMITTED: _on_admitted,
        ObservationKind.REQUEST_ABANDONED: _on_request_ended,
        ObservationKind.REQUEST_FINISHED: _on_request_ended,
        ObservationKind.STAGE_SPAN: _on_stage_span,
        ObservationKind.DENOISE_STEP: _on_denoise_step,
        ObservationKind.DENOISE_DONE: _on_denoise_done,
        ObservationKind.PROGRESS: _on_progress,
        ObservationKind.LOAD: _on_load,
        ObservationKind.HEALTH: _on_health,
        ObservationKind.CANARY: _on_canary,
        ObservationKind.PROCESS: _on_process,
        ObservationKind.GPU_PROCESS: _on_gpu_process,
        ObservationKind.GPU_DEVICE: _on_gpu_device,
        ObservationKind.LINK: _on_link,
        ObservationKind.ACTIVITY: _on_activity,
    }

    # ---- queries ------------------------------------------------------------------

    def warmed_up(self, now: float) -> bool:
        """Start-up is over: healthy for `startup_grace`, broken since attach for
        `startup_timeout`, or broken for sure (a recorded stage process exited)."""
        if self._first_healthy is not None:
            return now >= self._first_healthy + self._config.startup_grace
        return self._stage_exit_seen or now >= self._attached + self._config.startup_timeout

    def last_progress(self) -> float | None:
        """When any stage's counters last moved on the server's /metrics, for scheduling
        the canary. Spans do not count: a holder of the OTLP token could send them, and a
        stage's forged successes held every canary back from a deadlocked server."""
        return self._last_progress

    def deadline(self, stage_id: int) -> float:
        """How long a request may stay at a stage before its span is overdue."""
        p99s = [
            quantile
            for ref, memory in self._stages.items()
            if ref.stage_id == stage_id
            and (quantile := memory.durations.quantile(0.99)) is not None
        ]
        learned = self._config.overdue_multiplier * max(p99s) if p99s else 0.0
        return max(self._config.overdue_floor, learned)

    def in_flight(self, stage_id: int) -> int:
        return self._pending.in_flight(stage_id)

    def overdue_count(self, stage_id: int, now: float) -> int:
        return len(self._pending.overdue(stage_id, self.deadline(stage_id), now, self._blind))

    def last_heartbeat(self, ref: StageRef) -> float | None:
        memory = self._stages.get(ref)
        return memory.last_heartbeat if memory else None

    def last_progress_of(self, ref: StageRef) -> float | None:
        memory = self._stages.get(ref)
        return memory.progress_changed_at if memory else None

    def activity_readings(self, ref: StageRef) -> tuple[ProcessReadings, ...]:
        """The readings of each of the stage's processes that its cause was last found
        from, by pid; none once it is no longer silent. For the bundle of a verdict."""
        memory = self._stages.get(ref)
        if memory is None:
            return ()
        return tuple(
            ProcessReadings(
                known.latest,
                tuple(known.sampled),
                None if known.finding is None else known.finding.cause,
                known.finding is not None and known.finding.working,
                "" if known.finding is None else known.finding.detail,
            )
            for _, known in sorted(memory.activity.items())
        )

    def silent_stages(self, now: float) -> tuple[StageRef, ...]:
        """The local stage replicas whose processes are worth reading for a cause now: their
        loop has stopped beating, or their counters stay flat under load (see
        `SILENT_SHARE`), or they are judged stalled. A slow stage that beats and moves is
        not read: the watchdog's cost grows only with silence."""
        return tuple(
            ref
            for ref, memory in self._stages.items()
            if ref.stage_id not in self._remote and self._silent(ref, memory, now)
        )

    def next_due(self, now: float) -> float | None:
        """The first moment after `now` at which a timeout runs out for what is known now:
        a stage's heartbeat silence, its counters flat under load, a stopped or D-state
        process. Judging then, rather than at the next tick, gives the verdict as soon as
        the rules allow."""
        config = self._config
        due: list[float] = []
        for ref, memory in self._stages.items():
            if memory.last_heartbeat is not None:
                due.append(memory.last_heartbeat + self._heartbeat_timeout(memory))
            if memory.load > 0 and memory.load_positive_since is not None:
                flat_from = max(memory.progress_changed_at or 0.0, memory.load_positive_since)
                due.append(flat_from + config.progress_timeout)
            if (waiting := self._waiting_unworked(ref, memory, now)) is not None:
                due.append(waiting[1] + config.progress_timeout)
            due.extend(
                process.status_since + config.stuck_timeout
                for process in memory.processes.values()
                if process.exited_at is None
                and process.info.status in (ProcessStatus.STOPPED, ProcessStatus.DISK_SLEEP)
            )
            due.extend(since for since, _ in self._released_after_exit(memory))
            if memory.cause is not None and memory.working_since is not None:
                due.append(memory.working_since + self._config.work_budget(memory.cause.cause))
        if self._link_down_since is not None:
            due.append(self._link_down_since + config.link_grace)
        return min((moment for moment in due if moment > now), default=None)

    # ---- evaluation ---------------------------------------------------------------

    def evaluate(self, now: float) -> DetectorReport:
        warm = self.warmed_up(now)
        target_exit = self._exit(now)
        own = {ref: self._own_evidence(ref, memory, now) for ref, memory in self._stages.items()}
        shared = self._target_evidence(now)
        judged: dict[StageRef, tuple[StageState, list[Evidence], StageCause | None]] = {}
        # Local stages that neither answer for the target's evidence nor show liveness.
        unproved: list[StageRef] = []
        charged_any = False
        for ref, memory in self._stages.items():
            remote = ref.stage_id in self._remote
            cause = self._update_cause(ref, memory, now)
            excused = self._excused(memory, now)
            evidence = [e for e in own[ref] if e.kind not in excused]
            set_aside = len(evidence) < len(own[ref])
            held_up = self._held_up(ref, memory, evidence, now)
            if shared and self._answers_for_target(ref, memory, evidence, held_up, now):
                charged = [
                    Evidence(kind, ref, since, detail)
                    for kind, since, detail in shared
                    if kind not in excused
                ]
                charged_any = True
                set_aside = set_aside or len(charged) < len(shared)
                evidence.extend(charged)
            elif shared and not remote and not self._shows_own_liveness(memory, now):
                unproved.append(ref)
            evidence.extend(self._after_exit(ref, memory, evidence, now))
            if not self._root_alive():
                state = StageState.DEAD
                evidence = [self._server_gone(ref)]
            elif not warm:
                state = StageState.STARTING
            elif remote:
                state = self._decide_remote(memory, evidence, now)
            else:
                state = self._decide(memory, evidence, now, held_up, set_aside)
            if state in (StageState.STALLED, StageState.DEAD):
                evidence.extend(self._gpu_held(ref, memory, now))
            judged[ref] = (state, evidence, cause)
        pipeline = None
        if shared and not charged_any and unproved and warm and self._root_alive():
            pipeline = self._pipeline_status(shared, unproved, now)
        verdicts: list[Verdict] = []
        if pipeline is None:
            self._pipeline_state = StageState.HEALTHY
        else:
            if pipeline.state is not self._pipeline_state:
                self._pipeline_state, self._pipeline_since = pipeline.state, now
                if pipeline.state in (StageState.STALLED, StageState.DEAD):
                    verdicts.append(Verdict(PIPELINE, pipeline.state, now, pipeline.evidence))
            pipeline = replace(pipeline, since=self._pipeline_since)
            if pipeline.state in (StageState.STALLED, StageState.DEAD):
                # Neither cleared nor blamed: the hang is among them, which one is unknown.
                for ref in unproved:
                    _, evidence, cause = judged[ref]
                    judged[ref] = (StageState.UNKNOWN, evidence, cause)
        statuses: list[StageStatus] = []
        for ref, memory in self._stages.items():
            state, evidence, cause = judged[ref]
            remote = ref.stage_id in self._remote
            if state is not memory.state:
                memory.state, memory.since = state, now
                if state in (StageState.STALLED, StageState.DEAD) and self._root_alive():
                    verdicts.append(
                        Verdict(
                            ref,
                            state,
                            now,
                            tuple(evidence),
                            remote=remote,
                            cause=cause if state is StageState.STALLED else None,
                        )
                    )
            statuses.append(
                StageStatus(
                    ref,
                    self._names.get(ref, ""),
                    state,
                    memory.since,
                    tuple(evidence),
                    memory.last_heartbeat,
                    memory.progress_changed_at,
                    remote=remote,
                    cause=cause,
                    denoising=tuple(memory.denoising.values()),
                    seconds_per_step=memory.step_seconds.quantile(0.5),
                    request_errors=memory.request_errors,
                )
            )
        verdicts.extend(self._head_verdict(statuses, now))
        requests = {
            stage_id: StageRequests(self.in_flight(stage_id), self.overdue_count(stage_id, now))
            for stage_id in sorted({ref.stage_id for ref in self._stages})
        }
        return DetectorReport(
            now, warm, tuple(statuses), tuple(verdicts), target_exit, requests, pipeline
        )

    def _answers_for_target(
        self,
        ref: StageRef,
        memory: _StageMemory,
        evidence: list[Evidence],
        held_up: bool,
        now: float,
    ) -> bool:
        """The target's failing /health or canary is charged to this stage.

        A stage that beats (the plugin's heartbeats), and a remote one, which is seen
        through its spans only, answer for it unless they show liveness of their own. A
        local stage that never beat has nothing to show either way: blamed for lack of
        liveness, every stage of a pipeline without the plugin was judged stalled for one
        stall. So it answers only where its own readings prove it is the one: held up, its
        own evidence (a process stopped, in D, exited; counters flat under load), or a
        cause that is no work and that an idle stage never shows."""
        if memory.last_heartbeat is not None or ref.stage_id in self._remote or self._beats_seen():
            return held_up or not self._shows_own_liveness(memory, now)
        if held_up or any(e.kind not in _CONSEQUENCES for e in evidence):
            return True
        cause = memory.cause
        return cause is not None and not cause.working and cause.cause in _BLOCKED_CAUSES

    def _beats_seen(self) -> bool:
        """Some stage of the target beats: the plugin is there, and a stage that never beat
        beside it is silent by its own doing (its only replica died before the watchdog
        came), as plain as a stage that stopped beating."""
        return any(memory.last_heartbeat is not None for memory in self._stages.values())

    def _pipeline_status(
        self, shared: list[tuple[EvidenceKind, float, str]], unproved: list[StageRef], now: float
    ) -> StageStatus:
        """The target as a whole, while its /health or canary fails and no stage answers
        for it (`unproved`: the local stages that neither answer nor show liveness). Judged
        by the rules of a stage: its lateness excused while one of them works visibly
        (a compile may hold the canary up), confirmed by two kinds or one that stood, and
        on a host that starves them only once one stood for the time they could run. A
        confirmed /health 503 makes it dead (an engine is dead, which one is unknown).
        The ladder ends the whole server whatever stage a verdict names, so a real hang
        is acted on as fast as a stage's."""
        memories = [self._stages[ref] for ref in unproved]
        excused: frozenset[EvidenceKind] = frozenset().union(
            *(self._excused(memory, now) for memory in memories)
        )
        evidence = [
            Evidence(kind, PIPELINE, since, detail)
            for kind, since, detail in shared
            if kind not in excused
        ]
        kinds = {e.kind for e in evidence}
        if not self._confirmed(evidence, now):
            state = StageState.DEGRADED
        elif EvidenceKind.HEALTH_FAILED in kinds and self._health_answered:
            state = StageState.DEAD
        elif (
            self._pipeline_state is not StageState.STALLED
            and any(
                self._contended(memory, now) and self._starved(memory) is not None
                for memory in memories
            )
            and not self._stood(
                evidence, now, max(longest_wait(m.processes.values()) for m in memories)
            )
        ):
            state = StageState.DEGRADED
        else:
            state = StageState.STALLED
        return StageStatus(PIPELINE, "pipeline", state, now, tuple(evidence))

    def _decide(
        self,
        memory: _StageMemory,
        evidence: list[Evidence],
        now: float,
        held_up: bool,
        set_aside: bool = False,
    ) -> StageState:
        """`set_aside`: evidence was excused by work that advances (`_excused`); the stage
        is then degraded at best, late but not stalled."""
        kinds = {e.kind for e in evidence if e.kind not in _CONSEQUENCES}
        if not kinds and set_aside:
            return StageState.DEGRADED
        if not kinds:
            has_signal = (
                memory.last_heartbeat is not None
                or memory.progress_value is not None
                or bool(memory.processes)
            )
            return StageState.HEALTHY if has_signal else StageState.UNKNOWN
        if EvidenceKind.LINK_LOST in kinds:
            # Past its own grace already: an orphan is not waited on twice.
            return StageState.DEAD
        # Judged stalled, a stage stays so while its evidence stands: a wait for a CPU seen
        # since takes nothing back. Else a stage silent on a loaded host flaps, and each
        # return to stalled is a new verdict, a new plan, an alert's `for:` started again.
        judged = memory.state is StageState.STALLED
        waited = longest_wait(memory.processes.values())
        contended = self._contended(memory, now)
        busy = contended and (
            waited >= WAIT_WORTH_SAYING or busiest_runner(memory.processes.values()) is not None
        )
        confirmed = self._confirmed(evidence, now, busy=not judged and busy)
        if confirmed and EvidenceKind.PROCESS_EXIT in kinds:
            return StageState.DEAD
        if confirmed and EvidenceKind.HEALTH_FAILED in kinds and self._health_answered:
            # The server's own word: vLLM and vLLM-Omni answer /health 503 only once an
            # engine is dead (0.30: a stage has no live replica), and this stage is the
            # one without liveness. Its processes may take seconds more to exit; the
            # verdict does not turn on whether the exit was seen first.
            return StageState.DEAD
        if confirmed and (held_up or not self._progressing(memory, now)):
            if (
                not judged
                and contended
                and self._starved(memory) is not None
                and not self._stood(evidence, now, waited)
            ):
                return StageState.DEGRADED
            return StageState.STALLED
        return StageState.DEGRADED

    def _decide_remote(
        self, memory: _StageMemory, evidence: list[Evidence], now: float
    ) -> StageState:
        """A stage on another host, seen only through its spans and the server's word.

        Spans that stop arriving may be the network between the hosts, not the stage:
        silence alone leaves it `unknown`. The server's failing /health, charged to it
        because it shows no liveness while every local stage does, says it has no live
        replica: `dead` once confirmed. Its own watchdog acts on it; this one never does.
        """
        kinds = {e.kind for e in evidence if e.kind not in _CONSEQUENCES}
        beating = (
            memory.last_heartbeat is not None
            and now - memory.last_heartbeat <= self._heartbeat_timeout(memory)
        )
        if EvidenceKind.HEALTH_FAILED in kinds and self._confirmed(evidence, now):
            return StageState.DEAD
        if not beating:
            return StageState.UNKNOWN
        if not kinds:
            return StageState.HEALTHY
        if self._confirmed(evidence, now) and not self._progressing(memory, now):
            return StageState.STALLED
        return StageState.DEGRADED

    def _confirmed(self, evidence: list[Evidence], now: float, busy: bool = False) -> bool:
        """Two independent kinds of evidence, or one that stood `confirm_timeout`. For a
        stage `busy` (seen running or waiting for a CPU since its loop last beat), its
        lateness is one kind however many say it."""
        kinds = {e.kind for e in evidence if e.kind not in _CONSEQUENCES}
        independent = len(kinds - _LATENESS) + bool(kinds & _LATENESS) if busy else len(kinds)
        return independent >= 2 or self._stood(evidence, now)

    def _stood(self, evidence: list[Evidence], now: float, waited: float = 0.0) -> bool:
        """One kind of evidence that may stand alone has held for `confirm_timeout`, not
        counting `waited`, time the stage spent waiting for a CPU: it is enough on its own."""
        return any(
            now - e.since - waited >= self._config.confirm_timeout
            for e in evidence
            if e.kind not in _CONSEQUENCES and e.kind not in _NEVER_ALONE
        )

    def _contended(self, memory: _StageMemory, now: float) -> bool:
        """The CPU-contention rules may speak for the stage: no closer look has explained
        its silence, or one of its processes waited for a CPU through most of it.

        A stage whose processes were read asleep on a lock, stopped, spinning or waiting
        on the device is silent on its own, whatever its side threads waited for a CPU
        meanwhile: in a benchmark on two cores, a blocked forward's threads waited 0.7 s
        for one through 13 s (beside the watchdog's own stack samples), and the contention
        rules held its verdict back by 9 s. But an engine asleep on its worker's answer
        while that worker waits for a CPU is the host's doing: in a soak of two pipelines
        on two cores, a text stage's worker waited 6.3 s of its 9 s silence, its engine was
        read asleep in poll, and a healthy server was shut down."""
        cause = memory.cause
        if cause is None or cause.cause in (SilenceCause.STARVED, SilenceCause.UNKNOWN):
            return True
        beat = memory.last_heartbeat
        if beat is None or now <= beat:
            return False
        return longest_wait(memory.processes.values()) >= STARVED_SILENCE_SHARE * (now - beat)

    def _starved(self, memory: _StageMemory) -> CauseFinding | None:
        """The `starved` cause of a stage whose live process waited for a CPU in its latest
        readings since its loop last beat (see `starved.starved_finding`)."""
        window = STARVED_WINDOW_SHARE * self._heartbeat_timeout(memory)
        return starved_finding(memory.processes.values(), window)

    def _heartbeat_timeout(self, memory: _StageMemory) -> float:
        """`heartbeat_timeout`, stretched by the stage's own rhythm: a loop that its steps
        block for seconds at a time, healthy, is not silent before `rhythm_multiplier` of its
        longest healthy gaps (their p99), at most `heartbeat_timeout_max`. A loop that beats
        every second keeps the configured timeout, and its hangs are judged as fast."""
        config = self._config
        timeout = config.heartbeat_timeout
        p99 = memory.beat_gaps.quantile(0.99)
        if p99 is not None and len(memory.beat_gaps) >= BEAT_GAPS_TRUSTED:
            stretched = min(config.rhythm_multiplier * p99, config.heartbeat_timeout_max)
            timeout = max(timeout, stretched)
        return max(timeout, self._step_allowance(memory) or 0.0)

    def _step_allowance(self, memory: _StageMemory) -> float | None:
        """A diffusion stage beats once a denoising step while it works: while a request is
        in its steps, its silence is measured against the steps it learned to take."""
        step = memory.step_seconds.quantile(0.99) if memory.denoising else None
        if step is None:
            return None
        return min(self._config.rhythm_multiplier * step, step + STEP_SLACK)

    def _rhythm_note(self, memory: _StageMemory) -> str:
        timeout = self._heartbeat_timeout(memory)
        if timeout <= self._config.heartbeat_timeout:
            return ""
        if timeout == self._step_allowance(memory):
            step = memory.step_seconds.quantile(0.99) or 0.0
            return f" (its denoising steps take up to {step:.1f}s, so {timeout:.1f}s allowed)"
        return (
            f" (its rhythm: healthy gaps up to {memory.beat_gaps.quantile(0.99) or 0.0:.1f}s,"
            f" so {timeout:.1f}s allowed)"
        )

    def _silent(self, ref: StageRef, memory: _StageMemory, now: float) -> bool:
        config = self._config
        beat = memory.last_heartbeat
        if beat is not None and now - beat > SILENT_SHARE * self._heartbeat_timeout(memory):
            return True
        if beat is None and self._target_unwell() and not self._progressing(memory, now):
            # Without heartbeats a failing canary or /health is the only sign of a silence:
            # what each stage is doing is what may prove which one fails it.
            return True
        if self._unworked_for(ref, memory, now) > SILENT_SHARE * config.progress_timeout:
            # Its beats may be forged, its counters are not: what it does names the cause.
            return True
        if self._step_late(ref, memory, now, SILENT_SHARE):
            return True
        # A stage that beats has the requests on it told by its spans: vLLM-Omni 0.30
        # leaves its load gauges at the last batch's counts, and every stage of an idle
        # server, its gauge at 1 and its counters flat between two canaries, was read.
        oldest = self._pending.oldest(ref.stage_id)
        working = beat is None or oldest is not None
        if working and self._load(memory, now) > 0 and memory.load_positive_since is not None:
            flat_from = max(memory.progress_changed_at or 0.0, memory.load_positive_since)
            if beat is not None and oldest is not None:
                flat_from = max(flat_from, oldest.due_since)
            if now - flat_from > SILENT_SHARE * config.progress_timeout:
                return True
        return memory.state is StageState.STALLED

    def _update_cause(self, ref: StageRef, memory: _StageMemory, now: float) -> StageCause | None:
        """The stage's cause from the latest fresh findings of its live processes, kept with
        the moment it first held; None once the stage is no longer silent. A live stage
        process without a fresh finding counts as unknown: what its siblings do (an engine
        core asleep on its queue) says nothing of it (its worker may be compiling)."""
        fresh = {
            pid: known.finding
            for pid, known in memory.activity.items()
            if known.finding is not None
            and now - known.latest.time <= self._config.stale_after
            and (pid not in memory.processes or memory.processes[pid].exited_at is None)
        }
        unread = [
            pid
            for pid, process in memory.processes.items()
            if pid not in fresh and process.exited_at is None and process.info.runs_stage_work
        ]
        findings = list(fresh.values())
        if findings and unread:
            findings.append(
                CauseFinding(SilenceCause.UNKNOWN, False, f"pid {unread[0]} not read lately")
            )
        silent = self._silent(ref, memory, now)
        if not silent:
            # Readings from before it beat again say nothing of its next silence.
            memory.activity.clear()
        elif not fresh and (starved := self._starved(memory)) is not None:
            # Nothing read closer (no activity probe, or not yet): the process probe's
            # CPU figures name the cause.
            findings.append(starved)
        was_excused = bool(self._excused_by_work(memory, now))
        found = stage_cause(findings) if findings and silent else None
        ended = found is None or (not found.working and found.cause not in _WORK_STOPPED)
        if was_excused and ended:
            # The work ended (its child exited, its step returned): what piled up while
            # it was excused is the work's, for as long as the loop needs to beat again.
            memory.work_ended_at = now
        if found is None:
            memory.cause, memory.working_since = None, None
            return None
        previous = memory.cause
        same = previous is not None and (previous.cause, previous.working) == (
            found.cause,
            found.working,
        )
        since = previous.since if previous is not None and same else now
        detail = found.detail
        if not found.working:
            memory.working_since = None
        else:
            if memory.working_since is None:
                memory.working_since = now
            budget = self._config.work_budget(found.cause)
            worked = now - memory.working_since
            if worked >= budget:
                detail += f"; working for {worked:.0f}s, past its {budget:g}s budget"
        memory.cause = StageCause(found.cause, since, found.working, detail, memory.working_since)
        return memory.cause

    def _excused(self, memory: _StageMemory, now: float) -> frozenset[EvidenceKind]:
        """The evidence its advancing work excuses, until that work's budget runs out, and
        for one heartbeat timeout after the work ended by itself."""
        if self._excused_by_work(memory, now):
            return _EXCUSED_BY_WORK
        ended = memory.work_ended_at
        if ended is not None and now - ended < self._heartbeat_timeout(memory):
            return _EXCUSED_BY_WORK
        return frozenset()

    def _excused_by_work(self, memory: _StageMemory, now: float) -> bool:
        cause = memory.cause
        if cause is None or not cause.working or memory.working_since is None:
            return False
        return now - memory.working_since < self._config.work_budget(cause.cause)

    def _head_verdict(self, statuses: list[StageStatus], now: float) -> list[Verdict]:
        """The head's own verdict when its server has stayed unhealthy for `remote_grace`
        only because a remote stage has no live replica: its ladder restarts the head, as
        for any dead stage. Once per spell; a local stage unwell is judged on its own."""
        failing = self._health_failures >= self._config.health_failures
        if not failing or now - self._health_failed_since < self._config.remote_grace:
            self._head_judged_for = None
            return []
        unwell = (StageState.STALLED, StageState.DEAD, StageState.UNKNOWN)
        if any(s.state in unwell and not s.remote for s in statuses):
            return []
        missing = [s for s in statuses if s.remote and s.state in unwell]
        if not missing or self._head_judged_for is not None:
            return []
        culprit = missing[0]
        self._head_judged_for = culprit.stage
        failed_for = now - self._health_failed_since
        evidence = (
            Evidence(
                EvidenceKind.HEALTH_FAILED,
                culprit.stage,
                self._health_failed_since + self._config.remote_grace,
                f"/health {self._health_detail} for {failed_for:.1f}s while remote stage"
                f" {culprit.stage} is {culprit.state.value} and every local stage is well:"
                " the head is restarted",
            ),
        )
        return [Verdict(culprit.stage, StageState.DEAD, now, evidence)]

    def _held_up(
        self, ref: StageRef, memory: _StageMemory, evidence: list[Evidence], now: float
    ) -> bool:
        """The world says the stage cannot be working: one of its processes is stopped; its
        counters are flat with work queued (its load gauges say so, or a request waits at
        it and its step counters have not moved since); or it left a denoising step
        (`_step_left`). Heartbeats and spans, which a holder of the OTLP token could send
        in its name, never outweigh that: with beats and successful stage spans forged
        every 0.2 s, a deadlocked stage stayed degraded and no incident came in 60 s."""
        kinds = {e.kind for e in evidence}
        if EvidenceKind.PROGRESS_FLAT in kinds:
            return True
        if EvidenceKind.SPAN_OVERDUE in kinds and self._unworked_for(ref, memory, now) > (
            self._config.progress_timeout
        ):
            return True
        if self._step_left(ref, memory, now):
            # A diffusion stage's counters move once an image: what its process does
            # while its step is late is what the watchdog sees for itself.
            return True
        return any(
            p.exited_at is None
            and p.info.status is ProcessStatus.STOPPED
            and now - p.status_since > self._config.stuck_timeout
            for p in memory.processes.values()
        )

    def _waiting_unworked(
        self, ref: StageRef, memory: _StageMemory, now: float
    ) -> tuple[PendingRequest, float] | None:
        """The oldest request waiting at a stage whose step counters have not moved since
        it got there, and the moment they were last seen to move (or it got there).

        A stage that is working on a request moves its token or iteration counters at
        every engine step, whatever its load gauges say; vLLM-Omni 0.30 leaves those at
        the counts of the last batch, so they cannot tell a stalled stage from an idle one,
        but a request still owed the stage's span can. Only a stage of one replica: the
        span does not say which replica a waiting request is on. Only counters that move
        per step, and only fresh ones: a counter that moves when a request completes
        stays flat through a long one, and an old scrape says nothing. A stage process
        seen runnable is working or waiting for a CPU: a stage starved by its neighbours
        is not a stuck one (its heartbeats stop too), so the flat time counts from then.
        Only a request that reached it after the latest canary passed: one from before,
        its span lost, was not in the canary's way, and an idle stage is not read for it
        for good."""
        if not memory.counts_steps or memory.progress_seen_at is None:
            return None
        if self._denoises(ref, memory):
            # Its counters move once an image (one engine step holds the whole denoising
            # loop): its denoising steps and beats tell its work, not they.
            return None
        if now - memory.progress_seen_at > self._config.stale_after:
            return None
        if sum(1 for other in self._stages if other.stage_id == ref.stage_id) != 1:
            return None
        oldest = self._pending.oldest_since(ref.stage_id, self._canary_passed_at)
        if oldest is None:
            return None
        runnable = max(
            (
                p.runnable_seen_at
                for p in memory.processes.values()
                if p.exited_at is None and p.runnable_seen_at is not None
            ),
            default=0.0,
        )
        return oldest, max(oldest.due_since, memory.progress_changed_at or 0.0, runnable)

    def _unworked_for(self, ref: StageRef, memory: _StageMemory, now: float) -> float:
        """The seen seconds a request has waited at the stage with its step counters flat
        (`_waiting_unworked`); 0 while none does."""
        unworked = self._waiting_unworked(ref, memory, now)
        return 0.0 if unworked is None else self._blind.seen(unworked[1], now)

    def _load(self, memory: _StageMemory, now: float) -> float:
        """Requests on the stage, or 0 when the last scrape is too old to say."""
        if memory.load_at is None or now - memory.load_at > self._config.stale_after:
            return 0.0
        return memory.load

    def _progressing(self, memory: _StageMemory, now: float) -> bool:
        window = self._config.progress_timeout
        moved = memory.progress_moved_at is not None and now - memory.progress_moved_at <= window
        spans = memory.last_span_ok is not None and now - memory.last_span_ok <= window
        return moved or spans

    def _shows_own_liveness(self, memory: _StageMemory, now: float) -> bool:
        """Fresh heartbeats and either no work or moving counters: this stage is fine. One
        that never beat (no plugin) shows it by its counters moving."""
        if memory.last_heartbeat is None:
            return self._progressing(memory, now)
        beating = (
            memory.last_heartbeat is not None
            and now - memory.last_heartbeat <= self._heartbeat_timeout(memory)
        )
        return beating and (self._load(memory, now) <= 0 or self._progressing(memory, now))

    def _own_evidence(self, ref: StageRef, memory: _StageMemory, now: float) -> list[Evidence]:
        config = self._config
        found: list[Evidence] = []
        if memory.last_heartbeat is not None:
            found += self._silence(
                EvidenceKind.HEARTBEAT_LOST,
                ref,
                memory.last_heartbeat,
                self._heartbeat_timeout(memory),
                now,
                lambda silent: (
                    f"no loop heartbeat for {silent:.1f}s{self._rhythm_note(memory)}"
                    f"{cpu_note(memory.processes.values())}"
                ),
            )
        deadline = self.deadline(ref.stage_id)
        late = self._pending.overdue(ref.stage_id, deadline, now, self._blind)
        unworked = self._waiting_unworked(ref, memory, now)
        if late:
            found += self._silence(
                EvidenceKind.SPAN_OVERDUE,
                ref,
                late[0].due_since,
                deadline,
                now,
                lambda _: (
                    f"{len(late)} request(s) past the {deadline:.1f}s deadline,"
                    f" oldest {late[0].request_id}"
                ),
            )
        elif unworked is not None:
            oldest, flat_from = unworked
            found += self._silence(
                EvidenceKind.SPAN_OVERDUE,
                ref,
                flat_from,
                config.progress_timeout,
                now,
                lambda flat: (
                    f"{self.in_flight(ref.stage_id)} request(s) waiting at the stage,"
                    f" oldest {oldest.request_id}, and its step counters flat for {flat:.1f}s"
                ),
            )
        load = self._load(memory, now)
        if load > 0 and memory.load_positive_since is not None:
            flat_from = max(memory.progress_changed_at or 0.0, memory.load_positive_since)
            if now - flat_from > config.progress_timeout:
                found.append(
                    Evidence(
                        EvidenceKind.PROGRESS_FLAT,
                        ref,
                        flat_from + config.progress_timeout,
                        f"{load:g} request(s) on the stage, counters flat for"
                        f" {now - flat_from:.1f}s",
                    )
                )
        found.extend(self._process_evidence(ref, memory, now))
        link_down = self._link_down_since
        if link_down is not None and now - link_down > config.link_grace:
            found.append(
                Evidence(
                    EvidenceKind.LINK_LOST,
                    ref,
                    link_down + config.link_grace,
                    f"{self._link_detail} for {now - link_down:.1f}s: the stage is orphaned",
                )
            )
        return found

    def _silence(
        self,
        kind: EvidenceKind,
        ref: StageRef,
        since: float,
        timeout: float,
        now: float,
        describe: Callable[[float], str],
    ) -> list[Evidence]:
        """Evidence of `kind` once more than `timeout` of seen time has passed since
        `since`, held from the moment it ran out; `describe` words the seen seconds."""
        seen = self._blind.seen(since, now)
        if seen <= timeout:
            return []
        return [
            Evidence(
                kind, ref, now - (seen - timeout), describe(seen) + _unseen(now - since - seen)
            )
        ]

    def _process_evidence(self, ref: StageRef, memory: _StageMemory, now: float) -> list[Evidence]:
        config = self._config
        found: list[Evidence] = []
        exits = [
            p
            for p in memory.processes.values()
            if p.exited_at is not None and p.info.role in _STAGE_ROLES
        ]
        if exits and self._root_alive():
            first = min(exits, key=lambda p: p.exited_at or 0.0)
            how = "became a zombie" if first.info.status is ProcessStatus.ZOMBIE else "exited"
            found.append(
                Evidence(
                    EvidenceKind.PROCESS_EXIT,
                    ref,
                    first.exited_at or now,
                    f"{first.info.role.value} pid {first.info.pid} ({first.info.title}) {how}",
                )
            )
        live = [p for p in memory.processes.values() if p.exited_at is None]
        for process in live:
            if process.info.status in (ProcessStatus.STOPPED, ProcessStatus.DISK_SLEEP):
                held = now - process.status_since
                if held > config.stuck_timeout:
                    found.append(
                        Evidence(
                            EvidenceKind.PROCESS_STUCK,
                            ref,
                            process.status_since + config.stuck_timeout,
                            f"pid {process.info.pid} ({process.info.title})"
                            f" {process.info.status.value} for {held:.1f}s",
                        )
                    )
                    return found
        silent_since = memory.last_heartbeat
        if (
            live
            and memory.load_at is None
            and silent_since is not None
            and now - silent_since > self._heartbeat_timeout(memory)
        ):
            # Without load gauges (a headless stage serves no /metrics) a loop that stopped
            # beating is working only if its processes use a CPU or wait for one; a stage
            # starved of CPU shows runnable, and one in a long step burns CPU.
            quiet_from = max(
                silent_since,
                max(p.cpu_changed_at for p in live),
                max((p.runnable_seen_at or 0.0) for p in live),
            )
            if now - quiet_from > config.stuck_timeout:
                found.append(
                    Evidence(
                        EvidenceKind.PROCESS_STUCK,
                        ref,
                        quiet_from + config.stuck_timeout,
                        f"no heartbeat and no CPU progress in any stage process for"
                        f" {now - quiet_from:.1f}s",
                    )
                )
                return found
        if live and self._load(memory, now) > 0 and memory.load_positive_since is not None:
            # Quiet CPUs alone are normal for a stage waiting on its device or its queue;
            # together with counters that do not move either, nothing is running.
            busy_from = max(
                max(p.cpu_changed_at for p in live),
                memory.load_positive_since,
                memory.progress_changed_at or 0.0,
            )
            if now - busy_from > config.stuck_timeout:
                found.append(
                    Evidence(
                        EvidenceKind.PROCESS_STUCK,
                        ref,
                        busy_from + config.stuck_timeout,
                        f"no CPU progress in any stage process for {now - busy_from:.1f}s"
                        " with work queued",
                    )
                )
        return found

    def _target_unwell(self) -> bool:
        """The canary fails, or /health has failed `health_failures` times in a row."""
        failing = self._health_failures >= self._config.health_failures
        return failing or self._canary_failed_at is not None

    def _target_evidence(self, now: float) -> list[tuple[EvidenceKind, float, str]]:
        shared: list[tuple[EvidenceKind, float, str]] = []
        if self._health_failures >= self._config.health_failures:
            shared.append(
                (
                    EvidenceKind.HEALTH_FAILED,
                    self._health_confirmed_at,
                    f"/health {self._health_detail}, {self._health_failures} times in a row"
                    f" over {now - self._health_failed_since:.1f}s",
                )
            )
        if self._canary_failed_at is not None:
            shared.append((EvidenceKind.CANARY_FAILED, self._canary_failed_at, self._canary_detail))
        return shared

    def _after_exit(
        self, ref: StageRef, memory: _StageMemory, evidence: list[Evidence], now: float
    ) -> list[Evidence]:
        """What the server and the GPU said after one of the stage's processes exited: one
        failed /health or canary then confirms the death without waiting for N in a row. A
        refused /health is what a server that stops on purpose shows first, so it never
        counts. The driver letting go of the memory an exited stage process held confirms
        it too, from the device's side: a replica whose siblings still serve leaves
        /health at 200."""
        exit_at = min(
            (e.since for e in evidence if e.kind is EvidenceKind.PROCESS_EXIT), default=None
        )
        if exit_at is None:
            return []
        kinds = {e.kind for e in evidence}
        found: list[Evidence] = [
            Evidence(
                EvidenceKind.GPU_RELEASED,
                ref,
                since,
                f"the GPU no longer holds the {memory.gpu_bytes[pid] / 2**20:.0f} MiB"
                f" that exited pid {pid} held",
            )
            for since, pid in self._released_after_exit(memory)[:1]
            if since <= now
        ]
        unwell = self._health_unwell
        if EvidenceKind.HEALTH_FAILED not in kinds and unwell is not None and unwell[0] >= exit_at:
            found.append(
                Evidence(
                    EvidenceKind.HEALTH_FAILED,
                    ref,
                    unwell[0],
                    f"/health {unwell[1]} after the exit",
                )
            )
        canary = self._canary_last_failed
        if EvidenceKind.CANARY_FAILED not in kinds and canary is not None and canary >= exit_at:
            found.append(
                Evidence(
                    EvidenceKind.CANARY_FAILED,
                    ref,
                    canary,
                    f"{self._canary_detail} after the exit",
                )
            )
        return found

    def _released_after_exit(self, memory: _StageMemory) -> list[tuple[float, int]]:
        """(from when it counts, pid) of each exited stage process that held GPU memory and
        that a reading taken after its exit no longer lists, earliest first. A clean stop
        takes the engine down a moment before the server, so it counts only once the
        server has outlived the exit by `_EXIT_SETTLE`."""
        read_at = self._gpu_read_at
        if read_at is None or not self._root_alive():
            return []
        found = []
        for pid, process in memory.processes.items():
            exited_at = process.exited_at
            if (
                exited_at is not None
                and process.info.role in _STAGE_ROLES
                and memory.gpu_bytes.get(pid, 0.0) > 0
                and memory.gpu_seen_at.get(pid, read_at) < read_at
                and read_at >= exited_at
            ):
                found.append((max(read_at, exited_at + _EXIT_SETTLE), pid))
        return sorted(found)

    def _gpu_held(self, ref: StageRef, memory: _StageMemory, now: float) -> list[Evidence]:
        live_pids = {pid for pid, p in memory.processes.items() if p.exited_at is None}
        held = sum(b for pid, b in memory.gpu_bytes.items() if pid in live_pids or not live_pids)
        if held <= 0:
            return []
        return [
            Evidence(
                EvidenceKind.GPU_HELD,
                ref,
                now,
                f"{held / 2**20:.0f} MiB of GPU memory held by the stage's processes",
            )
        ]

    # ---- the target ---------------------------------------------------------------

    def _server_gone(self, ref: StageRef) -> Evidence:
        root = f"pid {self._root.pid}" if self._root else "the server"
        return Evidence(
            EvidenceKind.PROCESS_EXIT, ref, self._root_exited_at or 0.0, f"{root} exited"
        )

    def _root_alive(self) -> bool:
        return self._root_exited_at is None

    def _sign(self, time: float, text: str) -> None:
        self._unhealthy_signs.append((time, text))
        horizon = time - self._config.crash_window
        while self._unhealthy_signs and self._unhealthy_signs[0][0] < horizon:
            self._unhealthy_signs.pop(0)

    def _exit(self, now: float) -> TargetExit | None:
        if self._root_exited_at is None or self._exit_reported:
            return None
        self._exit_reported = True
        horizon = self._root_exited_at - self._config.crash_window
        settled = self._root_exited_at - _EXIT_SETTLE
        reasons = tuple(text for time, text in self._unhealthy_signs if horizon <= time <= settled)
        bad_states = [
            f"stage {ref} was {memory.state.value}"
            for ref, memory in self._stages.items()
            if memory.state in (StageState.DEGRADED, StageState.STALLED, StageState.DEAD)
        ]
        reasons = tuple(bad_states) + reasons
        root = self._root.identity if self._root else None
        return TargetExit(self._root_exited_at, bool(reasons), reasons[-12:], root)

    def _memory(self, stage: StageRef | None) -> _StageMemory | None:
        if stage is None:
            return None
        memory = self._stages.get(stage)
        if memory is None:
            # A replica the stage config did not list (e.g. scaled up) that the tree's titles
            # name: track it anyway, up to a bound. Spans name only stages known already.
            if len(self._stages) - len(self._names_of_topology) >= MAX_EXTRA_STAGES:
                return None
            memory = _StageMemory(since=0.0)
            self._stages[stage] = memory
            self._names[stage] = self._stage_name(stage)
        return memory

    def _stage_name(self, ref: StageRef) -> str:
        stage = self._topology.stage(ref.stage_id)
        return stage.name if stage else f"stage{ref.stage_id}"


def _unseen(blind: float) -> str:
    """What evidence says of the watchdog's own blindness, so nobody reads it as the
    server's: the time is left out of the figure before it."""
    return f" (and {blind:.1f}s the watchdog itself could not look)" if blind >= 0.05 else ""


def _word(obs: Observation) -> str:
    """An observation's outcome as the word people read in evidence."""
    return obs.outcome.value if obs.outcome is not None else ""
