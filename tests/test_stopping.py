"""Stopping ends in bounded time, even when a task loses its cancellation.

On Python < 3.12 `asyncio.wait_for` can swallow a cancellation that arrives as the thing
it waits on finishes. CI once saw a watchdog's `stop()` wait for ever after that: a loop
went on as if never cancelled, and `await task` never returned. The tasks here swallow
their cancellation on purpose, the way that race does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest
from fakes import FakeDevice, FakeNvml, FakePsutil, fake_host, local_config

from omni_watchdog.clock import FakeClock
from omni_watchdog.factory import build_watchdog
from omni_watchdog.probes.processes import ProcessTracker
from omni_watchdog.tasks import end_tasks
from omni_watchdog.types import Observation


class Stubborn:
    """A loop that meets the race `lose` times: each time, it goes round again."""

    def __init__(self, lose: int) -> None:
        self.lose = lose
        self.entered = asyncio.Event()

    async def run(self) -> None:
        self.entered.set()
        while True:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                if self.lose == 0:
                    raise
                self.lose -= 1


def test_a_task_that_lost_its_cancellation_is_cancelled_again_until_it_ends() -> None:
    async def scenario() -> tuple[list[asyncio.Task[None]], asyncio.Task[None]]:
        stubborn = Stubborn(lose=3)
        task = asyncio.create_task(stubborn.run())
        await stubborn.entered.wait()
        return await end_tasks([task], patience=5), task

    stuck, task = asyncio.run(scenario())
    assert stuck == []
    assert task.cancelled()


def test_a_task_that_never_ends_is_given_up_after_the_patience_and_named() -> None:
    async def scenario() -> tuple[list[str], bool]:
        stubborn = Stubborn(lose=10**9)
        endless = asyncio.create_task(stubborn.run(), name="endless")
        polite = asyncio.create_task(asyncio.sleep(60), name="polite")
        await stubborn.entered.wait()
        stuck = await end_tasks([endless, polite], patience=0.3)
        names = [task.get_name() for task in stuck]
        stubborn.lose = 0  # so that it ends with the test
        endless.cancel()
        return names, polite.cancelled()

    names, polite_cancelled = asyncio.run(scenario())
    assert names == ["endless"]
    assert polite_cancelled


def test_a_loop_that_failed_is_not_reported_as_never_retrieved() -> None:
    reported: list[str] = []

    async def fails() -> None:
        raise RuntimeError("a loop's bug, logged where it happened")

    async def scenario() -> list[asyncio.Task[None]]:
        asyncio.get_running_loop().set_exception_handler(
            lambda _, context: reported.append(context["message"])
        )
        task = asyncio.create_task(fails())
        await asyncio.sleep(0)
        return await end_tasks([task], patience=1)

    assert asyncio.run(scenario()) == []
    assert reported == []


def test_a_watchdog_whose_probe_loop_lost_its_cancellation_still_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = local_config(tmp_path / "state")

    async def scenario() -> tuple[bool, int]:
        watchdog = await build_watchdog(
            config,
            clock=FakeClock(1000.0, 1_700_000_000.0),
            host=fake_host(FakePsutil()),
            nvml=FakeNvml([FakeDevice(used=0, total=2**34, utilization=0)]),
        )
        entered = asyncio.Event()
        cancellations = 0

        async def collect(_: ProcessTracker) -> Sequence[Observation]:
            nonlocal cancellations
            entered.set()
            while True:
                try:
                    await asyncio.sleep(0.01)
                except asyncio.CancelledError:
                    cancellations += 1
                    if cancellations > 1:
                        raise
                    # Lost, as `asyncio.wait_for` loses it: the probe answers as if it
                    # had just finished, and its loop goes round again.
                    return []

        monkeypatch.setattr(ProcessTracker, "collect", collect)
        await watchdog.start()
        await entered.wait()
        # Not `wait_for`: cancelling a stop that hangs would hand its loop the second
        # cancellation this test is about.
        stopping = asyncio.create_task(watchdog.stop())
        done, _ = await asyncio.wait({stopping}, timeout=8)
        if not done:
            stopping.cancel()
        return bool(done), cancellations

    stopped, cancellations = asyncio.run(scenario())
    assert stopped
    assert cancellations >= 1
