"""The ladder wastes no time: a capture overlaps the shutdown request, and a server that
cannot answer is not asked. Its order and its guards stay those of test_policy."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import psutil
import pytest
from aiohttp import web
from deadline import wait_for
from fakes import FakePsutil
from policy.test_policy import TERM, Rig, report, the_0_11_tree

from omni_watchdog.types import (
    Incident,
    IncidentOutcome,
    Mode,
    StepName,
    StepOutcome,
    StepResult,
    TargetSnapshot,
)

# Real seconds a side waits for the other before it gives up: reached only when the two
# do not overlap, which is the failure these tests look for.
PATIENCE = 5.0


class AdminEndpoint:
    """A server's /admin/shutdown that answers 202 once `answer` is set."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()
        self.answer = asyncio.Event()
        self.calls = 0

    async def handle(self, request: web.Request) -> web.Response:
        self.calls += 1
        self.asked.set()
        await asyncio.wait_for(self.answer.wait(), PATIENCE)
        return web.Response(status=202, text='{"status": "shutting down"}')


@asynccontextmanager
async def admin_endpoint(endpoint: AdminEndpoint) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/admin/shutdown", endpoint.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/admin/shutdown"
    finally:
        await runner.cleanup()


async def climbed(rig: Rig, endpoint: AdminEndpoint) -> Incident:
    """The incident of one verdict, its ladder run to the end against `endpoint`."""
    async with admin_endpoint(endpoint) as url, aiohttp.ClientSession() as session:
        policy = rig.policy(session, admin_url=url)
        task = policy.on_report(report(), rig.snapshot)
        assert task is not None
        return await task


class CaptureRig(Rig):
    """A rig whose capture waits for the shutdown request to arrive, then lets it answer."""

    def __init__(self, tmp_path: Path, fake: FakePsutil, endpoint: AdminEndpoint) -> None:
        super().__init__(tmp_path, fake, Mode.ENFORCE)
        self.endpoint = endpoint

    async def capture(self, incident: Incident, snapshot: TargetSnapshot) -> StepResult:
        self.captures += 1
        try:
            await asyncio.wait_for(self.endpoint.asked.wait(), PATIENCE)
        except asyncio.TimeoutError:
            detail = "captured before the shutdown request"
        else:
            detail = "captured while the shutdown request waited"
        self.endpoint.answer.set()
        return StepResult(StepName.CAPTURE, StepOutcome.OK, self.clock.wall(), 0.0, detail)


def test_the_capture_runs_while_the_shutdown_request_waits(
    tmp_path: Path, fake_psutil: FakePsutil
) -> None:
    endpoint = AdminEndpoint()
    rig = CaptureRig(tmp_path, fake_psutil, endpoint)
    the_0_11_tree(rig)

    incident = asyncio.run(climbed(rig, endpoint))
    steps = [(s.step, s.outcome) for s in incident.steps]
    assert steps[:2] == [
        (StepName.CAPTURE, StepOutcome.OK),
        (StepName.SHUTDOWN, StepOutcome.NOT_RECOVERED),
    ]
    assert incident.steps[0].detail == "captured while the shutdown request waited"
    assert incident.steps[1].detail.startswith("202 ")
    assert endpoint.calls == 1
    # The fake tree ignores the request: the ladder goes on exactly as before.
    assert incident.outcome is IncidentOutcome.RECOVERED_BY_TERM
    assert fake_psutil.signals == [("killpg", 100, TERM)]


@pytest.mark.parametrize(
    ("stopped", "calls", "detail"),
    [
        # The server process itself: it cannot answer, so the signals come at once.
        (100, 0, "the server process pid 100 is stopped: it cannot answer a request"),
        # A frozen engine: its API still answers, and is asked.
        (103, 1, "202 "),
    ],
)
def test_only_a_server_that_can_answer_is_asked(
    tmp_path: Path, fake_psutil: FakePsutil, stopped: int, calls: int, detail: str
) -> None:
    endpoint = AdminEndpoint()
    endpoint.answer.set()
    rig = Rig(tmp_path, fake_psutil, Mode.ENFORCE)
    the_0_11_tree(rig)
    fake_psutil.table[stopped].state = "stopped"

    incident = asyncio.run(climbed(rig, endpoint))
    shutdown = next(s for s in incident.steps if s.step is StepName.SHUTDOWN)
    assert shutdown.detail.startswith(detail)
    assert endpoint.calls == calls
    if not calls:
        assert shutdown.outcome is StepOutcome.SKIPPED
        assert fake_psutil.signals == [("killpg", 100, TERM)]
        assert incident.outcome is IncidentOutcome.RECOVERED_BY_TERM


def test_a_capture_tool_whose_step_is_cancelled_does_not_outlive_it(
    tmp_path: Path, fake_psutil: FakePsutil
) -> None:
    rig = Rig(tmp_path, fake_psutil, Mode.ENFORCE)
    marker = f"omni-watchdog-test-{os.getpid()}-{time.monotonic_ns()}"

    def tools() -> list[psutil.Process]:
        return [
            child for child in psutil.Process().children() if marker in " ".join(child.cmdline())
        ]

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            actuators = rig.actuators(session)
            running = asyncio.create_task(
                actuators.run_bounded(
                    [sys.executable, "-c", f"import time; time.sleep(30)  # {marker}"], 60.0
                )
            )
            await wait_for(tools, 5)
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running
            await wait_for(
                lambda: not any(t.is_running() and t.status() != "zombie" for t in tools()), 5
            )

    asyncio.run(scenario())


class RaisingCaptureRig(Rig):
    """A rig whose capture fails as a full test run here saw it: asyncio's kill of a
    capture tool that had just exited raised ProcessLookupError."""

    async def capture(self, incident: Incident, snapshot: TargetSnapshot) -> StepResult:
        self.captures += 1
        raise ProcessLookupError


def test_a_capture_that_raises_is_a_failed_step_and_the_ladder_goes_on(
    tmp_path: Path, fake_psutil: FakePsutil
) -> None:
    endpoint = AdminEndpoint()
    endpoint.answer.set()
    rig = RaisingCaptureRig(tmp_path, fake_psutil, Mode.ENFORCE)
    the_0_11_tree(rig)

    incident = asyncio.run(climbed(rig, endpoint))
    capture = incident.steps[0]
    assert (capture.step, capture.outcome) == (StepName.CAPTURE, StepOutcome.FAILED)
    assert capture.detail == "capture failed: ProcessLookupError: "
    assert endpoint.calls == 1
    assert incident.outcome is IncidentOutcome.RECOVERED_BY_TERM
    assert fake_psutil.signals == [("killpg", 100, TERM)]
    # A bug, counted as one: its traceback reaches the log and the self-health series.
    assert [(loop, type(error)) for loop, error in rig.internal_errors] == [
        ("ladder", ProcessLookupError)
    ]
