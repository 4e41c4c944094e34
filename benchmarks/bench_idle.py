"""Idle: what the watchdog costs while the server it watches does nothing.

`omni-watchdog run` starts as its own process at the default settings (observe mode, the
generation's example config, no GPU backend) and watches the simulated vLLM-Omni server,
whose instrument plugin sends it heartbeats every second. Once the watchdog is warm and
has settled, its CPU time is read with psutil from outside over several windows; the
figure is their median, as a share of one core. Its probes, /health, the canary and the
span receiver all run as they would beside an idle server. RSS is the largest reading.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results import record
from watchdog_process import start_watchdog, wait_attached

from omni_watchdog.sim.launcher import SimProcess, free_port

SECTION = "Idle"
GENERATIONS = ("0.11", "0.30")
TARGET_CORE_SHARE = 0.01
TARGET_MB = 64.0
WINDOWS = 5
WINDOW_SECONDS = 20.0
SETTLE_SECONDS = 5.0
WARM_UP_LIMIT = 60.0


async def warm(api_url: str, pid: int) -> None:
    async with aiohttp.ClientSession() as session:
        await wait_attached(session, api_url, pid, WARM_UP_LIMIT, warm=True)


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def threads_in_tree(root: psutil.Process) -> int:
    """Threads of the watched server's tree: what the process probe reads each scan."""
    total = 0
    for process in [root, *root.children(recursive=True)]:
        try:
            total += process.num_threads()
        except psutil.NoSuchProcess:
            continue
    return total


def measure(generation: str) -> tuple[float, float, int]:
    """Median share of a core over the windows, largest RSS in MB, threads in the tree."""
    workdir = Path(tempfile.mkdtemp(prefix=f"omni-bench-idle-{generation}-"))
    api_port, otlp_port, server_port = free_port(), free_port(), free_port()
    watchdog = start_watchdog(
        workdir, f"http://127.0.0.1:{server_port}", api_port, otlp_port, [], generation
    )
    server = SimProcess.start(
        workdir,
        [],
        generation,
        env={"OMNI_WATCHDOG_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_port}/v1/traces"},
        port=server_port,
    )
    try:
        asyncio.run(warm(f"http://127.0.0.1:{api_port}", server.process.pid))
        time.sleep(SETTLE_SECONDS)
        process = psutil.Process(watchdog.pid)
        shares, rss = [], []
        for _ in range(WINDOWS):
            started, used = time.monotonic(), cpu_seconds(process)
            time.sleep(WINDOW_SECONDS)
            shares.append((cpu_seconds(process) - used) / (time.monotonic() - started))
            rss.append(process.memory_info().rss)
        if watchdog.poll() is not None or server.process.poll() is not None:
            raise RuntimeError("the watchdog or the server exited while measured")
        threads = threads_in_tree(psutil.Process(server.process.pid))
    finally:
        watchdog.terminate()
        watchdog.wait(timeout=10)
        server.stop()
    return statistics.median(shares), max(rss) / 1e6, threads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    rows = []
    ok = True
    for generation in GENERATIONS:
        share, megabytes, threads = measure(generation)
        cpu_ok, rss_ok = share <= TARGET_CORE_SHARE, megabytes <= TARGET_MB
        ok = ok and cpu_ok and rss_ok
        print(
            f"{generation}: watchdog idle {share:.2%} of a core (median of {WINDOWS} x "
            f"{WINDOW_SECONDS:g} s), RSS {megabytes:.1f} MB; {threads} threads in the tree"
        )
        rows += [
            (
                f"simulated vLLM-Omni {generation}: CPU, share of one core",
                f"{share:.2%}",
                f"<= {TARGET_CORE_SHARE:.0%}",
                "pass" if cpu_ok else "FAIL",
            ),
            (
                f"simulated vLLM-Omni {generation}: RSS",
                f"{megabytes:.1f} MB",
                f"<= {TARGET_MB:g} MB",
                "pass" if rss_ok else "FAIL",
            ),
            (
                f"simulated vLLM-Omni {generation}: threads in the watched tree",
                str(threads),
                "information",
                "-",
            ),
        ]
    if not args.no_write:
        record(
            SECTION,
            rows,
            note=(
                "`omni-watchdog run` at the default settings (observe mode, the example "
                "config, no GPU backend: /health every 1 s, the canary every 3 s while nothing "
                "else progresses; at rest, the stages judged every 1 s, the watchdog's own "
                "sight every 0.5 s, the process scan and the activity probe every 2 s, the "
                "whole process table listed only when a process was born, the spans "
                "collected when they come) watching "
                "the idle simulated server, "
                "its plugin beating every 1 s; CPU time read with psutil from outside, the "
                f"median of {WINDOWS} windows of {WINDOW_SECONDS:g} s after warm-up; RSS the "
                "largest reading; `python benchmarks/bench_idle.py`."
            ),
        )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
