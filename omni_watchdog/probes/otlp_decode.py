"""OTLP/HTTP export bodies as protobuf requests, and typed access to what their spans say.

The spans receiver's second step, after the transport has read a body: inflate it
(bounded), decode protobuf or OTLP JSON into an `ExportTraceServiceRequest`, and read the
attributes the receiver needs as Python values, with every value a sender controls cut
to a bound. A body that cannot be decoded is an `OtlpError`, which the transport answers.
"""

from __future__ import annotations

import base64
import json
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Union

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from omni_watchdog.semconv import (
    DENOISE_STEP_COUNT,
    DENOISE_STEP_INDEX,
    DENOISE_STEP_SECONDS,
    DIFFUSION_DENOISE_MS,
    GEN_AI_REQUEST_ID,
    HOST_BOOT_ID,
    PROCESS_KIND,
    PROCESS_PID,
    PROCESS_START_TICKS,
    REQUEST_ID,
    REQUEST_STAGE_PATH,
    SERVICE_NAME,
    STAGE_ID,
    STAGE_NAME,
    STAGE_REPLICA,
    VLLM_OMNI_STAGE_ID,
    VLLM_OMNI_STAGE_REPLICA,
    VLLM_PROCESS_ID,
    VLLM_PROCESS_KIND,
)
from omni_watchdog.types import StageRef

PROTOBUF = "application/x-protobuf"
JSON = "application/json"

AttributeValue = Union[str, int, float, bool, list[Any]]  # noqa: UP007 (an alias, 3.10)

STATUS_NAMES = ("unset", "ok", "error")
STATUS_CODE_ERROR = 2

# Bounds on what one span's or resource's attributes may make the watchdog keep.
MAX_ATTRIBUTES = 64
MAX_TEXT = 256
MAX_ITEMS = 16
# Request ids past this length are cut: an id names a request, it does not carry one.
MAX_REQUEST_ID = 256
MAX_STAGE_PATH = 64

_INFLATE_CHUNK = 256 * 1024
_GZIP_WBITS = 16 + zlib.MAX_WBITS
_ZERO_TRACE_ID = bytes(16)
_ZERO_SPAN_ID = bytes(8)

# The only span attributes read on ingestion; the rest are read when a record is built.
WANTED_KEYS = frozenset(
    {
        STAGE_ID,
        STAGE_REPLICA,
        REQUEST_ID,
        REQUEST_STAGE_PATH,
        GEN_AI_REQUEST_ID,
        VLLM_OMNI_STAGE_ID,
        VLLM_OMNI_STAGE_REPLICA,
        DENOISE_STEP_INDEX,
        DENOISE_STEP_COUNT,
        DENOISE_STEP_SECONDS,
        DIFFUSION_DENOISE_MS,
    }
)
_WANTED_KEY_BYTES = tuple((key, key.encode()) for key in sorted(WANTED_KEYS))
_NOTHING: dict[str, Any] = {}
# Distinct stage attribute values remembered; senders use a handful, a hostile one more.
STAGE_CACHE_SIZE = 4096
# Only short attribute values are remembered as cache keys, so a key never holds a body.
_CACHEABLE_TEXT = 32


class OtlpError(Exception):
    """An export request refused as a whole, with its HTTP status and rejection reason."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class DecodedExport:
    """One export request, and the wanted attribute keys its spans may hold."""

    request: ExportTraceServiceRequest
    wanted: frozenset[str]


def check_decodable(media_type: str, content_encoding: str) -> None:
    """Refuse (415) a body of a type or encoding that will not be decoded."""
    if media_type not in (PROTOBUF, JSON):
        raise OtlpError(
            415,
            "unsupported_media_type",
            f"unsupported content type {media_type!r}: use {PROTOBUF} or {JSON}",
        )
    if content_encoding not in ("", "identity", "gzip"):
        raise OtlpError(
            415,
            "unsupported_media_type",
            f"unsupported content encoding {content_encoding!r}: use gzip or none",
        )


def decode_export(body: bytes, media_type: str, content_encoding: str, limit: int) -> DecodedExport:
    """The export request in `body` as it came (gzip or not), refused (413) past `limit`
    bytes decompressed and (400) when it cannot be decoded."""
    if content_encoding == "gzip":
        body = gunzip(body, limit)
    elif len(body) > limit:
        raise OtlpError(413, "too_large", f"body is over {limit} bytes")
    request = decode_body(body, media_type)
    if media_type == PROTOBUF:
        # Protobuf keeps keys as raw UTF-8, so a key absent from the body is on no span;
        # JSON may escape characters, so there every key is looked for.
        wanted = frozenset(key for key, raw_key in _WANTED_KEY_BYTES if raw_key in body)
    else:
        wanted = WANTED_KEYS
    return DecodedExport(request, wanted)


def gunzip(data: bytes, limit: int) -> bytes:
    """Inflate a gzip body, refusing (413) as soon as the output would pass `limit` bytes."""
    if not data:
        raise OtlpError(400, "decode_error", "bad gzip body: empty")
    parts: list[bytes] = []
    size = 0
    pending = data
    while pending:
        inflater = zlib.decompressobj(_GZIP_WBITS)
        while not inflater.eof:
            try:
                chunk = inflater.decompress(pending, min(_INFLATE_CHUNK, limit - size + 1))
            except zlib.error as error:
                raise OtlpError(400, "decode_error", f"bad gzip body: {error}") from None
            size += len(chunk)
            if size > limit:
                raise OtlpError(413, "too_large", f"body is over {limit} bytes once decompressed")
            parts.append(chunk)
            pending = inflater.unconsumed_tail
            if not pending and not chunk and not inflater.eof:
                raise OtlpError(400, "decode_error", "bad gzip body: truncated stream")
        # Concatenated gzip members are one body.
        pending = inflater.unused_data
    return b"".join(parts)


def _hex_id_as_base64(value: object) -> str:
    """An OTLP JSON id (hex) in the base64 form protobuf's JSON parser wants; "" if malformed."""
    if not isinstance(value, str):
        return ""
    try:
        return base64.b64encode(bytes.fromhex(value)).decode("ascii")
    except ValueError:
        return ""


def _fix_ids(message: object, keys: tuple[str, ...]) -> None:
    if isinstance(message, dict):
        for key in keys:
            if key in message:
                message[key] = _hex_id_as_base64(message[key])


def _children(message: object, key: str) -> list[Any]:
    children = message.get(key) if isinstance(message, dict) else None
    return children if isinstance(children, list) else []


def decode_json(body: bytes) -> ExportTraceServiceRequest:
    """An OTLP JSON body (hex ids, lowerCamelCase names) as the protobuf request."""
    document = json.loads(body)
    if not isinstance(document, dict):
        raise ValueError("the body is not a JSON object")
    for resource_spans in _children(document, "resourceSpans"):
        for scope_spans in _children(resource_spans, "scopeSpans"):
            for span in _children(scope_spans, "spans"):
                _fix_ids(span, ("traceId", "spanId", "parentSpanId"))
                for link in _children(span, "links"):
                    _fix_ids(link, ("traceId", "spanId"))
    request = ExportTraceServiceRequest()
    json_format.ParseDict(document, request, ignore_unknown_fields=True)
    return request


def decode_body(body: bytes, media_type: str) -> ExportTraceServiceRequest:
    """The export request in `body`, or OtlpError(400) when it cannot be decoded."""
    try:
        if media_type == PROTOBUF:
            return ExportTraceServiceRequest.FromString(body)
        return decode_json(body)
    except (DecodeError, json_format.ParseError, ValueError, RecursionError) as error:
        kind = "protobuf" if media_type == PROTOBUF else "JSON"
        raise OtlpError(400, "decode_error", f"undecodable {kind} body: {error}") from None


def has_valid_ids(span: Any) -> bool:
    """The span's trace id is 16 bytes and its span id 8, neither all zero."""
    trace_id = span.trace_id
    span_id = span.span_id
    return (
        len(trace_id) == 16
        and len(span_id) == 8
        and trace_id != _ZERO_TRACE_ID
        and span_id != _ZERO_SPAN_ID
    )


class WantedAttributes:
    """Reads the `wanted` keys of span after span, nothing else: ingestion's hot path."""

    def __init__(self, wanted: frozenset[str]) -> None:
        self._wanted = wanted
        self._count = len(wanted)
        self._single = self._count == 1
        self._hint = 0

    def of(self, key_values: Any) -> Mapping[str, Any]:
        """The wanted keys among one span's `KeyValue`s, with their Python values."""
        wanted = self._wanted
        if not wanted or not key_values:
            return _NOTHING
        found: dict[str, Any] = {}
        hint = self._hint
        if self._single and len(key_values) > hint:
            # Senders set attributes in one order: look where it was last.
            kv = key_values[hint]
            if kv.key in wanted:
                found[kv.key] = attribute_value(kv.value)
        if not found:
            wanted_count = self._count
            for index, kv in enumerate(key_values):
                key = kv.key
                if key in wanted:
                    found[key] = attribute_value(kv.value)
                    if len(found) == wanted_count:
                        self._hint = index
                        break
        return found


def attribute_value(value: Any) -> AttributeValue | None:
    """The Python value of an OTLP `AnyValue`; bytes become hex, maps become flat keys later."""
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [attribute_value(item) for item in value.array_value.values]
    if which == "bytes_value":
        return bytes(value.bytes_value).hex()
    if which == "kvlist_value":
        return {kv.key: attribute_value(kv.value) for kv in value.kvlist_value.values}  # type: ignore[return-value]
    result: AttributeValue = getattr(value, which)
    return result


def flat_attributes(key_values: Iterable[Any]) -> dict[str, AttributeValue]:
    """OTLP `KeyValue`s as one flat dict; nested maps become dotted keys."""
    flat: dict[str, AttributeValue] = {}
    for kv in key_values:
        _put_flat(flat, kv.key, attribute_value(kv.value))
    return flat


def _put_flat(flat: dict[str, AttributeValue], key: str, value: Any) -> None:
    if isinstance(value, dict):
        for sub_key, sub_value in value.items():
            _put_flat(flat, f"{key}.{sub_key}", sub_value)
    elif value is not None:
        flat[key] = value


def bounded_attributes(key_values: Any) -> dict[str, AttributeValue]:
    """Like `flat_attributes`, but at most `MAX_ATTRIBUTES` keys, texts cut to `MAX_TEXT`,
    lists to `MAX_ITEMS`, and nested maps kept as their text: for what a sender says about
    itself, which is kept for as long as its spans are."""
    bounded: dict[str, AttributeValue] = {}
    for kv in key_values[:MAX_ATTRIBUTES]:
        value = kv.value
        which = value.WhichOneof("value")
        if which == "array_value":
            items = [bounded_scalar(item) for item in value.array_value.values[:MAX_ITEMS]]
            bounded[kv.key[:MAX_TEXT]] = [item for item in items if item is not None]
        elif which is not None:
            scalar = bounded_scalar(value)
            if scalar is not None:
                bounded[kv.key[:MAX_TEXT]] = scalar
    return bounded


def bounded_scalar(value: Any) -> str | int | float | bool | None:
    """An `AnyValue` as one scalar: texts cut to `MAX_TEXT`, bytes as hex, lists and maps
    as their (cut) text."""
    which = value.WhichOneof("value")
    if which in ("string_value", "int_value", "double_value", "bool_value"):
        scalar: str | int | float | bool = getattr(value, which)
        return scalar[:MAX_TEXT] if isinstance(scalar, str) else scalar
    if which == "bytes_value":
        return bytes(value.bytes_value[: MAX_TEXT // 2]).hex()
    if which is None:
        return None
    return str(value)[:MAX_TEXT]


def as_int(value: object) -> int | None:
    """An attribute as an int: OTLP JSON and some SDKs send numbers as strings."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        digits = value.strip().removeprefix("-")
        # ASCII digits only: str.isdigit() also takes "¹", which int() refuses. A number
        # longer than an int64 names nothing here, and int() of it costs quadratic time.
        if digits.isascii() and digits.isdigit() and len(digits) <= 19:
            return int(value)
        return None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def as_float(value: object) -> float | None:
    """An attribute as a float, or None when it is not a number."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    return None


def request_id(found: Mapping[str, Any], key: str, fallback: str = "") -> str:
    """The request id `key` (else `fallback`) names, as text cut to `MAX_REQUEST_ID`."""
    value = found.get(key)
    if value is None and fallback:
        value = found.get(fallback)
    if type(value) is str:
        return value if len(value) <= MAX_REQUEST_ID else value[:MAX_REQUEST_ID]
    return "" if value is None else str(value)[:MAX_REQUEST_ID]


def stage_path(value: object) -> tuple[int, ...]:
    """A list of stage ids as a path; () when it is no list of integers or too long."""
    if not isinstance(value, list) or len(value) > MAX_STAGE_PATH:
        return ()
    path = tuple(stage for stage in (as_int(item) for item in value) if stage is not None)
    return path if len(path) == len(value) else ()


def stage_of(attributes: Mapping[str, object]) -> StageRef | None:
    """The stage named by `omni.stage.id` and `omni.stage.replica` (default 0), if any."""
    stage_id = as_int(attributes.get(STAGE_ID))
    if stage_id is None:
        return None
    replica = as_int(attributes.get(STAGE_REPLICA))
    return StageRef(stage_id, replica or 0)


def _cacheable(value: object) -> bool:
    return (
        value is None
        or isinstance(value, int)
        or (isinstance(value, str) and len(value) <= _CACHEABLE_TEXT)
    )


@dataclass(frozen=True)
class ResourceInfo:
    """What the resource of a batch says about the process that sent it."""

    attributes: Mapping[str, AttributeValue]
    stage: StageRef | None
    stage_name: str
    pid: int | None
    process_kind: str
    service_name: str
    start_ticks: int | None = None
    boot_id: str = ""

    @classmethod
    def from_attributes(
        cls, attributes: dict[str, AttributeValue], stage: StageRef | None
    ) -> ResourceInfo:
        """The resource whose attributes are `attributes` and that names `stage`."""
        pid = as_int(attributes.get(PROCESS_PID))
        if pid is None:
            pid = as_int(attributes.get(VLLM_PROCESS_ID))
        kind = attributes.get(PROCESS_KIND, attributes.get(VLLM_PROCESS_KIND, ""))
        return cls(
            attributes=attributes,
            stage=stage,
            stage_name=str(attributes.get(STAGE_NAME, "")),
            pid=pid,
            process_kind=str(kind),
            service_name=str(attributes.get(SERVICE_NAME, "")),
            start_ticks=as_int(attributes.get(PROCESS_START_TICKS)),
            boot_id=str(attributes.get(HOST_BOOT_ID, "")),
        )


EMPTY_RESOURCE = ResourceInfo({}, None, "", None, "", "")


class StageRefs:
    """The stages attribute values name, one shared `StageRef` per stage: consecutive spans
    then name the same object, which the receiver compares by identity."""

    def __init__(self) -> None:
        self._refs: dict[tuple[object, object], StageRef | None] = {}

    def named(self, stage_id: object, replica: object) -> StageRef | None:
        """The stage these attribute values name."""
        key = (stage_id, replica)
        try:
            return self._refs[key]
        except KeyError:
            pass
        except TypeError:  # an unhashable value (a list) names no stage anyway
            return stage_of({STAGE_ID: stage_id, STAGE_REPLICA: replica})
        stage = stage_of({STAGE_ID: stage_id, STAGE_REPLICA: replica})
        if not (_cacheable(stage_id) and _cacheable(replica)):
            return stage
        if len(self._refs) >= STAGE_CACHE_SIZE:
            self._refs.clear()
        self._refs[key] = stage
        return stage

    def of_span(self, found: Mapping[str, Any], resource: ResourceInfo) -> StageRef | None:
        """The stage a span names: its own stage attributes (ours, else vLLM-Omni's) win over
        its resource's; a replica belongs to the stage id it came with."""
        if STAGE_ID in found:
            return self.named(found[STAGE_ID], found.get(STAGE_REPLICA))
        if STAGE_REPLICA in found:
            return self.named(resource.attributes.get(STAGE_ID), found[STAGE_REPLICA])
        if VLLM_OMNI_STAGE_ID in found:
            return self.named(found[VLLM_OMNI_STAGE_ID], found.get(VLLM_OMNI_STAGE_REPLICA))
        return resource.stage

    def resource(self, resource_spans: Any) -> ResourceInfo:
        """What one `ResourceSpans`' resource says about its sender, its values bounded."""
        if not resource_spans.HasField("resource"):
            return EMPTY_RESOURCE
        attributes = bounded_attributes(resource_spans.resource.attributes)
        stage = self.named(attributes.get(STAGE_ID), attributes.get(STAGE_REPLICA))
        return ResourceInfo.from_attributes(attributes, stage)
