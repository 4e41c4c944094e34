"""What a state says, in the words the API and the exposition share: pure functions of
a `WatchdogState`, so both show the same answer."""

from __future__ import annotations

from typing import Any

from omni_watchdog.jsonable import to_jsonable
from omni_watchdog.types import Incident, ProbeHealth, StageState, StageStatus, WatchdogState

# Liveness is about progress: slow (degraded) still passes, as vLLM's own /health would.
_LIVE_STATES = (StageState.HEALTHY, StageState.DEGRADED)


def target_health(state: WatchdogState) -> tuple[int, str]:
    """200 only while every local stage is healthy or degraded; else 503 and the reason.

    A remote stage is judged, and restarted, on its own host: a liveness probe that
    followed it would restart the head before `remote_grace`, for a stage the head cannot
    bring back. The head's own verdict after that grace is a local matter again."""
    report = state.report
    if not state.target.up:
        if state.target.by_process:
            return 503, "target server process not found"
        return 503, "target server does not answer /health"
    if report is None:
        return 503, "no evaluation yet"
    bad = [s for s in report.statuses if s.state not in _LIVE_STATES and not s.remote]
    pipeline = report.pipeline
    if pipeline is not None and pipeline.state not in _LIVE_STATES:
        bad.insert(0, pipeline)
    if not bad:
        return 200, "every stage is healthy or degraded"
    reasons = []
    for status in bad:
        why = "; ".join(e.detail for e in status.evidence[:2])
        subject = (
            f"target {status.state.value}, stage unknown"
            if status.stage.whole_pipeline
            else f"stage {status.stage} ({status.name}) {status.state.value}"
        )
        reasons.append(subject + (f": {why}" if why else ""))
    return 503, "\n".join(reasons)


def stage_host(state: WatchdogState, status: StageStatus | None) -> str:
    """Where a stage replica runs: its spans' word if remote, else this host; "" if unknown."""
    if status is not None and status.remote:
        return status.host
    return state.host


def status_of(state: WatchdogState, now: float) -> dict[str, Any]:
    """Everything /v1/status shows: stages, target, processes, probes, incidents."""

    def wall(monotonic_time: float | None) -> float | None:
        return None if monotonic_time is None else state.wall(monotonic_time)

    report = state.report
    gpu_by_pid = state.gpu.used_by_pid if state.gpu is not None else {}
    stages = []
    for status in report.statuses if report else ():
        pids = [
            p.pid for p in state.processes if p.stage == status.stage and p.status.value != "exited"
        ]
        heartbeat = status.last_heartbeat
        requests = report.requests.get(status.stage.stage_id) if report else None
        stages.append(
            {
                "stage_id": status.stage.stage_id,
                "replica": status.stage.replica,
                "name": status.name,
                "remote": status.remote,
                "host": stage_host(state, status) or None,
                "state": status.state.value,
                "since": wall(status.since),
                "evidence": [
                    {"kind": e.kind.value, "since": wall(e.since), "detail": e.detail}
                    for e in status.evidence
                ],
                "pids": pids,
                # This host's NVML cannot see a remote stage's memory: unknown, not zero.
                "gpu_memory_bytes": None
                if status.remote
                else sum(gpu_by_pid.get(pid, 0) for pid in pids),
                "cause": None
                if status.cause is None
                else {
                    "cause": status.cause.cause.value,
                    "since": wall(status.cause.since),
                    "seconds": now - status.cause.since,
                    "working": status.cause.working,
                    "detail": status.cause.detail,
                },
                "heartbeat_age_seconds": None if heartbeat is None else now - heartbeat,
                "last_progress": wall(status.last_progress),
                "in_flight": requests.in_flight if requests else 0,
                "overdue": requests.overdue if requests else 0,
                "request_errors": status.request_errors,
                # A diffusion stage's requests in their denoising steps, and its pace.
                "denoising": [
                    {
                        "request_id": request.request_id,
                        "step": request.step,
                        "steps": request.steps or None,
                        "step_seconds": now - request.since,
                    }
                    for request in status.denoising
                ],
                "seconds_per_step": status.seconds_per_step,
            }
        )
    target = state.target
    health = target.health
    current = state.remediation.open_incident
    last_evaluation = state.self_health.last_evaluation
    pause = state.remediation.pause
    link = state.link
    return {
        "now": state.wall(now),
        "host": state.host or None,
        "mode": state.remediation.mode.value,
        "link": None
        if link is None
        else {
            "address": link.address,
            "port": link.port,
            "up": link.up,
            "since": state.wall(link.since),
            "detail": link.detail,
        },
        "pause": None
        if pause is None
        else {"since": pause.since, "until": pause.until, "reason": pause.reason},
        "target": {
            "url": target.url,
            "pid": target.root.pid if target.root else None,
            "alive": target.up,
            "generation": target.generation,
            "warmed_up": bool(report and report.warmed_up),
            "health": None
            if health is None
            else {"outcome": to_jsonable(health.outcome), "detail": health.detail},
        },
        "topology": {
            "source": state.topology.source,
            "stages": [to_jsonable(stage) for stage in state.topology.stages],
        },
        "stages": stages,
        # The target as a whole while its /health or canary fails and no stage's own
        # readings answer for it ("target stalled, stage unknown"); null otherwise.
        "pipeline": None
        if report is None or report.pipeline is None
        else {
            "state": report.pipeline.state.value,
            "since": wall(report.pipeline.since),
            "evidence": [
                {"kind": e.kind.value, "since": wall(e.since), "detail": e.detail}
                for e in report.pipeline.evidence
            ],
        },
        "processes": [
            {
                "pid": p.pid,
                "ppid": p.ppid,
                "pgid": p.pgid,
                "sid": p.sid,
                "title": p.title,
                "role": p.role.value,
                "stage": None if p.stage is None else str(p.stage),
                "status": p.status.value,
                "orphaned": p.orphaned,
                "gpu_memory_bytes": gpu_by_pid.get(p.pid, 0),
            }
            for p in state.processes
        ],
        "probes": {h.name: _probe(h) for h in sorted(state.probes, key=lambda h: h.name)},
        "gpu": to_jsonable(state.gpu),
        "incident": None if current is None else current.incident_id,
        "remediation_budget_remaining": state.remediation.budget_remaining,
        "lock": to_jsonable(state.remediation.lock),
        "watchdog": {
            "evaluation_age_seconds": None if last_evaluation is None else now - last_evaluation,
            "internal_errors": dict(state.self_health.internal_errors),
            "state_write_errors": state.self_health.state_write_errors,
            "last_state_write_error": state.self_health.last_state_write_error,
        },
    }


def _probe(health: ProbeHealth) -> dict[str, Any]:
    shown: dict[str, Any] = {
        "up": health.up,
        "errors_total": health.errors_total,
        "last_error": health.last_error,
        "duration_seconds": health.last_duration,
    }
    if health.stack_sample_errors_total is not None:
        shown["stack_sample_errors_total"] = health.stack_sample_errors_total
        shown["last_stack_sample_error"] = health.last_stack_sample_error
    return shown


def incident_summary(incident: Incident) -> dict[str, Any]:
    return {
        "incident_id": incident.incident_id,
        "mode": incident.mode.value,
        "opened": incident.opened,
        "closed": incident.closed,
        "cause": incident.cause,
        "outcome": incident.outcome.value,
        "steps": [
            {"step": s.step.value, "outcome": s.outcome.value, "duration": s.duration}
            for s in incident.steps
        ],
        "bundle_dir": incident.bundle_dir,
    }
