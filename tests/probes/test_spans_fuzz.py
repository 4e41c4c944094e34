"""Property-based fuzzing of the receiver's decoders: any body is a result or an `OtlpError`
with a 4xx status, never another exception, and what is kept stays bounded."""

from __future__ import annotations

import asyncio
import gzip
import json
from typing import Any

from fakes import FakeSenders
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue

from omni_watchdog.clock import FakeClock
from omni_watchdog.config import SpansConfig
from omni_watchdog.probes.otlp_decode import JSON, PROTOBUF, OtlpError
from omni_watchdog.probes.span_store import MAX_SPAN_BYTES, SpanStore
from omni_watchdog.probes.spans import SpanReceiver
from omni_watchdog.semconv import (
    GEN_AI_REQUEST_ID,
    HEARTBEAT_SPAN,
    HOST_BOOT_ID,
    PROCESS_KIND,
    PROCESS_PID,
    PROCESS_START_TICKS,
    REQUEST_ADMITTED_SPAN,
    REQUEST_ID,
    REQUEST_STAGE_PATH,
    STAGE_ID,
    STAGE_REPLICA,
    STAGE_REQUEST_SPAN,
    VLLM_REQUEST_SPAN,
)
from omni_watchdog.types import StageRef

FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
KNOWN = {StageRef(0), StageRef(1), StageRef(1, 1)}
KEYS = [
    STAGE_ID,
    STAGE_REPLICA,
    REQUEST_ID,
    REQUEST_STAGE_PATH,
    GEN_AI_REQUEST_ID,
    PROCESS_PID,
    PROCESS_START_TICKS,
    HOST_BOOT_ID,
    PROCESS_KIND,
]
JSON_KEYS = (
    *("resourceSpans", "scopeSpans", "spans", "traceId", "spanId", "attributes", "key"),
    *("value", "stringValue", "intValue", "arrayValue", "values", "name", "resource"),
)
NAMES = [HEARTBEAT_SPAN, STAGE_REQUEST_SPAN, REQUEST_ADMITTED_SPAN, VLLM_REQUEST_SPAN, "x"]


def new_receiver() -> SpanReceiver:
    config = SpansConfig(max_body_bytes=1_000_000)
    return SpanReceiver(
        config, FakeClock(), SpanStore(16), senders=FakeSenders(stages=KNOWN), boot_id="boot"
    )


def ingest(receiver: SpanReceiver, body: bytes, media_type: str, encoding: str = "") -> None:
    try:
        receiver.ingest(body, media_type, encoding)
    except OtlpError as error:
        assert 400 <= error.status < 500, error.message
        assert error.reason in receiver.stats.spans_rejected
    asyncio.run(receiver.collect())


@FUZZ
@given(st.binary(max_size=2048), st.sampled_from([PROTOBUF, JSON]), st.sampled_from(["", "gzip"]))
def test_any_bytes(body: bytes, media_type: str, encoding: str) -> None:
    ingest(new_receiver(), body, media_type, encoding)


@FUZZ
@given(st.binary(max_size=2048), st.sampled_from([PROTOBUF, JSON]))
def test_any_gzip_member(body: bytes, media_type: str) -> None:
    ingest(new_receiver(), gzip.compress(body), media_type, "gzip")


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(JSON_KEYS),
            children,
            max_size=5,
        )
    ),
    max_leaves=40,
)


@FUZZ
@given(json_values)
def test_any_json_document(document: Any) -> None:
    ingest(new_receiver(), json.dumps(document).encode(), JSON)


any_values = st.recursive(
    st.builds(AnyValue, string_value=st.text(max_size=40))
    | st.builds(AnyValue, int_value=st.integers(min_value=-(2**63), max_value=2**63 - 1))
    | st.builds(AnyValue, double_value=st.floats(allow_nan=True))
    | st.builds(AnyValue, bool_value=st.booleans())
    | st.builds(AnyValue, bytes_value=st.binary(max_size=20))
    | st.just(AnyValue()),
    lambda children: st.lists(children, max_size=3).map(
        lambda items: AnyValue(array_value=ArrayValue(values=items))
    ),
    max_leaves=10,
)
key_values = st.lists(
    st.builds(KeyValue, key=st.sampled_from(KEYS) | st.text(max_size=10), value=any_values),
    max_size=8,
)


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    request = ExportTraceServiceRequest()
    for _ in range(draw(st.integers(0, 3))):
        resource_spans = request.resource_spans.add()
        resource_spans.resource.attributes.extend(draw(key_values))
        for _ in range(draw(st.integers(0, 2))):
            spans = resource_spans.scope_spans.add().spans
            for _ in range(draw(st.integers(0, 4))):
                span = spans.add(
                    name=draw(st.sampled_from(NAMES)),
                    trace_id=draw(st.binary(min_size=15, max_size=17)),
                    span_id=draw(st.binary(min_size=7, max_size=9)),
                    start_time_unix_nano=draw(st.integers(0, 2**64 - 1)),
                    end_time_unix_nano=draw(st.integers(0, 2**64 - 1)),
                )
                span.attributes.extend(draw(key_values))
    return request.SerializeToString()


@FUZZ
@given(requests())
def test_any_well_formed_request(body: bytes) -> None:
    receiver = new_receiver()
    ingest(receiver, body, PROTOBUF)
    stages = receiver.store.stages()
    # Only stages the senders know get a ring, and nothing kept outgrows its bound.
    assert set(stages) <= KNOWN
    for stage in (*stages, None):
        for data, _, _ in receiver.store.ring(stage):
            assert len(data) <= MAX_SPAN_BYTES + 512
        receiver.store.recent(stage)
