"""The span store's ring buffers, the forwarder, and the ingest benchmark's plumbing."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import importlib.util
import json
import sys
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from types import ModuleType

import aiohttp
import pytest
from aiohttp import web
from deadline import wait_for
from fakes import FakeSenders
from listening import listening
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import KeyValue
from otlp_bodies import batch, key_value
from ports import free_port
from span_evidence import evidence

from omni_watchdog.clock import FakeClock
from omni_watchdog.config import SpansConfig
from omni_watchdog.probes.otlp_decode import PROTOBUF
from omni_watchdog.probes.span_forward import SpanForwarder
from omni_watchdog.probes.span_store import SpanStore
from omni_watchdog.probes.spans import SpanReceiver
from omni_watchdog.semconv import (
    HEARTBEAT_SPAN,
    PROCESS_PID,
    REQUEST_ADMITTED_SPAN,
    REQUEST_ID,
    REQUEST_STAGE_PATH,
    STAGE_ID,
    STAGE_REPLICA,
    STAGE_REQUEST_SPAN,
)
from omni_watchdog.types import ObservationKind, StageRef

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark_module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def make_receiver(ring_size: int = 256, forwarder: SpanForwarder | None = None) -> SpanReceiver:
    return SpanReceiver(
        SpansConfig(ring_size=ring_size),
        FakeClock(),
        SpanStore(ring_size),
        forwarder,
        senders=FakeSenders(),
    )


def test_ring_buffer_keeps_the_last_spans_of_each_stage() -> None:
    receiver = make_receiver(ring_size=3)
    stage_one = {STAGE_ID: 1, STAGE_REPLICA: 0, PROCESS_PID: 11}
    spans: list[tuple[str, Mapping[str, int | str]]] = [(HEARTBEAT_SPAN, {})] * 5
    spans += [(STAGE_REQUEST_SPAN, {STAGE_ID: 2, REQUEST_ID: "r"})] * 2
    spans += [(HEARTBEAT_SPAN, {STAGE_REPLICA: 1})]
    spans += [("other", {STAGE_ID: "not a number"})] * 4
    receiver.ingest(batch(stage_one, spans), PROTOBUF)
    store = receiver.store
    assert store.stages() == [StageRef(1, 0), StageRef(1, 1), StageRef(2, 0)]
    assert [r.span_id for r in store.recent(StageRef(1, 0))] == [
        index.to_bytes(8, "big").hex() for index in (3, 4, 5)
    ]
    assert len(store.recent(StageRef(2, 0))) == 2
    assert [r.stage for r in store.recent(StageRef(1, 1))] == [StageRef(1, 1)]
    assert len(store.recent(None)) == 3
    assert store.recent(StageRef(9, 0)) == []
    assert store.pid_stages() == {11: (StageRef(1, 0), "")}
    bundle = store.to_jsonable()
    assert list(bundle["stages"]) == ["1.0", "1.1", "2.0", "none"]
    assert [len(spans) for spans in bundle["stages"].values()] == [3, 1, 2, 3]
    assert bundle["pids"] == {"11": {"stage": "1.0", "process_kind": ""}}
    json.dumps(bundle)
    observations = evidence(asyncio.run(receiver.collect()))
    assert [o.kind for o in observations] == [
        ObservationKind.HEARTBEAT,
        ObservationKind.STAGE_SPAN,
        ObservationKind.STAGE_SPAN,
        ObservationKind.HEARTBEAT,
    ]
    assert [o.stage for o in observations] == [
        StageRef(1, 0),
        StageRef(2, 0),
        StageRef(2, 0),
        StageRef(1, 1),
    ]


def test_ring_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="ring_size"):
        SpanStore(0)


class Upstream:
    """A capture server standing for an upstream collector; `hold` makes it hang."""

    def __init__(self, hold: bool = False) -> None:
        self.received: list[tuple[bytes, str, str]] = []
        self.release = asyncio.Event()
        if not hold:
            self.release.set()

    async def handle(self, request: web.Request) -> web.Response:
        self.received.append(
            (
                await request.read(),
                request.headers.get("Content-Type", ""),
                request.headers.get("Content-Encoding", ""),
            )
        )
        await self.release.wait()
        return web.Response(body=b"", content_type=PROTOBUF)

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[str]:
        app = web.Application()
        app.router.add_post("/v1/traces", self.handle)
        # Keep bodies as sent: the test compares them byte for byte.
        runner = web.AppRunner(app, auto_decompress=False)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        try:
            yield f"http://127.0.0.1:{runner.addresses[0][1]}/v1/traces"
        finally:
            self.release.set()
            await runner.cleanup()


@contextlib.asynccontextmanager
async def forwarding_receiver(
    upstream_url: str, queue_size: int = 100
) -> AsyncIterator[tuple[SpanReceiver, SpanForwarder, str]]:
    async with aiohttp.ClientSession() as session:
        forwarder = SpanForwarder(session, upstream_url, queue_size=queue_size, timeout=5.0)
        receiver = make_receiver(forwarder=forwarder)
        async with listening(receiver.app()) as listener:
            yield receiver, forwarder, f"http://127.0.0.1:{listener.port}/v1/traces"


async def post(url: str, body: bytes, headers: Mapping[str, str]) -> int:
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, data=body, headers=dict(headers)) as response,
    ):
        await response.read()
        return response.status


BODY = batch({STAGE_ID: 0}, [(HEARTBEAT_SPAN, {})])


def test_forwarding_reaches_the_upstream_as_received() -> None:
    upstream = Upstream()
    gzipped = gzip.compress(BODY)

    async def main() -> tuple[list[int], int]:
        async with (
            upstream.serving() as upstream_url,
            forwarding_receiver(upstream_url) as (receiver, _, url),
        ):
            statuses = [
                await post(url, BODY, {"Content-Type": PROTOBUF}),
                await post(url, gzipped, {"Content-Type": PROTOBUF, "Content-Encoding": "gzip"}),
                await post(url, b"junk", {"Content-Type": PROTOBUF}),
            ]
            await wait_for(lambda: receiver.stats.forwarded == 2, 5.0, interval=0.01)
            return statuses, receiver.stats.forward_dropped

    statuses, dropped = asyncio.run(main())
    assert statuses == [200, 200, 400]
    assert upstream.received == [(BODY, PROTOBUF, ""), (gzipped, PROTOBUF, "gzip")]
    assert dropped == 0


def test_upstream_down_drops_and_counts_without_failing_ingestion() -> None:
    async def main() -> tuple[list[int], int]:
        url_down = f"http://127.0.0.1:{free_port()}/v1/traces"
        async with forwarding_receiver(url_down) as (receiver, _, url):
            statuses = [await post(url, BODY, {"Content-Type": PROTOBUF}) for _ in range(3)]
            await wait_for(lambda: receiver.stats.forward_dropped == 3, 5.0, interval=0.01)
            return statuses, receiver.stats.forwarded

    statuses, forwarded = asyncio.run(main())
    assert statuses == [200, 200, 200]
    assert forwarded == 0


def test_hanging_upstream_never_blocks_ingestion() -> None:
    upstream = Upstream(hold=True)

    async def main() -> tuple[list[int], int]:
        async with (
            upstream.serving() as upstream_url,
            forwarding_receiver(upstream_url, queue_size=1) as (receiver, _, url),
        ):
            statuses = [await post(url, BODY, {"Content-Type": PROTOBUF}) for _ in range(4)]
            # One body is held upstream, at most one waits in the queue.
            assert receiver.stats.forward_dropped >= 2
            assert len(await receiver.collect()) == 4
        return statuses, receiver.stats.forwarded

    statuses, forwarded = asyncio.run(main())
    assert statuses == [200] * 4
    assert forwarded == 0


def test_benchmark_function_runs_on_a_tiny_input(tmp_path: Path) -> None:
    bench = load_benchmark_module("bench_ingest")
    for body in (bench.omni_stage_body(16), bench.vllm_request_body(4)):
        figures = bench.measure(body, runs=1, repeat=1)
        assert figures.spans_per_second > 0 and figures.bare_spans_per_second > 0
        assert figures.ratio > 0


def test_results_rewrites_one_section_and_keeps_the_others(tmp_path: Path) -> None:
    results = load_benchmark_module("results")
    path = tmp_path / "RESULTS.md"
    results.record("OTLP ingest", [("spans/s", "1", ">= 2", "FAIL")], note="first", path=path)
    results.record("Render", [("ms", "3", "<= 20", "pass")], path=path)
    results.record("OTLP ingest", [("spans/s", "5", ">= 2", "pass")], path=path)
    text = path.read_text()
    assert text.startswith("# Benchmark results\n\nMachine: ")
    assert "Python " in text and " cores" in text
    assert text.count("## OTLP ingest") == 1 and "first" not in text
    assert "| spans/s | 5 | >= 2 | pass |" in text
    assert "| ms | 3 | <= 20 | pass |" in text
    assert text.index("## OTLP ingest") < text.index("## Render")


def test_status_message_is_the_error_detail_and_bad_paths_are_empty() -> None:
    request = ExportTraceServiceRequest()
    spans = request.resource_spans.add().scope_spans.add().spans
    failed = spans.add(name=STAGE_REQUEST_SPAN, trace_id=b"\x01" * 16, span_id=b"\x01" * 8)
    failed.status.code = failed.status.STATUS_CODE_ERROR
    failed.status.message = "stage 1 timed out"
    failed.attributes.extend([key_value(STAGE_ID, 1)])
    admitted = spans.add(name=REQUEST_ADMITTED_SPAN, trace_id=b"\x02" * 16, span_id=b"\x02" * 8)
    path = KeyValue(key=REQUEST_STAGE_PATH)
    path.value.array_value.values.add().string_value = "first"
    admitted.attributes.extend([path, key_value(REQUEST_ID, "r")])
    receiver = make_receiver()
    receiver.ingest(request.SerializeToString(), PROTOBUF)
    stage_span, admission = asyncio.run(receiver.collect())
    assert (stage_span.outcome, stage_span.detail) == ("error", "stage 1 timed out")
    assert (admission.request_id, admission.path, admission.stage) == ("r", (), None)
    (record,) = receiver.store.recent(StageRef(1, 0))
    assert (record.status, record.status_message) == ("error", "stage 1 timed out")
