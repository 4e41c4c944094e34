"""Serve an aiohttp application the way `omni-watchdog run` does, for tests and benchmarks."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from aiohttp import web

from omni_watchdog.serving import Listener, ListenerLimits, RateLimitedLog


@contextlib.asynccontextmanager
async def listening(
    app: web.Application,
    header_timeout: float = 10.0,
    max_connections: int = 256,
    errors: list[None] | None = None,
) -> AsyncIterator[Listener]:
    """`app` on a free loopback port through the watchdog's own `Listener`; each error it
    counts is appended to `errors`."""
    errors = [] if errors is None else errors
    listener = Listener(
        app,
        "test",
        ListenerLimits(header_timeout, max_connections),
        RateLimitedLog(lambda: errors.append(None)),
    )
    await listener.start("127.0.0.1", 0)
    try:
        yield listener
    finally:
        await listener.close()
