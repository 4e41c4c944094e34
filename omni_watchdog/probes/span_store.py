"""The last spans of every stage, kept in ring buffers for the detector and incident bundles.

Spans are stored as their own serialized bytes and become `SpanRecord`s only when read:
ingestion is the hot path, reading happens once per incident. A decoded span would keep
the whole request it came in alive, and a span past `MAX_SPAN_BYTES` is cut down first,
so what the store holds is bounded whatever senders put in a span.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from opentelemetry.proto.trace.v1.trace_pb2 import Span

from omni_watchdog.probes.otlp_decode import (
    MAX_ATTRIBUTES,
    MAX_TEXT,
    STATUS_NAMES,
    AttributeValue,
    ResourceInfo,
    as_float,
    as_int,
    bounded_scalar,
    flat_attributes,
)
from omni_watchdog.semconv import (
    EXCEPTION_MESSAGE,
    GEN_AI_LATENCY_E2E,
    GEN_AI_LATENCY_TIME_IN_QUEUE,
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN,
    GEN_AI_REQUEST_ID,
    GEN_AI_USAGE_COMPLETION_TOKENS,
    GEN_AI_USAGE_PROMPT_TOKENS,
    PROCESS_KIND,
    PROCESS_PID,
    REQUEST_ID,
    STAGE_NAME,
)
from omni_watchdog.types import StageRef

# Bounds on what one kept span may make the watchdog keep.
MAX_SPAN_BYTES = 4096
MAX_EVENTS = 8
# Pids whose stage a resource taught; the target's tree is far smaller.
MAX_LEARNED_PIDS = 4096


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
        scalar = bounded_scalar(kv.value)
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
                copied.attributes.add(key=kv.key).value.string_value = str(bounded_scalar(kv.value))
        budget -= copied.ByteSize() + 2
    result: bytes = kept.SerializeToString()
    return result


def compacted(
    kept: list[tuple[StageRef | None, Any]], per_stage: int | None = None
) -> list[tuple[StageRef | None, bytes]]:
    """The spans as bounded bytes, only the last `per_stage` of each stage: the ring would
    drop the others at once, and serializing is most of what keeping a span costs."""
    if per_stage is not None and len(kept) > per_stage:
        # Keyed by identity: the receiver shares one StageRef per stage, and hashing the
        # dataclass is most of this loop's cost.
        left: dict[int, int] = {}
        tail: list[tuple[StageRef | None, Any]] = []
        for stage, span in reversed(kept):
            room = left.get(id(stage), per_stage)
            if room:
                left[id(stage)] = room - 1
                tail.append((stage, span))
        kept = tail[::-1]
    compacted = []
    for stage, span in kept:
        data = span.SerializeToString()
        compacted.append((stage, data if len(data) <= MAX_SPAN_BYTES else compact_span(span)))
    return compacted


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
        # The start each learned pid's process named, to tell a reused pid's new process.
        self._starts: dict[int, int | None] = {}

    def ring(self, stage: StageRef | None) -> deque[tuple[bytes, ResourceInfo, StageRef | None]]:
        """The ring of `stage`, created on first use; append (`compact_span` bytes, resource,
        stage). The receiver creates rings only for stages of the topology or the tree."""
        ring = self._rings.get(stage)
        if ring is None:
            ring = self._rings[stage] = deque(maxlen=self.ring_size)
        return ring

    def file(self, resource: ResourceInfo, kept: list[tuple[StageRef | None, bytes]]) -> None:
        """Append one resource's `compacted` spans to the rings of the stages they name."""
        filed_stage: StageRef | None = None
        ring = self.ring(None)
        for stage, data in kept:
            if stage is not filed_stage:
                filed_stage, ring = stage, self.ring(stage)
            ring.append((data, resource, stage))

    def learn_pid(
        self, pid: int, stage: StageRef, process_kind: str, start_ticks: int | None = None
    ) -> bool:
        """Remember that `pid` serves `stage`, as a batch's resource attributes said; True
        when that is news: a pid not known, a stage or kind that changed, or another
        process (another start) behind a known pid."""
        learned = (stage, process_kind)
        if self._pids.get(pid) == learned and self._starts.get(pid) == start_ticks:
            return False
        if pid not in self._pids and len(self._pids) >= MAX_LEARNED_PIDS:
            forgotten = next(iter(self._pids))
            del self._pids[forgotten]
            self._starts.pop(forgotten, None)
        self._pids[pid] = learned
        self._starts[pid] = start_ticks
        return True

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
