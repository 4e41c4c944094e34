"""Forwarding to an upstream collector: every OTLP body the spans receiver accepted, as it came.

The watchdog may sit between the server and the collector it would otherwise export to;
the forwarder keeps that collector fed without ever holding ingestion up.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

log = logging.getLogger(__name__)


class SpanForwarder:
    """Posts every accepted body to an upstream OTLP/HTTP endpoint from a background task.

    `submit` never waits: when the queue is full the body is dropped and counted, and a
    failing or slow upstream only fills the queue.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        endpoint: str,
        queue_size: int = 1000,
        timeout: float = 5.0,
    ) -> None:
        self._session = session
        self.endpoint = endpoint
        self._queue: asyncio.Queue[tuple[bytes, str, str]] = asyncio.Queue(maxsize=queue_size)
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._task: asyncio.Task[None] | None = None
        self.forwarded = 0
        self.dropped = 0
        self._bug_logged = False

    def start(self) -> None:
        """Start the background task; call from the running event loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def submit(self, body: bytes, content_type: str, content_encoding: str) -> None:
        """Queue one body as received, or drop and count it when the queue is full."""
        try:
            self._queue.put_nowait((body, content_type, content_encoding))
        except asyncio.QueueFull:
            self.dropped += 1

    async def close(self) -> None:
        """Stop the background task; bodies still queued are dropped and counted."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self.dropped += self._queue.qsize()
        while not self._queue.empty():
            self._queue.get_nowait()

    async def _run(self) -> None:
        while True:
            body, content_type, content_encoding = await self._queue.get()
            headers = {"Content-Type": content_type}
            if content_encoding:
                headers["Content-Encoding"] = content_encoding
            try:
                async with self._session.post(
                    self.endpoint, data=body, headers=headers, timeout=self._timeout
                ) as response:
                    await response.read()
                    ok = 200 <= response.status < 300
            except (aiohttp.ClientError, asyncio.TimeoutError) as error:
                log.debug("forwarding to %s failed: %s", self.endpoint, error)
                ok = False
            except Exception:  # the loop must outlive a bug; the body is dropped, counted
                if not self._bug_logged:
                    log.exception("forwarding to %s failed unexpectedly", self.endpoint)
                    self._bug_logged = True
                ok = False
            if ok:
                self.forwarded += 1
            else:
                self.dropped += 1
