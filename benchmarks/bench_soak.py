"""Slow-but-alive soak: a stage that is slow but still making progress is never remediated.

For each vLLM-Omni generation the simulated server (its shipped 3-stage config) runs with
a watchdog attached in enforce mode at default settings. Once warm-up is over, stage 1 (in
0.30 its replica 0, while replica 1 keeps its pace) turns ten times slower
(`slow-but-alive`: its heartbeats and tokens keep flowing) while clients keep
`--in-flight` of the report's requests going for `--duration` seconds, enough that
requests queue at the slow stage past their span deadline, and every stage's state is
sampled twice a second. In enforce mode every incident runs the ladder, so the figure is
the number of incidents opened: each one is a false remediation.

    python benchmarks/bench_soak.py [--duration 120] [--generation 0.11 --generation 0.30]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results import record

from omni_watchdog.demo import REPORT_REQUEST, arm_faults, attached, wait_for
from omni_watchdog.log import configure_logging
from omni_watchdog.types import StageState

SECTION = "Slow-but-alive soak"
FAULT = "1:slow-but-alive"
SAMPLE_INTERVAL = 0.5
# `stalled` needs no progress, not slowness: nothing worse than degraded may be seen.
ACCEPTABLE = {StageState.HEALTHY, StageState.DEGRADED}


async def keep_loaded(
    url: str, in_flight: int, until: float, latencies: list[float], failures: Counter[str]
) -> None:
    """`in_flight` clients sending the report's request back to back until `until`."""
    timeout = aiohttp.ClientTimeout(total=60)

    async def client(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < until:
            begun = time.monotonic()
            try:
                async with session.post(url + "/v1/chat/completions", json=REPORT_REQUEST) as r:
                    await r.read()
                    if r.status == 200:
                        latencies.append(time.monotonic() - begun)
                    else:
                        failures[f"HTTP {r.status}"] += 1
            except (aiohttp.ClientError, asyncio.TimeoutError) as error:
                failures[type(error).__name__] += 1

    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(client(session) for _ in range(in_flight)))


@dataclass
class Soak:
    """What one soak saw."""

    incidents: int = 0
    fault_fired: bool = False
    states: Counter[StageState] = field(default_factory=Counter)
    latencies_before: list[float] = field(default_factory=list)
    latencies_during: list[float] = field(default_factory=list)
    failures: Counter[str] = field(default_factory=Counter)


async def soak(workdir: Path, generation: str, duration: float, in_flight: int) -> Soak:
    seen = Soak()
    async with attached(workdir, [], generation, "enforce") as (watchdog, server):
        await wait_for(lambda: watchdog.state.report and watchdog.state.report.warmed_up, 60)
        # A few requests at full speed first, so the span deadlines know the stage's pace.
        until = time.monotonic() + 5
        await keep_loaded(server.url, in_flight, until, seen.latencies_before, seen.failures)
        await arm_faults(server.url, [FAULT])
        until = time.monotonic() + duration
        load = asyncio.create_task(
            keep_loaded(server.url, in_flight, until, seen.latencies_during, seen.failures)
        )
        while not load.done():
            report = watchdog.state.report
            if report is not None:
                seen.states.update(status.state for status in report.statuses)
            await asyncio.sleep(SAMPLE_INTERVAL)
        await load
        seen.incidents = len(watchdog.policy.incidents())
        seen.fault_fired = server.fault_time() is not None
    return seen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of soak each")
    parser.add_argument("--in-flight", type=int, default=8, help="concurrent requests")
    parser.add_argument(
        "--generation", action="append", choices=["0.11", "0.30"], help="default: both"
    )
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    rows: list[tuple[str, str, str, str]] = []
    failed = False
    for generation in args.generation or ["0.11", "0.30"]:
        with (
            tempfile.TemporaryDirectory(prefix="omni-watchdog-soak-") as workdir,
            (Path(workdir) / "watchdog.log").open("a", encoding="utf-8") as log,
        ):
            configure_logging("info", log)
            seen = asyncio.run(soak(Path(workdir), generation, args.duration, args.in_flight))
        label = f"{FAULT} ({generation}), {args.duration:g} s"
        before, during = seen.latencies_before, seen.latencies_during
        if not seen.fault_fired or not before or not during:
            # Nothing was slowed or nothing got through: the soak measured nothing.
            print(
                f"{label}: fault fired {seen.fault_fired}, requests {len(before)} + {len(during)}"
            )
            failed = True
            continue
        unacceptable = sorted(s.value for s in seen.states if s not in ACCEPTABLE)
        total = sum(seen.states.values())
        shares = ", ".join(f"{s.value} {n / total:.0%}" for s, n in seen.states.most_common())
        slowdown = statistics.median(during) / statistics.median(before)
        failed |= seen.incidents > 0 or bool(unacceptable)
        print(
            f"{label}: {seen.incidents} incidents; states sampled: {shares}; "
            f"requests {len(during)} at {statistics.median(during):.2f} s median "
            f"({slowdown:.1f}x the {statistics.median(before):.2f} s before); "
            f"failed requests: {dict(seen.failures) or 0}"
        )
        rows += [
            (
                f"{label}: incidents opened (each a remediation)",
                str(seen.incidents),
                "0",
                verdict(seen.incidents == 0),
            ),
            (
                f"{label}: stage states seen",
                shares,
                "healthy or degraded",
                verdict(not unacceptable),
            ),
            (
                f"{label}: median request time, before / during",
                f"{statistics.median(before):.2f} / {statistics.median(during):.2f} s",
                "information",
                "-",
            ),
            (f"{label}: requests completed during", f"{len(during):,}", "information", "-"),
        ]
    if not args.no_write and rows:
        record(
            SECTION,
            rows,
            note=(
                "The simulated server with a watchdog in enforce mode at default settings; "
                "after warm-up and 5 s at full speed, stage 1 (in 0.30 one of its two "
                "replicas) turns 10x slower with heartbeats and tokens flowing, under "
                f"{args.in_flight} requests in flight; "
                f"states sampled every {SAMPLE_INTERVAL:g} s; `python benchmarks/bench_soak.py`."
            ),
        )
    return 1 if failed else 0


def verdict(passed: bool) -> str:
    return "pass" if passed else "FAIL"


if __name__ == "__main__":
    raise SystemExit(main())
