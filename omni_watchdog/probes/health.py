"""The /health probe: how one call to the server's health endpoint ended, and how fast."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager

import aiohttp

from omni_watchdog.config import ProbesConfig
from omni_watchdog.http_body import read_at_most
from omni_watchdog.types import Clock, HealthOutcome, Observation, ObservationKind

# A new connection per call: a pooled one to a server that died fails as "disconnected",
# where a fresh one says what matters: refused (nothing listens) or timeout (hung).
FRESH_CONNECTION = {"Connection": "close"}
# The most of an answer read (/health, the canary's): the status says how the call went,
# an error body's first lines why; the rest is left unread.
MAX_ANSWER_READ = 64 * 1024


async def call_outcome(
    request: AbstractAsyncContextManager[aiohttp.ClientResponse],
) -> tuple[HealthOutcome, int | None, str]:
    """(outcome, status, error body or reason) of one HTTP call; never raises for the network."""
    try:
        async with request as response:
            body, _ = await read_at_most(response, MAX_ANSWER_READ)
            if 200 <= response.status < 300:
                return HealthOutcome.OK, response.status, ""
            return HealthOutcome.UNHEALTHY, response.status, body.decode("utf-8", "replace")
    except asyncio.TimeoutError:
        return HealthOutcome.TIMEOUT, None, "no answer in time"
    except aiohttp.ClientConnectorError as error:
        # A refused connection means nothing listens: the server is gone, not hung.
        if isinstance(error.os_error, ConnectionRefusedError):
            return HealthOutcome.REFUSED, None, str(error)
        return HealthOutcome.ERROR, None, str(error)
    except aiohttp.ClientError as error:
        return HealthOutcome.ERROR, None, f"{type(error).__name__}: {error}"


class HealthProbe:
    """Calls the server's /health with a short timeout: ok, unhealthy, timeout or refused."""

    name = "health"

    def __init__(
        self,
        session: aiohttp.ClientSession,
        target_url: str,
        config: ProbesConfig,
        clock: Clock,
    ) -> None:
        self._session = session
        self._url = target_url.rstrip("/") + config.health_path
        self._timeout = aiohttp.ClientTimeout(total=config.health_timeout)
        self._clock = clock

    async def collect(self) -> Sequence[Observation]:
        started = self._clock.monotonic()
        outcome, status, reason = await call_outcome(
            self._session.get(self._url, timeout=self._timeout, headers=FRESH_CONNECTION)
        )
        finished = self._clock.monotonic()
        detail = str(status) if status is not None else reason
        return [
            Observation(
                ObservationKind.HEALTH,
                finished,
                value=finished - started,
                outcome=outcome,
                detail=detail,
            )
        ]
