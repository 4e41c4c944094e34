"""Plugin overhead: simulated server throughput with the instrument plugin exporting, and without.

Two simulated vLLM-Omni servers (the report's 3-stage 0.11 config) run side by side. In
one the instrument plugin exports its spans (admitted, one per stage per request, loop
heartbeats) to a running watchdog in observe mode; in the other no OTLP endpoint is set,
so the plugin's telemetry is disabled. Rounds of the same load (a fixed count of
chat requests, a fixed number in flight, on loopback) alternate between the two, the
order flipping every round so that drift cancels; the figure is the median of the
per-round throughput ratios, all measured in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results import record
from watchdog_process import start_watchdog

from omni_watchdog.instrument.telemetry import ENDPOINT_ENV, STANDARD_ENDPOINT_ENV
from omni_watchdog.sim.launcher import SimProcess, free_port

SECTION = "Plugin overhead"
TARGET_RATIO = 0.98
REQUEST = {
    "model": "yujiepan/qwen2.5-omni-tiny-random",
    "messages": [{"role": "user", "content": "What is vLLM?"}],
    "max_tokens": 8,
    "stream": False,
}
_SPANS_RECEIVED = re.compile(rb"^omni_watchdog_spans_received_total (\S+)$", re.MULTILINE)


async def healthy(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=1)) as response:
            return response.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return False


async def wait_healthy(session: aiohttp.ClientSession, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not await healthy(session, url):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not healthy within {timeout:g}s")
        await asyncio.sleep(0.2)


async def load(session: aiohttp.ClientSession, url: str, requests: int, in_flight: int) -> float:
    """Requests per second for `requests` chat completions, `in_flight` at a time."""
    remaining = iter(range(requests))

    async def worker() -> None:
        for _ in remaining:
            async with session.post(url + "/v1/chat/completions", json=REQUEST) as response:
                await response.read()
                if response.status != 200:
                    raise RuntimeError(f"{url}: HTTP {response.status}")

    begun = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    return requests / (time.perf_counter() - begun)


async def spans_received(session: aiohttp.ClientSession, api_url: str) -> float:
    async with session.get(api_url + "/metrics") as response:
        match = _SPANS_RECEIVED.search(await response.read())
    return float(match.group(1)) if match else 0.0


async def measure(
    instrumented: str, bare: str, api_url: str, rounds: int, requests: int, in_flight: int
) -> tuple[list[float], list[float], float]:
    """Per-round requests/s with and without the plugin, and the spans the watchdog took."""
    with_plugin: list[float] = []
    without: list[float] = []
    connector = aiohttp.TCPConnector(limit=in_flight * 2)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for url in (instrumented, bare):
            await wait_healthy(session, url + "/health", 60)
        await wait_healthy(session, api_url + "/healthz", 30)
        for url in (instrumented, bare):  # warm both: connections, stage queues, exporters
            await load(session, url, requests // 4, in_flight)
        for index in range(rounds):
            order = [(instrumented, with_plugin), (bare, without)]
            for url, figures in order if index % 2 == 0 else reversed(order):
                figures.append(await load(session, url, requests, in_flight))
        # Let the plugin's export threads flush their last batches.
        await asyncio.sleep(1.0)
        received = await spans_received(session, api_url)
    return with_plugin, without, received


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=25, help="rounds per server (median)")
    parser.add_argument("--requests", type=int, default=120, help="requests per round")
    parser.add_argument("--in-flight", type=int, default=8, help="concurrent requests")
    parser.add_argument("--token-delay", type=float, default=0.002, help="sim seconds per token")
    parser.add_argument("--generation", choices=["0.11", "0.30"], default="0.30")
    parser.add_argument(
        "--control",
        action="store_true",
        help="both servers without the plugin: the bench's own bias (print only)",
    )
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    # Neither server may pick up an endpoint from this environment.
    for name in (ENDPOINT_ENV, STANDARD_ENDPOINT_ENV):
        os.environ.pop(name, None)
    workdir = Path(tempfile.mkdtemp(prefix="omni-bench-overhead-"))
    api_port, otlp_port = free_port(), free_port()
    sim_args = ["--token-delay", str(args.token_delay)]
    instrumented_port = free_port()
    target = f"http://127.0.0.1:{instrumented_port}"
    watchdog = start_watchdog(
        workdir, target, api_port, otlp_port, ["probes.enabled=spans"], args.generation
    )
    servers: list[SimProcess] = []
    try:
        endpoint = f"http://127.0.0.1:{otlp_port}/v1/traces"
        instrumented_env = {ENDPOINT_ENV: "" if args.control else endpoint}
        for name, env in (("with", instrumented_env), ("without", {ENDPOINT_ENV: ""})):
            (workdir / name).mkdir()
            port = instrumented_port if name == "with" else None
            servers.append(
                SimProcess.start(
                    workdir / name, [], args.generation, env=env, extra_args=sim_args, port=port
                )
            )
        with_plugin, without, received = asyncio.run(
            measure(
                servers[0].url,
                servers[1].url,
                f"http://127.0.0.1:{api_port}",
                args.rounds,
                args.requests,
                args.in_flight,
            )
        )
    finally:
        for server in servers:
            server.stop()
        watchdog.terminate()
        watchdog.wait(timeout=10)
    ratios = [w / b for w, b in zip(with_plugin, without, strict=True)]
    ratio = statistics.median(ratios)
    if args.control:
        print(f"control, neither server exporting: ratio {ratio:.3f}")
        return 0
    sent = args.rounds * args.requests + args.requests // 4
    if received < sent:
        # Fewer spans than requests: the plugin was not exporting, so nothing was measured.
        print(f"the watchdog received {received:,.0f} spans for {sent:,} requests", file=sys.stderr)
        return 1
    print(
        f"with the plugin: {statistics.median(with_plugin):.1f} requests/s, "
        f"without: {statistics.median(without):.1f} requests/s, ratio {ratio:.3f} "
        f"(rounds {', '.join(f'{r:.3f}' for r in ratios)}); "
        f"the watchdog received {received:,.0f} spans"
    )
    rows = [
        (
            "throughput ratio, with / without the plugin",
            f"{ratio:.3f}",
            f">= {TARGET_RATIO}",
            "pass" if ratio >= TARGET_RATIO else "FAIL",
        ),
        ("requests/s with the plugin", f"{statistics.median(with_plugin):.1f}", "information", "-"),
        ("requests/s without the plugin", f"{statistics.median(without):.1f}", "information", "-"),
        (
            "lowest / highest round ratio",
            f"{min(ratios):.3f} / {max(ratios):.3f}",
            "information",
            "-",
        ),
        ("spans the watchdog received", f"{received:,.0f}", "information", "-"),
    ]
    if not args.no_write:
        record(
            SECTION,
            rows,
            note=(
                f"Two simulated 3-stage servers side by side, one exporting to a watchdog in "
                f"observe mode (span receiver only), one with telemetry disabled; "
                f"{args.rounds} alternating rounds of {args.requests} chat requests, "
                f"{args.in_flight} in flight, {args.token_delay * 1000:g} ms per token; median "
                "of the per-round ratios; `python benchmarks/bench_overhead.py`."
            ),
        )
    return 0 if ratio >= TARGET_RATIO else 1


if __name__ == "__main__":
    raise SystemExit(main())
