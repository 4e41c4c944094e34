"""The canary probe: one minimal request with a deadline, sent only when nothing else moves.

`/health` and the gauges both look fine while a stopped engine serves nothing (measured on
the real vLLM), so only a request that has to finish shows such a hang. It is sent only
after `canary_interval` without organic progress, so it costs nothing under load.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp

from omni_watchdog.config import ProbesConfig
from omni_watchdog.probes.health import FRESH_CONNECTION, call_outcome
from omni_watchdog.types import Clock, HealthOutcome, Observation, ObservationKind, ProbeError

ERROR_BODY_CHARS = 200


class CanaryProbe:
    """Sends one text token request when no organic progress was seen for a while."""

    name = "canary"

    def __init__(
        self,
        session: aiohttp.ClientSession,
        target_url: str,
        config: ProbesConfig,
        clock: Clock,
        last_progress: Callable[[], float | None],
    ) -> None:
        self._session = session
        self._base_url = target_url.rstrip("/")
        self._config = config
        self._timeout = aiohttp.ClientTimeout(total=config.canary_deadline)
        self._clock = clock
        self._last_progress = last_progress
        self._last_sent: float | None = None
        self._model: str | None = None

    def due(self) -> bool:
        """True when nothing moved for `canary_interval` and no canary went out in that time."""
        now = self._clock.monotonic()
        interval = self._config.canary_interval
        last_progress = self._last_progress()
        if last_progress is not None and now - last_progress < interval:
            return False
        return self._last_sent is None or now - self._last_sent >= interval

    async def collect(self) -> Sequence[Observation]:
        if not self.due():
            return []
        body = await self._body()
        started = self._clock.monotonic()
        self._last_sent = started
        outcome, status, reason = await call_outcome(
            self._session.post(
                self._base_url + self._config.canary_path,
                json=body,
                timeout=self._timeout,
                headers=FRESH_CONNECTION,
            )
        )
        finished = self._clock.monotonic()
        if outcome is HealthOutcome.UNHEALTHY:
            detail = f"{status}: {reason[:ERROR_BODY_CHARS]}"
        else:
            detail = str(status) if status is not None else reason
        return [
            Observation(
                ObservationKind.CANARY,
                finished,
                value=finished - started,
                outcome=outcome,
                detail=detail,
            )
        ]

    async def _body(self) -> dict[str, Any]:
        if self._config.canary_body:
            return dict(self._config.canary_body)
        return {
            "model": await self._served_model(),
            "messages": [{"role": "user", "content": "ping"}],
            "max_tokens": 1,
            "temperature": 0,
            # vLLM-Omni routes a text-only request to the text stage only and checks the
            # value against the pipeline's output modalities; plain vLLM ignores the field.
            "modalities": ["text"],
        }

    async def _served_model(self) -> str:
        """The first model id of GET /v1/models, asked once and then cached."""
        if self._model is not None:
            return self._model
        url = self._base_url + "/v1/models"
        try:
            async with self._session.get(url, timeout=self._timeout) as response:
                if response.status != 200:
                    raise ProbeError(f"{url}: HTTP {response.status}, cannot name the model")
                listing = await response.json(content_type=None)
        except asyncio.TimeoutError:
            raise ProbeError(f"{url}: no answer in {self._timeout.total:g}s") from None
        except (aiohttp.ClientError, ValueError) as error:
            raise ProbeError(f"{url}: {error}") from None
        try:
            model = str(listing["data"][0]["id"])
        except (KeyError, IndexError, TypeError):
            raise ProbeError(f"{url}: no model id in the answer") from None
        self._model = model
        return model
