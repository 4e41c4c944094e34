"""Exits: what confirms that a stage process's exit killed its stage, and whether the
server's own exit was a crash or a clean stop."""

from __future__ import annotations

from omni_watchdog.config import DetectionConfig
from omni_watchdog.detector.memory import StageMemory, TargetMemory
from omni_watchdog.types import (
    Evidence,
    EvidenceKind,
    ProcessRole,
    StageRef,
    StageState,
    TargetExit,
)

# Roles whose exit means the stage lost its engine; a helper child exiting is only reported.
STAGE_ROLES = (ProcessRole.STAGE, ProcessRole.ENGINE, ProcessRole.WORKER)
# A clean stop takes its engine down a moment before the server itself (vLLM: all gone in
# under 0.5 s), so only signs older than this before the exit can make it a crash.
EXIT_SETTLE = 1.0


def after_exit(
    target: TargetMemory, ref: StageRef, memory: StageMemory, evidence: list[Evidence], now: float
) -> list[Evidence]:
    """What the server and the GPU said after one of the stage's processes exited: one
    failed /health or canary then confirms the death without waiting for N in a row. A
    refused /health is what a server that stops on purpose shows first, so it never
    counts. The driver letting go of the memory an exited stage process held confirms
    it too, from the device's side: a replica whose siblings still serve leaves
    /health at 200."""
    exit_at = min((e.since for e in evidence if e.kind is EvidenceKind.PROCESS_EXIT), default=None)
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
        for since, pid in released_after_exit(target, memory)[:1]
        if since <= now
    ]
    unwell = target.health_unwell
    if EvidenceKind.HEALTH_FAILED not in kinds and unwell is not None and unwell[0] >= exit_at:
        found.append(
            Evidence(
                EvidenceKind.HEALTH_FAILED,
                ref,
                unwell[0],
                f"/health {unwell[1]} after the exit",
            )
        )
    canary = target.canary_last_failed
    if EvidenceKind.CANARY_FAILED not in kinds and canary is not None and canary >= exit_at:
        found.append(
            Evidence(
                EvidenceKind.CANARY_FAILED,
                ref,
                canary,
                f"{target.canary_detail} after the exit",
            )
        )
    return found


def released_after_exit(target: TargetMemory, memory: StageMemory) -> list[tuple[float, int]]:
    """(from when it counts, pid) of each exited stage process that held GPU memory and
    that a reading taken after its exit no longer lists, earliest first. A clean stop
    takes the engine down a moment before the server, so it counts only once the
    server has outlived the exit by `EXIT_SETTLE`."""
    read_at = target.gpu_read_at
    if read_at is None or not target.root_alive():
        return []
    found = []
    for pid, process in memory.processes.items():
        exited_at = process.exited_at
        if (
            exited_at is not None
            and process.info.role in STAGE_ROLES
            and memory.gpu_bytes.get(pid, 0.0) > 0
            and memory.gpu_seen_at.get(pid, read_at) < read_at
            and read_at >= exited_at
        ):
            found.append((max(read_at, exited_at + EXIT_SETTLE), pid))
    return sorted(found)


def server_gone(target: TargetMemory, ref: StageRef) -> Evidence:
    """What every stage shows once the server's root process is gone."""
    root = f"pid {target.root.pid}" if target.root else "the server"
    return Evidence(EvidenceKind.PROCESS_EXIT, ref, target.root_exited_at or 0.0, f"{root} exited")


def target_exit(config: DetectionConfig, target: TargetMemory) -> TargetExit | None:
    """The server's exit, once: a crash where a stage was unwell or something looked wrong
    within `crash_window` before it (and at least `EXIT_SETTLE` before it), with why."""
    if target.root_exited_at is None or target.exit_reported:
        return None
    target.exit_reported = True
    horizon = target.root_exited_at - config.crash_window
    settled = target.root_exited_at - EXIT_SETTLE
    reasons = tuple(text for time, text in target.unhealthy_signs if horizon <= time <= settled)
    bad_states = [
        f"stage {ref} was {memory.state.value}"
        for ref, memory in target.stages.items()
        if memory.state in (StageState.DEGRADED, StageState.STALLED, StageState.DEAD)
    ]
    reasons = tuple(bad_states) + reasons
    root = target.root.identity if target.root else None
    return TargetExit(target.root_exited_at, bool(reasons), reasons[-12:], root)
