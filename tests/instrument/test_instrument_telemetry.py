"""StageTelemetry against a real local OTLP/HTTP collector."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from deadline import wait_until
from instrument.kept_spans import BlockedExporter, KeptSpans

from omni_watchdog import process_start
from omni_watchdog.instrument.telemetry import StageTelemetry, heartbeat_interval, traces_endpoint
from omni_watchdog.semconv import (
    EXCEPTION_EVENT,
    EXCEPTION_MESSAGE,
    EXCEPTION_TYPE,
    HEARTBEAT_SPAN,
    HOST_BOOT_ID,
    PROCESS_KIND,
    PROCESS_PID,
    PROCESS_START_TICKS,
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
    TOPOLOGY_SPAN,
    VLLM_REQUEST_SPAN,
)
from omni_watchdog.topology import reported_topology
from omni_watchdog.types import Stage

STATUS_ERROR = 2
Collector = Any
# How long an export to a collector on this machine may take.
EXPORT_WAIT_S = 5.0


@pytest.fixture
def stage_telemetry(collector: Collector) -> Iterator[StageTelemetry]:
    telemetry = StageTelemetry.from_environment(
        process_kind="stage",
        stage_id=1,
        stage_name="talker",
        replica=2,
        environ={"OMNI_WATCHDOG_OTLP_ENDPOINT": collector.url},
    )
    yield telemetry
    telemetry.shutdown()


def test_spans_arrive_with_names_attributes_and_resource(
    collector: Collector, stage_telemetry: StageTelemetry
) -> None:
    stage_telemetry.request_admitted("req-1", [0, 1, 2])
    with stage_telemetry.stage_request("req-1"):
        pass
    stage_telemetry.record_stage_request("req-2", 1_000, 2_000)
    stage_telemetry.request_abandoned("req-3")
    stage_telemetry.request_finished("req-4")
    wait_until(lambda: len(collector.spans) == 5, EXPORT_WAIT_S)
    [admitted] = collector.named(REQUEST_ADMITTED_SPAN)
    assert admitted.attributes[REQUEST_ID] == "req-1"
    assert admitted.attributes[REQUEST_STAGE_PATH] == [0, 1, 2]
    [abandoned] = collector.named(REQUEST_ABANDONED_SPAN)
    assert abandoned.attributes[REQUEST_ID] == "req-3"
    [finished] = collector.named(REQUEST_FINISHED_SPAN)
    assert finished.attributes[REQUEST_ID] == "req-4"
    stage_spans = collector.named(STAGE_REQUEST_SPAN)
    assert [span.attributes[REQUEST_ID] for span in stage_spans] == ["req-1", "req-2"]
    assert all(span.attributes[STAGE_ID] == 1 for span in stage_spans)
    assert all(span.attributes[STAGE_REPLICA] == 2 for span in stage_spans)
    assert stage_spans[1].start_ns == 1_000
    resource = admitted.resource
    assert resource[SERVICE_NAME] == "omni-watchdog-instrument"
    assert resource[STAGE_ID] == 1
    assert resource[STAGE_NAME] == "talker"
    assert resource[STAGE_REPLICA] == 2
    assert resource[PROCESS_KIND] == "stage"
    assert resource[PROCESS_PID] == os.getpid()
    # The pid and start that name this process for life, as the watchdog's tracker reads
    # them from /proc.
    assert resource[PROCESS_START_TICKS] == process_start.start_ticks(os.getpid())
    assert resource[HOST_BOOT_ID] == process_start.boot_id() != ""


def test_service_name_comes_from_otel_service_name(collector: Collector) -> None:
    telemetry = StageTelemetry.from_environment(
        process_kind="api",
        environ={
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": collector.url + "/v1/traces",
            "OTEL_SERVICE_NAME": "omni-api",
        },
    )
    telemetry.heartbeat()
    wait_until(lambda: len(collector.spans) == 1, EXPORT_WAIT_S)
    assert collector.spans[0].resource[SERVICE_NAME] == "omni-api"
    assert STAGE_ID not in collector.spans[0].attributes
    telemetry.shutdown()


def test_failure_marks_the_span_and_reraises_unchanged(
    collector: Collector, stage_telemetry: StageTelemetry
) -> None:
    failure = ValueError("engine dead")
    with pytest.raises(ValueError) as raised, stage_telemetry.stage_request("req-9"):
        raise failure
    assert raised.value is failure
    stage_telemetry.record_stage_request("req-10", 1, 2, error="stage 1 failed")
    wait_until(lambda: len(collector.spans) == 2, EXPORT_WAIT_S)
    wrapped, recorded = collector.named(STAGE_REQUEST_SPAN)
    assert wrapped.status_code == STATUS_ERROR
    assert "engine dead" in wrapped.status_message
    [(event_name, event_attributes)] = wrapped.events
    assert event_name == EXCEPTION_EVENT
    assert event_attributes[EXCEPTION_TYPE] == "ValueError"
    assert recorded.status_code == STATUS_ERROR
    assert recorded.events[0][1][EXCEPTION_MESSAGE] == "stage 1 failed"


def test_first_heartbeat_arrives_within_a_second_and_a_half(collector: Collector) -> None:
    telemetry = StageTelemetry.from_environment(
        process_kind="engine", stage_id=0, environ={"OMNI_WATCHDOG_OTLP_ENDPOINT": collector.url}
    )
    started = time.monotonic()
    telemetry.heartbeat()
    wait_until(lambda: bool(collector.named(HEARTBEAT_SPAN)), 1.5)
    assert time.monotonic() - started < 1.5
    telemetry.shutdown()


def test_heartbeats_stop_while_the_loop_is_blocked_and_resume_after(
    collector: Collector, stage_telemetry: StageTelemetry
) -> None:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    release = threading.Event()
    blocked_at: list[int] = []

    def block_the_loop() -> None:
        blocked_at.append(time.time_ns())
        release.wait(10)

    def beats_after(moment_ns: int) -> int:
        return sum(span.start_ns > moment_ns for span in collector.named(HEARTBEAT_SPAN))

    try:
        asyncio.run_coroutine_threadsafe(stage_telemetry.heartbeat_loop(0.05), loop)
        wait_until(lambda: len(collector.named(HEARTBEAT_SPAN)) >= 3, EXPORT_WAIT_S)
        loop.call_soon_threadsafe(block_the_loop)
        wait_until(lambda: bool(blocked_at), EXPORT_WAIT_S)
        # Long enough for several beats and exports, had the loop been free.
        time.sleep(0.6)
        assert beats_after(blocked_at[0]) == 0
        released_at = time.time_ns()
        release.set()
        wait_until(lambda: beats_after(released_at) >= 2, EXPORT_WAIT_S)
    finally:
        release.set()
        for task in asyncio.all_tasks(loop):
            loop.call_soon_threadsafe(task.cancel)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_collector_down_costs_counted_drops_not_time(unused_port: int) -> None:
    telemetry = StageTelemetry.from_environment(
        process_kind="stage",
        stage_id=0,
        environ={"OMNI_WATCHDOG_OTLP_ENDPOINT": f"http://127.0.0.1:{unused_port}"},
    )
    started = time.monotonic()
    for index in range(200):
        telemetry.heartbeat()
        with telemetry.stage_request(f"req-{index}"):
            pass
    assert time.monotonic() - started < 0.5
    wait_until(lambda: telemetry.dropped_spans == 400, EXPORT_WAIT_S)
    started = time.monotonic()
    telemetry.shutdown(timeout_s=1.0)
    telemetry.shutdown(timeout_s=1.0)
    assert time.monotonic() - started < 1.5


def test_a_full_queue_drops_and_counts_without_blocking() -> None:
    exporter = BlockedExporter()
    telemetry = StageTelemetry(
        exporter, process_kind="stage", stage_id=0, max_queue_size=10, schedule_delay_s=0.01
    )
    started = time.monotonic()
    for _ in range(30):
        telemetry.heartbeat()
    assert time.monotonic() - started < 0.5
    assert telemetry.dropped_spans == 20
    exporter.release.set()
    telemetry.shutdown(timeout_s=2.0)
    assert exporter.exported == 10


def test_without_an_endpoint_everything_is_a_no_op() -> None:
    telemetry = StageTelemetry.from_environment(process_kind="worker", environ={})
    assert not telemetry.enabled
    telemetry.request_admitted("req", [0])
    with telemetry.stage_request("req"):
        pass
    telemetry.record_stage_request("req", 0, 1, error="x")
    telemetry.heartbeat()
    asyncio.run(telemetry.heartbeat_loop())
    telemetry.shutdown()
    assert telemetry.dropped_spans == 0


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"OMNI_WATCHDOG_OTLP_ENDPOINT": "http://h:4318"}, "http://h:4318/v1/traces"),
        ({"OMNI_WATCHDOG_OTLP_ENDPOINT": "http://h:4318/"}, "http://h:4318/v1/traces"),
        ({"OMNI_WATCHDOG_OTLP_ENDPOINT": "http://h:9/x/traces"}, "http://h:9/x/traces"),
        (
            {
                "OMNI_WATCHDOG_OTLP_ENDPOINT": "http://own:1",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://std:2/v1/traces",
            },
            "http://own:1/v1/traces",
        ),
        (
            {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://std:2/v1/traces"},
            "http://std:2/v1/traces",
        ),
        ({}, None),
    ],
)
def test_endpoint_resolution(environ: dict[str, str], expected: str | None) -> None:
    assert traces_endpoint(environ) == expected


@pytest.mark.parametrize(
    ("text", "expected"), [("", 1.0), ("0.25", 0.25), ("0", 1.0), ("soon", 1.0), ("-2", 1.0)]
)
def test_heartbeat_interval(text: str, expected: float) -> None:
    assert heartbeat_interval({"OMNI_WATCHDOG_HEARTBEAT_INTERVAL": text}) == expected


def test_the_hosts_sampler_and_sdk_switch_do_not_thin_out_the_signals(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A server traced at 0% or with the SDK switched off still beats: the watchdog would
    # otherwise read missing heartbeats as a stalled stage.
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    kept = KeptSpans()
    telemetry = StageTelemetry(kept, process_kind="stage", stage_id=0)
    for index in range(20):
        telemetry.heartbeat()
        with telemetry.stage_request(f"req-{index}"):
            pass
    telemetry.shutdown(timeout_s=2.0)
    names = [span.name for span in kept.spans]
    assert names.count(HEARTBEAT_SPAN) == 20
    assert names.count(STAGE_REQUEST_SPAN) == 20


def test_stage_spans_join_the_current_trace_and_heartbeats_never_do() -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import use_span

    kept = KeptSpans()
    telemetry = StageTelemetry(kept, process_kind="stage", stage_id=1, replica=0)
    server_span = TracerProvider().get_tracer("vllm").start_span(VLLM_REQUEST_SPAN)
    with use_span(server_span, end_on_exit=True):
        with telemetry.stage_request("req-1"):
            pass
        telemetry.heartbeat()
    with telemetry.stage_request("req-2"):
        pass
    telemetry.shutdown(timeout_s=2.0)
    joined, beat, alone = kept.spans
    server = server_span.get_span_context()
    assert joined.context.trace_id == server.trace_id
    assert joined.parent is not None and joined.parent.span_id == server.span_id
    assert beat.name == HEARTBEAT_SPAN and beat.parent is None
    assert beat.context.trace_id != server.trace_id
    assert alone.parent is None and alone.context.trace_id not in (0, server.trace_id)
    assert all(span.context.span_id and span.context.trace_flags.sampled for span in kept.spans)
    assert joined.start_time is not None and joined.end_time is not None
    assert joined.start_time <= joined.end_time
    assert dict(joined.attributes or {}) == {
        STAGE_ID: 1,
        STAGE_REPLICA: 0,
        REQUEST_ID: "req-1",
    }


def test_the_topology_is_reported_again_and_again_and_a_failed_read_skips_one() -> None:
    kept = KeptSpans()
    telemetry = StageTelemetry(kept, process_kind="orchestrator")
    stages = (
        Stage(0, "thinker", final_output=True),
        Stage(1, "talker", replicas=2, upstream=(0,)),
    )
    reads: Iterator[tuple[Stage, ...] | Exception] = iter(
        [stages, RuntimeError("pools changing"), stages]
    )

    def read_stages() -> tuple[Stage, ...]:
        answer = next(reads)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def three_rounds() -> None:
        task = asyncio.get_running_loop().create_task(telemetry.topology_loop(read_stages, 0))
        for _ in range(3):
            await asyncio.sleep(0)
        task.cancel()

    asyncio.run(three_rounds())
    telemetry.shutdown(timeout_s=2.0)
    assert [span.name for span in kept.spans] == [TOPOLOGY_SPAN] * 2
    first = kept.spans[0]
    assert first.parent is None
    # Every attribute of the topology span is a list; the span's type allows scalars too.
    values = {key: list(value) for key, value in (first.attributes or {}).items()}  # type: ignore[arg-type]
    assert reported_topology(values).stages == (
        Stage(0, "thinker", final_output=True, downstream=(1,)),
        Stage(1, "talker", replicas=2, upstream=(0,)),
    )
