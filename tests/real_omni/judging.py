"""What the fault tests ask of a server and of the watchdog's incidents."""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import Any

import aiohttp
from e2e.harness import FAST
from real_vllm.client import chat
from real_vllm.server import VllmServer

from omni_watchdog.config import load_config
from omni_watchdog.types import StageRef, StepName


def in_background(server: VllmServer, session: aiohttp.ClientSession, count: int = 1) -> Any:
    """`count` chat requests left running; what each ended with, whenever it does."""
    loop = asyncio.get_running_loop()
    return [loop.create_task(chat_status(session, server.url)) for _ in range(count)]


async def chat_status(session: aiohttp.ClientSession, url: str) -> int | None:
    try:
        return await chat(session, url)
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None


def verdict_on(incident: Any, stage: StageRef) -> Any:
    return next((v for v in incident.verdicts if v.stage == stage), None)


def step_of(incident: Any, name: StepName) -> Any:
    return next((s for s in incident.steps if s.step is name), None)


def shipped() -> dict[str, Any]:
    """The detection thresholds and the canary as they ship: what is claimed is what a user
    gets. Judging starts as early as in the fault tests. On two cores shared with a second
    server, a healthy real stage fell silent for 2 s with the canary waiting at it, which
    the fault tests' short timeouts judge, and these tests are in enforce mode."""
    defaults = load_config(environ={})
    return {
        "detection": {
            name: f"{value:g}s" if isinstance(value, float) else value
            for name, value in asdict(defaults.detection).items()
            if name in FAST["detection"] and name != "startup_grace"
        },
        "probes": {
            "canary_interval": f"{defaults.probes.canary_interval:g}s",
            "canary_deadline": f"{defaults.probes.canary_deadline:g}s",
        },
    }
