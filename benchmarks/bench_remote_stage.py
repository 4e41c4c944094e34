"""A stage on another host: fault -> its own watchdog's verdict and -> its GPU memory
released, at the default settings.

Each run starts two "hosts" on this machine: the head (the simulated vLLM-Omni 0.30
server with stage 1 remote, and its watchdog) and the stage host (a headless simulated
stage 1, registered with the head's coordinator, and its own `omni-watchdog run
--headless` process in enforce mode, every threshold and the plugin's heartbeat at their
defaults). One fault is made on the stage host, and the figures run from the fault to the
stage watchdog's verdict and to the end of its verify step (simulated memory back to its
baseline). The head's watchdog must open nothing: a remote stage is never its to act on.

Faults: SIGKILL of a replica (dead), SIGSTOP of a replica (stalled), a blocked forward
(the stage loop deadlocks on the next request; stalled), and the head killed (the stage is
orphaned; dead once its link has been down for `link_grace`).

    python benchmarks/bench_remote_stage.py [--runs 10] [--fault kill --fault orphan ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from bench_detection import spread, verdict_of
from e2e.hosts import (
    Head,
    StageHost,
    chat,
    head_with_remote_stage,
    running_stage_host,
)
from results import record

from omni_watchdog.config import DetectionConfig, LadderConfig
from omni_watchdog.log import configure_logging
from omni_watchdog.sim.faults import EVENTS_FILE

TARGET_S = 15.0


def kill_replica(head: Head, stage: StageHost) -> float:
    stage.replicas()[0].send_signal(signal.SIGKILL)
    return time.time()


def stop_replica(head: Head, stage: StageHost) -> float:
    stage.replicas()[0].send_signal(signal.SIGSTOP)
    return time.time()


def block_forward(head: Head, stage: StageHost) -> float:
    """Armed now; it fires on the next request, which the run sends (the fault's time is
    when the simulator says it fired)."""
    stage.inject("silent-stall")
    return 0.0


def orphan(head: Head, stage: StageHost) -> float:
    head.sim.stop()
    return time.time()


@dataclass(frozen=True)
class Fault:
    name: str
    make: Callable[[Head, StageHost], float]
    verdict: str


FAULTS = {
    "kill": Fault("SIGKILL of a replica", kill_replica, "dead"),
    "stop": Fault("SIGSTOP of a replica", stop_replica, "stalled"),
    "block": Fault("a blocked forward", block_forward, "stalled"),
    "orphan": Fault("the head killed: the stage orphaned", orphan, "dead"),
}


@dataclass(frozen=True)
class Run:
    verdict: float | None
    released: float | None
    outcome: str
    head_incidents: int


def fired_at(stage: StageHost) -> float | None:
    path = stage.state_dir / EVENTS_FILE
    if not path.exists():
        return None
    times = [
        float(event["time"])
        for line in path.read_text().splitlines()
        if (event := json.loads(line)).get("event") == "fault_triggered"
    ]
    return min(times) if times else None


async def measure(fault: Fault, workdir: Path) -> Run:
    requests: list[asyncio.Task[int]] = []
    try:
        async with (
            head_with_remote_stage(workdir / "head", {}) as head,
            running_stage_host(head, workdir / "stage", watchdog_config={}, plugin_env={}) as stage,
        ):
            made_at = fault.make(head, stage)
            if fault.make is block_forward:
                requests = [asyncio.ensure_future(chat(head, timeout=120)) for _ in range(2)]
            incident = await stage.closed_incident(90)
            fault_time = made_at or fired_at(stage)
            timeline = incident.get("timeline") or {}
            verdict_at, released_at = timeline.get("verdict"), timeline.get("released")
            # The head killed on purpose records its own crash: not a remote stage's.
            acted = 0 if fault.make is orphan else len(head.watchdog.state.remediation.incidents)
            return Run(
                None if fault_time is None or verdict_at is None else verdict_at - fault_time,
                None if fault_time is None or released_at is None else released_at - fault_time,
                str(incident.get("outcome")),
                acted,
            )
    finally:
        for request in requests:
            request.cancel()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--fault", action="append", choices=sorted(FAULTS))
    args = parser.parse_args()
    rows: list[tuple[str, str, str, str]] = []
    failed = False
    for key in args.fault or list(FAULTS):
        fault = FAULTS[key]
        runs = []
        for number in range(args.runs):
            with (
                tempfile.TemporaryDirectory(prefix="omni-watchdog-bench-") as workdir,
                (Path(workdir) / "head-watchdog.log").open("a", encoding="utf-8") as log,
            ):
                configure_logging("info", log)
                run = asyncio.run(measure(fault, Path(workdir)))
            runs.append(run)
            print(
                f"{fault.name} run {number + 1}: verdict {run.verdict}, released"
                f" {run.released}, {run.outcome}, head incidents {run.head_incidents}",
                flush=True,
            )
        outcomes = sorted({run.outcome for run in runs})
        label = f"{fault.name}, {args.runs} runs, outcomes {outcomes}"
        doubled = sum(run.head_incidents for run in runs)
        if doubled:
            failed = True
            label += f", {doubled} incident(s) on the head (FAIL: never its to act on)"
        for what, values in (
            (f"fault -> {fault.verdict} verdict", [r.verdict for r in runs]),
            ("fault -> memory released", [r.released for r in runs]),
        ):
            measured = [value for value in values if value is not None]
            median = statistics.median(measured) if len(measured) == args.runs else None
            verdict = verdict_of(median, TARGET_S)
            failed = failed or verdict.startswith("FAIL")
            rows.append(
                (
                    f"{label}: {what}",
                    spread(measured) if measured else "-",
                    f"<= {TARGET_S:g} s (median)",
                    verdict,
                )
            )
    defaults, ladder = DetectionConfig(), LadderConfig()
    note = (
        f"The stage host's watchdog at the defaults (heartbeat every 1 s, heartbeat_timeout"
        f" {defaults.heartbeat_timeout:g} s, stuck_timeout {defaults.stuck_timeout:g} s,"
        f" confirm_timeout {defaults.confirm_timeout:g} s, link_grace"
        f" {defaults.link_grace:g} s, term_grace {ladder.term_grace:g} s; no shutdown step:"
        " a headless stage has no admin endpoint). The fault time is the signal's, the"
        " head's death's, or when the simulator's blocked forward fired."
    )
    record("Stages on other hosts", rows, note)
    for row in rows:
        print(" | ".join(row))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
