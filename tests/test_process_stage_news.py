"""A process's stage, named by its spans' resource, reaches the process tracker.

The spans receiver tells each pid's stage as a PROCESS_STAGE observation when it is news;
the watchdog hands it to the tracker, whose next scan maps the process by it (a diffusion
stage's worker, whose title names no stage, is known only so).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
from deadline import wait_for
from fakes import FakeDevice, FakeNvml, FakePsutil, fake_host, local_config
from otlp_bodies import batch

from omni_watchdog.clock import FakeClock
from omni_watchdog.factory import build_watchdog
from omni_watchdog.probes.otlp_decode import PROTOBUF
from omni_watchdog.process_start import start_time_of_ticks
from omni_watchdog.semconv import (
    HEARTBEAT_SPAN,
    PROCESS_KIND,
    PROCESS_PID,
    PROCESS_START_TICKS,
    STAGE_ID,
)
from omni_watchdog.types import ProcessInfo, ProcessRole, StageRef, WatchdogState

WORKER_TICKS = 123_456


def test_the_tracker_maps_a_process_by_the_stage_its_spans_name(tmp_path: Path) -> None:
    table = FakePsutil(port=9)  # local_config's target
    table.add(100, 1, "vllm serve")
    table.add(101, 100, "python worker.py", create_time=start_time_of_ticks(WORKER_TICKS))
    table.listening = [100]
    worker = {PROCESS_PID: 101, PROCESS_START_TICKS: WORKER_TICKS, PROCESS_KIND: "stage"}

    async def scenario() -> tuple[ProcessInfo, bool, ProcessInfo]:
        watchdog = await build_watchdog(
            local_config(tmp_path / "state"),
            clock=FakeClock(1000.0, 1_700_000_000.0),
            host=fake_host(table),
            nvml=FakeNvml([FakeDevice(used=0, total=2**34, utilization=0)]),
        )
        try:
            await watchdog.start()
            before = await wait_for(lambda: worker_of(watchdog.state), 10)
            async with (
                aiohttp.ClientSession() as session,
                session.post(
                    f"http://127.0.0.1:{watchdog.otlp_port}/v1/traces",
                    data=batch({**worker, STAGE_ID: 0}, [(HEARTBEAT_SPAN, {})]),
                    headers={"Content-Type": PROTOBUF},
                ) as response,
            ):
                assert response.status == 200, await response.text()
            after = await wait_for(lambda: mapped_worker_of(watchdog.state), 10)
            return before, heartbeat_heard(watchdog.state, StageRef(0)), after
        finally:
            await watchdog.stop()

    before, heard, after = asyncio.run(scenario())
    assert (before.role, before.stage) == (ProcessRole.HELPER, None)
    assert heard
    assert (after.role, after.stage) == (ProcessRole.STAGE, StageRef(0))


def worker_of(state: WatchdogState) -> ProcessInfo | None:
    return next((info for info in state.processes if info.pid == 101), None)


def mapped_worker_of(state: WatchdogState) -> ProcessInfo | None:
    """The worker once a scan has mapped it to a stage."""
    worker = worker_of(state)
    return worker if worker is not None and worker.stage is not None else None


def heartbeat_heard(state: WatchdogState, stage: StageRef) -> bool:
    report = state.report
    statuses = report.statuses if report is not None else ()
    return any(s.stage == stage and s.last_heartbeat is not None for s in statuses)
