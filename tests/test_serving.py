"""The listeners: a connection cap that never locks real clients out, and header deadlines."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web
from aiohttp.typedefs import Handler
from deadline import wait_for
from listening import listening

from omni_watchdog.clock import FakeClock
from omni_watchdog.serving import Listener, RateLimitedLog

DEADLINE = 5.0


def app_with(handler: Handler | None = None) -> web.Application:
    async def hello(_: web.Request) -> web.Response:
        return web.Response(text="hello")

    app = web.Application()
    app.router.add_get("/", handler or hello)
    return app


@asynccontextmanager
async def listener_of(
    app: web.Application, header_timeout: float = 10.0, max_connections: int = 8
) -> AsyncIterator[tuple[Listener, list[None]]]:
    errors: list[None] = []
    async with listening(app, header_timeout, max_connections, errors) as listener:
        yield listener, errors


async def get(port: int) -> int:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}/", timeout=aiohttp.ClientTimeout(DEADLINE)) as reply,
    ):
        await reply.read()
        return reply.status


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    """Whether the server closes the connection before the deadline."""
    try:
        return await asyncio.wait_for(reader.read(), DEADLINE) == b""
    except asyncio.TimeoutError:
        return False


def test_idle_connections_make_room_for_a_real_client() -> None:
    async def scenario() -> tuple[int, list[bool], dict[str, int]]:
        async with listener_of(app_with(), max_connections=3) as (listener, _):
            assert listener.port is not None
            idle = [await asyncio.open_connection("127.0.0.1", listener.port) for _ in range(3)]
            await wait_for(lambda: listener.open_connections == 3, DEADLINE)
            status = await get(listener.port)
            closed = [await closed_by_server(reader) for reader, _ in idle[:1]]
            # aiohttp saw the evicted connection go too: it holds no more than are open.
            await wait_for(
                lambda: len(listener.server_connections()) == listener.open_connections,
                DEADLINE,
            )
            for _, writer in idle:
                writer.close()
            return status, closed, dict(listener.closed)

    status, closed, counts = asyncio.run(scenario())
    assert status == 200
    assert closed == [True]  # the oldest idle connection went first
    assert counts["over_cap"] == 1


def test_connections_all_busy_are_kept_and_the_new_one_refused() -> None:
    release = asyncio.Event()
    entered: list[None] = []

    async def slow(_: web.Request) -> web.Response:
        entered.append(None)
        await release.wait()
        return web.Response(text="done")

    async def scenario() -> tuple[bool, list[int], int]:
        async with listener_of(app_with(slow), max_connections=2) as (listener, _):
            assert listener.port is not None
            busy = [asyncio.create_task(get(listener.port)) for _ in range(2)]
            await wait_for(lambda: len(entered) == 2, DEADLINE)
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            refused = await closed_by_server(reader)
            writer.close()
            release.set()
            return refused, list(await asyncio.gather(*busy)), listener.closed["over_cap"]

    refused, statuses, over_cap = asyncio.run(scenario())
    assert refused
    assert statuses == [200, 200]
    assert over_cap == 1


def test_a_slow_request_head_is_cut_off_and_counted() -> None:
    async def scenario() -> tuple[bool, bool, dict[str, int]]:
        async with listener_of(app_with(), header_timeout=0.3) as (listener, _):
            assert listener.port is not None
            slow_reader, slow_writer = await asyncio.open_connection("127.0.0.1", listener.port)
            slow_writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n")  # never finished
            idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", listener.port)
            slow = await closed_by_server(slow_reader)
            idle = await closed_by_server(idle_reader)
            slow_writer.close()
            idle_writer.close()
            return slow, idle, dict(listener.closed)

    slow, idle, counts = asyncio.run(scenario())
    assert slow and idle
    # An idle connection going is housekeeping; a half-sent head is a refusal.
    assert counts == {"over_cap": 0, "header_timeout": 1, "bad_request": 0}


def test_a_kept_alive_client_gets_several_answers() -> None:
    async def scenario() -> list[int]:
        async with listener_of(app_with(), header_timeout=1.0) as (listener, _):
            assert listener.port is not None
            async with aiohttp.ClientSession() as session:
                statuses = []
                for _ in range(3):
                    async with session.get(f"http://127.0.0.1:{listener.port}/") as reply:
                        statuses.append(reply.status)
                return statuses

    assert asyncio.run(scenario()) == [200, 200, 200]


def test_a_handler_that_raises_answers_500_and_is_counted() -> None:
    async def broken(_: web.Request) -> web.Response:
        raise RuntimeError("a bug")

    async def scenario() -> tuple[int, int, int]:
        async with listener_of(app_with(broken)) as (listener, errors):
            assert listener.port is not None
            first = await get(listener.port)
            await get(listener.port)
            return first, len(errors), listener.open_connections

    status, errors, _ = asyncio.run(scenario())
    assert status == 500
    assert errors == 2


def test_the_error_log_is_rate_limited_but_every_error_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    counted: list[None] = []
    log = RateLimitedLog(lambda: counted.append(None), interval=10.0, monotonic=clock.monotonic)
    with caplog.at_level(logging.ERROR, logger="omni_watchdog.serving"):
        for _ in range(30):
            log.error("accept_failed")
            log.error("handler_failed")
            clock.advance(1.0)
    assert len(counted) == 60
    logged = [record.getMessage() for record in caplog.records]
    assert logged.count("accept_failed") == 3
    assert logged.count("handler_failed") == 3


def test_a_malformed_request_head_is_refused_and_counted_not_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    heads = (b"GARBAGE\r\n\r\n", b"GET / HTTP/1.1\r\nHost: x\r\nno colon\r\n\r\n")

    async def scenario() -> tuple[list[bytes], int, dict[str, int]]:
        async with listener_of(app_with()) as (listener, errors):
            assert listener.port is not None
            answers = []
            for head in heads * 5:
                reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
                writer.write(head)
                answers.append((await asyncio.wait_for(reader.read(), 5)).split(b"\r\n")[0])
                writer.close()
            return answers, len(errors), dict(listener.closed)

    with caplog.at_level("DEBUG"):
        answers, errors, counts = asyncio.run(scenario())
    assert all(re.match(rb"HTTP/1\.[01] 400 ", answer) for answer in answers), answers
    assert counts["bad_request"] == len(heads) * 5
    # A client's bad bytes are not the watchdog's errors, nor a traceback in its log.
    assert errors == 0
    assert not [r for r in caplog.records if r.exc_info]
