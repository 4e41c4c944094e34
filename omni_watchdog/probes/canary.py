"""The canary probe: one minimal request with a deadline, sent only when nothing else moves.

`/health` and the gauges both look fine while a stopped engine serves nothing (measured on
the real vLLM), so only a request that has to finish shows such a hang. It is sent only
after `canary_interval` without organic progress, so it costs nothing under load. Which
request it is follows the pipeline (`CanaryPlan`): one text token for an LLM pipeline; for
one with a diffusion stage, none while every stage beats or one is denoising, else the
cheapest image it makes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp

from omni_watchdog.config import ProbesConfig
from omni_watchdog.probes.health import FRESH_CONNECTION, call_outcome
from omni_watchdog.types import (
    CanaryPlan,
    Clock,
    HealthOutcome,
    Observation,
    ObservationKind,
    ProbeError,
)

ERROR_BODY_CHARS = 200
# Answers that refuse the request itself; a timeout (408) or an overloaded server (429)
# is the server's state, and counts.
REFUSED_REQUEST = frozenset(range(400, 500)) - {408, 429}
# Where a one-stage diffusion server takes an image request, and the size its canary asks:
# small, and a multiple of 16, which DiT pipelines ask of a size (a VAE's x8 and patches
# of 2). A model that refuses it needs `canary_body` and `canary_path`.
IMAGES_PATH = "/v1/images/generations"
CANARY_IMAGE_SIZE = "64x64"


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
        plan: Callable[[float], CanaryPlan] = lambda now: CanaryPlan.TEXT,
    ) -> None:
        """`plan`: the canary the server gets now, if any (`Detector.canary_plan`)."""
        self._session = session
        self._base_url = target_url.rstrip("/")
        self._config = config
        self._timeout = aiohttp.ClientTimeout(total=config.canary_deadline)
        self._clock = clock
        self._last_progress = last_progress
        self._plan = plan
        self._last_sent: float | None = None
        self._model: str | None = None

    def due(self) -> bool:
        """True when nothing moved for `canary_interval` and no canary went out in that
        time (whether one goes out is the plan's)."""
        now = self._clock.monotonic()
        interval = self._config.canary_interval
        last_progress = self._last_progress()
        if last_progress is not None and now - last_progress < interval:
            return False
        return self._last_sent is None or now - self._last_sent >= interval

    async def rest(self, seconds: float) -> None:
        """Wait `seconds`, and on until a canary can next be due. Progress and canaries
        only move that moment later, so looking then is never late; once due, the plan is
        asked every `seconds`."""
        now = self._clock.monotonic()
        marks = [mark for mark in (self._last_progress(), self._last_sent) if mark is not None]
        until_due = max(marks) + self._config.canary_interval - now if marks else 0.0
        await asyncio.sleep(max(seconds, until_due))

    async def collect(self) -> Sequence[Observation]:
        if not self.due():
            return []
        plan = self._plan(self._clock.monotonic())
        if plan is CanaryPlan.NONE:
            return []
        path, body = await self._request(plan)
        started = self._clock.monotonic()
        self._last_sent = started
        outcome, status, reason = await call_outcome(
            self._session.post(
                self._base_url + path,
                json=body,
                timeout=self._timeout,
                headers=FRESH_CONNECTION,
            )
        )
        finished = self._clock.monotonic()
        if outcome is HealthOutcome.UNHEALTHY and status in REFUSED_REQUEST:
            # The server answered, and said the request was wrong for it (an image model
            # asked for text): the canary's fault, not the server's. Reported as the
            # probe's failure, never as evidence against the server.
            raise ProbeError(
                f"{path}: the server refused the canary request, {status}:"
                f" {reason[:ERROR_BODY_CHARS]} (set probes.canary_body and probes.canary_path)"
            )
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

    async def _request(self, plan: CanaryPlan) -> tuple[str, dict[str, Any]]:
        """The path and body of the canary of `plan`; a configured body wins."""
        if self._config.canary_body:
            return self._config.canary_path, dict(self._config.canary_body)
        model = await self._served_model()
        if plan is CanaryPlan.IMAGE:
            # One denoising step of the smallest image: the diffusion stage's whole path,
            # a fraction of one real request's work.
            return IMAGES_PATH, {
                "model": model,
                "prompt": "ping",
                "n": 1,
                "size": CANARY_IMAGE_SIZE,
                "num_inference_steps": 1,
            }
        messages = [{"role": "user", "content": "ping"}]
        if plan is CanaryPlan.IMAGE_CHAT:
            # vLLM-Omni 0.30 takes an image request of an LLM → DiT pipeline only at chat
            # completions, with no output modality named; size and steps are its own.
            return self._config.canary_path, {
                "model": model,
                "messages": messages,
                "modalities": [],
            }
        return self._config.canary_path, {
            "model": model,
            "messages": messages,
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
