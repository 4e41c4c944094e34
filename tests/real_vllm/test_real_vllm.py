"""End to end: the watchdog against the real vLLM server (CPU build, tiny local model).

The tests that do not harm the server share one, and the last of them ends it; each other
destructive test starts its own.
A hang is made the way docs/design.md, The problem, measured it: SIGSTOP of the EngineCore (or of
its Worker), death by SIGKILL of the EngineCore. Only processes a test started are signalled.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from deadline import wait_for
from e2e.harness import (
    RECOVERED,
    incident_done,
    incidents_now,
    last_heartbeat,
    live_processes,
    state,
    steps_of,
)
from real_vllm.client import (
    ASK_EVERY,
    LONG_REQUEST,
    Stream,
    all_spans,
    chat,
    evidence_kinds,
    gone,
    health_status,
    running_stream,
)
from real_vllm.server import VllmServer, watching

from omni_watchdog.probes.span_store import SpanRecord
from omni_watchdog.semconv import HEARTBEAT_SPAN, VLLM_REQUEST_SPAN
from omni_watchdog.types import (
    EvidenceKind,
    IncidentOutcome,
    ProcessRole,
    StageRef,
    StageState,
)

pytestmark = pytest.mark.e2e

STAGE = StageRef(0)
ENGINE_TITLE = "VLLM::EngineCore"
WORKER_TITLE = "VLLM::Worker"
SOAK_SECONDS = 60.0
SPAN_KIND_SERVER = 2


# The stopped-Worker test is about vLLM's own error path (its execute-model timeout, then
# its own exit), so the watchdog must judge more slowly than that timeout; with the fast
# settings it would rightly end the stalled server first.
SLOWER_THAN_VLLM: dict[str, Any] = {
    "detection": {
        "heartbeat_timeout": "15s",
        "progress_timeout": "30s",
        "stuck_timeout": "30s",
        "health_failures": 30,
        "confirm_timeout": "40s",
    },
    "probes": {"canary_interval": "30s", "canary_deadline": "20s"},
}


def recorded_crash(incident: Any) -> bool:
    return incident.outcome is IncidentOutcome.CRASHED or incident.crashed


def stage_evidence(watchdog: Any) -> set[EvidenceKind]:
    report = watchdog.state.report
    statuses = report.statuses if report else ()
    return {e.kind for status in statuses if status.stage == STAGE for e in status.evidence}


def is_request_of(span: SpanRecord, max_tokens: int) -> bool:
    return span.name == VLLM_REQUEST_SPAN and span.completion_tokens == max_tokens


def is_heartbeat_of(span: SpanRecord, pid: int) -> bool:
    return span.name == HEARTBEAT_SPAN and span.pid == pid


def test_attaches_maps_the_tree_and_sees_spans_and_progress(
    shared_server: VllmServer, tmp_path: Path
) -> None:
    engine = shared_server.titled(ENGINE_TITLE)
    worker = shared_server.titled(WORKER_TITLE)

    async def scenario() -> None:
        async with (
            watching(shared_server, tmp_path, mode="observe") as watchdog,
            aiohttp.ClientSession() as session,
        ):
            roles = {info.pid: (info.role, info.stage) for info in live_processes(watchdog)}
            assert roles[shared_server.process.pid][0] is ProcessRole.API
            assert roles[engine.pid] == (ProcessRole.ENGINE, STAGE)
            assert roles[worker.pid] == (ProcessRole.WORKER, STAGE)

            status_url = f"http://127.0.0.1:{watchdog.api_port}/v1/status"

            async def last_progress() -> float | None:
                async with session.get(status_url) as response:
                    status = await response.json()
                stage = next(s for s in status["stages"] if s["stage_id"] == 0)
                return None if stage["last_progress"] is None else float(stage["last_progress"])

            before = await last_progress()
            statuses = await asyncio.gather(*(chat(session, shared_server.url) for _ in range(3)))
            assert statuses == [200, 200, 200]

            async def moved() -> bool:
                after = await last_progress()
                return after is not None and (before is None or after > before)

            await wait_for(moved, 10, "stage 0's last progress moved", ASK_EVERY)
            # The canary's own requests (one token each) are spans too: look for ours.
            ours = await wait_for(
                lambda: [s for s in all_spans(watchdog) if is_request_of(s, 8)][2:], 15
            )
            assert all(s.stage == STAGE and s.kind == SPAN_KIND_SERVER for s in ours), ours
            assert state(watchdog, STAGE) is StageState.HEALTHY
            assert not await incidents_now(watchdog)

    asyncio.run(scenario())


def test_plugin_heartbeats_arrive_from_the_engine_core(
    shared_server: VllmServer, tmp_path: Path
) -> None:
    engine = shared_server.titled(ENGINE_TITLE)

    async def scenario() -> None:
        async with watching(shared_server, tmp_path, mode="observe") as watchdog:
            beats = await wait_for(
                lambda: [
                    s
                    for s in all_spans(watchdog)
                    if s.name == HEARTBEAT_SPAN and s.pid == engine.pid
                ],
                10,
            )
            assert beats[0].stage == STAGE
            # The detector reads a kept span at the next collection, a probe interval later.
            await wait_for(lambda: last_heartbeat(watchdog, STAGE) is not None, 10)

    asyncio.run(scenario())


def test_stopped_engine_core_is_stalled_and_the_tree_ended(
    fresh_server: Callable[..., VllmServer], tmp_path: Path
) -> None:
    server = fresh_server()
    engine = server.titled(ENGINE_TITLE)

    async def scenario() -> None:
        async with (
            watching(server, tmp_path, mode="enforce") as watchdog,
            aiohttp.ClientSession() as session,
        ):
            stream = await running_stream(session, server)
            server.signal(engine, signal.SIGSTOP)
            # The real server keeps answering /health while its engine is stopped.
            for _ in range(3):
                assert await health_status(session, server) == 200
                await asyncio.sleep(0.3)
            incident = await incident_done(watchdog, 60)
            await stream.cancel()
            verdict = incident.verdicts[0]
            assert verdict.stage == STAGE and verdict.state is StageState.STALLED
            kinds = evidence_kinds(incident)
            assert EvidenceKind.PROCESS_STUCK in kinds
            # A second, independent kind; the stopped process outweighs the progress made
            # just before it, so the verdict need not wait for the counters to go flat.
            assert kinds & {
                EvidenceKind.PROGRESS_FLAT,
                EvidenceKind.CANARY_FAILED,
                EvidenceKind.HEARTBEAT_LOST,
            }
            assert EvidenceKind.HEALTH_FAILED not in kinds
            assert incident.outcome in RECOVERED, steps_of(incident)
            # What the watchdog ended, before the test's own clean-up runs.
            assert not server.leftovers()

    asyncio.run(scenario())


def test_stopped_worker_times_out_and_its_exit_is_a_crash(
    fresh_server: Callable[..., VllmServer], tmp_path: Path
) -> None:
    server = fresh_server({"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "5"})
    worker = server.titled(WORKER_TITLE)

    async def scenario() -> None:
        async with (
            watching(server, tmp_path, mode="enforce", overrides=SLOWER_THAN_VLLM) as watchdog,
            aiohttp.ClientSession() as session,
        ):
            stream = await running_stream(session, server)
            server.signal(worker, signal.SIGSTOP)
            await asyncio.wait_for(stream.task, 30)
            if not stream.errors():
                # It ran its length before the stop took hold (on two busy cores the
                # test's loop can wake late): the next request meets the stopped Worker.
                stream = Stream(session, server.url, LONG_REQUEST)
                await asyncio.wait_for(stream.task, 30)
            assert stream.errors(), stream.events[-3:]
            await wait_for(lambda: server.process.poll() is not None, 30)
            incident = await incident_done(watchdog, 30)
            assert recorded_crash(incident), (incident.outcome, incident.cause)
            # Whatever the server left behind (at times the stopped Worker), the watchdog ends.
            await gone(server, 10)

    asyncio.run(scenario())


@pytest.mark.timeout(SOAK_SECONDS + 120)
def test_healthy_server_under_load_is_never_touched(
    shared_server: VllmServer, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with (
            watching(shared_server, tmp_path, mode="enforce") as watchdog,
            aiohttp.ClientSession() as session,
        ):
            seen: set[StageState | None] = set()
            served = 0
            deadline = time.monotonic() + SOAK_SECONDS
            while time.monotonic() < deadline:
                statuses = await asyncio.gather(
                    chat(session, shared_server.url, 32), chat(session, shared_server.url, 4)
                )
                assert list(statuses) == [200, 200]
                served += len(statuses)
                seen.add(state(watchdog, STAGE))
            assert seen <= {StageState.HEALTHY, StageState.DEGRADED}, seen
            assert not await incidents_now(watchdog)
            assert served > 20
            assert shared_server.process.poll() is None

    asyncio.run(scenario())


def test_last_a_killed_engine_core_is_dead_and_the_exit_a_crash(
    shared_server: VllmServer, tmp_path: Path
) -> None:
    """The last test here ends the shared server, as a server of its own would be."""
    server = shared_server
    engine = server.titled(ENGINE_TITLE)

    async def scenario() -> None:
        async with watching(server, tmp_path, mode="enforce") as watchdog:
            server.signal(engine, signal.SIGKILL)
            await wait_for(lambda: EvidenceKind.PROCESS_EXIT in stage_evidence(watchdog), 10)
            await wait_for(lambda: server.process.poll() is not None, 30)
            # vLLM exits by itself with 0 after its engine died: only the watchdog tells.
            assert server.process.returncode == 0
            incident = await incident_done(watchdog, 30)
            assert recorded_crash(incident), (incident.outcome, incident.cause)
            assert state(watchdog, STAGE) is StageState.DEAD
            await gone(server, 10)

    asyncio.run(scenario())
