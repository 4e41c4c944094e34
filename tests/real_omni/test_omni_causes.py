"""End to end on the real vLLM-Omni 0.30 (CPU): a silent stage's cause decides.

One server of its own: its talker's forward waits on a JIT build in a child, then runs a
real `torch.compile` on a cold Inductor cache, each longer than every shipped timeout;
the watchdog, in enforce mode at its shipped thresholds, waits for both, naming each on
`/v1/status` while it lasts. Then, in dry run so that the server stays, a build whose
child is stopped half-way and a forward spinning in one frame are judged stalled, each
verdict naming its cause. Only processes the test started are signalled.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
from e2e.harness import incident_done, note_worse_than_degraded
from real_omni.judging import in_background, shipped, verdict_on
from real_omni.server import STAGES, OmniServer, watched
from real_vllm.client import answer

from omni_watchdog.demo import wait_for
from omni_watchdog.types import ProcessRole, SilenceCause, StageRef, StageState

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

TALKER = StageRef(1)
JIT_S = 20.0
# A cold torch.compile of a small function: about a minute on two busy cores.
COMPILE_LIMIT_S = 240.0


async def causes_on_the_api(
    session: aiohttp.ClientSession, watchdog: Any, stage: StageRef, seen: list[dict[str, Any]]
) -> None:
    """Until cancelled, each cause `/v1/status` shows for `stage`, as an operator sees it."""
    url = f"http://127.0.0.1:{watchdog.api_port}/v1/status"
    while True:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as response:
            status = await response.json()
        for shown in status["stages"]:
            key = (shown["stage_id"], shown["replica"])
            if key == (stage.stage_id, stage.replica) and shown["cause"] is not None:
                seen.append(shown["cause"])
        await asyncio.sleep(0.5)


def builder_of(server: Any, watchdog: Any) -> psutil.Process | None:
    """The child the talker's worker waits on, once there is one: a process of the test's
    own server (the worker is itself a child of the stage's engine core)."""
    talker = {
        info.pid
        for info in watchdog.tracker.live()
        if info.stage == TALKER and info.role is ProcessRole.WORKER
    }
    children = []
    for process in server.tree():
        with contextlib.suppress(psutil.NoSuchProcess):
            if process.ppid() in talker:
                children.append(process)
    return children[0] if len(children) == 1 else None


def test_legit_work_is_waited_for_and_what_stops_advancing_is_judged_by_its_cause(
    fresh_omni: Callable[..., OmniServer], tmp_path: Path
) -> None:
    server, faults = fresh_omni()

    async def waited_for(watchdog: Any, word: str, cause: SilenceCause, limit: float) -> None:
        async with aiohttp.ClientSession() as session:
            worse: list[str] = []
            seen: list[dict[str, Any]] = []
            watchers = [
                asyncio.create_task(note_worse_than_degraded(watchdog, STAGES, worse)),
                asyncio.create_task(causes_on_the_api(session, watchdog, TALKER, seen)),
            ]
            faults.arm(TALKER.stage_id, word)
            try:
                status, body = await answer(session, server.url, timeout=limit)
            finally:
                faults.disarm(TALKER.stage_id)
                for watcher in watchers:
                    watcher.cancel()
            assert status == 200, body
            assert not worse, worse
            assert not watchdog.policy.incidents(), watchdog.policy.incidents()
            named = {shown["cause"] for shown in seen}
            assert cause.value in named, seen[-5:]
            assert all(shown["working"] for shown in seen if shown["cause"] == cause.value)

    async def judged(watchdog: Any, word: str, cause: SilenceCause) -> str:
        plan = await incident_done(watchdog, 120)
        verdict = verdict_on(plan, TALKER)
        assert verdict is not None and verdict.state is StageState.STALLED, plan
        assert verdict.cause is not None, verdict
        assert verdict.cause.cause is cause and not verdict.cause.working, (word, verdict.cause)
        return str(verdict.cause.detail)

    for part in ("enforce", "stopped", "spin"):
        (tmp_path / part).mkdir()

    async def scenario() -> None:
        async with watched(server, tmp_path / "enforce", overrides=shipped()) as watchdog:
            await waited_for(watchdog, f"jit:{JIT_S:g}", SilenceCause.WAITING_ON_CHILD, 120)
            await waited_for(watchdog, "compile", SilenceCause.COMPILING, COMPILE_LIMIT_S)
        async with (
            watched(server, tmp_path / "stopped", "dry-run", shipped()) as watchdog,
            aiohttp.ClientSession() as session,
        ):
            faults.arm(TALKER.stage_id, f"jit:{JIT_S:g}")
            # Its answer waits for the build, stopped meanwhile: longer than a chat's 60 s.
            request = asyncio.create_task(answer(session, server.url, timeout=240))
            builder = await wait_for(lambda: builder_of(server, watchdog), 60)
            server.signal(builder, signal.SIGSTOP)
            detail = await judged(watchdog, "jit, its child stopped", SilenceCause.WAITING_ON_CHILD)
            assert f"pid {builder.pid}: stopped (T)" in detail, detail
            # Let the build go on: the request ends, and the server with it is whole.
            server.signal(builder, signal.SIGCONT)
            faults.disarm(TALKER.stage_id)
            status, body = await request
            assert status == 200, body
        async with watched(server, tmp_path / "spin", "dry-run", shipped()) as watchdog:
            faults.arm(TALKER.stage_id, "spin")
            async with aiohttp.ClientSession() as session:
                in_background(server, session)
                detail = await judged(watchdog, "spin", SilenceCause.SPINNING)
                assert "holding the GIL" in detail, detail

    asyncio.run(scenario())
