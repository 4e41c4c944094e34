"""End to end: a real watchdog's /metrics and incident trace through engine-dead-hang.

The simulated server (real processes) hangs as in the report; the watchdog in enforce mode
kills it. Its own /metrics then counts the incident, its steps and the release, passes
promtool, and the incident reaches an OTLP capture server as one trace.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from deadline import wait_for
from e2e.harness import FAST, SIM_ENV, attached, in_background, incident_done, warmed_up
from exporters.otlp_capture import CaptureServer, attributes
from prometheus_client.parser import text_string_to_metric_families

from omni_watchdog.app import Watchdog
from omni_watchdog.exporters.prometheus import UNKNOWN_HOST
from omni_watchdog.log import configure_logging
from omni_watchdog.semconv import INCIDENT_ID, INCIDENT_SPAN, LADDER_STEP_SPAN_PREFIX
from omni_watchdog.types import IncidentOutcome

pytestmark = pytest.mark.e2e


async def scrape(watchdog: Watchdog) -> tuple[str, str]:
    url = f"http://127.0.0.1:{watchdog.api_port}/metrics"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        assert response.status == 200
        return response.headers["Content-Type"], await response.text()


def value(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    raise AssertionError(f"no sample {name}{labels}")


def test_an_incident_shows_in_metrics_and_as_a_trace(tmp_path: Path) -> None:
    configure_logging("debug", (tmp_path / "watchdog.log").open("a"))

    async def scenario() -> tuple[str, str, str, CaptureServer, Any, str, str]:
        capture = CaptureServer()
        await capture.start()
        overrides = {**FAST, "otlp_export_endpoint": capture.url}
        try:
            async with attached(
                tmp_path, ["1:engine-dead-hang"], "0.11", "enforce", overrides, None, SIM_ENV
            ) as (watchdog, server):
                await warmed_up(watchdog)
                _, before = await scrape(watchdog)
                in_background(server.url)
                incident = await incident_done(watchdog)
                await wait_for(lambda: watchdog.state.counters.incidents, 5)
                content_type, after = await scrape(watchdog)
                stage = watchdog.state.topology.stage(incident.verdicts[0].stage.stage_id)
                assert stage is not None
                stage_name = stage.name
                host = watchdog.state.host
        finally:
            # Only now: the watchdog's stop, on leaving `attached`, exports the spans queued.
            await capture.stop()
        return content_type, before, after, capture, incident, stage_name, host

    content_type, before, after, capture, incident, stage_name, host = asyncio.run(scenario())

    assert content_type.startswith("text/plain; version=0.0.4")
    outcome = incident.outcome.value
    assert incident.outcome is IncidentOutcome.RECOVERED_BY_KILL
    assert value(before, "omni_watchdog_incidents_total", outcome=outcome) == 0
    assert value(before, "omni_watchdog_target_up") == 1
    assert value(after, "omni_watchdog_incidents_total", outcome=outcome) == 1
    assert value(after, "omni_watchdog_ladder_steps_total", step="kill", outcome="recovered") == 1
    assert value(after, "omni_watchdog_verdict_to_release_seconds_count") == 1
    verdict = incident.verdicts[0]
    verdicts = value(
        after,
        "omni_watchdog_verdicts_total",
        stage=str(verdict.stage.stage_id),
        stage_name=stage_name,
        host=host or UNKNOWN_HOST,
        state=verdict.state.value,
        evidence=verdict.evidence[0].kind.value,
    )
    assert verdicts >= 1

    spans = capture.spans()
    root = next(s for s in spans if s.name == INCIDENT_SPAN)
    assert attributes(root)[INCIDENT_ID] == incident.incident_id
    steps = [s.name for s in spans if s.parent_span_id == root.span_id]
    assert steps == [LADDER_STEP_SPAN_PREFIX + s.step.value for s in incident.steps]

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package 'prometheus'); live body not linted")
    checked = subprocess.run(
        [promtool, "check", "metrics"], input=after, capture_output=True, text=True, timeout=30
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
