"""Whether a stage works on what it owes: a diffusion stage's denoising steps, and the
requests waiting at a stage with its step counters flat.

Spans and beats can be sent in a stage's name by anyone with the OTLP token; what is
read here (the steps of requests the stage is owed, its step counters, its process
seen runnable) is what says that it is held up, whatever those say.
"""

from __future__ import annotations

from omni_watchdog.config import DetectionConfig
from omni_watchdog.detector.expectations import PendingRequest
from omni_watchdog.detector.memory import StageMemory, TargetMemory, heartbeat_timeout
from omni_watchdog.types import (
    STAGE_TYPE_DIFFUSION,
    Evidence,
    EvidenceKind,
    ProcessStatus,
    SilenceCause,
    StageRef,
)

# Causes that say a stage in the middle of a denoising step is not running it: a step
# computes or waits on its device; asleep on a lock or a queue, stopped, or spinning in
# one frame, the stage has left it, whatever beats come in its name.
STEP_NOT_RUNNING = frozenset(
    {SilenceCause.LOCK_OR_QUEUE_WAIT, SilenceCause.STOPPED, SilenceCause.SPINNING}
)


def denoises(target: TargetMemory, ref: StageRef, memory: StageMemory) -> bool:
    """A diffusion stage: the topology says so, or it told denoising steps."""
    if len(memory.step_seconds) or memory.denoising:
        return True
    return any(
        stage.stage_id == ref.stage_id and stage.stage_type == STAGE_TYPE_DIFFUSION
        for stage in target.topology.stages
    )


def step_silence(target: TargetMemory, ref: StageRef, memory: StageMemory, now: float) -> float:
    """Seconds a diffusion stage's denoising loop has not shown itself at work on the
    requests it owes: since the latest of a step of one of them told, one of them
    ended, and the oldest of them reaching it (a newer arrival, which anyone with the
    token can make up, shows no work). 0 while it owes none that reached it after the
    latest canary passed (one before that, its span lost, was not in the canary's
    way), and for a stage that does not denoise."""
    if not denoises(target, ref, memory):
        return 0.0
    oldest = target.pending.oldest_since(ref.stage_id, target.canary_passed_at)
    if oldest is None:
        return 0.0
    steps = (
        request.since
        for request in memory.denoising.values()
        if target.pending.waits_at(request.request_id, ref.stage_id)
    )
    return now - max(memory.owed_ended_at, oldest.due_since, *steps)


def step_late(
    config: DetectionConfig,
    target: TargetMemory,
    ref: StageRef,
    memory: StageMemory,
    now: float,
    share: float = 1.0,
) -> bool:
    """The stage owes requests and has shown no work on them for `share` of its
    allowance. Its beats may still come (a holder of the OTLP token can send them in
    its name); its steps of the requests it owes, which only its denoising loop tells,
    have stopped."""
    return step_silence(target, ref, memory, now) > share * heartbeat_timeout(config, memory)


def step_left(
    config: DetectionConfig, target: TargetMemory, ref: StageRef, memory: StageMemory, now: float
) -> bool:
    """Its step is late and its process was read not running it: asleep on a lock or a
    queue, stopped, or spinning in one frame. A step that computes or waits on its
    device is work, however late (a 3 s step of a stage that learned 40 ms ones)."""
    cause = memory.cause
    return (
        cause is not None
        and not cause.working
        and cause.cause in STEP_NOT_RUNNING
        and step_late(config, target, ref, memory, now)
    )


def waiting_unworked(
    config: DetectionConfig, target: TargetMemory, ref: StageRef, memory: StageMemory, now: float
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
    if denoises(target, ref, memory):
        # Its counters move once an image (one engine step holds the whole denoising
        # loop): its denoising steps and beats tell its work, not they.
        return None
    if now - memory.progress_seen_at > config.stale_after:
        return None
    if sum(1 for other in target.stages if other.stage_id == ref.stage_id) != 1:
        return None
    oldest = target.pending.oldest_since(ref.stage_id, target.canary_passed_at)
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


def unworked_for(
    config: DetectionConfig, target: TargetMemory, ref: StageRef, memory: StageMemory, now: float
) -> float:
    """The seen seconds a request has waited at the stage with its step counters flat
    (`waiting_unworked`); 0 while none does."""
    unworked = waiting_unworked(config, target, ref, memory, now)
    return 0.0 if unworked is None else target.blind.seen(unworked[1], now)


def held_up(
    config: DetectionConfig,
    target: TargetMemory,
    ref: StageRef,
    memory: StageMemory,
    evidence: list[Evidence],
    now: float,
) -> bool:
    """The world says the stage cannot be working: one of its processes is stopped; its
    counters are flat with work queued (its load gauges say so, or a request waits at
    it and its step counters have not moved since); or it left a denoising step
    (`step_left`). Heartbeats and spans, which a holder of the OTLP token could send
    in its name, never outweigh that: with beats and successful stage spans forged
    every 0.2 s, a deadlocked stage stayed degraded and no incident came in 60 s."""
    kinds = {e.kind for e in evidence}
    if EvidenceKind.PROGRESS_FLAT in kinds:
        return True
    if EvidenceKind.SPAN_OVERDUE in kinds and unworked_for(config, target, ref, memory, now) > (
        config.progress_timeout
    ):
        return True
    if step_left(config, target, ref, memory, now):
        # A diffusion stage's counters move once an image: what its process does
        # while its step is late is what the watchdog sees for itself.
        return True
    return any(
        p.exited_at is None
        and p.info.status is ProcessStatus.STOPPED
        and now - p.status_since > config.stuck_timeout
        for p in memory.processes.values()
    )
