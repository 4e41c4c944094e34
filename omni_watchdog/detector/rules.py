"""The rules that decide: each stage's state from its evidence, verdicts on the changes.

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

from dataclasses import replace

from omni_watchdog.config import DetectionConfig
from omni_watchdog.detector.evidence import (
    TargetEvidence,
    deadline,
    gpu_held,
    overdue_count,
    own_evidence,
    target_evidence,
)
from omni_watchdog.detector.exits import after_exit, server_gone, target_exit
from omni_watchdog.detector.memory import (
    StageMemory,
    TargetMemory,
    heartbeat_timeout,
    load,
    progressing,
)
from omni_watchdog.detector.silence import excused, silent, update_cause
from omni_watchdog.detector.starved import (
    WAIT_WORTH_SAYING,
    busiest_runner,
    contended,
    longest_wait,
    stage_starved,
)
from omni_watchdog.detector.work import held_up
from omni_watchdog.types import (
    PIPELINE,
    DetectorReport,
    Evidence,
    EvidenceKind,
    SilenceCause,
    StageCause,
    StageRef,
    StageRequests,
    StageState,
    StageStatus,
    Verdict,
)

# gpu_held follows from a state, so it is shown but never counted towards one.
CONSEQUENCES = (EvidenceKind.GPU_HELD,)
# Evidence that never confirms a verdict alone, however long it stands: a request whose
# span is late or lost says as much of the exporter, the network or the receiver as of
# the stage (CI: a healthy, idle, beating real vLLM-Omni stage judged stalled, and ended,
# on one overdue request alone). It confirms beside another kind.
NEVER_ALONE = frozenset({EvidenceKind.SPAN_OVERDUE})
# Evidence that says only that a stage answered late. Where the stage was seen running or
# waiting for a CPU meanwhile (a long step, a loaded host), that explains them all at once:
# they are one kind there, and a stall confirmed by them alone waits for `confirm_timeout`.
LATENESS = frozenset(
    {EvidenceKind.HEARTBEAT_LOST, EvidenceKind.SPAN_OVERDUE, EvidenceKind.CANARY_FAILED}
)
# Causes that are no work and that an idle stage never shows: a stage that never beat (no
# plugin) and shows one answers for the target's failing /health or canary. Asleep on a
# lock or a queue is what every idle stage shows, so it proves nothing; neither does a wait
# on a child, which an idle engine may show on its worker's pipe.
BLOCKED_CAUSES = frozenset({SilenceCause.STOPPED, SilenceCause.SPINNING, SilenceCause.DEVICE_WAIT})


def evaluate(config: DetectionConfig, target: TargetMemory, now: float) -> DetectorReport:
    """Every stage judged now, the target as a whole where no stage answers for it, and a
    verdict for each stage that turned stalled or dead."""
    warm = warmed_up(config, target, now)
    exited = target_exit(config, target)
    own = {
        ref: own_evidence(config, target, ref, memory, now) for ref, memory in target.stages.items()
    }
    shared = target_evidence(config, target, now)
    judged: dict[StageRef, tuple[StageState, list[Evidence], StageCause | None]] = {}
    # Local stages that neither answer for the target's evidence nor show liveness.
    unproved: list[StageRef] = []
    charged_any = False
    for ref, memory in target.stages.items():
        remote = ref.stage_id in target.remote
        cause = update_cause(config, target, ref, memory, now)
        excused_kinds = excused(config, memory, now)
        evidence = [e for e in own[ref] if e.kind not in excused_kinds]
        set_aside = len(evidence) < len(own[ref])
        held = held_up(config, target, ref, memory, evidence, now)
        if shared and answers_for_target(config, target, ref, memory, evidence, held, now):
            charged = [
                Evidence(kind, ref, since, detail)
                for kind, since, detail in shared
                if kind not in excused_kinds
            ]
            charged_any = True
            set_aside = set_aside or len(charged) < len(shared)
            evidence.extend(charged)
        elif shared and not remote and not shows_own_liveness(config, memory, now):
            unproved.append(ref)
        evidence.extend(after_exit(target, ref, memory, evidence, now))
        if not target.root_alive():
            state = StageState.DEAD
            evidence = [server_gone(target, ref)]
        elif not warm:
            state = StageState.STARTING
        elif remote:
            state = decide_remote(config, target, memory, evidence, now)
        else:
            state = decide(config, target, memory, evidence, now, held, set_aside)
        if state in (StageState.STALLED, StageState.DEAD):
            evidence.extend(gpu_held(ref, memory, now))
        judged[ref] = (state, evidence, cause)
    pipeline = None
    if shared and not charged_any and unproved and warm and target.root_alive():
        pipeline = pipeline_status(config, target, shared, unproved, now)
    verdicts: list[Verdict] = []
    if pipeline is None:
        target.pipeline_state = StageState.HEALTHY
    else:
        if pipeline.state is not target.pipeline_state:
            target.pipeline_state, target.pipeline_since = pipeline.state, now
            if pipeline.state in (StageState.STALLED, StageState.DEAD):
                verdicts.append(Verdict(PIPELINE, pipeline.state, now, pipeline.evidence))
        pipeline = replace(pipeline, since=target.pipeline_since)
        if pipeline.state in (StageState.STALLED, StageState.DEAD):
            # Neither cleared nor blamed: the hang is among them, which one is unknown.
            for ref in unproved:
                _, evidence, cause = judged[ref]
                judged[ref] = (StageState.UNKNOWN, evidence, cause)
    statuses: list[StageStatus] = []
    for ref, memory in target.stages.items():
        state, evidence, cause = judged[ref]
        remote = ref.stage_id in target.remote
        if state is not memory.state:
            memory.state, memory.since = state, now
            if state in (StageState.STALLED, StageState.DEAD) and target.root_alive():
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
                target.names.get(ref, ""),
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
    verdicts.extend(head_verdict(config, target, statuses, now))
    requests = {
        stage_id: StageRequests(
            target.pending.in_flight(stage_id),
            overdue_count(config, target, stage_id, now),
            deadline(config, target, stage_id),
        )
        for stage_id in sorted({ref.stage_id for ref in target.stages})
    }
    return DetectorReport(
        now,
        warm,
        tuple(statuses),
        tuple(verdicts),
        exited,
        requests,
        pipeline,
        at_rest=warm and not verdicts and at_rest(config, target, now),
    )


def at_rest(config: DetectionConfig, target: TargetMemory, now: float) -> bool:
    """Whether the server is idle and well: every stage and the pipeline healthy and
    beating, no request owed and no image denoising at any stage, /health and the canary
    answering, its root alive. Only news can then change a verdict, so the watchdog may
    judge less often (see `app`). Load gauges are not asked: vLLM-Omni 0.30 leaves them at
    its last batch's counts, and a stage flat under load is judged when `next_due` says."""
    if (
        len(target.pending) > 0
        or target.root_exited_at is not None
        or target.health_failures > 0
        or target.canary_failed_at is not None
        or target.pipeline_state is not StageState.HEALTHY
    ):
        return False
    return all(
        memory.state is StageState.HEALTHY
        and not memory.denoising
        and not silent(config, target, ref, memory, now)
        for ref, memory in target.stages.items()
    )


def warmed_up(config: DetectionConfig, target: TargetMemory, now: float) -> bool:
    """Start-up is over: healthy for `startup_grace`, broken since attach for
    `startup_timeout`, or broken for sure (a recorded stage process exited)."""
    if target.first_healthy is not None:
        return now >= target.first_healthy + config.startup_grace
    return target.stage_exits > 0 or now >= target.attached + config.startup_timeout


def answers_for_target(
    config: DetectionConfig,
    target: TargetMemory,
    ref: StageRef,
    memory: StageMemory,
    evidence: list[Evidence],
    held: bool,
    now: float,
) -> bool:
    """The target's failing /health or canary is charged to this stage.

    A stage that beats (the plugin's heartbeats), and a remote one, which is seen
    through its spans only, answer for it unless they show liveness of their own. A
    local stage that never beat has nothing to show either way: blamed for lack of
    liveness, every stage of a pipeline without the plugin was judged stalled for one
    stall. So it answers only where its own readings prove it is the one: held up, its
    own evidence (a process stopped, in D, exited; counters flat under load), or a
    cause that is no work and that an idle stage never shows. `held`: the world says it
    cannot be working (`work.held_up`)."""
    beats_seen = any(other.last_heartbeat is not None for other in target.stages.values())
    # Where some stage beats, the plugin is there: a stage that never beat beside it is
    # silent by its own doing (its only replica died before the watchdog came), as plain
    # as a stage that stopped beating.
    if memory.last_heartbeat is not None or ref.stage_id in target.remote or beats_seen:
        return held or not shows_own_liveness(config, memory, now)
    if held or any(e.kind not in CONSEQUENCES for e in evidence):
        return True
    cause = memory.cause
    return cause is not None and not cause.working and cause.cause in BLOCKED_CAUSES


def shows_own_liveness(config: DetectionConfig, memory: StageMemory, now: float) -> bool:
    """Fresh heartbeats and either no work or moving counters: this stage is fine. One
    that never beat (no plugin) shows it by its counters moving."""
    if memory.last_heartbeat is None:
        return progressing(config, memory, now)
    beating = now - memory.last_heartbeat <= heartbeat_timeout(config, memory)
    return beating and (load(config, memory, now) <= 0 or progressing(config, memory, now))


def pipeline_status(
    config: DetectionConfig,
    target: TargetMemory,
    shared: list[TargetEvidence],
    unproved: list[StageRef],
    now: float,
) -> StageStatus:
    """The target as a whole, while its /health or canary fails and no stage answers
    for it (`unproved`: the local stages that neither answer nor show liveness). Judged
    by the rules of a stage: its lateness excused while one of them works visibly
    (a compile may hold the canary up), confirmed by two kinds or one that stood, and
    on a host that starves them only once one stood for the time they could run. A
    confirmed /health 503 makes it dead (an engine is dead, which one is unknown).
    The ladder ends the whole server whatever stage a verdict names, so a real hang
    is acted on as fast as a stage's."""
    memories = [target.stages[ref] for ref in unproved]
    excused_kinds: frozenset[EvidenceKind] = frozenset().union(
        *(excused(config, memory, now) for memory in memories)
    )
    evidence = [
        Evidence(kind, PIPELINE, since, detail)
        for kind, since, detail in shared
        if kind not in excused_kinds
    ]
    kinds = {e.kind for e in evidence}
    if not confirmed(config, evidence, now):
        state = StageState.DEGRADED
    elif EvidenceKind.HEALTH_FAILED in kinds and target.health_answered:
        state = StageState.DEAD
    elif (
        target.pipeline_state is not StageState.STALLED
        and any(
            contended(memory, now) and stage_starved(config, memory) is not None
            for memory in memories
        )
        and not stood(
            config, evidence, now, max(longest_wait(m.processes.values()) for m in memories)
        )
    ):
        state = StageState.DEGRADED
    else:
        state = StageState.STALLED
    return StageStatus(PIPELINE, "pipeline", state, now, tuple(evidence))


def decide(
    config: DetectionConfig,
    target: TargetMemory,
    memory: StageMemory,
    evidence: list[Evidence],
    now: float,
    held: bool,
    set_aside: bool = False,
) -> StageState:
    """A local stage's state from its evidence. `held`: the world says it cannot be
    working (`work.held_up`), whatever its counters and spans did. `set_aside`: evidence
    was excused by work that advances (`silence.excused`); the stage is then degraded at
    best, late but not stalled."""
    kinds = {e.kind for e in evidence if e.kind not in CONSEQUENCES}
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
    is_contended = contended(memory, now)
    busy = is_contended and (
        waited >= WAIT_WORTH_SAYING or busiest_runner(memory.processes.values()) is not None
    )
    is_confirmed = confirmed(config, evidence, now, busy=not judged and busy)
    if is_confirmed and EvidenceKind.PROCESS_EXIT in kinds:
        return StageState.DEAD
    if is_confirmed and EvidenceKind.HEALTH_FAILED in kinds and target.health_answered:
        # The server's own word: vLLM and vLLM-Omni answer /health 503 only once an
        # engine is dead (0.30: a stage has no live replica), and this stage is the
        # one without liveness. Its processes may take seconds more to exit; the
        # verdict does not turn on whether the exit was seen first.
        return StageState.DEAD
    if is_confirmed and (held or not progressing(config, memory, now)):
        if (
            not judged
            and is_contended
            and stage_starved(config, memory) is not None
            and not stood(config, evidence, now, waited)
        ):
            return StageState.DEGRADED
        return StageState.STALLED
    return StageState.DEGRADED


def decide_remote(
    config: DetectionConfig,
    target: TargetMemory,
    memory: StageMemory,
    evidence: list[Evidence],
    now: float,
) -> StageState:
    """A stage on another host, seen only through its spans and the server's word.

    Spans that stop arriving may be the network between the hosts, not the stage:
    silence alone leaves it `unknown`. The server's failing /health, charged to it
    because it shows no liveness while every local stage does, says it has no live
    replica: `dead` once confirmed. Its own watchdog acts on it; this one never does.
    """
    kinds = {e.kind for e in evidence if e.kind not in CONSEQUENCES}
    beating = (
        memory.last_heartbeat is not None
        and now - memory.last_heartbeat <= heartbeat_timeout(config, memory)
    )
    if EvidenceKind.HEALTH_FAILED in kinds and confirmed(config, evidence, now):
        return StageState.DEAD
    if not beating:
        return StageState.UNKNOWN
    if not kinds:
        return StageState.HEALTHY
    if confirmed(config, evidence, now) and not progressing(config, memory, now):
        return StageState.STALLED
    return StageState.DEGRADED


def confirmed(
    config: DetectionConfig, evidence: list[Evidence], now: float, busy: bool = False
) -> bool:
    """Two independent kinds of evidence, or one that stood `confirm_timeout`. For a
    stage `busy` (seen running or waiting for a CPU since its loop last beat), its
    lateness is one kind however many say it."""
    kinds = {e.kind for e in evidence if e.kind not in CONSEQUENCES}
    independent = len(kinds - LATENESS) + bool(kinds & LATENESS) if busy else len(kinds)
    return independent >= 2 or stood(config, evidence, now)


def stood(
    config: DetectionConfig, evidence: list[Evidence], now: float, waited: float = 0.0
) -> bool:
    """One kind of evidence that may stand alone has held for `confirm_timeout`, not
    counting `waited`, time the stage spent waiting for a CPU: it is enough on its own."""
    return any(
        now - e.since - waited >= config.confirm_timeout
        for e in evidence
        if e.kind not in CONSEQUENCES and e.kind not in NEVER_ALONE
    )


def head_verdict(
    config: DetectionConfig, target: TargetMemory, statuses: list[StageStatus], now: float
) -> list[Verdict]:
    """The head's own verdict when its server has stayed unhealthy for `remote_grace`
    only because a remote stage has no live replica: its ladder restarts the head, as
    for any dead stage. Once per spell; a local stage unwell is judged on its own."""
    failing = target.health_failures >= config.health_failures
    if not failing or now - target.health_failed_since < config.remote_grace:
        target.head_judged_for = None
        return []
    unwell = (StageState.STALLED, StageState.DEAD, StageState.UNKNOWN)
    if any(s.state in unwell and not s.remote for s in statuses):
        return []
    missing = [s for s in statuses if s.remote and s.state in unwell]
    if not missing or target.head_judged_for is not None:
        return []
    culprit = missing[0]
    target.head_judged_for = culprit.stage
    failed_for = now - target.health_failed_since
    evidence = (
        Evidence(
            EvidenceKind.HEALTH_FAILED,
            culprit.stage,
            target.health_failed_since + config.remote_grace,
            f"/health {target.health_detail} for {failed_for:.1f}s while remote stage"
            f" {culprit.stage} is {culprit.state.value} and every local stage is well:"
            " the head is restarted",
        ),
    )
    return [Verdict(culprit.stage, StageState.DEAD, now, evidence)]
