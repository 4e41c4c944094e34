"""Talking to a real vLLM or vLLM-Omni server, and reading what a watchdog saw of it."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import aiohttp
from deadline import wait_for
from real_vllm.server import MODEL_NAME, VllmServer

from omni_watchdog.app import Watchdog
from omni_watchdog.probes.span_store import SpanRecord
from omni_watchdog.types import EvidenceKind

# How often a wait asks a real server: each look costs it a request.
ASK_EVERY = 0.25
# Long enough to still be decoding when a signal arrives a moment after its first token.
LONG_REQUEST = 480


def chat_body(max_tokens: int, stream: bool = False) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "What is vLLM?"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        # A random model may say end-of-text at once; these requests must run their length.
        "ignore_eos": True,
        "stream": stream,
    }


async def answer(
    session: aiohttp.ClientSession, url: str, max_tokens: int = 8, timeout: float = 60.0
) -> tuple[int, str]:
    """A chat completion's status, and the start of its body when it failed."""
    async with session.post(
        url + "/v1/chat/completions",
        json=chat_body(max_tokens),
        timeout=aiohttp.ClientTimeout(total=timeout),
    ) as response:
        body = await response.text()
        return response.status, "" if response.status == 200 else body[:500]


async def chat(session: aiohttp.ClientSession, url: str, max_tokens: int = 8) -> int:
    return (await answer(session, url, max_tokens))[0]


class Stream:
    """A streaming chat completion read in the background: its events and how it ended."""

    def __init__(self, session: aiohttp.ClientSession, url: str, max_tokens: int) -> None:
        self.events: list[dict[str, Any]] = []
        self.first_token = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self._read(session, url, max_tokens))

    async def _read(self, session: aiohttp.ClientSession, url: str, max_tokens: int) -> None:
        async with session.post(
            url + "/v1/chat/completions",
            json=chat_body(max_tokens, stream=True),
            timeout=aiohttp.ClientTimeout(total=120),
        ) as response:
            async for line in response.content:
                data = line.decode().strip().removeprefix("data:").strip()
                if not data or data == "[DONE]":
                    continue
                self.events.append(json.loads(data))
                self.first_token.set()

    def errors(self) -> list[dict[str, Any]]:
        return [event for event in self.events if "error" in event]

    async def cancel(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.task


async def running_stream(session: aiohttp.ClientSession, server: VllmServer) -> Stream:
    """A long streaming request that the engine is decoding right now."""
    stream = Stream(session, server.url, LONG_REQUEST)
    await asyncio.wait_for(stream.first_token.wait(), 30)
    return stream


async def health_status(session: aiohttp.ClientSession, server: VllmServer) -> int | None:
    try:
        async with session.get(
            server.url + "/health", timeout=aiohttp.ClientTimeout(total=2)
        ) as response:
            return response.status
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None


def all_spans(watchdog: Watchdog) -> list[SpanRecord]:
    store = watchdog.spans
    return [record for stage in (*store.stages(), None) for record in store.recent(stage)]


def evidence_kinds(incident: Any) -> set[EvidenceKind]:
    return {e.kind for verdict in incident.verdicts for e in verdict.evidence}


async def gone(server: VllmServer, timeout: float) -> None:
    await wait_for(lambda: not server.leftovers(), timeout)
