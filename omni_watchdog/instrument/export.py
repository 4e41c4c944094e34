"""OTLP/HTTP protobuf export of the plugin's spans to the watchdog's own receiver.

The SDK's exporter builds one protobuf object per span, attribute and value in Python and
sends each batch through `requests`; inside a stage process that costs about 50 us a span
and a millisecond a batch, taken from the loop being watched. Here a batch is written
straight to protobuf's wire format (the bytes equal the SDK encoder's, which the tests
check) and posted over one kept-alive `http.client` connection.

This exporter serves `OMNI_WATCHDOG_OTLP_ENDPOINT` and `OMNI_WATCHDOG_HEAD_OTLP_ENDPOINT`
only: the watchdog's receiver needs no compression or client certificates, and its one
header, the bearer token, is given here. A general collector named by the standard
`OTEL_EXPORTER_OTLP_*` variables keeps the SDK's exporter, which honours all of those.
"""

from __future__ import annotations

import functools
import http.client
import logging
import struct
import threading
from collections.abc import Iterable, Mapping, Sequence
from urllib.parse import urlsplit

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext

from omni_watchdog import __version__

logger = logging.getLogger(__name__)

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
# SpanFlags: the span says whether its parent is remote (OTLP 1.1).
_HAS_IS_REMOTE = 0x100
_IS_REMOTE = 0x200
_SMALL_VARINTS = [bytes([value]) for value in range(0x80)]


def _varint(value: int) -> bytes:
    if value < 0x80:
        return _SMALL_VARINTS[value]
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _tag(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def _delimited(tag: bytes, payload: bytes) -> bytes:
    return tag + _varint(len(payload)) + payload


def _text(value: str) -> bytes:
    return value.encode("utf-8", "replace")


_VARINT, _FIXED64, _DELIMITED, _FIXED32 = 0, 1, 2, 5
# AnyValue's oneof: a member that is set is written even when it holds its default.
_ANY_STRING = _tag(1, _DELIMITED)
_ANY_BOOL = _tag(2, _VARINT)
_ANY_INT = _tag(3, _VARINT)
_ANY_DOUBLE = _tag(4, _FIXED64)
_ANY_ARRAY = _tag(5, _DELIMITED)
_ANY_KVLIST = _tag(6, _DELIMITED)
_ANY_BYTES = _tag(7, _DELIMITED)
_LIST_VALUES = _tag(1, _DELIMITED)  # ArrayValue.values, KeyValueList.values
_KV_KEY = _tag(1, _DELIMITED)
_KV_VALUE = _tag(2, _DELIMITED)


def _any_value(value: object) -> bytes:
    """One AnyValue; TypeError or ValueError for what OTLP cannot carry."""
    if value is None:
        return b""
    if isinstance(value, bool):  # before int: bool is an int subclass
        return _ANY_BOOL + _SMALL_VARINTS[int(value)]
    if isinstance(value, str):
        # Strict: protobuf refuses text that is not UTF-8, and so does the SDK's encoder.
        return _delimited(_ANY_STRING, value.encode("utf-8"))
    if isinstance(value, int):
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise ValueError(f"{value} does not fit an int64")
        return _ANY_INT + _varint(value & 0xFFFF_FFFF_FFFF_FFFF)
    if isinstance(value, float):
        return _ANY_DOUBLE + struct.pack("<d", value)
    if isinstance(value, bytes):
        return _delimited(_ANY_BYTES, value)
    if isinstance(value, Sequence):
        items = b"".join(_delimited(_LIST_VALUES, _any_value(item)) for item in value)
        return _delimited(_ANY_ARRAY, items)
    if isinstance(value, Mapping):
        pairs = b"".join(
            _delimited(_LIST_VALUES, _key_value(str(key), item)) for key, item in value.items()
        )
        return _delimited(_ANY_KVLIST, pairs)
    raise TypeError(f"cannot encode a {type(value).__name__}")


@functools.lru_cache(maxsize=1024)
def _key_prefix(key: str) -> bytes:
    """A KeyValue's key and the tag of its value: the plugin sends a handful of keys."""
    return _delimited(_KV_KEY, _text(key)) + _KV_VALUE


def _key_value(key: str, value: object) -> bytes:
    encoded = _any_value(value)
    return _key_prefix(key) + _varint(len(encoded)) + encoded


def _attributes(tag: bytes, attributes: Mapping[str, object] | None) -> bytes:
    """Repeated KeyValue under `tag`; an attribute that cannot be encoded is left out."""
    if not attributes:
        return b""
    parts = []
    for key, value in attributes.items():
        try:
            pair = _key_value(key, value)
        except (TypeError, ValueError, UnicodeEncodeError):
            logger.debug("attribute %r left out of the export", key, exc_info=True)
            continue
        parts.append(_delimited(tag, pair))
    return b"".join(parts)


def _scalar(tag: bytes, value: int) -> bytes:
    """A proto3 varint field, which is not written when it holds its default."""
    return tag + _varint(value) if value else b""


def _string(tag: bytes, value: str | None) -> bytes:
    return _delimited(tag, _text(value)) if value else b""


def _flags(parent: SpanContext | None) -> int:
    if parent is not None and parent.is_remote:
        return _HAS_IS_REMOTE | _IS_REMOTE
    return _HAS_IS_REMOTE


# Resource, InstrumentationScope, Span, Span.Event, Span.Link, Status fields.
_RESOURCE_ATTRIBUTES = _tag(1, _DELIMITED)
_SCOPE_NAME, _SCOPE_VERSION, _SCOPE_ATTRIBUTES = (_tag(n, _DELIMITED) for n in (1, 2, 3))
_SPAN_TRACE_ID, _SPAN_ID, _SPAN_TRACE_STATE, _SPAN_PARENT_ID, _SPAN_NAME = (
    _tag(n, _DELIMITED) for n in (1, 2, 3, 4, 5)
)
_SPAN_KIND = _tag(6, _VARINT)
_SPAN_START, _SPAN_END = _tag(7, _FIXED64), _tag(8, _FIXED64)
_SPAN_ATTRIBUTES = _tag(9, _DELIMITED)
_SPAN_DROPPED_ATTRIBUTES = _tag(10, _VARINT)
_SPAN_EVENTS = _tag(11, _DELIMITED)
_SPAN_DROPPED_EVENTS = _tag(12, _VARINT)
_SPAN_LINKS = _tag(13, _DELIMITED)
_SPAN_DROPPED_LINKS = _tag(14, _VARINT)
_SPAN_STATUS = _tag(15, _DELIMITED)
_SPAN_FLAGS = _tag(16, _FIXED32)
_EVENT_TIME = _tag(1, _FIXED64)
_EVENT_NAME, _EVENT_ATTRIBUTES = _tag(2, _DELIMITED), _tag(3, _DELIMITED)
_EVENT_DROPPED_ATTRIBUTES = _tag(4, _VARINT)
_LINK_TRACE_ID, _LINK_SPAN_ID, _LINK_ATTRIBUTES = (_tag(n, _DELIMITED) for n in (1, 2, 4))
_LINK_DROPPED_ATTRIBUTES = _tag(5, _VARINT)
_LINK_FLAGS = _tag(6, _FIXED32)
_STATUS_MESSAGE, _STATUS_CODE = _tag(2, _DELIMITED), _tag(3, _VARINT)
# ScopeSpans, ResourceSpans, ExportTraceServiceRequest fields.
_SCOPE_SPANS_SCOPE, _SCOPE_SPANS_SPANS, _SCOPE_SPANS_SCHEMA = (
    _tag(n, _DELIMITED) for n in (1, 2, 3)
)
_RESOURCE_SPANS_RESOURCE, _RESOURCE_SPANS_SCOPES, _RESOURCE_SPANS_SCHEMA = (
    _tag(n, _DELIMITED) for n in (1, 2, 3)
)
_REQUEST_RESOURCE_SPANS = _tag(1, _DELIMITED)


def _fixed64(tag: bytes, value: int | None) -> bytes:
    return tag + struct.pack("<Q", value) if value else b""


def _span(span: ReadableSpan, context: SpanContext) -> bytes:
    parts = [
        _SPAN_TRACE_ID + b"\x10" + context.trace_id.to_bytes(16, "big"),
        _SPAN_ID + b"\x08" + context.span_id.to_bytes(8, "big"),
    ]
    if context.trace_state:
        parts.append(
            _string(_SPAN_TRACE_STATE, ",".join(f"{k}={v}" for k, v in context.trace_state.items()))
        )
    if span.parent is not None:
        parts.append(_SPAN_PARENT_ID + b"\x08" + span.parent.span_id.to_bytes(8, "big"))
    parts.append(_string(_SPAN_NAME, span.name))
    # OTLP numbers kinds from 1 (0 is "unspecified"); the API numbers them from 0.
    parts.append(_SPAN_KIND + _varint(span.kind.value + 1))
    parts.append(_fixed64(_SPAN_START, span.start_time))
    parts.append(_fixed64(_SPAN_END, span.end_time))
    parts.append(_attributes(_SPAN_ATTRIBUTES, span.attributes))
    parts.append(_scalar(_SPAN_DROPPED_ATTRIBUTES, span.dropped_attributes))
    for event in span.events:
        encoded = (
            _fixed64(_EVENT_TIME, event.timestamp)
            + _string(_EVENT_NAME, event.name)
            + _attributes(_EVENT_ATTRIBUTES, event.attributes)
            + _scalar(_EVENT_DROPPED_ATTRIBUTES, event.dropped_attributes)
        )
        parts.append(_delimited(_SPAN_EVENTS, encoded))
    parts.append(_scalar(_SPAN_DROPPED_EVENTS, span.dropped_events))
    for link in span.links:
        encoded = (
            _LINK_TRACE_ID
            + b"\x10"
            + link.context.trace_id.to_bytes(16, "big")
            + _LINK_SPAN_ID
            + b"\x08"
            + link.context.span_id.to_bytes(8, "big")
            + _attributes(_LINK_ATTRIBUTES, link.attributes)
            + _scalar(_LINK_DROPPED_ATTRIBUTES, link.dropped_attributes)
            + _LINK_FLAGS
            + struct.pack("<I", _flags(link.context))
        )
        parts.append(_delimited(_SPAN_LINKS, encoded))
    parts.append(_scalar(_SPAN_DROPPED_LINKS, span.dropped_links))
    status = span.status
    parts.append(
        _delimited(
            _SPAN_STATUS,
            _string(_STATUS_MESSAGE, status.description)
            + _scalar(_STATUS_CODE, status.status_code.value),
        )
    )
    parts.append(_SPAN_FLAGS + struct.pack("<I", _flags(span.parent)))
    return b"".join(parts)


def _resource(resource: Resource) -> bytes:
    return _attributes(_RESOURCE_ATTRIBUTES, resource.attributes)


def _scope(scope: InstrumentationScope | None) -> bytes:
    if scope is None:
        return b""
    return (
        _string(_SCOPE_NAME, scope.name)
        + _string(_SCOPE_VERSION, scope.version)
        + _attributes(_SCOPE_ATTRIBUTES, scope.attributes)
    )


def encode_spans(spans: Iterable[ReadableSpan]) -> bytes:
    """An `ExportTraceServiceRequest`, grouped by resource and then by scope, as the SDK does."""
    # Keyed by identity: hashing a Resource serialises its attributes to JSON, and the spans
    # of one provider share one Resource object.
    groups: dict[int, tuple[Resource, dict[InstrumentationScope | None, list[bytes]]]] = {}
    for span in spans:
        context = span.get_span_context()
        if context is None:  # only a span that never started has none
            continue
        resource = span.resource
        _, scopes = groups.setdefault(id(resource), (resource, {}))
        scopes.setdefault(span.instrumentation_scope or None, []).append(_span(span, context))
    body = []
    for resource, scopes in groups.values():
        scope_spans = []
        for scope, encoded_spans in scopes.items():
            scope_spans.append(
                _delimited(
                    _RESOURCE_SPANS_SCOPES,
                    _delimited(_SCOPE_SPANS_SCOPE, _scope(scope))
                    + b"".join(_delimited(_SCOPE_SPANS_SPANS, encoded) for encoded in encoded_spans)
                    + _string(_SCOPE_SPANS_SCHEMA, scope.schema_url if scope else None),
                )
            )
        resource_spans = (
            _delimited(_RESOURCE_SPANS_RESOURCE, _resource(resource))
            + b"".join(scope_spans)
            + _string(_RESOURCE_SPANS_SCHEMA, resource.schema_url)
        )
        body.append(_delimited(_REQUEST_RESOURCE_SPANS, resource_spans))
    return b"".join(body)


# The watchdog's receiver may close an idle kept-alive connection; a request that found it
# closed was never read, so sending it once more on a fresh connection cannot duplicate it.
_STALE_CONNECTION = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)


class WatchdogSpanExporter(SpanExporter):
    """Posts each batch to the watchdog's OTLP/HTTP receiver over one kept-alive connection."""

    def __init__(self, endpoint: str, timeout_s: float, token: str = "") -> None:
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {endpoint!r}")
        # A stage that exports to two watchdogs says which one failed.
        self._endpoint = endpoint
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port
        self._path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._timeout_s = timeout_s
        self._headers = {
            "Content-Type": "application/x-protobuf",
            "User-Agent": f"omni-watchdog-instrument/{__version__}",
        }
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._lock = threading.Lock()
        self._connection: http.client.HTTPConnection | None = None

    def _connect(self) -> http.client.HTTPConnection:
        if self._https:
            return http.client.HTTPSConnection(self._host, self._port, timeout=self._timeout_s)
        return http.client.HTTPConnection(self._host, self._port, timeout=self._timeout_s)

    def _close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def _post(self, body: bytes) -> int:
        """The response's status; the connection is reopened once if it had gone stale."""
        reused = self._connection is not None
        if self._connection is None:
            self._connection = self._connect()
        try:
            self._connection.request("POST", self._path, body, self._headers)
            response = self._connection.getresponse()
            response.read()
        except _STALE_CONNECTION:
            self._close()
            if not reused:
                raise
            return self._post(body)
        if response.will_close:
            self._close()
        return response.status

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        body = encode_spans(spans)
        with self._lock:
            try:
                status = self._post(body)
            except (OSError, http.client.HTTPException) as error:
                self._close()
                logger.debug("span export to %s failed: %s", self._endpoint, error)
                return SpanExportResult.FAILURE
        if 200 <= status < 300:
            return SpanExportResult.SUCCESS
        logger.debug("span export to %s refused: HTTP %d", self._endpoint, status)
        return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        with self._lock:
            self._close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
