"""A loopback OTLP/HTTP traces endpoint for the trace exporter's tests."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


class CaptureServer:
    """A loopback OTLP/HTTP traces endpoint that keeps every decoded request."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.content_types: list[str] = []
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        async def traces(request: web.Request) -> web.Response:
            self.content_types.append(request.content_type)
            self.requests.append(ExportTraceServiceRequest.FromString(await request.read()))
            return web.Response(body=b"", content_type="application/x-protobuf")

        app = web.Application()
        app.router.add_post("/v1/traces", traces)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}/v1/traces"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def spans(self) -> list[Any]:
        return [
            span
            for request in self.requests
            for resource_spans in request.resource_spans
            for scope_spans in resource_spans.scope_spans
            for span in scope_spans.spans
        ]


def attributes(span: Any) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for kv in span.attributes:
        value = kv.value
        kind = value.WhichOneof("value")
        if kind == "array_value":
            found[kv.key] = [getattr(v, v.WhichOneof("value")) for v in value.array_value.values]
        else:
            found[kv.key] = getattr(value, kind)
    return found
