"""The health probe: every way a /health call can end is an observation, not an error."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from omni_watchdog.clock import FakeClock
from omni_watchdog.config import ProbesConfig
from omni_watchdog.probes.health import HealthProbe
from omni_watchdog.types import Observation, ObservationKind

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
CONFIG = ProbesConfig(health_timeout=0.2)


class SteppingClock(FakeClock):
    """A fake clock that moves 0.25 s each time it is read, so latency is checkable."""

    def monotonic(self) -> float:
        self.advance(0.25)
        return super().monotonic()


async def probe_once(url: str) -> Observation:
    async with aiohttp.ClientSession() as session:
        (observation,) = await HealthProbe(session, url, CONFIG, SteppingClock()).collect()
    return observation


def health_of(handler: Handler) -> Observation:
    async def main() -> Observation:
        app = web.Application()
        app.router.add_get("/health", handler)
        async with TestServer(app, host="127.0.0.1") as server:
            return await probe_once(str(server.make_url("")))

    return asyncio.run(main())


async def hang(request: web.Request) -> web.Response:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


@pytest.mark.parametrize(
    ("status", "outcome"), [(200, "ok"), (204, "ok"), (503, "unhealthy"), (404, "unhealthy")]
)
def test_status_codes(status: int, outcome: str) -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(status=status)

    observation = health_of(handler)
    assert observation.kind == ObservationKind.HEALTH
    assert (observation.outcome, observation.detail) == (outcome, str(status))
    assert observation.value == 0.25
    assert observation.time == 1000.5


def test_no_answer_in_time_is_a_timeout() -> None:
    observation = health_of(hang)
    assert observation.outcome == "timeout"


def test_nothing_listening_is_refused() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    observation = asyncio.run(probe_once(f"http://127.0.0.1:{port}"))
    assert observation.outcome == "refused"


def test_a_dropped_connection_is_an_error() -> None:
    async def main() -> Observation:
        async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readline()
            writer.close()

        server = await asyncio.start_server(drop, "127.0.0.1", 0)
        async with server:
            port = server.sockets[0].getsockname()[1]
            return await probe_once(f"http://127.0.0.1:{port}")

    observation = asyncio.run(main())
    assert observation.outcome == "error"
    assert "ServerDisconnectedError" in observation.detail
