"""`POST /admin/shutdown`: a token-protected way to start the server's own graceful shutdown.

Neither vLLM nor vLLM-Omni has a shutdown endpoint; SIGTERM to the API process is their
graceful path, so the default trigger raises exactly that. A watchdog that does not share
the server's PID namespace has no other lever.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from omni_watchdog.bearer import bearer_matches

logger = logging.getLogger(__name__)

ADMIN_TOKEN_ENV = "OMNI_WATCHDOG_ADMIN_TOKEN"
ADMIN_SHUTDOWN_PATH = "/admin/shutdown"


def terminate_current_process() -> None:
    """Send SIGTERM to this process: what vLLM's server takes as "shut down gracefully"."""
    os.kill(os.getpid(), signal.SIGTERM)


@dataclass(frozen=True)
class AdminAnswer:
    """The status and JSON body of one answer; `accepted` means shut down after sending it."""

    status: int
    body: dict[str, str]
    headers: dict[str, str]

    @property
    def accepted(self) -> bool:
        return self.status == 202


class ShutdownAuthority:
    """Decides whether one shutdown call is allowed, from its Authorization header."""

    def __init__(self, token: str | None) -> None:
        self._token = token.encode() if token else None

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> ShutdownAuthority:
        env = os.environ if environ is None else environ
        return cls(env.get(ADMIN_TOKEN_ENV, "").strip() or None)

    @property
    def enabled(self) -> bool:
        """Whether a token is configured, that is whether shutdown can ever be accepted."""
        return self._token is not None

    def answer(self, authorization: str | None) -> AdminAnswer:
        """403 without a configured token, 401 without the right bearer token, else 202."""
        if self._token is None:
            return AdminAnswer(
                403, {"error": f"shutdown disabled: {ADMIN_TOKEN_ENV} is not set"}, {}
            )
        if not bearer_matches(authorization, self._token):
            return AdminAnswer(
                401, {"error": "missing or wrong bearer token"}, {"WWW-Authenticate": "Bearer"}
            )
        return AdminAnswer(202, {"status": "shutting down"}, {})


def _run_trigger(trigger: Callable[[], None]) -> None:
    logger.warning("omni-watchdog: shutdown requested through %s", ADMIN_SHUTDOWN_PATH)
    try:
        trigger()
    except Exception:
        logger.exception("omni-watchdog: the shutdown trigger failed")


def add_aiohttp_admin_route(
    app: web.Application,
    trigger: Callable[[], None] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> None:
    """Add `POST /admin/shutdown` to an aiohttp application."""
    authority = ShutdownAuthority.from_environment(environ)
    start_shutdown = trigger or terminate_current_process

    async def shutdown_handler(request: web.Request) -> web.StreamResponse:
        answer = authority.answer(request.headers.get("Authorization"))
        response = web.json_response(answer.body, status=answer.status, headers=answer.headers)
        if answer.accepted:
            # Send the answer first: once shutdown starts the connection may not outlive it.
            await response.prepare(request)
            await response.write_eof()
            asyncio.get_running_loop().call_soon(_run_trigger, start_shutdown)
        return response

    app.router.add_post(ADMIN_SHUTDOWN_PATH, shutdown_handler)


def add_fastapi_admin_route(
    app: Any,
    trigger: Callable[[], None] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> None:
    """Add `POST /admin/shutdown` to a FastAPI or Starlette application (vLLM's API server)."""
    # Imported here so the package works where Starlette is not installed.
    from starlette.background import BackgroundTask
    from starlette.requests import Request
    from starlette.responses import JSONResponse

    authority = ShutdownAuthority.from_environment(environ)
    start_shutdown = trigger or terminate_current_process

    async def shutdown_endpoint(request: Request) -> JSONResponse:
        answer = authority.answer(request.headers.get("authorization"))
        # Starlette runs a background task only after the response has been sent.
        background = BackgroundTask(_run_trigger, start_shutdown) if answer.accepted else None
        return JSONResponse(
            answer.body, status_code=answer.status, headers=answer.headers, background=background
        )

    app.router.add_route(
        ADMIN_SHUTDOWN_PATH, shutdown_endpoint, methods=["POST"], include_in_schema=False
    )
