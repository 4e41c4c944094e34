"""The composition root: a watchdog built from fakes is whole before it starts.

The first release's exporters read attributes that existed only after `start()`, so a
built watchdog could not render its own /metrics. Now the factory hands every exporter a
first state: a watchdog that was built and never started (or failed to start) still
renders every family, serves its status, and stops cleanly.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestClient, TestServer
from fakes import FakeDevice, FakeNvml, FakePsutil, fake_host, local_config
from prometheus_client.parser import text_string_to_metric_families

from omni_watchdog.clock import FakeClock
from omni_watchdog.config import load_config
from omni_watchdog.exporters.prometheus import FAMILY_NAMES
from omni_watchdog.factory import build_watchdog, this_host
from omni_watchdog.probes.activity import ActivityProbe
from omni_watchdog.types import ProcessHost


def test_a_built_watchdog_renders_and_serves_before_it_starts(tmp_path: Path) -> None:
    config = load_config(
        None,
        overrides={
            "target": "http://127.0.0.1:8000",
            "state_dir": str(tmp_path / "state"),
            "detection": {"work_timeouts": {"compiling": "30m"}},
        },
        environ={},
    )

    async def scenario() -> tuple[str, int, dict[str, Any]]:
        watchdog = await build_watchdog(
            config,
            clock=FakeClock(1000.0, 1_700_000_000.0),
            host=fake_host(FakePsutil()),
            nvml=FakeNvml([FakeDevice(used=2**30, total=2**34, utilization=0)]),
        )
        try:
            async with TestClient(TestServer(watchdog.api_app())) as client:
                body = await (await client.get("/metrics")).text()
                healthz = await client.get("/healthz")
                status = await (await client.get("/v1/status")).json()
            return body, healthz.status, status
        finally:
            await watchdog.stop()

    body, healthz, status = asyncio.run(scenario())
    # The budgets the detector grants work are the configured ones.
    assert 'omni_watchdog_work_budget_seconds{cause="compiling"} 1800.0' in body
    assert 'omni_watchdog_work_budget_seconds{cause="loading"} 600.0' in body
    names = {family.name for family in text_string_to_metric_families(body)}
    assert names == {name.removesuffix("_total") for name in FAMILY_NAMES}
    # Not evaluating yet: the watchdog says so rather than claiming health.
    assert healthz == 503
    assert status["mode"] == config.mode.value
    assert status["stages"] == []
    assert status["topology"]["source"] == "default"
    # Before the first evaluation the one default stage is starting, nothing worse.
    host = config.resolved_host()
    assert (
        f'omni_watchdog_stage_state{{stage="0",stage_name="engine",replica="0",host="{host}",'
        'state="starting"} 1' in body
    )


def kernel_readers_run(host: ProcessHost, state: Path) -> set[str]:
    """Which of the readers that ask the kernel about a pid a watchdog built over `host` runs."""

    async def scenario() -> set[str]:
        watchdog = await build_watchdog(
            local_config(state),
            clock=FakeClock(1000.0, 1_700_000_000.0),
            host=host,
            nvml=FakeNvml([FakeDevice(used=0, total=2**34, utilization=0)]),
        )
        try:
            runs = {
                "exit_notices": watchdog._tracker._exits is not None,
                "socket_owners": watchdog._receiver._endpoint._connections is not None,
                "activity": any(
                    probe.name == ActivityProbe.name for probe, _ in watchdog._periodic
                ),
            }
            return {reader for reader, running in runs.items() if running}
        finally:
            await watchdog.stop()

    return asyncio.run(scenario())


def test_a_fake_host_gets_no_reader_that_asks_this_kernel_about_its_pids(
    tmp_path: Path,
) -> None:
    # A fake table's pids are not this kernel's: a pidfd, a socket's owner or a /proc read
    # of one of them would be some other process's.
    assert kernel_readers_run(fake_host(FakePsutil()), tmp_path / "state") == set()


def test_this_host_gets_every_reader_of_this_kernel(tmp_path: Path) -> None:
    assert kernel_readers_run(this_host(), tmp_path / "state") == {
        "exit_notices",
        "socket_owners",
        "activity",
    }
