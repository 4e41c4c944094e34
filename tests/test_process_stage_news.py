"""A process's stage, named by its spans' resource, reaches the process tracker.

The spans receiver tells each pid's stage as a PROCESS_STAGE observation when it is news;
the watchdog hands it to the tracker, whose next scan maps the process by it (a diffusion
stage's worker, whose title names no stage, is known only so).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from fakes import FakeDevice, FakeNvml, FakePsutil, local_config, no_cpu_waits
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
from omni_watchdog.types import ObservationKind, ProcessInfo, ProcessRole, StageRef

WORKER_TICKS = 123_456


def test_the_tracker_maps_a_process_by_the_stage_its_spans_name(tmp_path: Path) -> None:
    table = FakePsutil(port=9)  # local_config's target
    table.add(100, 1, "vllm serve")
    table.add(101, 100, "python worker.py", create_time=start_time_of_ticks(WORKER_TICKS))
    table.listening = [100]
    worker = {PROCESS_PID: 101, PROCESS_START_TICKS: WORKER_TICKS, PROCESS_KIND: "stage"}

    async def scenario() -> tuple[ProcessInfo, list[ObservationKind], ProcessInfo]:
        watchdog = await build_watchdog(
            local_config(tmp_path / "state"),
            clock=FakeClock(1000.0, 1_700_000_000.0),
            process_table=table,
            cpu_waits=no_cpu_waits,
            nvml=FakeNvml([FakeDevice(used=0, total=2**34, utilization=0)]),
            start_time=table.start_time,
        )
        try:
            await watchdog.tracker.collect()
            (before,) = [info for info in watchdog.tracker.live() if info.pid == 101]
            watchdog.receiver.ingest(
                batch({**worker, STAGE_ID: 0}, [(HEARTBEAT_SPAN, {})]), PROTOBUF
            )
            observations = await watchdog.receiver.collect()
            watchdog._take(watchdog.receiver, observations)
            await watchdog.tracker.collect()
            (after,) = [info for info in watchdog.tracker.live() if info.pid == 101]
            return before, [obs.kind for obs in observations], after
        finally:
            await watchdog.stop()

    before, kinds, after = asyncio.run(scenario())
    assert (before.role, before.stage) == (ProcessRole.HELPER, None)
    assert kinds == [ObservationKind.HEARTBEAT, ObservationKind.PROCESS_STAGE]
    assert (after.role, after.stage) == (ProcessRole.STAGE, StageRef(0))
