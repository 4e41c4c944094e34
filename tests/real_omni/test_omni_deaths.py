"""End to end: real stage deaths of the real vLLM-Omni 0.30 (CPU), the watchdog in enforce
mode.

Each test starts its own three-stage server (thinker → talker → code2wav) and kills one
stage, as production does: a forward that raises, a killed stage engine, a worker dying on
its first forward. vLLM-Omni then stays up at 503 for good. Only processes a test started
are signalled.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest
from deadline import wait_for
from e2e.harness import RECOVERED, incident_done, steps_of
from real_omni.judging import in_background, step_of, verdict_on
from real_omni.server import OmniServer, engine_of, watched
from real_vllm.client import (
    ASK_EVERY,
    evidence_kinds,
    gone,
    health_status,
)

from omni_watchdog.types import (
    EvidenceKind,
    StageRef,
    StageState,
    StepName,
)

# A server of its own takes two minutes and more to start on two busy cores.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
# Long enough that a ladder waiting for vLLM-Omni 0.30 to exit by itself would show.
SELF_EXIT_GRACE_S = 60.0


def test_forward_that_raises_kills_the_stage_and_the_server_is_ended(
    fresh_omni: Callable[..., OmniServer], tmp_path: Path
) -> None:
    server, faults = fresh_omni()
    code2wav = StageRef(2)

    async def scenario() -> None:
        async with watched(server, tmp_path) as watchdog, aiohttp.ClientSession() as session:
            faults.arm(code2wav.stage_id, "raise")
            (request,) = in_background(server, session)
            assert await request == 500
            incident = await incident_done(watchdog, 90)
            verdict = verdict_on(incident, code2wav)
            # The server answers 503 at once ("no live replica"); the stage's engine and
            # worker exit after tearing down, which took over 2 s on two busy cores once.
            # Whichever the watchdog sees first, the 503 or the exit, the stage is dead.
            assert verdict is not None and verdict.state is StageState.DEAD, incident
            # vLLM-Omni 0.30 never exits by itself after a stage death: one of the
            # ladder's steps ended it, never a crash of its own.
            assert incident.outcome in RECOVERED, steps_of(incident)
            await gone(server, 15)

    asyncio.run(scenario())


def test_killed_stage_engine_is_dead_and_the_server_left_at_503_is_ended(
    fresh_omni: Callable[..., OmniServer], tmp_path: Path
) -> None:
    server, _ = fresh_omni()
    talker = StageRef(1)
    engine = engine_of(server, talker.stage_id)
    patient = {"ladder": {"self_exit_grace": f"{SELF_EXIT_GRACE_S:g}s"}}

    async def scenario() -> None:
        async with (
            watched(server, tmp_path, overrides=patient) as watchdog,
            aiohttp.ClientSession() as session,
        ):
            server.signal(engine, signal.SIGKILL)

            async def unhealthy() -> bool:
                return await health_status(session, server) == 503

            # vLLM-Omni evicts the replica and stays up at 503 for good: nothing ends it
            # but the watchdog.
            await wait_for(unhealthy, 30, "/health answering 503", ASK_EVERY)
            incident = await incident_done(watchdog, 90)
            verdict = verdict_on(incident, talker)
            assert verdict is not None and verdict.state is StageState.DEAD, incident
            assert EvidenceKind.PROCESS_EXIT in evidence_kinds(incident)
            # vLLM-Omni 0.30 never exits by itself after a stage death: it is asked at
            # once, without waiting self_exit_grace for it first.
            shutdown = step_of(incident, StepName.SHUTDOWN)
            assert shutdown is not None and shutdown.detail.startswith("202 "), steps_of(incident)
            assert shutdown.duration < SELF_EXIT_GRACE_S, steps_of(incident)
            await gone(server, 15)

    asyncio.run(scenario())


def test_worker_dying_on_its_first_forward_right_after_attach_is_judged_and_ended(
    fresh_omni: Callable[..., OmniServer], tmp_path: Path
) -> None:
    server, faults = fresh_omni()
    thinker = StageRef(0)

    async def scenario() -> None:
        # Armed before the watchdog attaches; the first request is the canary's own.
        faults.arm(thinker.stage_id, "signal:ILL")
        async with watched(server, tmp_path) as watchdog:
            incident = await incident_done(watchdog, 90)
            verdict = verdict_on(incident, thinker)
            assert verdict is not None and verdict.state is StageState.DEAD, incident
            await gone(server, 15)

    asyncio.run(scenario())
