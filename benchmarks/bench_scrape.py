"""Scrape: time to render the watchdog's /metrics at 64 stages x 8 GPUs x 512 pids.

The state is the exposition tests' scripted one (the real detector and stats, the rest written
out), scaled up: 64 stages of one replica, 8 processes per stage (512 pids, each holding
memory on one of 8 GPUs), 2,000 requests in flight. Each run times
`MetricsExposition.render`, the whole body a scrape returns; the figure is the median.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

# The exposition tests' helpers import as the test runner puts them on the path: `tests/`
# itself.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from exporters.watchdog_state import scripted_state
from results import record

SECTION = "Scrape"
STAGES = 64
GPUS = 8
PIDS_PER_STAGE = 8
REQUESTS = 2000
TARGET_MS = 20.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21, help="timed renders (median reported)")
    parser.add_argument("--no-record", action="store_true", help="print only")
    args = parser.parse_args()
    runs = max(7, args.runs)

    scripted = scripted_state(
        stages=STAGES,
        first_replicas=1,
        gpus=GPUS,
        pids_per_replica=PIDS_PER_STAGE,
        requests=REQUESTS,
        # Every stage on this host: the most processes and GPU series a page can have.
        with_remote=False,
    )
    exposition = scripted.exposition()
    body = exposition.render()  # warm the label caches, as the first scrape does
    series = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
    gpu_pids = len(scripted.state.gpu.processes) if scripted.state.gpu else 0
    timings = []
    for _ in range(runs):
        begun = time.perf_counter()
        exposition.render()
        timings.append((time.perf_counter() - begun) * 1000)
    median = statistics.median(timings)
    verdict = "pass" if median <= TARGET_MS else "FAIL"
    rows = [
        (
            f"render, {STAGES} stages x {GPUS} GPUs x {gpu_pids} GPU pids",
            f"{median:.2f} ms",
            f"<= {TARGET_MS:g} ms",
            verdict,
        ),
        ("series in the exposition", f"{series:,}", "information", "-"),
        ("body size", f"{len(body) / 1024:.0f} KiB", "information", "-"),
        (
            "fastest / slowest run",
            f"{min(timings):.2f} / {max(timings):.2f} ms",
            "information",
            "-",
        ),
    ]
    for row in rows:
        print(" | ".join(row))
    note = (
        f"`MetricsExposition.render` over the scripted test state scaled to {STAGES} stages,"
        f" {STAGES * PIDS_PER_STAGE} stage processes (plus one unmapped GPU pid) on {GPUS} GPUs"
        f" and {REQUESTS:,} requests in flight; median of {runs} runs after one warm-up render;"
        " `python benchmarks/bench_scrape.py`."
    )
    if not args.no_record:
        record(SECTION, rows, note)


if __name__ == "__main__":
    main()
