"""The watchdog's JSON API: status, the target's real health, incidents, and /metrics.

It serves the latest `WatchdogState` the evaluation loop pushed (`export`); nothing here
reads the watchdog itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from aiohttp import web

from omni_watchdog.exporters.prometheus import MetricsExposition
from omni_watchdog.exporters.views import incident_summary, status_of, target_health
from omni_watchdog.policy.incidents import to_jsonable
from omni_watchdog.types import Clock, WatchdogState

# /healthz fails when the last evaluation is older than this (20 evaluation intervals):
# judging has stopped, and the watchdog could not see a hang.
EVALUATION_STALE_AFTER = 5.0


class JsonApi:
    """The routes of `--listen`, over the latest state."""

    def __init__(
        self,
        clock: Clock,
        state: WatchdogState,
        metrics: MetricsExposition,
        bundle_files: Callable[[str], Sequence[str]],
    ) -> None:
        """`bundle_files(incident_id)` lists an incident's bundle files, relative to it."""
        self._clock = clock
        self._state = state
        self._metrics = metrics
        self._bundle_files = bundle_files

    def export(self, state: WatchdogState) -> None:
        self._state = state

    def evaluation_age(self) -> float | None:
        """Seconds since the last evaluation; None before the first."""
        last = self._state.self_health.last_evaluation
        return None if last is None else self._clock.monotonic() - last

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/status", self._status)
        app.router.add_get("/v1/target/health", self._target_health)
        app.router.add_get("/v1/incidents", self._incidents)
        app.router.add_get("/v1/incidents/{incident_id}", self._incident)
        app.router.add_get("/healthz", self._own_health)
        app.router.add_get("/metrics", self._scrape)
        return app

    async def _status(self, _: web.Request) -> web.Response:
        return web.json_response(status_of(self._state, self._clock.monotonic()))

    async def _target_health(self, _: web.Request) -> web.Response:
        code, reason = target_health(self._state)
        return web.Response(status=code, text=reason + "\n")

    async def _incidents(self, _: web.Request) -> web.Response:
        incidents = self._state.remediation.incidents
        return web.json_response({"incidents": [incident_summary(i) for i in incidents]})

    async def _incident(self, request: web.Request) -> web.Response:
        wanted = request.match_info["incident_id"]
        found = next(
            (i for i in self._state.remediation.incidents if i.incident_id == wanted), None
        )
        if found is None:
            raise web.HTTPNotFound(text="no such incident\n")
        body = to_jsonable(found)
        body["files"] = list(self._bundle_files(found.incident_id))
        return web.json_response(body)

    async def _own_health(self, _: web.Request) -> web.Response:
        age = self.evaluation_age()
        if age is None or age > EVALUATION_STALE_AFTER:
            # Judging has stopped (or never started): the watchdog cannot see a hang.
            seen = "no evaluation yet" if age is None else f"last evaluation {age:.1f}s ago"
            return web.Response(status=503, text=f"not evaluating: {seen}\n")
        return web.Response(text="ok\n")

    async def _scrape(self, _: web.Request) -> web.Response:
        metrics = self._metrics
        response = web.Response(
            body=metrics.render(), headers={"Content-Type": metrics.content_type}
        )
        # Prometheus asks for gzip on every scrape; the exposition shrinks about tenfold.
        response.enable_compression()
        return response
