"""End to end: a real Prometheus scrapes the watchdog during a hang and the alert fires.

The simulated server runs the report's `1:engine-dead-hang` with the watchdog in observe
mode (so the hang lasts), and Prometheus (Debian's `prometheus` binary) scrapes the
watchdog's `/metrics` every second and evaluates `alerts/omni-watchdog.rules.yml` every
second. The real rules wait minutes (`for:`) before firing; this test loads a copy with
every `for:` shortened to a few seconds and nothing else changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from deadline import wait_for
from e2e.harness import FAST, SIM_ENV, attached, run_scenario, warmed_up
from ports import free_port
from test_alerts import RULES, prometheus_tool

from omni_watchdog.demo import send_request
from omni_watchdog.log import configure_logging

pytestmark = pytest.mark.e2e

SHORT_FOR = "2s"
# The stage-1 hang is judged stalled, or dead once the engine's exit is seen.
HANG_ALERTS = {"OmniStageStalled", "OmniStageDead"}
# How often Prometheus is asked: it scrapes and evaluates every second.
PROMETHEUS_EVERY = 0.5


def rules_with_short_for(path: Path) -> Path:
    """A copy of the alerting rules with each `for:` cut to SHORT_FOR, all else identical."""
    document = yaml.safe_load(RULES.read_text())
    for group in document["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = SHORT_FOR
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def prometheus_config(path: Path, rules: Path, watchdog_port: int) -> Path:
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules)],
        "scrape_configs": [
            {
                "job_name": "omni-watchdog",
                "metrics_path": "/metrics",
                "static_configs": [{"targets": [f"127.0.0.1:{watchdog_port}"]}],
            }
        ],
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


class PrometheusServer:
    """A Prometheus server this test started, on a free loopback port with its own TSDB."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / "prometheus.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, config: Path) -> None:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [
                    prometheus_tool("prometheus"),
                    f"--config.file={config}",
                    f"--storage.tsdb.path={self.workdir / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[PrometheusServer]:
    prometheus_tool("prometheus")
    server = PrometheusServer(tmp_path)
    yield server
    server.stop()


async def api(session: aiohttp.ClientSession, url: str) -> Any:
    """The `data` of a Prometheus API answer, or None while it is not ready."""
    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as response:
            if response.status == 200:
                return (await response.json())["data"]
    return None


def test_a_hang_fires_the_stage_alert_in_prometheus(
    tmp_path: Path, prometheus: PrometheusServer
) -> None:
    configure_logging("debug", (tmp_path / "watchdog.log").open("a"))
    rules = rules_with_short_for(tmp_path / "omni-watchdog.rules.yml")

    async def scenario() -> list[dict[str, Any]]:
        async with (
            attached(tmp_path, ["1:engine-dead-hang"], "0.11", "observe", FAST, None, SIM_ENV) as (
                watchdog,
                server,
            ),
            aiohttp.ClientSession() as session,
        ):
            assert watchdog.api_port is not None
            prometheus.start(
                prometheus_config(tmp_path / "prometheus.yml", rules, watchdog.api_port)
            )
            targets_url = prometheus.url + "/api/v1/targets"

            async def scraped() -> bool:
                data = await api(session, targets_url)
                return bool(data) and any(t["health"] == "up" for t in data["activeTargets"])

            await wait_for(
                scraped, 30, "Prometheus scraping the watchdog's /metrics", PROMETHEUS_EVERY
            )
            await warmed_up(watchdog)
            request = asyncio.create_task(send_request(server.url))
            alerts: list[dict[str, Any]] = []

            async def firing() -> bool:
                data = await api(session, prometheus.url + "/api/v1/alerts")
                alerts[:] = data["alerts"] if data else []
                return any(
                    a["labels"]["alertname"] in HANG_ALERTS and a["state"] == "firing"
                    for a in alerts
                )

            await wait_for(firing, 60, "a stage alert firing", PROMETHEUS_EVERY)
            request.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await request
            # Observe mode: the watchdog recorded the hang and left the server alone.
            incidents = watchdog.state.remediation.incidents
            assert all(i.outcome.value in ("open", "observed") for i in incidents)
            assert server.process.poll() is None
            return alerts

    try:
        alerts = run_scenario(scenario())
    except (AssertionError, TimeoutError) as failure:
        raise AssertionError(f"{failure}\nprometheus log:\n{prometheus.log()}") from failure
    fired = [a for a in alerts if a["labels"]["alertname"] in HANG_ALERTS]
    stage = next(a for a in fired if a["state"] == "firing")
    assert stage["labels"]["stage"] == "1"
    assert stage["labels"]["stage_name"] == "talker"
    assert stage["labels"]["severity"] == "critical"
    assert stage["labels"]["job"] == "omni-watchdog"
    assert stage["annotations"]["runbook_url"].endswith("#" + stage["labels"]["alertname"].lower())
