"""The watchdog's JSON API: status, the target's real health, and incidents."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from omni_watchdog.policy.incidents import to_jsonable
from omni_watchdog.types import Incident, StageState

if TYPE_CHECKING:
    from omni_watchdog.app import Watchdog

# /healthz fails when the last evaluation is older than this (20 evaluation intervals):
# judging has stopped, and the watchdog could not see a hang.
EVALUATION_STALE_AFTER = 5.0
# Liveness is about progress: slow (degraded) still passes, as vLLM's own /health would.
_LIVE_STATES = (StageState.HEALTHY, StageState.DEGRADED)


def status_of(watchdog: Watchdog) -> dict[str, Any]:
    """Everything /v1/status shows: stages, target, processes, probes, incidents."""
    clock = watchdog.clock
    now = clock.monotonic()

    def wall(monotonic_time: float | None) -> float | None:
        return None if monotonic_time is None else clock.wall() - (now - monotonic_time)

    report = watchdog.last_report
    processes = watchdog.tracker.recorded()
    gpu = watchdog.gpu.last_snapshot() if watchdog.gpu else {"devices": []}
    gpu_by_pid: dict[int, int] = {}
    for device in gpu.get("devices", []):
        for held in device["processes"]:
            gpu_by_pid[held["pid"]] = gpu_by_pid.get(held["pid"], 0) + held["used_bytes"]
    stages = []
    for status in report.statuses if report else ():
        pids = [p.pid for p in processes if p.stage == status.stage and p.status.value != "exited"]
        detector = watchdog.detector
        heartbeat = detector.last_heartbeat(status.stage)
        stages.append(
            {
                "stage_id": status.stage.stage_id,
                "replica": status.stage.replica,
                "name": status.name,
                "state": status.state.value,
                "since": wall(status.since),
                "evidence": [
                    {"kind": e.kind.value, "since": wall(e.since), "detail": e.detail}
                    for e in status.evidence
                ],
                "pids": pids,
                "gpu_memory_bytes": sum(gpu_by_pid.get(pid, 0) for pid in pids),
                "heartbeat_age_seconds": None if heartbeat is None else now - heartbeat,
                "last_progress": wall(detector.last_progress_of(status.stage)),
                "in_flight": detector.in_flight(status.stage.stage_id),
                "overdue": detector.overdue_count(status.stage.stage_id, now),
            }
        )
    root = watchdog.tracker.root
    health = watchdog.last_health
    current = next((i for i in reversed(watchdog.policy.incidents()) if i.closed is None), None)
    return {
        "mode": watchdog.policy.mode.value,
        "target": {
            "url": watchdog.config.target,
            "pid": root.pid if root else None,
            "alive": watchdog.target_up,
            "generation": watchdog.tracker.generation,
            "warmed_up": bool(report and report.warmed_up),
            "health": None
            if health is None
            else {"outcome": health.outcome, "detail": health.detail},
        },
        "topology": {
            "source": watchdog.topology.source,
            "stages": [to_jsonable(stage) for stage in watchdog.topology.stages],
        },
        "stages": stages,
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
            for p in processes
        ],
        "probes": {
            name: {
                "up": h.up,
                "errors_total": h.errors_total,
                "last_error": h.last_error,
                "duration_seconds": h.last_duration,
            }
            for name, h in sorted(watchdog.probe_health.items())
        },
        "gpu": gpu,
        "incident": None if current is None else current.incident_id,
        "remediation_budget_remaining": watchdog.policy.budget_remaining(),
        "lock": to_jsonable(watchdog.policy.lock_status()),
        "watchdog": {
            "evaluation_age_seconds": watchdog.evaluation_age(),
            "internal_errors": dict(watchdog.internal_errors),
            "state_write_errors": watchdog.write_errors.total,
            "last_state_write_error": watchdog.write_errors.last,
        },
    }


def target_health(watchdog: Watchdog) -> tuple[int, str]:
    """200 only while every stage is healthy or degraded; else 503 and the reason."""
    report = watchdog.last_report
    if not watchdog.target_up:
        if "processes" in watchdog.config.probes.enabled:
            return 503, "target server process not found"
        return 503, "target server does not answer /health"
    if report is None:
        return 503, "no evaluation yet"
    bad = [s for s in report.statuses if s.state not in _LIVE_STATES]
    if not bad:
        return 200, "every stage is healthy or degraded"
    reasons = []
    for status in bad:
        why = "; ".join(e.detail for e in status.evidence[:2])
        reasons.append(
            f"stage {status.stage} ({status.name}) {status.state.value}"
            + (f": {why}" if why else "")
        )
    return 503, "\n".join(reasons)


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


def build_api(watchdog: Watchdog) -> web.Application:
    """The aiohttp application served on `--listen`."""

    async def status(_: web.Request) -> web.Response:
        return web.json_response(status_of(watchdog))

    async def health(_: web.Request) -> web.Response:
        code, reason = target_health(watchdog)
        return web.Response(status=code, text=reason + "\n")

    async def incidents(_: web.Request) -> web.Response:
        return web.json_response(
            {"incidents": [incident_summary(i) for i in watchdog.policy.incidents()]}
        )

    async def incident(request: web.Request) -> web.Response:
        found = watchdog.policy.incident(request.match_info["incident_id"])
        if found is None:
            raise web.HTTPNotFound(text="no such incident\n")
        body = to_jsonable(found)
        body["files"] = [
            str(path.relative_to(watchdog.bundles.directory(found.incident_id)))
            for path in watchdog.bundles.files(found.incident_id)
        ]
        return web.json_response(body)

    async def own_health(_: web.Request) -> web.Response:
        age = watchdog.evaluation_age()
        if age is None or age > EVALUATION_STALE_AFTER:
            # Judging has stopped (or never started): the watchdog cannot see a hang.
            seen = "no evaluation yet" if age is None else f"last evaluation {age:.1f}s ago"
            return web.Response(status=503, text=f"not evaluating: {seen}\n")
        return web.Response(text="ok\n")

    async def metrics(_: web.Request) -> web.Response:
        exposition = watchdog.exposition
        return web.Response(
            body=exposition.render(), headers={"Content-Type": exposition.content_type}
        )

    app = web.Application()
    app.router.add_get("/v1/status", status)
    app.router.add_get("/v1/target/health", health)
    app.router.add_get("/v1/incidents", incidents)
    app.router.add_get("/v1/incidents/{incident_id}", incident)
    app.router.add_get("/healthz", own_health)
    app.router.add_get("/metrics", metrics)
    return app
