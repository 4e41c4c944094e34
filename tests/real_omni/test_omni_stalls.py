"""End to end: real stalls of the real vLLM-Omni 0.30 (CPU), the watchdog in enforce mode.

Each test starts its own three-stage server (thinker → talker → code2wav) and stops one
stage from making progress, as production does: a forward that never returns, a stopped
stage engine. (A killed API server that leaves a hung stage behind ends the shared server
of `test_healthy_omni.py`, its last test.) Only processes a test started are signalled.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest
from deadline import wait_for
from e2e.forgery import forge, traces_url
from e2e.harness import (
    ACCEPTED,
    OPERATOR_TOKEN,
    RECOVERED,
    closed_by_id,
    held_back,
    incident_by_id,
    incident_done,
    oncall,
    state,
    steps_of,
)
from real_omni.judging import in_background, step_of, verdict_on
from real_omni.server import OTLP_TOKEN, OmniServer, engine_of, watched
from real_vllm.client import (
    evidence_kinds,
    health_status,
)

from omni_watchdog.process_start import sender_attributes
from omni_watchdog.semconv import PROCESS_PID
from omni_watchdog.types import (
    EvidenceKind,
    IncidentOutcome,
    StageRef,
    StageState,
    StepName,
)

# A server of its own takes two minutes and more to start on two busy cores.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ON_CALL = {"operator_token": OPERATOR_TOKEN}
# How long a held incident is watched doing nothing, in the watchdog's own judging time: the
# shutdown step would have been sent within the first evaluation after the capture.
HELD_FOR_S = 2.0


def test_blocked_forward_is_planned_in_dry_run_and_ended_once_on_call_approves(
    fresh_omni: Callable[..., OmniServer], tmp_path: Path
) -> None:
    """Meanwhile a holder of the OTLP token forges heartbeats and successful stage spans
    every 0.2 s in the blocked engine's name and the API server's: the stage's counters,
    flat while requests wait at it, and the failing canary outweigh them (before, the
    stage stayed degraded, no canary went out, and nothing was planned)."""
    server, faults = fresh_omni()
    code2wav = StageRef(2)

    async def scenario() -> None:
        async with (
            watched(server, tmp_path, "dry-run", ON_CALL) as watchdog,
            aiohttp.ClientSession() as session,
        ):
            claimed = (engine_of(server, code2wav.stage_id).pid, server.process.pid)
            stop = asyncio.Event()
            forging = [
                asyncio.create_task(
                    forge(
                        traces_url(watchdog),
                        {PROCESS_PID: pid, **sender_attributes(pid)},
                        [code2wav.stage_id],
                        stop,
                        OTLP_TOKEN,
                    )
                )
                for pid in claimed
            ]
            faults.arm(code2wav.stage_id, "block")
            in_background(server, session)
            try:
                # vLLM-Omni 0.30 answers /health with 200 all along: only the watchdog tells.
                await wait_for(lambda: state(watchdog, code2wav) is not StageState.HEALTHY, 30)
                assert await health_status(session, server) == 200
                plan = await incident_done(watchdog, 90)
            finally:
                stop.set()
                taken = await asyncio.gather(*forging)
            assert min(taken) > 5, taken
            verdict = verdict_on(plan, code2wav)
            assert verdict is not None and verdict.state is StageState.STALLED, plan
            assert verdict.cause is not None, plan
            assert EvidenceKind.HEALTH_FAILED not in evidence_kinds(plan)
            assert plan.outcome is IncidentOutcome.PLANNED and server.process.poll() is None

            code, out, err = await oncall(
                watchdog, "remediate", "--incident", plan.incident_id, "--yes"
            )
            assert code == 0, err
            approved = await wait_for(
                lambda: next(
                    (i for i in watchdog.state.remediation.incidents if i.incident_id in out),
                    None,
                ),
                10,
            )
            incident = await wait_for(lambda: closed_by_id(watchdog, approved.incident_id), 90)
            # The admin endpoint takes the request. vLLM-Omni's own shutdown takes 12-16 s,
            # and on two busy cores it once outlasted the 20 s grace; terminate ends it then.
            shutdown = step_of(incident, StepName.SHUTDOWN)
            assert shutdown is not None and shutdown.outcome in ACCEPTED, incident
            assert shutdown.detail.startswith("202 "), shutdown.detail
            assert incident.outcome in RECOVERED, steps_of(incident)
            assert not server.leftovers()

    asyncio.run(scenario())


def test_stopped_stage_engine_is_held_by_a_pause_and_the_tree_ended_after_it(
    fresh_omni: Callable[..., OmniServer], tmp_path: Path
) -> None:
    server, _ = fresh_omni()
    thinker = StageRef(0)
    engine = engine_of(server, thinker.stage_id)

    async def scenario() -> None:
        async with (
            watched(server, tmp_path, "enforce", ON_CALL) as watchdog,
            aiohttp.ClientSession() as session,
        ):
            code, _, err = await oncall(watchdog, "pause", "--for", "10m", "--reason", "test")
            assert code == 0, err
            server.signal(engine, signal.SIGSTOP)
            in_background(server, session)
            found = await wait_for(lambda: watchdog.state.remediation.incidents, 90)
            incident_id = found[0].incident_id
            await wait_for(lambda: held_back(watchdog, incident_id), 60)
            # Held: the evidence is captured, the server untouched while the pause lasts,
            # through evaluations that still judge the stage stalled.
            held_at = time.monotonic()  # the watchdog runs on the system clock
            await wait_for(
                lambda: (
                    (report := watchdog.state.report) is not None
                    and report.time >= held_at + HELD_FOR_S
                    and state(watchdog, thinker) is StageState.STALLED
                ),
                60,
            )
            held = incident_by_id(watchdog, incident_id)
            assert held is not None
            assert [s.step for s in held.steps] == [StepName.CAPTURE], steps_of(held)
            assert server.process.poll() is None and closed_by_id(watchdog, incident_id) is None

            code, _, err = await oncall(watchdog, "resume")
            assert code == 0, err
            incident = await wait_for(lambda: closed_by_id(watchdog, incident_id), 90)
            verdict = verdict_on(incident, thinker)
            assert verdict is not None and verdict.state is StageState.STALLED, incident
            assert EvidenceKind.PROCESS_STUCK in evidence_kinds(incident)
            assert incident.outcome in RECOVERED, steps_of(incident)
            assert not server.leftovers()

    asyncio.run(scenario())
