"""Never wrong: a long soak in enforce mode opens no incident.

For each vLLM-Omni generation the simulated server (its shipped 3-stage config) runs with
a watchdog attached in enforce mode at default settings. Once warm-up is over and 5 s of
requests at full speed have shown the stages' pace, two faults that a healthy server
shows under load are armed: stage 1 (in 0.30 its replica 0, while replica 1 keeps its
pace) turns ten times slower (`slow-but-alive`: heartbeats and tokens keep flowing), and
every fourth token of stage 2 takes one blocking 1.5 s step (`long-steps`, within the
default timeouts). For `--duration` seconds clients keep `--in-flight` of the report's
requests going; every `--burst-every` seconds `--burst` more clients join for 10 s; and
one impatient client sends requests it abandons after 0.2 to 3 s. Every stage's state is
sampled twice a second. In enforce mode every incident runs the ladder, so the figure is
the number of incidents opened: each one is a false remediation.

    python benchmarks/bench_soak.py [--duration 1800] [--generation 0.11 --generation 0.30]
"""

from __future__ import annotations

import argparse
import asyncio
import random
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

SECTION = "Never-wrong soak"
FAULTS = ["1:slow-but-alive", "2:long-steps"]
SAMPLE_INTERVAL = 0.5
BURST_SECONDS = 10.0
# `stalled` needs no progress, not slowness: nothing worse than degraded may be seen.
ACCEPTABLE = {StageState.HEALTHY, StageState.DEGRADED}


@dataclass
class Soak:
    """What one soak saw."""

    incidents: int = 0
    fault_fired: bool = False
    states: Counter[StageState] = field(default_factory=Counter)
    latencies_before: list[float] = field(default_factory=list)
    latencies_during: list[float] = field(default_factory=list)
    failures: Counter[str] = field(default_factory=Counter)
    abandoned: int = 0
    bursts: int = 0


async def one_request(session: aiohttp.ClientSession, url: str, seen: Soak, during: bool) -> None:
    begun = time.monotonic()
    try:
        async with session.post(url + "/v1/chat/completions", json=REPORT_REQUEST) as response:
            await response.read()
            if response.status == 200:
                (seen.latencies_during if during else seen.latencies_before).append(
                    time.monotonic() - begun
                )
            else:
                seen.failures[f"HTTP {response.status}"] += 1
    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
        seen.failures[type(error).__name__] += 1


async def clients(url: str, count: int, until: float, seen: Soak, during: bool) -> None:
    """`count` clients sending the report's request back to back until `until`."""

    async def client(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < until:
            await one_request(session, url, seen, during)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        await asyncio.gather(*(client(session) for _ in range(count)))


async def impatient(url: str, until: float, seen: Soak, chance: random.Random) -> None:
    """One client that gives up on each request after 0.2 to 3 s, mid-flight."""
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < until:
            patience = chance.uniform(0.2, 3.0)
            try:
                await asyncio.wait_for(one_request(session, url, seen, True), patience)
            except asyncio.TimeoutError:
                seen.abandoned += 1
            await asyncio.sleep(chance.uniform(0.0, 1.0))


async def bursts(url: str, every: float, size: int, until: float, seen: Soak) -> None:
    while time.monotonic() + every < until:
        await asyncio.sleep(every)
        seen.bursts += 1
        await clients(url, size, time.monotonic() + BURST_SECONDS, seen, True)


async def soak(workdir: Path, generation: str, args: argparse.Namespace) -> Soak:
    seen = Soak()
    async with attached(workdir, [], generation, "enforce") as (watchdog, server):
        await wait_for(lambda: watchdog.state.report and watchdog.state.report.warmed_up, 60)
        # A few requests at full speed first, so the span deadlines know the stages' pace.
        await clients(server.url, args.in_flight, time.monotonic() + 5, seen, False)
        await arm_faults(server.url, FAULTS)
        until = time.monotonic() + args.duration
        load = asyncio.gather(
            clients(server.url, args.in_flight, until, seen, True),
            impatient(server.url, until, seen, random.Random(generation)),
            bursts(server.url, args.burst_every, args.burst, until, seen),
        )
        while not load.done():
            report = watchdog.state.report
            if report is not None:
                seen.states.update(status.state for status in report.statuses)
            await asyncio.sleep(SAMPLE_INTERVAL)
        await load
        seen.incidents = len(watchdog.state.remediation.incidents)
        seen.fault_fired = len(server.events()) == len(FAULTS)
    return seen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds of soak each")
    parser.add_argument("--in-flight", type=int, default=8, help="steady concurrent requests")
    parser.add_argument("--burst", type=int, default=16, help="clients that join in a burst")
    parser.add_argument("--burst-every", type=float, default=60.0, help="seconds between bursts")
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
            seen = asyncio.run(soak(Path(workdir), generation, args))
        label = f"{', '.join(FAULTS)} ({generation}), {args.duration:g} s"
        before, during = seen.latencies_before, seen.latencies_during
        if not seen.fault_fired or not before or not during:
            # Nothing was slowed or nothing got through: the soak measured nothing.
            print(
                f"{label}: faults fired {seen.fault_fired}, requests {len(before)} + {len(during)}"
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
            f"{seen.abandoned} abandoned by their client; {seen.bursts} bursts; "
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
            (
                f"{label}: requests completed / abandoned by their client / bursts",
                f"{len(during):,} / {seen.abandoned:,} / {seen.bursts}",
                "information",
                "-",
            ),
        ]
    if not args.no_write and rows:
        record(
            SECTION,
            rows,
            note=(
                "The simulated server with a watchdog in enforce mode at default settings; "
                "after warm-up and 5 s at full speed, stage 1 (in 0.30 one of its two "
                "replicas) turns 10x slower with heartbeats and tokens flowing and every "
                "4th token of stage 2 takes one blocking 1.5 s step; "
                f"{args.in_flight} requests in flight, {args.burst} more for 10 s every "
                f"{args.burst_every:g} s, and one client abandoning each request after "
                f"0.2 - 3 s; states sampled every {SAMPLE_INTERVAL:g} s; "
                "`python benchmarks/bench_soak.py`."
            ),
        )
    return 1 if failed else 0


def verdict(passed: bool) -> str:
    return "pass" if passed else "FAIL"


if __name__ == "__main__":
    raise SystemExit(main())
