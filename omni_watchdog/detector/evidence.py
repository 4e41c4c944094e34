"""Evidence: what the memory of a stage, and of the server as a whole, says against it
now, each piece with the moment it began to stand and words an operator can check.

Silence is counted in seen time: what the watchdog could not look at (its own blind
spells) is left out of every figure, and said so.
"""

from __future__ import annotations

from collections.abc import Callable

from omni_watchdog.config import DetectionConfig
from omni_watchdog.detector.exits import STAGE_ROLES
from omni_watchdog.detector.memory import (
    StageMemory,
    TargetMemory,
    heartbeat_timeout,
    load,
    step_allowance,
)
from omni_watchdog.detector.starved import cpu_note
from omni_watchdog.detector.work import waiting_unworked
from omni_watchdog.types import Evidence, EvidenceKind, ProcessStatus, StageRef

# Evidence of the target as a whole (/health, the canary), not yet charged to a stage:
# its kind, since when it stands, and its words.
TargetEvidence = tuple[EvidenceKind, float, str]


def own_evidence(
    config: DetectionConfig, target: TargetMemory, ref: StageRef, memory: StageMemory, now: float
) -> list[Evidence]:
    """What the stage's own signals say: its loop's silence, its requests late or waiting
    with its counters flat, its counters flat under load, its processes, its lost link."""
    found: list[Evidence] = []
    if memory.last_heartbeat is not None:
        found += silence(
            target,
            EvidenceKind.HEARTBEAT_LOST,
            ref,
            memory.last_heartbeat,
            heartbeat_timeout(config, memory),
            now,
            lambda silent: (
                f"no loop heartbeat for {silent:.1f}s{rhythm_note(config, memory)}"
                f"{cpu_note(memory.processes.values())}"
            ),
        )
    limit = deadline(config, target, ref.stage_id)
    late = target.pending.overdue(ref.stage_id, limit, now, target.blind)
    unworked = waiting_unworked(config, target, ref, memory, now)
    if late:
        found += silence(
            target,
            EvidenceKind.SPAN_OVERDUE,
            ref,
            late[0].due_since,
            limit,
            now,
            lambda _: (
                f"{len(late)} request(s) past the {limit:.1f}s deadline,"
                f" oldest {late[0].request_id}"
            ),
        )
    elif unworked is not None:
        oldest, flat_from = unworked
        found += silence(
            target,
            EvidenceKind.SPAN_OVERDUE,
            ref,
            flat_from,
            config.progress_timeout,
            now,
            lambda flat: (
                f"{target.pending.in_flight(ref.stage_id)} request(s) waiting at the stage,"
                f" oldest {oldest.request_id}, and its step counters flat for {flat:.1f}s"
            ),
        )
    on_stage = load(config, memory, now)
    if on_stage > 0 and memory.load_positive_since is not None:
        flat_from = max(memory.progress_changed_at or 0.0, memory.load_positive_since)
        if now - flat_from > config.progress_timeout:
            found.append(
                Evidence(
                    EvidenceKind.PROGRESS_FLAT,
                    ref,
                    flat_from + config.progress_timeout,
                    f"{on_stage:g} request(s) on the stage, counters flat for"
                    f" {now - flat_from:.1f}s",
                )
            )
    found.extend(process_evidence(config, target, ref, memory, now))
    link_down = target.link_down_since
    if link_down is not None and now - link_down > config.link_grace:
        found.append(
            Evidence(
                EvidenceKind.LINK_LOST,
                ref,
                link_down + config.link_grace,
                f"{target.link_detail} for {now - link_down:.1f}s: the stage is orphaned",
            )
        )
    return found


def silence(
    target: TargetMemory,
    kind: EvidenceKind,
    ref: StageRef,
    since: float,
    timeout: float,
    now: float,
    describe: Callable[[float], str],
) -> list[Evidence]:
    """Evidence of `kind` once more than `timeout` of seen time has passed since
    `since`, held from the moment it ran out; `describe` words the seen seconds."""
    seen = target.blind.seen(since, now)
    if seen <= timeout:
        return []
    return [
        Evidence(kind, ref, now - (seen - timeout), describe(seen) + _unseen(now - since - seen))
    ]


def process_evidence(
    config: DetectionConfig, target: TargetMemory, ref: StageRef, memory: StageMemory, now: float
) -> list[Evidence]:
    """What the stage's processes say: one exited, one stopped or in D too long, or none
    using a CPU while the stage is silent or has work queued."""
    found: list[Evidence] = []
    exits = [
        p
        for p in memory.processes.values()
        if p.exited_at is not None and p.info.role in STAGE_ROLES
    ]
    if exits and target.root_alive():
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
        and now - silent_since > heartbeat_timeout(config, memory)
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
    if live and load(config, memory, now) > 0 and memory.load_positive_since is not None:
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


def target_evidence(
    config: DetectionConfig, target: TargetMemory, now: float
) -> list[TargetEvidence]:
    """/health failing `health_failures` times in a row, and a failing canary."""
    shared: list[TargetEvidence] = []
    if target.health_failures >= config.health_failures:
        shared.append(
            (
                EvidenceKind.HEALTH_FAILED,
                target.health_confirmed_at,
                f"/health {target.health_detail}, {target.health_failures} times in a row"
                f" over {now - target.health_failed_since:.1f}s",
            )
        )
    if target.canary_failed_at is not None:
        shared.append((EvidenceKind.CANARY_FAILED, target.canary_failed_at, target.canary_detail))
    return shared


def gpu_held(ref: StageRef, memory: StageMemory, now: float) -> list[Evidence]:
    """The GPU memory a stalled or dead stage's processes still hold (the exited ones'
    too, when none lives): shown beside its verdict, never counted towards one."""
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


def deadline(config: DetectionConfig, target: TargetMemory, stage_id: int) -> float:
    """How long a request may stay at a stage before its span is overdue."""
    p99s = [
        quantile
        for ref, memory in target.stages.items()
        if ref.stage_id == stage_id and (quantile := memory.durations.quantile(0.99)) is not None
    ]
    learned = config.overdue_multiplier * max(p99s) if p99s else 0.0
    return max(config.overdue_floor, learned)


def overdue_count(config: DetectionConfig, target: TargetMemory, stage_id: int, now: float) -> int:
    """Requests that have waited at the stage past its deadline."""
    limit = deadline(config, target, stage_id)
    return len(target.pending.overdue(stage_id, limit, now, target.blind))


def rhythm_note(config: DetectionConfig, memory: StageMemory) -> str:
    """Why a stage's heartbeat timeout is longer than the configured one, if it is."""
    timeout = heartbeat_timeout(config, memory)
    if timeout <= config.heartbeat_timeout:
        return ""
    if timeout == step_allowance(config, memory):
        step = memory.step_seconds.quantile(0.99) or 0.0
        return f" (its denoising steps take up to {step:.1f}s, so {timeout:.1f}s allowed)"
    return (
        f" (its rhythm: healthy gaps up to {memory.beat_gaps.quantile(0.99) or 0.0:.1f}s,"
        f" so {timeout:.1f}s allowed)"
    )


def _unseen(blind: float) -> str:
    """What evidence says of the watchdog's own blindness, so nobody reads it as the
    server's: the time is left out of the figure before it."""
    return f" (and {blind:.1f}s the watchdog itself could not look)" if blind >= 0.05 else ""
