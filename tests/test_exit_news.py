"""A stage process's exit sends the /health probe at once, then often, for a while.

A server whose engine died may answer /health once more before its loop stops; the
failed answer that follows confirms the death. The watchdog runs its real loops here, on
the real clock, with the tracker and the /health probe replaced by stand-ins.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from deadline import wait_for
from fakes import FakeDevice, FakeNvml, FakePsutil, fake_host, info, local_config

from omni_watchdog.app import ASKING_EVERY
from omni_watchdog.clock import SystemClock
from omni_watchdog.factory import build_watchdog
from omni_watchdog.probes.health import HealthProbe
from omni_watchdog.probes.processes import ProcessTracker
from omni_watchdog.types import (
    HealthOutcome,
    Observation,
    ObservationKind,
    ProcessRole,
    ProcessStatus,
)

pytestmark = pytest.mark.e2e

CONFIRM = 3.0


def test_an_exit_asks_health_at_once_and_often_until_it_would_confirm_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = local_config(
        tmp_path / "state",
        {
            # Left to its period, /health would not be asked again during this test.
            "probes": {"health_interval": "60s"},
            "detection": {"confirm_timeout": f"{CONFIRM}s", "heartbeat_timeout": "1s"},
        },
    )
    asked: list[float] = []

    async def health(self: HealthProbe) -> Sequence[Observation]:
        asked.append(time.monotonic())
        return [Observation(ObservationKind.HEALTH, time.monotonic(), outcome=HealthOutcome.OK)]

    monkeypatch.setattr(HealthProbe, "collect", health)

    async def scenario() -> tuple[float, list[float]]:
        watchdog = await build_watchdog(
            config,
            clock=SystemClock(),
            host=fake_host(FakePsutil()),
            nvml=FakeNvml([FakeDevice(used=0, total=2**34, utilization=0)]),
        )
        engine = info(200, 100, ProcessRole.ENGINE, stage=0)
        exit_now = asyncio.Event()

        async def tracker(_: ProcessTracker) -> Sequence[Observation]:
            status = ProcessStatus.EXITED if exit_now.is_set() else ProcessStatus.SLEEPING
            process = dataclasses.replace(engine, status=status)
            return [
                Observation(
                    ObservationKind.PROCESS, time.monotonic(), process=process, outcome=status
                )
            ]

        monkeypatch.setattr(ProcessTracker, "collect", tracker)
        await watchdog.start()
        try:
            await wait_for(lambda: asked, 5)
            await asyncio.sleep(0.5)
            assert len(asked) == 1, "one call at start, then the 60 s period"
            exit_now.set()
            exited = time.monotonic()
            await wait_for(lambda: len(asked) >= 4, CONFIRM)
            # Past the window the period is the configured one again.
            await asyncio.sleep(CONFIRM + 1.0 - (time.monotonic() - exited))
            return exited, list(asked)
        finally:
            await watchdog.stop()

    exited, calls = asyncio.run(scenario())
    after = [t - exited for t in calls[1:]]
    assert after[0] < 1.0, "the exit sends /health at once, not after its 60 s period"
    gaps = [b - a for a, b in itertools.pairwise(after)]
    assert all(gap >= ASKING_EVERY * 0.8 for gap in gaps), gaps
    assert after[-1] < CONFIRM + ASKING_EVERY + 0.5, after
