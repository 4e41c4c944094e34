"""A local OTLP/HTTP collector that keeps every span it is sent, for the instrument tests."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from ports import free_port


def attribute_value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [attribute_value(item) for item in value.array_value.values]
    return getattr(value, kind) if kind else None


@dataclass
class CapturedSpan:
    name: str
    attributes: dict[str, Any]
    resource: dict[str, Any]
    status_code: int
    status_message: str
    events: list[tuple[str, dict[str, Any]]]
    start_ns: int
    span_id: bytes


class Collector:
    """Decodes `ExportTraceServiceRequest` bodies posted to /v1/traces and keeps the spans.

    It keeps each request's `Authorization` header too, and can misbehave: answer every
    export with `status`, or hold every answer while `hanging`, until the test ends.
    """

    def __init__(self) -> None:
        self.spans: list[CapturedSpan] = []
        self.authorizations: list[str | None] = []
        self.status = 200
        self.hanging = False
        self.released = threading.Event()
        self._lock = threading.Lock()
        self.url = ""

    async def receive(self, request: web.Request) -> web.Response:
        body = await request.read()
        with self._lock:
            self.authorizations.append(request.headers.get("Authorization"))
        while self.hanging and not self.released.is_set():
            await asyncio.sleep(0.05)
        if self.status != 200:
            return web.Response(status=self.status)
        message = ExportTraceServiceRequest.FromString(body)
        with self._lock:
            for resource_spans in message.resource_spans:
                resource = {
                    a.key: attribute_value(a.value) for a in resource_spans.resource.attributes
                }
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append(
                            CapturedSpan(
                                name=span.name,
                                attributes={
                                    a.key: attribute_value(a.value) for a in span.attributes
                                },
                                resource=resource,
                                status_code=span.status.code,
                                status_message=span.status.message,
                                events=[
                                    (
                                        e.name,
                                        {a.key: attribute_value(a.value) for a in e.attributes},
                                    )
                                    for e in span.events
                                ],
                                start_ns=span.start_time_unix_nano,
                                span_id=span.span_id,
                            )
                        )
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )

    def named(self, name: str) -> list[CapturedSpan]:
        with self._lock:
            return [span for span in self.spans if span.name == name]


@pytest.fixture
def unused_port() -> int:
    """A loopback port nothing listens on."""
    return free_port()


@contextmanager
def serving() -> Iterator[Collector]:
    """A collector listening on a loopback port, on its own event loop's thread."""
    collector = Collector()
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/v1/traces", collector.receive)
    runner = web.AppRunner(app)
    port = free_port()

    async def start() -> None:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(5)
    collector.url = f"http://127.0.0.1:{port}"
    try:
        yield collector
    finally:
        collector.released.set()
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


@pytest.fixture
def collector() -> Iterator[Collector]:
    with serving() as collector:
        yield collector


@pytest.fixture
def head_collector() -> Iterator[Collector]:
    """A second collector: the head's watchdog, beside the local one."""
    with serving() as collector:
        yield collector
