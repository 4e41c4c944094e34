"""A stage's silence and its cause: when a stage counts as silent, the cause its
processes' findings (`detector/causes.py`) and CPU figures (`detector/starved.py`) name,
and the evidence that work which visibly advances excuses while its budget lasts.
"""

from __future__ import annotations

from omni_watchdog.config import DetectionConfig
from omni_watchdog.detector.causes import CauseFinding, stage_cause
from omni_watchdog.detector.memory import (
    StageMemory,
    TargetMemory,
    heartbeat_timeout,
    load,
    progressing,
)
from omni_watchdog.detector.starved import stage_starved
from omni_watchdog.detector.work import step_late, unworked_for
from omni_watchdog.types import EvidenceKind, SilenceCause, StageCause, StageRef, StageState

# A stage is silent, and its processes are read for a cause, once its loop has not beaten
# for this share of `heartbeat_timeout`, or its counters have stayed flat under load for
# this share of `progress_timeout`: two readings are in by the time evidence stands.
SILENT_SHARE = 0.5
# What a stage whose work visibly advances (a compile, a child building for it, a step
# whose frames move) is excused from until its work budget runs out: each says only that
# it is late or quiet, which such work is. A stopped or exited process, a failed /health
# and a lost link are never excused: a stage doing legit work shows none of them.
EXCUSED_BY_WORK = frozenset(
    {
        EvidenceKind.HEARTBEAT_LOST,
        EvidenceKind.SPAN_OVERDUE,
        EvidenceKind.CANARY_FAILED,
        EvidenceKind.PROGRESS_FLAT,
        EvidenceKind.PROCESS_STUCK,
    }
)
# Causes that say the work a stage was excused for stopped advancing (its child stopped or
# idle, its process stopped, its loop spinning): judged at once. Any other end of the work
# (the stage beats again, or sleeps as its loop picks the result up) is the work done.
WORK_STOPPED = frozenset(
    {SilenceCause.STOPPED, SilenceCause.WAITING_ON_CHILD, SilenceCause.SPINNING}
)


def silent(
    config: DetectionConfig, target: TargetMemory, ref: StageRef, memory: StageMemory, now: float
) -> bool:
    """The stage is worth reading for a cause: its loop stopped beating, a request waits
    at it with its counters flat, its step is late, its counters stay flat under load
    (see `SILENT_SHARE`), the target fails with no beat of its own to say otherwise, or
    it is judged stalled."""
    beat = memory.last_heartbeat
    if beat is not None and now - beat > SILENT_SHARE * heartbeat_timeout(config, memory):
        return True
    if beat is None and target_unwell(config, target) and not progressing(config, memory, now):
        # Without heartbeats a failing canary or /health is the only sign of a silence:
        # what each stage is doing is what may prove which one fails it.
        return True
    if unworked_for(config, target, ref, memory, now) > SILENT_SHARE * config.progress_timeout:
        # Its beats may be forged, its counters are not: what it does names the cause.
        return True
    if step_late(config, target, ref, memory, now, SILENT_SHARE):
        return True
    # A stage that beats has the requests on it told by its spans: vLLM-Omni 0.30
    # leaves its load gauges at the last batch's counts, and every stage of an idle
    # server, its gauge at 1 and its counters flat between two canaries, was read.
    oldest = target.pending.oldest(ref.stage_id)
    working = beat is None or oldest is not None
    if working and load(config, memory, now) > 0 and memory.load_positive_since is not None:
        flat_from = max(memory.progress_changed_at or 0.0, memory.load_positive_since)
        if beat is not None and oldest is not None:
            flat_from = max(flat_from, oldest.due_since)
        if now - flat_from > SILENT_SHARE * config.progress_timeout:
            return True
    return memory.state is StageState.STALLED


def update_cause(
    config: DetectionConfig, target: TargetMemory, ref: StageRef, memory: StageMemory, now: float
) -> StageCause | None:
    """The stage's cause from the latest fresh findings of its live processes, kept with
    the moment it first held; None once the stage is no longer silent. A live stage
    process without a fresh finding counts as unknown: what its siblings do (an engine
    core asleep on its queue) says nothing of it (its worker may be compiling)."""
    fresh = {
        pid: known.finding
        for pid, known in memory.activity.items()
        if known.finding is not None
        and now - known.latest.time <= config.stale_after
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
    is_silent = silent(config, target, ref, memory, now)
    if not is_silent:
        # Readings from before it beat again say nothing of its next silence.
        memory.activity.clear()
    elif not fresh and (starved := stage_starved(config, memory)) is not None:
        # Nothing read closer (no activity probe, or not yet): the process probe's
        # CPU figures name the cause.
        findings.append(starved)
    was_excused = excused_by_work(config, memory, now)
    found = stage_cause(findings) if findings and is_silent else None
    ended = found is None or (not found.working and found.cause not in WORK_STOPPED)
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
        budget = config.work_budget(found.cause)
        worked = now - memory.working_since
        if worked >= budget:
            detail += f"; working for {worked:.0f}s, past its {budget:g}s budget"
    memory.cause = StageCause(found.cause, since, found.working, detail, memory.working_since)
    return memory.cause


def excused(config: DetectionConfig, memory: StageMemory, now: float) -> frozenset[EvidenceKind]:
    """The evidence its advancing work excuses, until that work's budget runs out, and
    for one heartbeat timeout after the work ended by itself."""
    if excused_by_work(config, memory, now):
        return EXCUSED_BY_WORK
    ended = memory.work_ended_at
    if ended is not None and now - ended < heartbeat_timeout(config, memory):
        return EXCUSED_BY_WORK
    return frozenset()


def excused_by_work(config: DetectionConfig, memory: StageMemory, now: float) -> bool:
    """Its cause is work that advances, and has been for less than that work's budget."""
    cause = memory.cause
    if cause is None or not cause.working or memory.working_since is None:
        return False
    return now - memory.working_since < config.work_budget(cause.cause)


def target_unwell(config: DetectionConfig, target: TargetMemory) -> bool:
    """The canary fails, or /health has failed `health_failures` times in a row."""
    failing = target.health_failures >= config.health_failures
    return failing or target.canary_failed_at is not None
