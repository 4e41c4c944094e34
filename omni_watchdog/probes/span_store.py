"""The last spans of every stage, kept in ring buffers for the detector and incident bundles.

Spans are stored as their own serialized bytes and become `SpanRecord`s only when read:
ingestion is the hot path, reading happens once per incident. A decoded span would keep
the whole request it came in alive, and a span past `MAX_SPAN_BYTES` is cut down first,
so what the store holds is bounded whatever senders put in a span.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Union

from opentelemetry.proto.trace.v1.trace_pb2 import Span

from omni_watchdog.semconv import (
    EXCEPTION_MESSAGE,
    GEN_AI_LATENCY_E2E,
    GEN_AI_LATENCY_TIME_IN_QUEUE,
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN,
    GEN_AI_REQUEST_ID,
    GEN_AI_USAGE_COMPLETION_TOKENS,
    GEN_AI_USAGE_PROMPT_TOKENS,
    HOST_BOOT_ID,
    PROCESS_KIND,
    PROCESS_PID,
    PROCESS_START_TICKS,
    REQUEST_ID,
    SERVICE_NAME,
    STAGE_ID,
    STAGE_NAME,
    STAGE_REPLICA,
    VLLM_PROCESS_ID,
    VLLM_PROCESS_KIND,
)
from omni_watchdog.types import StageRef

AttributeValue = Union[str, int, float, bool, list[Any]]  # noqa: UP007 (an alias, 3.10)

STATUS_NAMES = ("unset", "ok", "error")
STATUS_CODE_ERROR = 2

# Bounds on what one span or resource may make the watchdog keep.
MAX_SPAN_BYTES = 4096
MAX_ATTRIBUTES = 64
MAX_TEXT = 256
MAX_ITEMS = 16
MAX_EVENTS = 8
# Pids whose stage a resource taught; the target's tree is far smaller.
MAX_LEARNED_PIDS = 4096


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


def bounded_attributes(key_values: Any) -> dict[str, AttributeValue]:
    """Like `flat_attributes`, but at most `MAX_ATTRIBUTES` keys, texts cut to `MAX_TEXT`,
    lists to `MAX_ITEMS`, and nested maps kept as their text: for what a sender says about
    itself, which is kept for as long as its spans are."""
    bounded: dict[str, AttributeValue] = {}
    for kv in key_values[:MAX_ATTRIBUTES]:
        value = kv.value
        which = value.WhichOneof("value")
        if which == "array_value":
            items = [_bounded_scalar(item) for item in value.array_value.values[:MAX_ITEMS]]
            bounded[kv.key[:MAX_TEXT]] = [item for item in items if item is not None]
        elif which is not None:
            scalar = _bounded_scalar(value)
            if scalar is not None:
                bounded[kv.key[:MAX_TEXT]] = scalar
    return bounded


def _bounded_scalar(value: Any) -> str | int | float | bool | None:
    which = value.WhichOneof("value")
    if which in ("string_value", "int_value", "double_value", "bool_value"):
        scalar: str | int | float | bool = getattr(value, which)
        return scalar[:MAX_TEXT] if isinstance(scalar, str) else scalar
    if which == "bytes_value":
        return bytes(value.bytes_value[: MAX_TEXT // 2]).hex()
    if which is None:
        return None
    return str(value)[:MAX_TEXT]


def compact_span(span: Any) -> bytes:
    """The span as bytes no longer than about `MAX_SPAN_BYTES`: whole when it fits, else
    with its attributes bounded, its events reduced to their names and exception
    messages, and its links and dropped counts left out."""
    data: bytes = span.SerializeToString()
    if len(data) <= MAX_SPAN_BYTES:
        return data
    kept = Span(
        trace_id=span.trace_id,
        span_id=span.span_id,
        parent_span_id=span.parent_span_id,
        name=span.name[:MAX_TEXT],
        kind=span.kind,
        start_time_unix_nano=span.start_time_unix_nano,
        end_time_unix_nano=span.end_time_unix_nano,
    )
    kept.status.code = span.status.code
    kept.status.message = span.status.message[:MAX_TEXT]
    budget = MAX_SPAN_BYTES - kept.ByteSize()
    for kv in span.attributes:
        scalar = _bounded_scalar(kv.value)
        if scalar is None:
            continue
        attribute = kept.attributes.add(key=kv.key[:MAX_TEXT])
        if isinstance(scalar, bool):
            attribute.value.bool_value = scalar
        elif isinstance(scalar, int):
            attribute.value.int_value = scalar
        elif isinstance(scalar, float):
            attribute.value.double_value = scalar
        else:
            attribute.value.string_value = scalar
        budget -= attribute.ByteSize() + 2
        if budget <= 0 or len(kept.attributes) >= MAX_ATTRIBUTES:
            break
    for event in span.events[:MAX_EVENTS]:
        if budget <= 0:
            break
        copied = kept.events.add(name=event.name[:MAX_TEXT], time_unix_nano=event.time_unix_nano)
        for kv in event.attributes:
            if kv.key == EXCEPTION_MESSAGE:
                copied.attributes.add(key=kv.key).value.string_value = str(
                    _bounded_scalar(kv.value)
                )
        budget -= copied.ByteSize() + 2
    result: bytes = kept.SerializeToString()
    return result


def _put_flat(flat: dict[str, AttributeValue], key: str, value: Any) -> None:
    if isinstance(value, dict):
        for sub_key, sub_value in value.items():
            _put_flat(flat, f"{key}.{sub_key}", sub_value)
    elif value is not None:
        flat[key] = value


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


def stage_of(attributes: Mapping[str, object]) -> StageRef | None:
    """The stage named by `omni.stage.id` and `omni.stage.replica` (default 0), if any."""
    stage_id = as_int(attributes.get(STAGE_ID))
    if stage_id is None:
        return None
    replica = as_int(attributes.get(STAGE_REPLICA))
    return StageRef(stage_id, replica or 0)


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


@dataclass(frozen=True)
class SpanRecord:
    """One received span, with its stage identity and vLLM's `gen_ai` figures mapped out."""

    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: int
    start_unix_nano: int
    end_unix_nano: int
    status: str
    status_message: str
    stage: StageRef | None
    stage_name: str
    pid: int | None
    process_kind: str
    service_name: str
    request_id: str
    prompt_tokens: int | None
    completion_tokens: int | None
    latency_e2e: float | None
    time_to_first_token: float | None
    time_in_queue: float | None
    attributes: Mapping[str, AttributeValue]

    @property
    def duration(self) -> float:
        """Seconds from start to end."""
        return max(0, self.end_unix_nano - self.start_unix_nano) / 1e9

    def to_jsonable(self) -> dict[str, Any]:
        data = asdict(self)
        data["stage"] = str(self.stage) if self.stage is not None else None
        data["attributes"] = dict(self.attributes)
        return data

    @classmethod
    def from_span(cls, span: Any, resource: ResourceInfo, stage: StageRef | None) -> SpanRecord:
        """A record from an OTLP `Span`, its batch's resource and the stage it was filed under."""
        attributes = flat_attributes(span.attributes)

        pid = as_int(attributes.get(PROCESS_PID))
        code = span.status.code
        return cls(
            trace_id=bytes(span.trace_id).hex(),
            span_id=bytes(span.span_id).hex(),
            parent_span_id=bytes(span.parent_span_id).hex(),
            name=span.name,
            kind=span.kind,
            start_unix_nano=span.start_time_unix_nano,
            end_unix_nano=span.end_time_unix_nano,
            status=STATUS_NAMES[code] if 0 <= code < len(STATUS_NAMES) else "unset",
            status_message=span.status.message,
            stage=stage,
            stage_name=str(attributes.get(STAGE_NAME, resource.stage_name)),
            pid=resource.pid if pid is None else pid,
            process_kind=str(attributes.get(PROCESS_KIND, resource.process_kind)),
            service_name=resource.service_name,
            request_id=str(attributes.get(REQUEST_ID, attributes.get(GEN_AI_REQUEST_ID, ""))),
            prompt_tokens=as_int(attributes.get(GEN_AI_USAGE_PROMPT_TOKENS)),
            completion_tokens=as_int(attributes.get(GEN_AI_USAGE_COMPLETION_TOKENS)),
            latency_e2e=as_float(attributes.get(GEN_AI_LATENCY_E2E)),
            time_to_first_token=as_float(attributes.get(GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN)),
            time_in_queue=as_float(attributes.get(GEN_AI_LATENCY_TIME_IN_QUEUE)),
            attributes=attributes,
        )


class SpanStore:
    """Per stage (and one bucket for spans without a stage), the last `ring_size` spans."""

    def __init__(self, ring_size: int) -> None:
        if ring_size < 1:
            raise ValueError(f"ring_size must be at least 1, got {ring_size}")
        self.ring_size = ring_size
        # Each entry is (span bytes, its resource, the stage it was filed under).
        self._rings: dict[StageRef | None, deque[tuple[bytes, ResourceInfo, StageRef | None]]] = {}
        self._pids: dict[int, tuple[StageRef, str]] = {}

    def ring(self, stage: StageRef | None) -> deque[tuple[bytes, ResourceInfo, StageRef | None]]:
        """The ring of `stage`, created on first use; append (`compact_span` bytes, resource,
        stage). The receiver creates rings only for stages of the topology or the tree."""
        ring = self._rings.get(stage)
        if ring is None:
            ring = self._rings[stage] = deque(maxlen=self.ring_size)
        return ring

    def learn_pid(self, pid: int, stage: StageRef, process_kind: str) -> None:
        """Remember that `pid` serves `stage`, as a batch's resource attributes said."""
        if pid not in self._pids and len(self._pids) >= MAX_LEARNED_PIDS:
            del self._pids[next(iter(self._pids))]
        self._pids[pid] = (stage, process_kind)

    def recent(self, stage: StageRef | None) -> list[SpanRecord]:
        """The spans kept for `stage` (None: spans without a stage), oldest first."""
        ring = self._rings.get(stage)
        if ring is None:
            return []
        return [
            SpanRecord.from_span(Span.FromString(data), resource, filed)
            for data, resource, filed in ring
        ]

    def stages(self) -> list[StageRef]:
        """Stages that have spans kept, in order."""
        return sorted(stage for stage in self._rings if stage is not None)

    def pid_stages(self) -> dict[int, tuple[StageRef, str]]:
        """process.pid -> (stage, process kind) learned from resource attributes."""
        return dict(self._pids)

    def to_jsonable(self) -> dict[str, Any]:
        """Everything kept, as plain JSON types, for an incident bundle."""
        buckets: list[StageRef | None] = [*self.stages()]
        if None in self._rings:
            buckets.append(None)
        return {
            "ring_size": self.ring_size,
            "stages": {
                str(stage) if stage is not None else "none": [
                    record.to_jsonable() for record in self.recent(stage)
                ]
                for stage in buckets
            },
            "pids": {
                str(pid): {"stage": str(stage), "process_kind": kind}
                for pid, (stage, kind) in sorted(self._pids.items())
            },
        }
