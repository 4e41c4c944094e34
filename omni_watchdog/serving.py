"""The one way the watchdog serves HTTP: its API and its OTLP receiver, bounded.

Each listener caps its open connections and gives every connection `header_timeout` to
send a whole request head, after connecting or after its previous response. A client that
holds a connection without finishing a request head is the first to go when the cap is
reached, so idle or slow connections can never lock the target's own exporters out.
Bodies are read by the handlers, which bound them themselves, and never inflated by
aiohttp: the receiver inflates gzip within its size cap.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Handler

from omni_watchdog.log import log_event

logger = logging.getLogger("omni_watchdog.serving")

CLOSE_REASONS = ("over_cap", "header_timeout", "bad_request")
# One log line per kind of listener error in this many seconds; the count is kept whole.
ERROR_LOG_INTERVAL = 10.0
# How long a closing listener lets the requests it is serving finish before cancelling them.
CLOSE_GRACE = 1.0


@dataclass(frozen=True)
class ListenerLimits:
    """How much one listener lets its clients hold."""

    header_timeout: float
    max_connections: int


class RateLimitedLog:
    """Logs an error at most once per `interval` per kind, and counts every one."""

    def __init__(
        self,
        count: Callable[[], None],
        interval: float = ERROR_LOG_INTERVAL,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._count = count
        self._interval = interval
        self._monotonic = monotonic
        self._last: dict[str, float] = {}

    def error(self, kind: str, exc_info: BaseException | None = None, **fields: Any) -> None:
        self._count()
        now = self._monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self._interval:
            return
        self._last[kind] = now
        log_event(logger, kind, logging.ERROR, exc_info=exc_info, **fields)


class _Connection(asyncio.Protocol):
    """aiohttp's protocol for one connection, with the listener's deadline around it."""

    def __init__(self, listener: Listener, inner: Any) -> None:
        self._listener = listener
        self._inner = inner
        self.transport: asyncio.Transport | None = None
        self.in_request = False
        self._admitted = False
        self._received_since_armed = False
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if not self._listener.admit(self):
            transport.abort()
            return
        self._admitted = True
        self.arm()
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._admitted:
            self._received_since_armed = True
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        if not self._admitted:
            return None
        result: bool | None = self._inner.eof_received()
        return result

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm()
        self._listener.release(self)
        # aiohttp's handler saw the connection open (an evicted one too): it must see it go.
        if self._admitted:
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def arm(self) -> None:
        """Start the wait for the next request head."""
        self.disarm()
        self.in_request = False
        self._received_since_armed = False
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._listener.limits.header_timeout, self._expire)

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def request_started(self) -> None:
        self.disarm()
        self.in_request = True

    def close(self, reason: str | None) -> None:
        """Close the connection; a reason counts it as one the listener refused."""
        if reason is not None:
            self._listener.count_closed(reason)
        if self.transport is not None:
            self.transport.close()

    def _expire(self) -> None:
        self._timer = None
        # A connection that sent nothing since its last answer is only idle: closing it is
        # ordinary keep-alive housekeeping, not a refusal.
        self.close("header_timeout" if self._received_since_armed else None)


class Listener:
    """One aiohttp application on HOST:PORT with a connection cap and header deadlines."""

    def __init__(
        self,
        app: web.Application,
        name: str,
        limits: ListenerLimits,
        errors: RateLimitedLog,
    ) -> None:
        self.name = name
        self.limits = limits
        self._errors = errors
        self.closed = dict.fromkeys(CLOSE_REASONS, 0)
        # Insertion order is connection age: the oldest waiting connection goes first.
        self._open: dict[_Connection, None] = {}
        self._by_transport: dict[asyncio.BaseTransport, _Connection] = {}
        app.middlewares.insert(0, self._track_request)
        self._runner = web.AppRunner(
            app,
            access_log=None,
            logger=_RequestErrorLog(self),
            auto_decompress=False,
            keepalive_timeout=limits.header_timeout,
            handle_signals=False,
            # aiohttp's default lets a request still being served hold `close` for a minute.
            shutdown_timeout=CLOSE_GRACE,
        )
        self._server: asyncio.Server | None = None
        self.port: int | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen; the bound port (port 0 picks a free one)."""
        await self._runner.setup()
        protocol_factory = self._runner.server
        assert protocol_factory is not None
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self, protocol_factory()),
            host,
            port,
            reuse_address=True,
            backlog=min(1024, self.limits.max_connections * 2),
        )
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for connection in list(self._open):
                connection.close(None)
            await self._server.wait_closed()
            self._server = None
        await self._runner.cleanup()

    @property
    def open_connections(self) -> int:
        return len(self._open)

    def server_connections(self) -> list[Any]:
        """aiohttp's own handlers of the open connections."""
        server = self._runner.server
        return list(server.connections) if server is not None else []

    def admit(self, connection: _Connection) -> bool:
        """Take a new connection, making room by closing the oldest one between requests."""
        if len(self._open) >= self.limits.max_connections:
            waiting = next((c for c in self._open if not c.in_request), None)
            if waiting is None:
                self.count_closed("over_cap")
                return False
            self.release(waiting)
            waiting.close("over_cap")
        self._open[connection] = None
        if connection.transport is not None:
            self._by_transport[connection.transport] = connection
        return True

    def release(self, connection: _Connection) -> None:
        """Forget a connection that is closing, or closed."""
        if connection.transport is not None:
            self._by_transport.pop(connection.transport, None)
        self._open.pop(connection, None)

    def count_closed(self, reason: str) -> None:
        self.closed[reason] += 1

    def request_failed(self, error: BaseException | None) -> None:
        """aiohttp could not serve a request: a malformed head is the client's, counted
        as a refusal; anything else is a bug of ours, counted and logged, rate-limited."""
        if isinstance(error, HttpProcessingError):
            self.count_closed("bad_request")
            return
        self._errors.error("request_failed", exc_info=error, listener=self.name)

    @web.middleware
    async def _track_request(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        connection = self._by_transport.get(request.transport) if request.transport else None
        if connection is not None:
            connection.request_started()
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except asyncio.CancelledError:
            raise
        except Exception as error:
            self._errors.error(
                "handler_failed", exc_info=error, listener=self.name, path=request.path
            )
            return web.Response(status=500, text="internal error; see the watchdog's log\n")
        finally:
            if connection is not None and connection in self._open:
                connection.arm()


def install_loop_error_handler(loop: asyncio.AbstractEventLoop, errors: RateLimitedLog) -> None:
    """Errors the event loop reports itself (a failed accept when out of descriptors, a
    callback that raised) are logged at a bounded rate and counted, never a log flood."""

    def handle(_: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = str(context.get("message", "event loop error"))
        exception = context.get("exception")
        errors.error(
            "loop_error",
            exc_info=exception if isinstance(exception, BaseException) else None,
            message=message,
        )

    loop.set_exception_handler(handle)


class _RequestErrorLog(logging.Logger):
    """What aiohttp logs about one request, handed to its listener.

    aiohttp writes a traceback for every request it cannot serve, a malformed head
    included; unchecked, any client could fill the watchdog's log."""

    def __init__(self, listener: Listener) -> None:
        super().__init__(f"omni_watchdog.serving.{listener.name}")
        self._listener = listener

    def debug(self, msg: object, *args: object, **kwargs: Any) -> None:
        # Bytes that are not HTTP at all are only a debug line to aiohttp; still a refusal.
        error = kwargs.get("exc_info")
        if isinstance(error, HttpProcessingError):
            self._listener.request_failed(error)

    def exception(self, msg: object, *args: object, **kwargs: Any) -> None:
        self._listener.request_failed(_raised(kwargs.get("exc_info")))

    def error(self, msg: object, *args: object, **kwargs: Any) -> None:
        self._listener.request_failed(_raised(kwargs.get("exc_info")))


def _raised(exc_info: object) -> BaseException | None:
    """The exception a logging call names: given, or the one being handled."""
    if isinstance(exc_info, BaseException):
        return exc_info
    return sys.exc_info()[1]
