"""Intake: each kind of observation folded into the detector's memory of the server.

Nothing is judged here; what is kept is what the evidence and the rules read later. An
observation about a stage replica the topology does not list makes a memory for it, up
to `MAX_EXTRA_STAGES`.
"""

from __future__ import annotations

from collections.abc import Callable

from omni_watchdog.config import DetectionConfig
from omni_watchdog.detector.exits import STAGE_ROLES
from omni_watchdog.detector.expectations import BlindSpells
from omni_watchdog.detector.memory import (
    MAX_DENOISING,
    MAX_EXTRA_STAGES,
    MAX_PROCESSES_PER_STAGE,
    ActivityMemory,
    ProcessMemory,
    StageMemory,
    TargetMemory,
    heartbeat_timeout,
    stage_name,
)
from omni_watchdog.types import (
    DIFFUSION_WORKER_TITLE,
    STEP_COUNTERS,
    DenoisingRequest,
    HealthOutcome,
    Observation,
    ObservationKind,
    ProcessRole,
    ProcessStatus,
    SpanOutcome,
    StageRef,
    Topology,
)

Fold = Callable[[DetectionConfig, TargetMemory, Observation], None]


def fold(config: DetectionConfig, target: TargetMemory, obs: Observation) -> None:
    """Keep what `obs` says; a kind the detector does not read is passed over."""
    handler = _HANDLERS.get(obs.kind)
    if handler is not None:
        handler(config, target, obs)


def unseen_timeout(obs: Observation, blind: BlindSpells) -> bool:
    """A timeout the watchdog was blind for part of: its answer may have waited unread
    while the timer ran. It says nothing either way, so it is set aside, not folded."""
    if obs.outcome is not HealthOutcome.TIMEOUT:
        return False
    return blind.within(obs.time - obs.value, obs.time) > 0


def take_topology(target: TargetMemory, topology: Topology, now: float) -> None:
    """Judge the stages of `topology` from now on, keeping what is known of every stage
    replica that stays. One it drops is kept while it shows a signal of its own (a
    process, a heartbeat, progress): it is real, even if no source names it."""
    target.topology = topology
    kept = {ref: memory for ref, memory in target.stages.items() if memory.shows_itself()}
    refs = topology.refs()
    target.stages = {ref: target.stages.get(ref) or StageMemory(since=now) for ref in refs}
    target.stages |= {ref: memory for ref, memory in kept.items() if ref not in refs}
    target.names = {ref: stage_name(topology, ref) for ref in target.stages}
    target.names_of_topology = frozenset(topology.refs())
    target.pid_stage = {pid: ref for pid, ref in target.pid_stage.items() if ref in target.stages}


def _forget_unnamed(target: TargetMemory, ref: StageRef) -> None:
    """A replica kept only for a signal of its own, whose last process was mapped to
    another stage, is gone: a headless stage's processes mapped by spawn order to the
    default stage 0 before its config named stage N left a stage 0 that its watchdog
    showed, and judged dead with the orphan, on a host that never ran it."""
    memory = target.stages.get(ref)
    if memory is not None and ref not in target.names_of_topology and not memory.shows_itself():
        del target.stages[ref]
        target.names.pop(ref, None)


def sign(config: DetectionConfig, target: TargetMemory, time: float, text: str) -> None:
    """Something looked wrong at `time`: kept for `crash_window`, to tell a crash."""
    target.unhealthy_signs.append((time, text))
    horizon = time - config.crash_window
    while target.unhealthy_signs and target.unhealthy_signs[0][0] < horizon:
        target.unhealthy_signs.pop(0)


def stage_memory(target: TargetMemory, stage: StageRef | None) -> StageMemory | None:
    """The memory of `stage`, made for a replica the topology does not list, up to a bound."""
    if stage is None:
        return None
    memory = target.stages.get(stage)
    if memory is None:
        # A replica the stage config did not list (e.g. scaled up) that the tree's titles
        # name: track it anyway, up to a bound. Spans name only stages known already.
        if len(target.stages) - len(target.names_of_topology) >= MAX_EXTRA_STAGES:
            return None
        memory = StageMemory(since=0.0)
        target.stages[stage] = memory
        target.names[stage] = stage_name(target.topology, stage)
    return memory


def _on_heartbeat(config: DetectionConfig, target: TargetMemory, obs: Observation) -> None:
    memory = stage_memory(target, obs.stage)
    if memory is not None:
        previous = memory.last_heartbeat
        if previous is not None and 0 < obs.time - previous <= heartbeat_timeout(config, memory):
            memory.beat_gaps.add(obs.time - previous)
        # Spans of a sender the tracker had not recorded yet arrive late, and older.
        memory.last_heartbeat = max(obs.time, previous or obs.time)
        for known in memory.processes.values():
            known.wait_at_beat, known.seen_at_beat = known.info.cpu_wait_seconds, known.seen_at
            known.cpu_at_beat = known.info.cpu_seconds
        if memory.first_heartbeat is None:
            memory.first_heartbeat = obs.time
        if obs.stage is not None:
            _retire_replaced(config, target, obs.stage, obs.time)


def _retire_replaced(
    config: DetectionConfig, target: TargetMemory, beating: StageRef, now: float
) -> None:
    """Lower replicas of `beating`'s stage that it replaced, with no process of their
    own: one that went silent before `beating` first beat, or one that never beat while
    `beating` has beaten for longer than its heartbeat timeout. vLLM-Omni 0.30's master
    numbers a replacement anew (`replica1` after `replica0` was evicted) and keeps the
    evicted slot, so the old number would stay `unknown` beside its replacement for good,
    at the head and on the stage's own host. A replica that beats beside it, one that
    starts a little later than it, or one with processes (a hung one among them) is never
    retired; one that comes back is known again at its first sign."""
    first = target.stages[beating].first_heartbeat
    if first is None:
        return
    for ref, memory in list(target.stages.items()):
        if ref.stage_id != beating.stage_id or ref.replica >= beating.replica:
            continue
        if memory.processes:
            continue
        timeout = heartbeat_timeout(config, memory)
        last = memory.last_heartbeat
        replaced = now - first > timeout if last is None else first > last + timeout
        if replaced:
            del target.stages[ref]
            target.names.pop(ref, None)


def _on_admitted(config: DetectionConfig, target: TargetMemory, obs: Observation) -> None:
    target.pending.admit(obs.request_id, obs.path, obs.time)


def _on_request_ended(config: DetectionConfig, target: TargetMemory, obs: Observation) -> None:
    target.pending.abandon(obs.request_id)
    for memory in target.stages.values():
        memory.denoising.pop(obs.request_id, None)


def _on_denoise_done(config: DetectionConfig, target: TargetMemory, obs: Observation) -> None:
    memory = stage_memory(target, obs.stage)
    if memory is not None and obs.stage is not None:
        if target.pending.waits_at(obs.request_id, obs.stage.stage_id):
            memory.owed_ended_at = max(memory.owed_ended_at, obs.time)
        memory.denoising.pop(obs.request_id, None)
        if obs.value > 0:
            memory.step_seconds.add(obs.value)


def _on_denoise_step(config: DetectionConfig, target: TargetMemory, obs: Observation) -> None:
    """A diffusion stage started a denoising step: it works, and how fast."""
    memory = stage_memory(target, obs.stage)
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


def _on_stage_span(config: DetectionConfig, target: TargetMemory, obs: Observation) -> None:
    failed = obs.outcome is SpanOutcome.ERROR
    memory = stage_memory(target, obs.stage)
    if obs.stage is not None:
        if memory is not None and target.pending.waits_at(obs.request_id, obs.stage.stage_id):
            memory.owed_ended_at = max(memory.owed_ended_at, obs.time)
        target.pending.stage_done(obs.request_id, obs.stage.stage_id, obs.time, failed)
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
        sign(config, target, obs.time, f"stage {obs.stage} request failed: {obs.detail}")
    else:
        memory.last_span_ok = obs.time
        memory.durations.add(obs.value)


def _on_progress(config: DetectionConfig, target: TargetMemory, obs: Observation) -> None:
    memory = stage_memory(target, obs.stage)
    if memory is None:
        return
    memory.progress_seen_at = obs.time
    memory.counts_steps = obs.detail == STEP_COUNTERS
    if memory.progress_value is None or obs.value != memory.progress_value:
        # The first sample is only a baseline; movement is a change after it.
        if memory.progress_value is not None:
            target.last_progress = obs.time
            memory.progress_moved_at = obs.time
        memory.progress_value = obs.value
        memory.progress_changed_at = obs.time


def _on_load(config: DetectionConfig, target: TargetMemory, obs: Observation) -> None:
    memory = stage_memory(target, obs.stage)
    if memory is None:
        return
    if obs.value > 0 and memory.load <= 0:
        memory.load_positive_since = obs.time
    elif obs.value <= 0:
        memory.load_positive_since = None
    memory.load = obs.value
    memory.load_at = obs.time


def _on_health(config: DetectionConfig, target: TargetMemory, obs: Observation) -> None:
    if obs.outcome is HealthOutcome.OK:
        if target.first_healthy is None:
            target.first_healthy = obs.time
        target.health_failures = 0
        target.health_unwell = None
        return
    target.health_failures += 1
    if target.health_failures == 1:
        target.health_failed_since = obs.time
    if target.health_failures == config.health_failures:
        target.health_confirmed_at = obs.time
    target.health_detail = f"{_word(obs)} {obs.detail}".strip()
    target.health_answered = obs.outcome is HealthOutcome.UNHEALTHY
    # A refused connection is what any stopping server shows; it says nothing of a crash.
    if obs.outcome is not HealthOutcome.REFUSED:
        sign(config, target, obs.time, f"/health {target.health_detail}")
        target.health_unwell = (obs.time, target.health_detail)


def _on_link(config: DetectionConfig, target: TargetMemory, obs: Observation) -> None:
    if obs.outcome is HealthOutcome.OK:
        # A headless stage has no /health: registered with its master is its "ready".
        if target.first_healthy is None:
            target.first_healthy = obs.time
        target.link_down_since = None
        return
    if target.link_down_since is None:
        target.link_down_since = obs.time
        sign(config, target, obs.time, f"link to the master down: {obs.detail}")
    target.link_detail = obs.detail


def _on_canary(config: DetectionConfig, target: TargetMemory, obs: Observation) -> None:
    if obs.outcome is HealthOutcome.OK:
        target.canary_passed_at = obs.time
        target.canary_failed_at = None
        target.canary_last_failed = None
        target.canary_detail = ""
        return
    if target.canary_failed_at is None:
        target.canary_failed_at = obs.time
    target.canary_last_failed = obs.time
    target.canary_detail = f"canary {_word(obs)} {obs.detail}".strip()
    sign(config, target, obs.time, target.canary_detail)


def _on_process(config: DetectionConfig, target: TargetMemory, obs: Observation) -> None:
    info = obs.process
    if info is None:
        return
    exited = obs.outcome is ProcessStatus.EXITED
    if DIFFUSION_WORKER_TITLE in info.title:
        target.diffusion_seen = True
    if info.role is ProcessRole.API and not info.orphaned:
        target.root = info
        # An unreaped server is as gone as a reaped one: it holds nothing and serves nothing.
        gone = exited or info.status is ProcessStatus.ZOMBIE
        if gone and target.root_exited_at is None:
            target.root_exited_at = obs.time
    if info.stage is None:
        return
    previous = target.pid_stage.get(info.pid)
    if previous is not None and previous != info.stage and previous in target.stages:
        # Mapped by spawn order first, by title or spans later: the later map wins.
        target.stages[previous].processes.pop(info.pid, None)
        _forget_unnamed(target, previous)
    target.pid_stage[info.pid] = info.stage
    memory = stage_memory(target, info.stage)
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
            if info.role in STAGE_ROLES and target.root_alive():
                target.stage_exits += 1
                sign(config, target, obs.time, f"{info.role.value} pid {info.pid} of stage exited")
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


def _on_activity(config: DetectionConfig, target: TargetMemory, obs: Observation) -> None:
    memory = stage_memory(target, obs.stage)
    reading = obs.activity
    if memory is None or reading is None:
        return
    known = memory.activity.get(reading.pid)
    if known is None:
        if len(memory.activity) >= MAX_PROCESSES_PER_STAGE:
            return
        known = memory.activity[reading.pid] = ActivityMemory(reading)
    elif reading.time > known.latest.time:
        known.add(reading)
    if reading.stacks_read:
        known.sampled.append(reading)


def _on_gpu_process(config: DetectionConfig, target: TargetMemory, obs: Observation) -> None:
    memory = stage_memory(target, obs.stage)
    if memory is not None and obs.pid is not None:
        memory.gpu_bytes[obs.pid] = obs.value
        memory.gpu_seen_at[obs.pid] = obs.time


def _on_gpu_device(config: DetectionConfig, target: TargetMemory, obs: Observation) -> None:
    # A reading lists its devices first, then every pid holding memory on them.
    target.gpu_read_at = obs.time


def _word(obs: Observation) -> str:
    """An observation's outcome as the word people read in evidence."""
    return obs.outcome.value if obs.outcome is not None else ""


_HANDLERS: dict[ObservationKind, Fold] = {
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
