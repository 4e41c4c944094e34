"""Fault -> verdict and fault -> GPU memory released, per fault, at default settings.

Each run starts the simulated server with one fault, attaches a watchdog in enforce mode
with every threshold at its default, sends the report's request and measures from the
moment the fault fired (the simulator's event log) to the verdict and to the end of the
verify step. Figures are medians and 95th percentiles over the runs, each beside its
floor: for a death the exit notice (fault -> the exit's evidence, measured in the same
run), for a stall the heartbeat timeout.

    python benchmarks/bench_detection.py [--runs 20] [--fault 1:engine-dead-hang@0.11 ...]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from results import record

from omni_watchdog.config import DetectionConfig
from omni_watchdog.demo import run_scenario, summary
from omni_watchdog.log import configure_logging
from omni_watchdog.types import EvidenceKind, Incident


@dataclass(frozen=True)
class Fault:
    """A fault to measure and its targets from docs/design.md, Performance targets."""

    spec: str
    generation: str
    verdict: str  # "dead" or "stalled"
    verdict_target: float | None = None
    verdict_at_p95: bool = False
    release_target: float | None = None


FAULTS = [
    Fault("1:engine-dead-hang", "0.11", "dead", 1.5, release_target=10.0),
    Fault("1.0:stage-dead-503,1.1:stage-dead-503", "0.30", "dead", 1.5),
    Fault("0:silent-stall", "0.11", "stalled", 4.0, verdict_at_p95=True),
    Fault("1:frozen-engine", "0.11", "stalled", 4.0, verdict_at_p95=True),
]


@dataclass(frozen=True)
class Run:
    verdict: float | None
    released: float | None
    floor: float | None
    outcome: str


def exit_notice(incident: Incident, fault_time: float) -> float | None:
    """Fault -> the wall time of the first process exit among the verdicts' evidence."""
    opened = incident.timeline.get("verdict")
    exits = [
        e for v in incident.verdicts for e in v.evidence if e.kind is EvidenceKind.PROCESS_EXIT
    ]
    if not exits or opened is None:
        return None
    # Evidence times are on the watchdog's monotonic clock; the verdict's is on both.
    verdict_monotonic = min(v.time for v in incident.verdicts)
    return opened - (verdict_monotonic - min(e.since for e in exits)) - fault_time


def measure(fault: Fault) -> Run:
    with (
        tempfile.TemporaryDirectory(prefix="omni-watchdog-bench-") as workdir,
        (Path(workdir) / "watchdog.log").open("a", encoding="utf-8") as log,
    ):
        # The watchdog's log would drown the figures; it goes with the run's directory.
        configure_logging("info", log)
        incident, fault_time = asyncio.run(
            run_scenario(Path(workdir), fault.spec.split(","), fault.generation, say=lambda _: None)
        )
    if incident is None or fault_time is None:
        return Run(None, None, None, "no incident")
    figures = summary(incident, fault_time)
    if fault.verdict == "dead":
        floor = exit_notice(incident, fault_time)
    else:
        floor = DetectionConfig().heartbeat_timeout
    return Run(
        figures["fault_to_verdict_s"], figures["fault_to_released_s"], floor, figures["outcome"]
    )


def p95(values: list[float]) -> float:
    if len(values) < 2:
        return values[0]
    return statistics.quantiles(values, n=20, method="inclusive")[-1]


def spread(values: list[float]) -> str:
    return (
        f"{statistics.median(values):.2f} s median, {p95(values):.2f} s p95"
        f" ({min(values):.2f} - {max(values):.2f})"
    )


def verdict_of(value: float | None, target: float | None) -> str:
    if value is None:
        return "FAIL (not measured)"
    if target is None:
        return "-"
    return "pass" if value <= target else "FAIL"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--fault", action="append", help="FAULT@GENERATION, repeatable")
    args = parser.parse_args()
    chosen = FAULTS
    if args.fault:
        wanted = {tuple(spec.split("@")) for spec in args.fault}
        chosen = [f for f in FAULTS if (f.spec, f.generation) in wanted]
    rows: list[tuple[str, str, str, str]] = []
    failed = False
    for fault in chosen:
        runs = []
        for number in range(args.runs):
            run = measure(fault)
            runs.append(run)
            print(
                f"{fault.spec} ({fault.generation}) run {number + 1}: verdict {run.verdict}s,"
                f" floor {run.floor}s, released {run.released}s, {run.outcome}",
                flush=True,
            )
        outcomes = sorted({run.outcome for run in runs})
        label = f"{fault.spec} ({fault.generation}), {args.runs} runs, outcomes {outcomes}"
        verdicts = [run.verdict for run in runs if run.verdict is not None]
        floors = [run.floor for run in runs if run.floor is not None]
        releases = [run.released for run in runs if run.released is not None]
        complete = len(verdicts) == args.runs
        verdict_value = None
        if complete:
            verdict_value = p95(verdicts) if fault.verdict_at_p95 else statistics.median(verdicts)
        shown = spread(verdicts) if verdicts else "-"
        if verdicts and floors:
            floor = statistics.median(floors)
            ratio = statistics.median(verdicts) / floor if floor > 0 else float("inf")
            shown += (
                f"; floor {floor:.2f} s: median - floor"
                f" {statistics.median(verdicts) - floor:.2f} s, median / floor {ratio:.1f}"
            )
        wanted = "-"
        if fault.verdict_target is not None:
            at = "p95" if fault.verdict_at_p95 else "median"
            wanted = f"<= {fault.verdict_target:g} s ({at})"
        verdict = verdict_of(verdict_value, fault.verdict_target)
        failed = failed or verdict.startswith("FAIL")
        rows.append((f"{label}: fault -> {fault.verdict} verdict", shown, wanted, verdict))
        release_value = statistics.median(releases) if len(releases) == args.runs else None
        wanted = "-" if fault.release_target is None else f"<= {fault.release_target:g} s (median)"
        verdict = verdict_of(release_value, fault.release_target)
        failed = failed or verdict.startswith("FAIL")
        rows.append(
            (
                f"{label}: fault -> memory released",
                spread(releases) if releases else "-",
                wanted,
                verdict,
            )
        )
    defaults = DetectionConfig()
    note = (
        f"Default settings (heartbeat every 1 s, heartbeat_timeout {defaults.heartbeat_timeout:g}"
        f" s, progress_timeout {defaults.progress_timeout:g} s, /metrics every 1 s,"
        " health every 1 s, 0.25 s after a stage exit; term_grace 3 s); the fault time is"
        " when the simulator's fault fired. The floor of a death is the exit notice, of a"
        " stall the heartbeat timeout."
    )
    record("Detection and release", rows, note)
    for row in rows:
        print(" | ".join(row))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
