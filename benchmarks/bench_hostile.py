"""Hostile input: the watchdog's RSS, `/metrics` series and scrape time after each load.

`omni-watchdog run` (observe mode, the report's 3-stage config, no GPU backend) watches a
plain HTTP server started here, so its tree is one process whose pid and start this
benchmark knows, as the instrument plugin in it would. Then, one after another:
- many stage ids: heartbeats for 100,000 invented stage replicas, half claiming the
  target's own process (refused as unknown stages), half from a process outside its tree
  (refused as unknown senders);
- huge attributes: bodies of one span with an 8 MB attribute, from the target, for a
  stage it has (kept, cut down to a few kilobytes);
- 100k-span bodies: bodies of 100,000 heartbeat spans each, from the target;
- many idle connections: 2,000 connections held open without a byte on each listener,
  while the scrape is measured.
After each load: the watchdog's RSS (psutil, from outside), the number of series on its
`/metrics`, and the median of 9 scrapes.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results import record
from watchdog_process import (
    BENCH_AUTHORIZATION,
    BENCH_TOKEN,
    start_plain_target,
    start_watchdog,
    target_resource,
    wait_attached,
)

from omni_watchdog.process_start import boot_id
from omni_watchdog.semconv import (
    HEARTBEAT_SPAN,
    HOST_BOOT_ID,
    PROCESS_PID,
    PROCESS_START_TICKS,
    STAGE_ID,
    STAGE_REPLICA,
    STAGE_REQUEST_SPAN,
)
from omni_watchdog.sim.launcher import free_port

SECTION = "Hostile input"
TARGET_RSS_MB = 200.0
TARGET_SERIES = 5_000
TARGET_SCRAPE_MS = 50.0
INVENTED_STAGES = 100_000
SPANS_PER_BODY = 1_000
HUGE_ATTRIBUTE_BYTES = 8 * 2**20
HUGE_BODIES = 20
BIG_BODY_SPANS = 100_000
BIG_BODIES = 3
IDLE_CONNECTIONS = 2_000
SCRAPES = 9
_START_NANOS = 1_796_221_666_000_000_000
PROTOBUF = {"Content-Type": "application/x-protobuf"}


def _int(key: str, value: int) -> KeyValue:
    return KeyValue(key=key, value=AnyValue(int_value=value))


def heartbeats(resource: list[KeyValue], stages: list[tuple[int, int]], first: int = 0) -> bytes:
    """One body of `omni.stage.loop` spans, one per (stage, replica)."""
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    resource_spans.resource.attributes.extend(resource)
    spans = resource_spans.scope_spans.add().spans
    for index, (stage, replica) in enumerate(stages, start=first + 1):
        span = spans.add(
            name=HEARTBEAT_SPAN,
            trace_id=index.to_bytes(16, "big"),
            span_id=index.to_bytes(8, "big"),
            start_time_unix_nano=_START_NANOS,
            end_time_unix_nano=_START_NANOS,
        )
        span.attributes.extend([_int(STAGE_ID, stage), _int(STAGE_REPLICA, replica)])
    return request.SerializeToString()


def huge_attribute(resource: list[KeyValue], index: int) -> bytes:
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    resource_spans.resource.attributes.extend(resource)
    span = resource_spans.scope_spans.add().spans.add(
        name=STAGE_REQUEST_SPAN,
        trace_id=(index + 1).to_bytes(16, "big"),
        span_id=(index + 1).to_bytes(8, "big"),
    )
    span.attributes.extend(
        [
            _int(STAGE_ID, 0),
            KeyValue(key="prompt", value=AnyValue(string_value="x" * HUGE_ATTRIBUTE_BYTES)),
        ]
    )
    return request.SerializeToString()


async def post(session: aiohttp.ClientSession, url: str, body: bytes) -> int:
    async with session.post(
        url, data=body, headers={**PROTOBUF, **BENCH_AUTHORIZATION}
    ) as response:
        await response.read()
        return response.status


async def figures(
    session: aiohttp.ClientSession, api_url: str, process: psutil.Process
) -> tuple[float, int, float]:
    """(RSS in MB, series on /metrics, median scrape in ms)."""
    await asyncio.sleep(1.0)  # the receiver's queue drained, a few evaluations done
    timings = []
    text = ""
    for _ in range(SCRAPES):
        begun = time.perf_counter()
        async with session.get(api_url + "/metrics") as response:
            text = await response.text()
        timings.append((time.perf_counter() - begun) * 1000)
    series = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
    return process.memory_info().rss / 1e6, series, statistics.median(timings)


async def hostile(
    api_port: int, otlp_port: int, target_pid: int, process: psutil.Process
) -> list[tuple[str, float, int, float]]:
    api_url = f"http://127.0.0.1:{api_port}"
    traces = f"http://127.0.0.1:{otlp_port}/v1/traces"
    ours = target_resource(target_pid)
    outsider = [
        _int(PROCESS_PID, 1),
        _int(PROCESS_START_TICKS, 1),
        KeyValue(key=HOST_BOOT_ID, value=AnyValue(string_value=boot_id())),
    ]
    rows = []
    limits = aiohttp.TCPConnector(limit=16)
    async with aiohttp.ClientSession(connector=limits) as session:
        await wait_attached(session, api_url, target_pid, 60)
        rows.append(("at rest", *await figures(session, api_url, process)))

        invented = [(stage, stage % 7) for stage in range(3, 3 + INVENTED_STAGES)]
        for first in range(0, INVENTED_STAGES, SPANS_PER_BODY):
            chunk = invented[first : first + SPANS_PER_BODY]
            sender = ours if first % (2 * SPANS_PER_BODY) == 0 else outsider
            await post(session, traces, heartbeats(sender, chunk, first))
        rows.append(("many stage ids", *await figures(session, api_url, process)))

        for index in range(HUGE_BODIES):
            await post(session, traces, huge_attribute(ours, index))
        rows.append(("huge attributes", *await figures(session, api_url, process)))

        known = [(0, 0)] * BIG_BODY_SPANS
        for index in range(BIG_BODIES):
            await post(session, traces, heartbeats(ours, known, index * BIG_BODY_SPANS))
        rows.append(("100k-span bodies", *await figures(session, api_url, process)))

        held = []
        for port in (otlp_port, api_port):
            for _ in range(IDLE_CONNECTIONS):
                held.append(await asyncio.open_connection("127.0.0.1", port))
        try:
            rows.append(("many idle connections", *await figures(session, api_url, process)))
        finally:
            for _, writer in held:
                writer.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="omni-bench-hostile-"))
    target_port, api_port, otlp_port = free_port(), free_port(), free_port()
    target = start_plain_target(target_port)
    watchdog = start_watchdog(
        workdir,
        f"http://127.0.0.1:{target_port}",
        api_port,
        otlp_port,
        [],
        generation="0.11",
        # Its loads speak in the target's name, from here: with the token, as its plugin
        # would (without one only the target's own process may).
        otlp_token=BENCH_TOKEN,
    )
    try:
        rows = asyncio.run(hostile(api_port, otlp_port, target.pid, psutil.Process(watchdog.pid)))
    finally:
        watchdog.terminate()
        watchdog.wait(timeout=10)
        target.terminate()
        target.wait(timeout=10)
    table = []
    ok = True
    for load, rss, series, scrape in rows:
        print(f"{load}: RSS {rss:.1f} MB, {series:,} series, scrape {scrape:.1f} ms")
        checks = (
            (f"{load}: RSS", f"{rss:.1f} MB", rss <= TARGET_RSS_MB, f"<= {TARGET_RSS_MB:g} MB"),
            (f"{load}: series", f"{series:,}", series <= TARGET_SERIES, f"<= {TARGET_SERIES:,}"),
            (
                f"{load}: scrape",
                f"{scrape:.1f} ms",
                scrape <= TARGET_SCRAPE_MS,
                f"<= {TARGET_SCRAPE_MS:g} ms",
            ),
        )
        for figure, measured, passed, target_text in checks:
            table.append((figure, measured, target_text, "pass" if passed else "FAIL"))
            ok = ok and passed
    if not args.no_write:
        record(
            SECTION,
            table,
            note=(
                "`omni-watchdog run` (observe mode, 3-stage config) watching a plain HTTP "
                f"server, after each load in turn: heartbeats for {INVENTED_STAGES:,} invented "
                f"stage replicas (half from the target's process, half from outside its tree); "
                f"{HUGE_BODIES} bodies with one {HUGE_ATTRIBUTE_BYTES // 2**20} MB attribute; "
                f"{BIG_BODIES} bodies of {BIG_BODY_SPANS:,} spans; {IDLE_CONNECTIONS:,} idle "
                "connections on each listener, held while scraping. RSS from outside with "
                f"psutil; scrape is the median of {SCRAPES}; `python benchmarks/bench_hostile.py`."
            ),
        )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
