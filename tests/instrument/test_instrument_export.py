"""The plugin's own OTLP encoder and exporter: the SDK's bytes, a kept-alive connection."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from instrument.kept_spans import KeptSpans
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
    set_span_in_context,
)

from omni_watchdog.instrument.export import WatchdogSpanExporter, encode_spans
from omni_watchdog.instrument.telemetry import StageTelemetry
from omni_watchdog.semconv import (
    EXCEPTION_EVENT,
    EXCEPTION_MESSAGE,
    EXCEPTION_TYPE,
    HEARTBEAT_SPAN,
    PROCESS_PID,
    REQUEST_ADMITTED_SPAN,
    REQUEST_ID,
    REQUEST_STAGE_PATH,
    SERVICE_NAME,
    STAGE_ID,
    STAGE_REQUEST_SPAN,
)


def tracer_pair(resource: Resource | None = None) -> tuple[TracerProvider, KeptSpans]:
    kept = KeptSpans()
    provider = TracerProvider(resource=resource) if resource else TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(kept))
    return provider, kept


def plugin_like_spans() -> list[ReadableSpan]:
    resource = Resource({SERVICE_NAME: "svc", PROCESS_PID: 4242, STAGE_ID: 1, "ratio": 0.5})
    provider, kept = tracer_pair(resource)
    tracer = provider.get_tracer("omni_watchdog.instrument")
    tracer.start_span(
        REQUEST_ADMITTED_SPAN,
        attributes={REQUEST_ID: "chatcmpl-1", REQUEST_STAGE_PATH: [0, 1, 2]},
    ).end()
    for index in range(3):
        tracer.start_span(
            STAGE_REQUEST_SPAN, attributes={STAGE_ID: 1, REQUEST_ID: f"r{index}"}
        ).end()
    tracer.start_span(HEARTBEAT_SPAN, attributes={}).end()
    return kept.spans


def every_field_spans() -> list[ReadableSpan]:
    provider, kept = tracer_pair(Resource({SERVICE_NAME: "other", "negative": -7}))
    tracer = provider.get_tracer("scope", "1.2.3", schema_url="https://schema/1")
    remote = SpanContext(
        0x0123456789ABCDEF0123456789ABCDEF,
        0x0123456789ABCDEF,
        is_remote=True,
        trace_flags=TraceFlags(1),
        trace_state=TraceState([("vendor", "value"), ("k", "v")]),
    )
    with tracer.start_as_current_span(
        "with-parent",
        context=set_span_in_context(NonRecordingSpan(remote)),
        kind=SpanKind.SERVER,
        links=[Link(remote, {"link.count": 2})],
        attributes={
            "text": "é and ✓",
            "empty": "",
            "flag": False,
            "zero": 0,
            "huge": 2**63 - 1,
            "tiny": -(2**63),
            "real": -1.25,
            "texts": ["a", ""],
            "numbers": [1, 2],
            "reals": [0.5],
            "flags": [True, False],
        },
    ) as span:
        span.add_event(EXCEPTION_EVENT, {EXCEPTION_TYPE: "StageError", EXCEPTION_MESSAGE: "x"})
        span.add_event("empty event")
        span.set_status(Status(StatusCode.ERROR, "stage 1 failed"))
        with tracer.start_as_current_span("local child", kind=SpanKind.CLIENT) as child:
            child.set_status(Status(StatusCode.OK))
    provider.get_tracer("no-version").start_span("producer", kind=SpanKind.PRODUCER).end()
    return kept.spans


@pytest.mark.parametrize(
    "spans",
    [plugin_like_spans, every_field_spans, lambda: plugin_like_spans() + every_field_spans()],
    ids=["plugin spans", "every field", "two resources"],
)
def test_the_bytes_equal_the_sdk_encoders(spans: object) -> None:
    batch = spans()  # type: ignore[operator]
    assert encode_spans(batch) == sdk_encode(batch).SerializeToString()


def test_what_otlp_cannot_carry_is_left_out_and_the_rest_goes() -> None:
    provider, kept = tracer_pair()
    provider.get_tracer("t").start_span(
        "odd", attributes={"too.big": 2**64, "broken": "\ud800", "kept": "yes"}
    ).end()
    decoded = ExportTraceServiceRequest.FromString(encode_spans(kept.spans))
    [span] = decoded.resource_spans[0].scope_spans[0].spans
    assert [(a.key, a.value.string_value) for a in span.attributes] == [("kept", "yes")]


def test_an_empty_batch_is_an_empty_request() -> None:
    assert encode_spans([]) == b""


class Sink(ThreadingHTTPServer):
    """An OTLP/HTTP endpoint that records bodies, headers and connections, and can misbehave."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), SinkHandler)
        self.bodies: list[bytes] = []
        self.headers_seen: list[dict[str, str]] = []
        self.connections = 0
        self.status = 200
        # Close each connection after answering, without telling the client: the way a
        # receiver drops an idle kept-alive connection.
        self.drop_after_answer = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1/traces"


class SinkHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Sink

    def setup(self) -> None:
        super().setup()
        self.server.connections += 1

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.bodies.append(body)
        self.server.headers_seen.append(dict(self.headers.items()))
        self.send_response(self.server.status)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()
        if self.server.drop_after_answer:
            self.close_connection = True

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def sink() -> Iterator[Sink]:
    server = Sink()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_batches_arrive_over_one_kept_alive_connection(sink: Sink) -> None:
    exporter = WatchdogSpanExporter(sink.url, timeout_s=1.0)
    spans = plugin_like_spans()
    for _ in range(3):
        assert exporter.export(spans) is SpanExportResult.SUCCESS
    assert sink.bodies == [encode_spans(spans)] * 3
    assert sink.connections == 1
    assert sink.headers_seen[0]["Content-Type"] == "application/x-protobuf"
    assert sink.headers_seen[0]["User-Agent"].startswith("omni-watchdog-instrument/")
    exporter.shutdown()


def test_a_connection_the_receiver_dropped_is_reopened_without_losing_the_batch(
    sink: Sink,
) -> None:
    sink.drop_after_answer = True
    exporter = WatchdogSpanExporter(sink.url, timeout_s=1.0)
    spans = plugin_like_spans()
    for _ in range(3):
        assert exporter.export(spans) is SpanExportResult.SUCCESS
    assert len(sink.bodies) == 3
    assert sink.connections == 3


def test_a_refusal_is_a_failure(sink: Sink) -> None:
    sink.status = 503
    exporter = WatchdogSpanExporter(sink.url, timeout_s=1.0)
    assert exporter.export(plugin_like_spans()) is SpanExportResult.FAILURE
    sink.status = 200
    assert exporter.export(plugin_like_spans()) is SpanExportResult.SUCCESS


def test_nobody_listening_fails_at_once(unused_port: int) -> None:
    exporter = WatchdogSpanExporter(f"http://127.0.0.1:{unused_port}/v1/traces", timeout_s=1.0)
    started = time.monotonic()
    assert exporter.export(plugin_like_spans()) is SpanExportResult.FAILURE
    assert time.monotonic() - started < 0.5


@pytest.mark.parametrize("endpoint", ["127.0.0.1:4318", "grpc://127.0.0.1:4317", "http://"])
def test_an_endpoint_that_is_no_http_url_is_refused(endpoint: str) -> None:
    with pytest.raises(ValueError, match="not an http"):
        WatchdogSpanExporter(endpoint, timeout_s=1.0)


def test_a_general_collector_gets_the_sdks_exporter_with_its_headers(
    sink: Sink, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer%20abc")
    telemetry = StageTelemetry.from_environment(
        process_kind="stage",
        stage_id=0,
        environ={"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": sink.url},
    )
    telemetry.heartbeat()
    telemetry.shutdown(timeout_s=2.0)
    assert sink.headers_seen, "the heartbeat never reached the collector"
    assert sink.headers_seen[0]["authorization"] == "Bearer abc"


def test_the_watchdogs_endpoint_gets_the_lean_exporter(sink: Sink) -> None:
    telemetry = StageTelemetry.from_environment(
        process_kind="stage", stage_id=0, environ={"OMNI_WATCHDOG_OTLP_ENDPOINT": sink.url}
    )
    telemetry.heartbeat()
    telemetry.shutdown(timeout_s=2.0)
    assert sink.headers_seen[0]["User-Agent"].startswith("omni-watchdog-instrument/")


@pytest.mark.parametrize(("token", "header"), [("s3cret", "Bearer s3cret"), ("", None)])
def test_the_receiver_token_goes_in_every_export(
    sink: Sink, token: str, header: str | None
) -> None:
    telemetry = StageTelemetry.from_environment(
        process_kind="stage",
        stage_id=0,
        environ={"OMNI_WATCHDOG_OTLP_ENDPOINT": sink.url, "OMNI_WATCHDOG_OTLP_TOKEN": token},
    )
    telemetry.heartbeat()
    telemetry.shutdown(timeout_s=2.0)
    assert sink.headers_seen, "the heartbeat never reached the receiver"
    assert sink.headers_seen[0].get("Authorization") == header
