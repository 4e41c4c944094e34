"""Fault -> verdict and fault -> GPU memory released, per fault, at default settings.

Each run starts the simulated server with one fault, attaches a watchdog in enforce mode
with every threshold at its default, sends the report's request and measures from the
moment the fault fired (the simulator's event log) to the verdict and to the end of the
verify step. Figures are medians over the runs.

    python benchmarks/bench_detection.py [--runs 5] [--fault 1:engine-dead-hang@0.11 ...]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

from results import record

from omni_watchdog.demo import run_scenario, summary
from omni_watchdog.log import configure_logging

# (fault spec, generation, fault -> verdict target, fault -> released target), from
# docs/design.md, Performance targets: a verdict within 5 s of a stage that stops (stalled,
# or dead for the report's hang), the memory back within 15 s of the report's hang.
FAULTS: list[tuple[str, str, float | None, float | None]] = [
    ("1:engine-dead-hang", "0.11", 5.0, 15.0),
    ("1.0:stage-dead-503,1.1:stage-dead-503", "0.30", None, None),
    ("0:silent-stall", "0.11", 5.0, None),
    ("1:frozen-engine", "0.11", 5.0, None),
]


def measure(fault: str, generation: str) -> tuple[float | None, float | None, str]:
    with (
        tempfile.TemporaryDirectory(prefix="omni-watchdog-bench-") as workdir,
        (Path(workdir) / "watchdog.log").open("a", encoding="utf-8") as log,
    ):
        # The watchdog's log would drown the figures; it goes with the run's directory.
        configure_logging("info", log)
        incident, fault_time = asyncio.run(
            run_scenario(Path(workdir), fault.split(","), generation, say=lambda _: None)
        )
    if incident is None:
        return None, None, "no incident"
    figures = summary(incident, fault_time)
    return figures["fault_to_verdict_s"], figures["fault_to_released_s"], figures["outcome"]


def verdict_of(value: float | None, target: float | None) -> str:
    if value is None:
        return "FAIL (not measured)"
    if target is None:
        return "-"
    return "pass" if value <= target else "FAIL"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--fault", action="append", help="FAULT@GENERATION, repeatable")
    args = parser.parse_args()
    chosen = FAULTS
    if args.fault:
        wanted = {tuple(spec.split("@")) for spec in args.fault}
        chosen = [row for row in FAULTS if (row[0], row[1]) in wanted]
    rows: list[tuple[str, str, str, str]] = []
    failed = False
    for fault, generation, verdict_target, release_target in chosen:
        verdicts, releases, outcomes = [], [], []
        for run in range(args.runs):
            to_verdict, to_release, outcome = measure(fault, generation)
            print(
                f"{fault} ({generation}) run {run + 1}: verdict {to_verdict}s,"
                f" released {to_release}s, {outcome}",
                flush=True,
            )
            outcomes.append(outcome)
            if to_verdict is not None:
                verdicts.append(to_verdict)
            if to_release is not None:
                releases.append(to_release)
        median_verdict = statistics.median(verdicts) if verdicts else None
        median_release = statistics.median(releases) if len(releases) == args.runs else None
        label = f"{fault} ({generation}), {args.runs} runs, outcomes {sorted(set(outcomes))}"
        for name, value, target in (
            ("fault -> verdict", median_verdict, verdict_target),
            ("fault -> memory released", median_release, release_target),
        ):
            shown = "-" if value is None else f"{value:.2f} s (median)"
            wanted_text = "-" if target is None else f"<= {target:g} s"
            verdict = verdict_of(value, target)
            failed = failed or verdict.startswith("FAIL")
            rows.append((f"{label}: {name}", shown, wanted_text, verdict))
    note = (
        "Default settings (heartbeat 1 s, heartbeat_timeout 3 s, health 1 s x 3, "
        "term_grace 3 s); the fault time is when the simulator's fault fired."
    )
    record("Detection and release", rows, note)
    for row in rows:
        print(" | ".join(row))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
