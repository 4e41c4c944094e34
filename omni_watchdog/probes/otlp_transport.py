"""OTLP/HTTP `POST /v1/traces` for the spans receiver: the first step a span takes.

The aiohttp application checks the bearer token and what the body is before reading a
byte of it, reads it within the configured size and time, finds the process end of the
connection it came on, hands it to the receiver's `ingest`, and answers as a collector
does: an empty response, a partial success, or a `google.rpc.Status` with the HTTP status
of the refusal (400, 401, 408, 413, 415, 503), in the body's own encoding.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web
from aiohttp.typedefs import Handler
from google.protobuf import json_format
from google.rpc import status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceResponse,
)

from omni_watchdog.bearer import bearer_matches
from omni_watchdog.config import SpansConfig
from omni_watchdog.probes.otlp_decode import JSON, PROTOBUF, OtlpError
from omni_watchdog.probes.span_trust import ConnectionSender, ConnectionSenders

TRACES_PATH = "/v1/traces"
RESPONSE_STATUSES = (200, 400, 401, 404, 405, 408, 413, 415, 503)
RETRY_AFTER_SECONDS = 1

# google.rpc.Code values for the Status body of a failed export.
_GRPC_INVALID_ARGUMENT = 3
_GRPC_RESOURCE_EXHAUSTED = 8
_GRPC_UNAVAILABLE = 14

_READ_CHUNK = 64 * 1024


@dataclass(frozen=True)
class IngestResult:
    """What one export request gave: spans accepted and rejected, and why some were."""

    accepted: int
    rejected: int
    error_message: str = ""


class ExportSink(Protocol):
    """Where the bodies the endpoint reads go: the spans receiver."""

    def check_acceptable(self, media_type: str, content_encoding: str) -> None:
        """Refuse (OtlpError) what will not be taken, before a byte of the body is read."""
        ...

    def ingest(
        self,
        body: bytes,
        media_type: str,
        content_encoding: str,
        sender: ConnectionSender | None,
    ) -> IngestResult:
        """Take one body as it came; OtlpError when it is refused as a whole."""
        ...


class TracesEndpoint:
    """Serves `POST /v1/traces` into `sink`, counting each refused request in `rejected`
    by reason and each answer in `requests` by status.

    `token`: the bearer token an export must carry ("" for none). `connections`: where a
    connection's process is looked up (None: nowhere).
    """

    def __init__(
        self,
        config: SpansConfig,
        sink: ExportSink,
        rejected: dict[str, int],
        *,
        token: str = "",
        connections: ConnectionSenders | None = None,
    ) -> None:
        self._config = config
        self._sink = sink
        self._rejected = rejected
        self._token = token.encode() if token else None
        self._connections = connections
        self.requests = dict.fromkeys(RESPONSE_STATUSES, 0)
        self._empty_response = {
            PROTOBUF: ExportTraceServiceResponse().SerializeToString(),
            JSON: b"{}",
        }

    def app(self) -> web.Application:
        """The aiohttp application serving `POST /v1/traces`."""
        app = web.Application(
            middlewares=[self._count_status], client_max_size=self._config.max_body_bytes
        )
        app.router.add_post(TRACES_PATH, self._handle_traces)
        return app

    def check_authorized(self, authorization: str | None) -> None:
        """Refuse (401) an export without the configured bearer token."""
        if self._token is None:
            return
        if not bearer_matches(authorization, self._token):
            raise OtlpError(401, "unauthorized", "missing or wrong bearer token")

    async def _read_body(self, request: web.Request) -> bytes:
        """The request body, refused (413) as soon as it passes the configured cap."""
        limit = self._config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise OtlpError(413, "too_large", f"body is over {limit} bytes")
        parts: list[bytes] = []
        size = 0
        async for chunk in request.content.iter_chunked(_READ_CHUNK):
            size += len(chunk)
            if size > limit:
                raise OtlpError(413, "too_large", f"body is over {limit} bytes")
            parts.append(chunk)
        return b"".join(parts)

    async def _read_body_in_time(self, request: web.Request) -> bytes:
        timeout = self._config.body_timeout
        try:
            return await asyncio.wait_for(self._read_body(request), timeout)
        except asyncio.TimeoutError:
            raise OtlpError(
                408, "body_timeout", f"the body did not arrive within {timeout:g}s"
            ) from None
        except ConnectionResetError:
            # An exporter that gave up waiting (its own timeout) closes mid-body: a client
            # going away, counted, not an error of the watchdog's.
            raise OtlpError(
                400, "body_incomplete", "the connection closed before the body ended"
            ) from None

    async def _handle_traces(self, request: web.Request) -> web.Response:
        media_type = request.content_type
        encoding = request.headers.get("Content-Encoding", "").strip().lower()
        try:
            self.check_authorized(request.headers.get("Authorization"))
            self._sink.check_acceptable(media_type, encoding)
            # Looked up while the connection is surely open: a sender gone by the time its
            # body is read must not slip past the check.
            sender = self._sender_of(request)
            body = await self._read_body_in_time(request)
            result = self._sink.ingest(body, media_type, encoding, sender)
        except OtlpError as error:
            self._rejected[error.reason] += 1
            return self._error_response(error, media_type)
        if not result.rejected:
            return web.Response(body=self._empty_response[media_type], content_type=media_type)
        response = ExportTraceServiceResponse()
        response.partial_success.rejected_spans = result.rejected
        response.partial_success.error_message = result.error_message
        return self._message_response(200, response, media_type)

    def _sender_of(self, request: web.Request) -> ConnectionSender | None:
        """The process end of the request's connection, where it is looked up and found.
        OtlpError: the connection is gone already."""
        if self._connections is None:
            return None
        transport = request.transport
        if transport is None:
            raise OtlpError(400, "body_incomplete", "the connection closed before the body ended")
        return self._connections.of(transport)

    def _error_response(self, error: OtlpError, media_type: str) -> web.Response:
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if error.status == 503 else None
        if media_type not in (PROTOBUF, JSON):
            return web.Response(status=error.status, text=error.message, headers=headers)
        code = {413: _GRPC_RESOURCE_EXHAUSTED, 503: _GRPC_UNAVAILABLE}.get(
            error.status, _GRPC_INVALID_ARGUMENT
        )
        status = status_pb2.Status(code=code, message=error.message)
        return self._message_response(error.status, status, media_type, headers)

    @staticmethod
    def _message_response(
        status: int, message: Any, media_type: str, headers: Mapping[str, str] | None = None
    ) -> web.Response:
        if media_type == PROTOBUF:
            body = message.SerializeToString()
        else:
            body = json_format.MessageToJson(message, indent=None).encode()
        return web.Response(status=status, body=body, content_type=media_type, headers=headers)

    @web.middleware
    async def _count_status(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            response = await handler(request)
        except web.HTTPException as error:
            self.requests[error.status] = self.requests.get(error.status, 0) + 1
            raise
        self.requests[response.status] = self.requests.get(response.status, 0) + 1
        return response
