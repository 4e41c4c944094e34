"""The watchdog's JSON API: status, the target's real health, incidents with their report
and stacks, and /metrics.

It serves the latest `WatchdogState` the evaluation loop pushed (`export`); nothing here
reads the watchdog itself. The watchdog adds the operator's actions (`operator.py`) to
the same application; every route here is read-only and open.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web

from omni_watchdog.exporters.prometheus import MetricsExposition
from omni_watchdog.exporters.report.page import render_incident_report
from omni_watchdog.exporters.views import incident_summary, status_of, target_health
from omni_watchdog.jsonable import to_jsonable
from omni_watchdog.types import Clock, Incident, IncidentBundles, OperatorAction, WatchdogState

# /healthz fails when the last evaluation is older than this (20 evaluation intervals, 5
# while the server is at rest):
# judging has stopped, and the watchdog could not see a hang.
EVALUATION_STALE_AFTER = 5.0
# Reads of a bundle (a report, stacks, an incident's files) that run at once, each in a
# thread whose Python work holds the GIL (16 reports at once kept the watchdog blind
# 11.5 s), and those in hand at all, running or waiting; past that a read is a 503.
READS_AT_ONCE = 2
READS_WAITING = 16
RETRY_READ_AFTER_SECONDS = 1


class BundleReads:
    """Runs the API's reads of incident bundles off the loop, a few at a time."""

    def __init__(self, at_once: int = READS_AT_ONCE, waiting: int = READS_WAITING) -> None:
        self._slots = asyncio.Semaphore(at_once)
        self._waiting = 0
        self._max_waiting = waiting
        self.refused = 0

    async def run(self, read: Callable[[], Any]) -> Any:
        """`read()` in a thread once a slot is free; a 503 if too many wait already."""
        if self._waiting >= self._max_waiting:
            self.refused += 1
            raise web.HTTPServiceUnavailable(
                text=json.dumps({"error": "too many incident reads at once, retry later"}),
                content_type="application/json",
                headers={"Retry-After": str(RETRY_READ_AFTER_SECONDS)},
            )
        self._waiting += 1
        try:
            async with self._slots:
                return await asyncio.to_thread(read)
        finally:
            self._waiting -= 1


class JsonApi:
    """The routes of `--listen`, over the latest state."""

    def __init__(
        self,
        clock: Clock,
        state: WatchdogState,
        metrics: MetricsExposition,
        bundles: IncidentBundles,
        actions_of: Callable[[str], Sequence[OperatorAction]] = lambda _: (),
        reads: BundleReads | None = None,
    ) -> None:
        """`actions_of(incident_id)` lists the operator's journaled actions on it; `reads`
        runs the reads of bundles (one of its own by default)."""
        self._clock = clock
        self._state = state
        self._metrics = metrics
        self._bundles = bundles
        self._actions_of = actions_of
        self.reads = reads or BundleReads()

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
        app.router.add_get("/v1/incidents/{incident_id}/stacks", self._stacks)
        app.router.add_get("/v1/incidents/{incident_id}/report", self._report)
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
        found = self._known(request)
        body = to_jsonable(found)
        body["files"] = await self.reads.run(lambda: self._bundles.names(found.incident_id))
        return web.json_response(body)

    async def _stacks(self, request: web.Request) -> web.Response:
        found = self._known(request)
        files = await self.reads.run(lambda: self._bundles.read(found.incident_id))
        return web.json_response({"stacks": stacks_of(files)})

    async def _report(self, request: web.Request) -> web.Response:
        found = self._known(request)
        # Files and journal are read, and the page made, off the loop: a large bundle must
        # not make the watchdog blind.
        page = await self.reads.run(lambda: self._render(found))
        return web.Response(text=page, content_type="text/html")

    def _render(self, incident: Incident) -> str:
        files = self._bundles.read(incident.incident_id)
        actions = [to_jsonable(a) for a in self._actions_of(incident.incident_id)]
        return render_incident_report(to_jsonable(incident), files, actions)

    def _known(self, request: web.Request) -> Incident:
        """The incident the path names; only a known one is looked for on disk."""
        wanted = request.match_info["incident_id"]
        found = next(
            (i for i in self._state.remediation.incidents if i.incident_id == wanted), None
        )
        if found is None:
            raise web.HTTPNotFound(
                text=json.dumps({"error": f"no incident {wanted}"}),
                content_type="application/json",
            )
        return found

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


def stacks_of(files: dict[str, str]) -> list[dict[str, Any]]:
    """Each captured stack of the bundle, with what `processes.json` says of its pid."""
    try:
        listed = json.loads(files.get("processes.json", "[]"))
        processes = {int(p["pid"]): p for p in listed if isinstance(p, dict) and "pid" in p}
    except (ValueError, TypeError, KeyError):
        processes = {}
    stacks = []
    for name, text in sorted(files.items()):
        folder, _, file_name = name.partition("/")
        pid_text = file_name.removesuffix(".txt")
        if folder != "stacks" or not pid_text.isdigit():
            continue
        process = processes.get(int(pid_text), {})
        stage = process.get("stage")
        stacks.append(
            {
                "pid": int(pid_text),
                "title": str(process.get("title", "")),
                "stage": f"{stage.get('stage_id')}.{stage.get('replica', 0)}"
                if isinstance(stage, dict)
                else None,
                "role": str(process.get("role", "")),
                "text": text,
            }
        )
    return stacks
