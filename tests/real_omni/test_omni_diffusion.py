"""End to end: diffusion stages of the real vLLM-Omni 0.30 (CPU), the watchdog in enforce
mode at its shipped thresholds.

Three servers of the harness's tiny image pipeline: one-stage inline (the API server
process is the diffusion worker), one-stage with the mp executor (a `DiffusionWorker`
child), and text → DiT (the DiT in a `StageDiffusionProc` child). A denoising step is one
call of the DiT, the whole denoising loop inside one engine step: the plugin beats once a
step, and the watchdog knows a slow image from a stuck one by the steps and by what the
stage's process does. Only processes a test started are signalled.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import explain
import pytest
from deadline import wait_for
from e2e.forgery import forge, traces_url
from e2e.harness import RECOVERED, all_healthy, incident_done, state, steps_of
from real_omni.judging import shipped, verdict_on
from real_omni.server import (
    DIFFUSION_READY_TIMEOUT,
    FAULTS_DIR,
    IMAGES_PATH,
    OTLP_TOKEN,
    READY_TIMEOUT,
    Faults,
    OmniServer,
    diffusion_worker_of,
    image_chat_body,
    image_generation_body,
    start_diffusion_server,
    start_image_server,
    watched,
)
from real_vllm.client import gone, health_status
from real_vllm.server import Shared, VllmServer, start_ready

from omni_watchdog.process_start import sender_attributes
from omni_watchdog.semconv import PROCESS_PID
from omni_watchdog.types import ProcessRole, StageRef, StageState

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

DIT = StageRef(0)
IMAGE_DIT = StageRef(1)
# A request's answer, or None when it got none in time.
Answer = tuple[int, Any] | None


async def post(
    session: aiohttp.ClientSession, url: str, body: Mapping[str, Any], timeout: float = 120.0
) -> Answer:
    try:
        async with session.post(
            url, json=dict(body), timeout=aiohttp.ClientTimeout(total=timeout)
        ) as response:
            return response.status, await response.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None


def status_of(watchdog: Any, stage: StageRef) -> Any:
    report = watchdog.state.report
    return next((s for s in report.statuses if s.stage == stage), None) if report else None


@pytest.fixture
def fresh_diffusion(
    omni_diffusion_model: Path, tmp_path: Path
) -> Iterator[Callable[..., OmniServer]]:
    """Starts a one-stage diffusion server of this test's own; all of it dies at the end."""
    started: list[VllmServer] = []

    def start(*, multiprocess: bool = False) -> OmniServer:
        workdir = tmp_path / f"diffusion-{len(started)}"
        server = start_ready(
            lambda: start_diffusion_server(
                omni_diffusion_model, workdir, multiprocess=multiprocess
            )[0],
            DIFFUSION_READY_TIMEOUT,
            alone=True,
        )
        started.append(server)
        explain.witness_this_test(f"vLLM-Omni diffusion server {server.url}", server.account)
        return server, Faults(workdir / FAULTS_DIR)

    try:
        yield start
    finally:
        for server in started:
            server.stop()


@pytest.fixture(scope="module")
def shared_image_server(
    omni_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Shared[OmniServer]]:
    """The text → DiT pipeline, for this module's tests that do not harm it."""
    workdir = tmp_path_factory.mktemp("shared-image")
    server = start_ready(
        lambda: start_image_server(omni_model, workdir)[0], READY_TIMEOUT, alone=True
    )
    try:
        with explain.witnessed("the shared image pipeline", server.account):
            yield Shared((server, Faults(workdir / FAULTS_DIR)), server)
    finally:
        server.stop()


@pytest.fixture
def image_server(
    shared_image_server: Shared[OmniServer], request: pytest.FixtureRequest
) -> Iterator[OmniServer]:
    with shared_image_server.used_by(request.node.nodeid):
        yield shared_image_server.value


async def mapped_and_beating(watchdog: Any, stage: StageRef, pid: int) -> Any:
    """The stage judged healthy and beating, `pid` recorded as a process that runs its
    work; what the watchdog recorded of `pid`."""
    await all_healthy(watchdog, 60)
    await wait_for(lambda: (status_of(watchdog, stage) or _NONE).last_heartbeat is not None, 30)
    recorded = {p.pid: p for p in watchdog.state.processes}
    assert pid in recorded, recorded
    assert recorded[pid].stage == stage and recorded[pid].runs_stage_work, recorded[pid]
    return recorded[pid]


class _NoStatus:
    last_heartbeat = None


_NONE = _NoStatus()


def test_inline_server_waits_for_a_slow_image_and_ends_a_stuck_step(
    fresh_diffusion: Callable[..., OmniServer], tmp_path: Path
) -> None:
    server, faults = fresh_diffusion()
    worker = diffusion_worker_of(server)
    # Inline: the API server renamed itself; it is the diffusion worker.
    assert worker.pid == server.process.pid

    async def scenario() -> None:
        async with (
            watched(server, tmp_path, "enforce", shipped()) as watchdog,
            aiohttp.ClientSession() as session,
        ):
            mapped = await mapped_and_beating(watchdog, DIT, worker.pid)
            assert mapped.role is ProcessRole.API
            url = server.url + IMAGES_PATH
            answer = await post(session, url, image_generation_body())
            assert answer is not None and answer[0] == 200, answer

            # A legit slow image: four steps of 3 s of CPU work each.
            faults.arm(DIT.stage_id, "step-work:3")
            slow = asyncio.create_task(post(session, url, image_generation_body(steps=4)))
            shown = await wait_for(
                lambda: (
                    (status_of(watchdog, DIT).denoising or None)
                    if status_of(watchdog, DIT)
                    else None
                ),
                30,
            )
            (request,) = shown
            assert request.steps == 4 and 1 <= request.step <= 4, request
            answer = await slow
            assert answer is not None and answer[0] == 200, answer
            faults.disarm(DIT.stage_id)
            assert not watchdog.state.remediation.open_incident
            assert state(watchdog, DIT) is not StageState.STALLED
            status = status_of(watchdog, DIT)
            assert status.seconds_per_step is not None and status.seconds_per_step >= 2.0

            # A step that never ends: /health stays 200, nothing in vLLM-Omni times out.
            # Meanwhile a holder of the OTLP token forges beats and successful stage spans
            # in the worker's name every 0.2 s: its steps stop, its process sleeps, and the
            # image canary fails behind the step, which outweighs them.
            stop = asyncio.Event()
            sender = {PROCESS_PID: worker.pid, **sender_attributes(worker.pid)}
            forging = asyncio.create_task(
                forge(traces_url(watchdog), sender, [DIT.stage_id], stop, OTLP_TOKEN)
            )
            faults.arm(DIT.stage_id, "block")
            stuck = asyncio.create_task(post(session, url, image_generation_body(), 90))
            try:
                incident = await incident_done(watchdog, 90)
            finally:
                stop.set()
                taken = await forging
            assert taken > 5, taken
            verdict = verdict_on(incident, DIT)
            assert verdict is not None and verdict.state is StageState.STALLED, incident
            assert verdict.cause is not None and not verdict.cause.working, verdict
            assert incident.outcome in RECOVERED, steps_of(incident)
            await gone(server, 15)
            stuck.cancel()

    asyncio.run(scenario())


def test_killed_mp_diffusion_worker_is_dead_and_the_server_left_at_503_is_ended(
    fresh_diffusion: Callable[..., OmniServer], tmp_path: Path
) -> None:
    server, _ = fresh_diffusion(multiprocess=True)
    worker = diffusion_worker_of(server)
    assert worker.ppid() == server.process.pid

    async def scenario() -> None:
        async with (
            watched(server, tmp_path, "enforce", shipped()) as watchdog,
            aiohttp.ClientSession() as session,
        ):
            await mapped_and_beating(watchdog, DIT, worker.pid)
            worker.send_signal(signal.SIGKILL)
            incident = await incident_done(watchdog, 90)
            verdict = verdict_on(incident, DIT)
            assert verdict is not None and verdict.state is StageState.DEAD, incident
            assert incident.outcome in RECOVERED, steps_of(incident)
            await gone(server, 15)
            assert await health_status(session, server) is None

    asyncio.run(scenario())


def test_image_pipeline_answers_and_every_stage_beats_with_its_processes(
    image_server: OmniServer, tmp_path: Path
) -> None:
    server, _ = image_server
    worker = diffusion_worker_of(server)

    async def scenario() -> None:
        async with (
            watched(server, tmp_path, "enforce", shipped()) as watchdog,
            aiohttp.ClientSession() as session,
        ):
            mapped = await mapped_and_beating(watchdog, IMAGE_DIT, worker.pid)
            assert mapped.role is ProcessRole.STAGE
            answer = await post(session, server.url + "/v1/chat/completions", image_chat_body())
            assert answer is not None and answer[0] == 200, answer
            content = answer[1]["choices"][0]["message"]["content"]
            assert content[0]["type"] == "image_url", content
            assert not watchdog.state.remediation.open_incident

    asyncio.run(scenario())


def test_a_raise_in_one_image_is_a_request_error_and_the_stage_serves_on(
    image_server: OmniServer, tmp_path: Path
) -> None:
    server, faults = image_server

    async def scenario() -> None:
        async with (
            watched(server, tmp_path, "enforce", shipped()) as watchdog,
            aiohttp.ClientSession() as session,
        ):
            await all_healthy(watchdog, 60)
            url = server.url + "/v1/chat/completions"
            faults.arm(IMAGE_DIT.stage_id, "raise")
            try:
                answer = await post(session, url, image_chat_body())
            finally:
                faults.disarm(IMAGE_DIT.stage_id)
            assert answer is not None and answer[0] == 500, answer
            await wait_for(lambda: status_of(watchdog, IMAGE_DIT).request_errors >= 1, 15)
            answer = await post(session, url, image_chat_body())
            assert answer is not None and answer[0] == 200, answer
            assert not watchdog.state.remediation.open_incident
            report = watchdog.state.report
            assert report is not None
            assert all(
                s.state not in (StageState.STALLED, StageState.DEAD) for s in report.statuses
            )

    asyncio.run(scenario())


def test_a_30_second_image_is_waited_for(image_server: OmniServer, tmp_path: Path) -> None:
    server, faults = image_server

    async def scenario() -> None:
        async with (
            watched(server, tmp_path, "enforce", shipped()) as watchdog,
            aiohttp.ClientSession() as session,
        ):
            await all_healthy(watchdog, 60)
            faults.arm(IMAGE_DIT.stage_id, "step-work:7.5")
            try:
                answer = await post(session, server.url + "/v1/chat/completions", image_chat_body())
            finally:
                faults.disarm(IMAGE_DIT.stage_id)
            assert answer is not None and answer[0] == 200, answer
            assert not watchdog.state.remediation.open_incident
            assert state(watchdog, IMAGE_DIT) is not StageState.STALLED

    asyncio.run(scenario())


def test_last_a_killed_diffusion_stage_process_is_dead_and_the_server_ended(
    image_server: OmniServer, tmp_path: Path
) -> None:
    server, _ = image_server
    worker = diffusion_worker_of(server)

    async def scenario() -> None:
        async with watched(server, tmp_path, "enforce", shipped()) as watchdog:
            await all_healthy(watchdog, 60)
            worker.send_signal(signal.SIGKILL)
            incident = await incident_done(watchdog, 90)
            verdict = verdict_on(incident, IMAGE_DIT)
            assert verdict is not None and verdict.state is StageState.DEAD, incident
            assert incident.outcome in RECOVERED, steps_of(incident)
            await gone(server, 30)

    asyncio.run(scenario())
