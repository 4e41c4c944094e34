"""Memory: the watchdog's resident set with 100,000 requests in flight.

`omni-watchdog run` starts as its own process (observe mode, the report's 3-stage
config, no GPU backend) and watches a plain HTTP server. This process sends it 100,000
`omni.request.admitted` spans over OTLP/HTTP, shaped as the instrument plugin in that
server would send them (its pid and start, request id, stage path 0 -> 1 -> 2), and no
stage span, so every request stays pending at stage 0. Once the watchdog's
`/metrics` shows them all in flight, the watchdog's RSS is read with psutil from outside;
the figure is the largest of several readings a few evaluation cycles apart.
"""

from __future__ import annotations

import argparse
import asyncio
import re
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

from omni_watchdog.semconv import (
    PROCESS_KIND,
    REQUEST_ADMITTED_SPAN,
    REQUEST_ID,
    REQUEST_STAGE_PATH,
    SERVICE_NAME,
)
from omni_watchdog.sim.launcher import free_port

SECTION = "Memory"
REQUESTS = 100_000
BATCH = 1_000
STAGE_PATH = (0, 1, 2)
TARGET_MB = 150.0
READINGS = 5
_IN_FLIGHT = re.compile(rb'^omni_watchdog_stage_requests_in_flight\{stage="0"[^}]*\} (\S+)$', re.M)
_START_NANOS = 1_796_221_666_000_000_000


def _string(key: str, value: str) -> KeyValue:
    return KeyValue(key=key, value=AnyValue(string_value=value))


def admitted_body(first: int, count: int, server_pid: int) -> bytes:
    """`count` admitted spans from the API server, as the plugin exports them."""
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    resource_spans.resource.attributes.extend(
        [
            _string(SERVICE_NAME, "vllm-omni"),
            _string(PROCESS_KIND, "api"),
            *target_resource(server_pid),
        ]
    )
    scope_spans = resource_spans.scope_spans.add()
    scope_spans.scope.name = "omni_watchdog.instrument"
    for index in range(first, first + count):
        span = scope_spans.spans.add()
        span.trace_id = (index + 1).to_bytes(16, "big")
        span.span_id = (index + 1).to_bytes(8, "big")
        span.name = REQUEST_ADMITTED_SPAN
        span.start_time_unix_nano = _START_NANOS + index * 1_000
        span.end_time_unix_nano = span.start_time_unix_nano + 1_000
        # A request id as long as vLLM's: "chatcmpl-" and 32 hex digits.
        span.attributes.append(_string(REQUEST_ID, f"chatcmpl-{index:032x}"))
        path = KeyValue(key=REQUEST_STAGE_PATH)
        for stage in STAGE_PATH:
            path.value.array_value.values.add().int_value = stage
        span.attributes.append(path)
    return request.SerializeToString()


async def in_flight(session: aiohttp.ClientSession, api_url: str) -> int:
    async with session.get(api_url + "/metrics") as response:
        match = _IN_FLIGHT.search(await response.read())
    return int(float(match.group(1))) if match else 0


async def measure(
    process: psutil.Process, api_port: int, otlp_port: int, server_pid: int
) -> tuple[float, float]:
    """(RSS before the spans, largest RSS with all requests in flight), in bytes."""
    api_url = f"http://127.0.0.1:{api_port}"
    bodies = [admitted_body(first, BATCH, server_pid) for first in range(0, REQUESTS, BATCH)]
    async with aiohttp.ClientSession() as session:
        await wait_attached(session, api_url, server_pid, 30)
        await asyncio.sleep(2.0)  # a few probe and evaluation cycles, as in steady state
        before = process.memory_info().rss
        for body in bodies:
            async with session.post(
                f"http://127.0.0.1:{otlp_port}/v1/traces",
                data=body,
                headers={"Content-Type": "application/x-protobuf", **BENCH_AUTHORIZATION},
            ) as response:
                await response.read()
                if response.status != 200:
                    raise RuntimeError(f"the receiver answered HTTP {response.status}")
        deadline = time.monotonic() + 60
        while await in_flight(session, api_url) < REQUESTS:
            if time.monotonic() > deadline:
                raise TimeoutError("the requests never all showed as in flight")
            await asyncio.sleep(0.2)
        readings = []
        for _ in range(READINGS):
            readings.append(process.memory_info().rss)
            await asyncio.sleep(0.5)
        if await in_flight(session, api_url) != REQUESTS:
            raise RuntimeError("requests in flight changed while measuring")
    return float(before), float(max(readings))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="omni-bench-memory-"))
    api_port, otlp_port, server_port = free_port(), free_port(), free_port()
    server = start_plain_target(server_port)
    watchdog = start_watchdog(
        workdir,
        f"http://127.0.0.1:{server_port}",
        api_port,
        otlp_port,
        # A queue that holds the whole burst, so that none of it is refused with 503.
        [f"spans.queue_size={REQUESTS // BATCH * 2}"],
        otlp_token=BENCH_TOKEN,
    )
    try:
        before, after = asyncio.run(
            measure(psutil.Process(watchdog.pid), api_port, otlp_port, server.pid)
        )
    finally:
        watchdog.terminate()
        watchdog.wait(timeout=10)
        server.terminate()
        server.wait(timeout=10)
    megabytes = after / 1e6
    per_request = (after - before) / REQUESTS
    ok = megabytes <= TARGET_MB
    print(
        f"watchdog RSS: {before / 1e6:.1f} MB idle, {megabytes:.1f} MB with {REQUESTS:,} "
        f"requests in flight ({per_request:.0f} bytes per request)"
    )
    rows = [
        (
            f"RSS with {REQUESTS:,} requests in flight",
            f"{megabytes:.1f} MB",
            f"<= {TARGET_MB:g} MB",
            "pass" if ok else "FAIL",
        ),
        ("RSS idle, before the spans", f"{before / 1e6:.1f} MB", "information", "-"),
        ("bytes per pending request", f"{per_request:.0f}", "information", "-"),
    ]
    if not args.no_write:
        record(
            SECTION,
            rows,
            note=(
                f"`omni-watchdog run` (observe mode, 3-stage config) fed {REQUESTS:,} "
                f"`{REQUEST_ADMITTED_SPAN}` spans over OTLP/HTTP in batches of {BATCH:,} with no "
                f"stage span, so all stay pending; RSS read with psutil from outside, largest of "
                f"{READINGS} readings; `python benchmarks/bench_memory.py`."
            ),
        )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
