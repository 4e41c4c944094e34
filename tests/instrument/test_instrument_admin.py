"""POST /admin/shutdown on aiohttp and on FastAPI/Starlette."""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from omni_watchdog.instrument.admin import add_aiohttp_admin_route, add_fastapi_admin_route

TOKEN = {"OMNI_WATCHDOG_ADMIN_TOKEN": "s3cret"}
CASES = [
    ({}, {"Authorization": "Bearer s3cret"}, 403),
    (TOKEN, {}, 401),
    (TOKEN, {"Authorization": "Bearer wrong"}, 401),
    (TOKEN, {"Authorization": "Basic s3cret"}, 401),
    (TOKEN, {"Authorization": "Bearer s3cret"}, 202),
]


async def call_aiohttp(environ: dict[str, str], headers: dict[str, str]) -> tuple[int, int]:
    triggered: list[str] = []
    app = web.Application()
    add_aiohttp_admin_route(app, lambda: triggered.append("shutdown"), environ=environ)
    async with TestClient(TestServer(app)) as client:
        response = await client.post("/admin/shutdown", headers=headers)
        status = response.status
        await response.json()
        # The trigger is scheduled after the answer is written; give the loop its turn.
        for _ in range(10):
            await asyncio.sleep(0)
    return status, len(triggered)


@pytest.mark.parametrize(("environ", "headers", "status"), CASES)
def test_aiohttp_route(environ: dict[str, str], headers: dict[str, str], status: int) -> None:
    assert asyncio.run(call_aiohttp(environ, headers)) == (status, 1 if status == 202 else 0)


async def call_asgi(app: Any, headers: dict[str, str], events: list[str]) -> int:
    """Drive one POST through an ASGI app, noting each message sent and the trigger call."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/admin/shutdown",
        "raw_path": b"/admin/shutdown",
        "root_path": "",
        "query_string": b"",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    status: list[int] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        events.append(message["type"])
        if message["type"] == "http.response.start":
            status.append(message["status"])

    await app(scope, receive, send)
    return status[0]


@pytest.mark.skipif(importlib.util.find_spec("fastapi") is None, reason="FastAPI is not installed")
@pytest.mark.parametrize(("environ", "headers", "status"), CASES)
def test_fastapi_route(environ: dict[str, str], headers: dict[str, str], status: int) -> None:
    from fastapi import FastAPI

    events: list[str] = []
    app = FastAPI()
    add_fastapi_admin_route(app, lambda: events.append("trigger"), environ=environ)
    assert asyncio.run(call_asgi(app, headers, events)) == status
    if status == 202:
        assert events[-1] == "trigger"
        assert events.index("http.response.body") < events.index("trigger")
    else:
        assert "trigger" not in events


async def call_aiohttp_raw(authorization: bytes) -> bytes:
    """POST with an Authorization header of raw bytes, as no HTTP client library would."""
    app = web.Application()
    add_aiohttp_admin_route(app, lambda: None, environ=TOKEN)
    async with TestServer(app, host="127.0.0.1") as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(
            b"POST /admin/shutdown HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n"
            b"Authorization: " + authorization + b"\r\nConnection: close\r\n\r\n"
        )
        await writer.drain()
        answer = await reader.read()
        writer.close()
    return answer.split(b"\r\n", 1)[0]


@pytest.mark.parametrize(
    "authorization", [b"Bearer \xff\xfe", b"Bearer s3cret\xc3", b"\xe2\x82", b"Bearer", b""]
)
def test_a_malformed_authorization_header_is_401_not_500(authorization: bytes) -> None:
    assert asyncio.run(call_aiohttp_raw(authorization)) == b"HTTP/1.1 401 Unauthorized"
