"""The canary probe: sent only when nothing moved, at most once per interval, with a deadline."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from omni_watchdog.clock import FakeClock
from omni_watchdog.config import ProbesConfig
from omni_watchdog.probes.canary import CanaryProbe
from omni_watchdog.types import CanaryPlan, ObservationKind, ProbeError

CONFIG = ProbesConfig(canary_interval=3.0, canary_deadline=0.3)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class FakeServer:
    """/v1/models, /v1/chat/completions and /v1/images/generations that record what they
    were asked."""

    def __init__(self, completion: Handler | None = None, models_status: int = 200) -> None:
        self.bodies: list[Any] = []
        self.paths: list[str] = []
        self.model_calls = 0
        self._completion = completion
        self._models_status = models_status

    async def models(self, request: web.Request) -> web.Response:
        self.model_calls += 1
        listing = {"object": "list", "data": [{"id": "tiny"}, {"id": "other"}]}
        return web.json_response(listing, status=self._models_status)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        self.paths.append(request.path)
        if self._completion:
            return await self._completion(request)
        return web.json_response({"choices": [{"message": {"content": "p"}}]})

    def run(self, check: Callable[[str], Awaitable[None]]) -> None:
        async def main() -> None:
            app = web.Application()
            app.router.add_get("/v1/models", self.models)
            app.router.add_post("/v1/chat/completions", self.chat)
            app.router.add_post("/v1/images/generations", self.chat)
            async with TestServer(app, host="127.0.0.1") as server:
                await check(str(server.make_url("")))

        asyncio.run(main())


def canary(
    session: aiohttp.ClientSession,
    url: str,
    clock: FakeClock,
    last_progress: list[float | None],
    config: ProbesConfig = CONFIG,
) -> CanaryProbe:
    return CanaryProbe(session, url, config, clock, lambda: last_progress[0])


def test_sent_only_without_recent_progress_and_once_per_interval() -> None:
    server = FakeServer()
    clock = FakeClock(start=100.0)
    progress: list[float | None] = [99.0]

    async def check(url: str) -> None:
        async with aiohttp.ClientSession() as session:
            probe = canary(session, url, clock, progress)
            assert await probe.collect() == []  # organic progress 1 s ago
            clock.set(102.0)
            (observation,) = await probe.collect()
            assert observation.kind == ObservationKind.CANARY
            assert (observation.outcome, observation.detail) == ("ok", "200")
            clock.set(104.0)
            assert await probe.collect() == []  # one went out 2 s ago
            clock.set(105.0)
            assert len(await probe.collect()) == 1
            progress[0] = 107.0
            clock.set(109.0)
            assert await probe.collect() == []  # traffic again: no canary needed
            progress[0] = None
            assert len(await probe.collect()) == 1

    server.run(check)
    assert len(server.bodies) == 3
    assert server.model_calls == 1
    assert server.bodies[0] == {
        "model": "tiny",
        "messages": [{"role": "user", "content": "ping"}],
        "max_tokens": 1,
        "temperature": 0,
        "modalities": ["text"],
    }


@pytest.mark.parametrize(
    ("plan", "path", "body"),
    [
        (CanaryPlan.NONE, None, None),
        (
            CanaryPlan.IMAGE,
            "/v1/images/generations",
            {"model": "tiny", "prompt": "ping", "n": 1, "size": "64x64", "num_inference_steps": 1},
        ),
        (
            CanaryPlan.IMAGE_CHAT,
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "ping"}], "modalities": []},
        ),
    ],
    ids=["none", "image", "image chat"],
)
def test_the_plan_picks_the_canary_of_a_pipeline_with_a_diffusion_stage(
    plan: CanaryPlan, path: str | None, body: dict[str, Any] | None
) -> None:
    server = FakeServer()
    clock = FakeClock(start=100.0)
    asked: list[float] = []

    def planned(now: float) -> CanaryPlan:
        asked.append(now)
        return plan

    async def check(url: str) -> None:
        async with aiohttp.ClientSession() as session:
            probe = CanaryProbe(session, url, CONFIG, clock, lambda: None, planned)
            found = await probe.collect()
            assert len(found) == (0 if plan is CanaryPlan.NONE else 1)

    server.run(check)
    assert asked == [100.0]
    assert server.paths == ([] if path is None else [path])
    assert server.bodies == ([] if body is None else [body])


def test_configured_body_is_sent_as_is() -> None:
    server = FakeServer()
    body = {"model": "qwen-omni", "prompt": "hi", "max_tokens": 1}
    config = ProbesConfig(canary_body=body, canary_path="/v1/chat/completions")

    async def check(url: str) -> None:
        async with aiohttp.ClientSession() as session:
            await canary(session, url, FakeClock(), [None], config).collect()

    server.run(check)
    assert server.bodies == [body]
    assert server.model_calls == 0


def test_missed_deadline_is_a_timeout() -> None:
    async def hang(request: web.Request) -> web.Response:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def check(url: str) -> None:
        async with aiohttp.ClientSession() as session:
            (observation,) = await canary(session, url, FakeClock(), [None]).collect()
        assert observation.outcome == "timeout"

    FakeServer(hang).run(check)


def test_error_answer_is_unhealthy_with_status_and_body() -> None:
    error = {"error": {"message": "EngineDeadError: " + "x" * 300, "code": 500}}

    async def dead(request: web.Request) -> web.Response:
        return web.json_response(error, status=500)

    async def check(url: str) -> None:
        async with aiohttp.ClientSession() as session:
            (observation,) = await canary(session, url, FakeClock(), [None]).collect()
        assert observation.outcome == "unhealthy"
        assert observation.detail == "500: " + json.dumps(error)[:200]

    FakeServer(dead).run(check)


def test_a_request_the_server_refuses_is_the_probe_s_failure_not_evidence() -> None:
    # vLLM-Omni's image pipeline refuses a text-only request.
    refusal = {"error": {"message": "Unsupported output modalities text", "code": 400}}

    async def refuse(request: web.Request) -> web.Response:
        return web.json_response(refusal, status=400)

    async def check(url: str) -> None:
        async with aiohttp.ClientSession() as session:
            probe = canary(session, url, FakeClock(), [None])
            with pytest.raises(ProbeError, match="refused the canary request, 400"):
                await probe.collect()

    FakeServer(refuse).run(check)


def test_a_server_gone_after_the_model_is_known_is_refused() -> None:
    fake = FakeServer()
    clock = FakeClock()

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/v1/models", fake.models)
        app.router.add_post("/v1/chat/completions", fake.chat)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        async with aiohttp.ClientSession() as session:
            probe = canary(session, str(server.make_url("")), clock, [None])
            await probe.collect()
            await server.close()
            clock.advance(3.0)
            (observation,) = await probe.collect()
        assert observation.outcome == "refused"

    asyncio.run(main())


def test_unknown_model_is_a_probe_error() -> None:
    async def check(url: str) -> None:
        async with aiohttp.ClientSession() as session:
            with pytest.raises(ProbeError, match="HTTP 404"):
                await canary(session, url, FakeClock(), [None]).collect()

    FakeServer(models_status=404).run(check)
