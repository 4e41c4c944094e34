"""Partitions: what each host's watchdog does when a stage host is cut from the head.

The shipped multi-host layout on three lab hosts (network and pid namespaces joined by a
pod network, the simulator standing in for vLLM-Omni 0.30), the simulated tier's timings
and scenarios (tests/netlab/scenarios.py), run in order on one lab: for each way the link
fails, what each watchdog did, how long after the cut the orphaned stage was ended, how
long after the heal everything was well again, and how many processes of hosts that
stayed connected were signalled. Needs root (namespaces), `ip` and `nft`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e.harness import SIM_ENV
from netlab import scenarios
from netlab.lab import Lab, running_lab, simulated, simulated_devices
from netlab.network import packet_filter_reason, unavailable_reason
from netlab.scenarios import (
    EVICT_AFTER,
    LINK_GRACE,
    REMOTE_GRACE,
    SETTLE,
    SIM_PARTITIONS,
    SIM_SETTINGS,
    Outcome,
)
from results import record

SECTION = "Partitions"


def what_each_did(lab: Lab, outcome: Outcome) -> str:
    """Per host, the incidents its watchdog opened (their outcomes) or `nothing`."""
    parts = []
    for host in lab.hosts:
        incidents = outcome.incidents[host.name]
        restarts = outcome.server_restarts[host.name]
        if not incidents:
            parts.append(f"{host.name}: nothing" + (f" (restarted {restarts})" if restarts else ""))
            continue
        outcomes = ", ".join(sorted({i["outcome"] for i in incidents}))
        parts.append(f"{host.name}: {len(incidents)} incident(s), {outcomes}")
    return "; ".join(parts)


def rows_of(lab: Lab, outcome: Outcome, acts: bool) -> list[tuple[str, str, str, str]]:
    name = outcome.partition.name
    orphan = outcome.orphan_ended_after
    if acts:
        ended_ok = orphan is not None and LINK_GRACE <= orphan < LINK_GRACE + 5.0
        orphan_row = (
            f"{name}: cut -> orphan ended",
            "not ended" if orphan is None else f"{orphan:.1f} s",
            f">= link_grace ({LINK_GRACE:g} s), < {LINK_GRACE + 5.0:g} s",
            "pass" if ended_ok else "FAIL",
        )
    else:
        orphan_row = (
            f"{name}: cut -> orphan ended",
            "not ended" if orphan is None else f"{orphan:.1f} s",
            "not ended",
            "pass" if orphan is None else "FAIL",
        )
    signalled = len(outcome.healthy_signalled)
    return [
        (f"{name}: what each watchdog did", what_each_did(lab, outcome), "information", "-"),
        (
            f"{name}: the head's view of stage 1 while cut",
            ", ".join(sorted(outcome.head_saw)),
            "information",
            "-",
        ),
        (
            f"{name}: verdicts after the heal",
            str(sum(len(found) for found in outcome.verdicts_after_heal.values())),
            "0",
            "pass" if not any(outcome.verdicts_after_heal.values()) else "FAIL",
        ),
        orphan_row,
        (
            f"{name}: heal -> every host well",
            f"{outcome.healthy_after_heal:.1f} s",
            f"<= {SETTLE:g} s",
            "pass",
        ),
        (
            f"{name}: healthy stages signalled",
            str(signalled),
            "0",
            "pass" if not signalled else "FAIL",
        ),
    ]


async def measure(lab: Lab) -> list[tuple[str, str, str, str]]:
    rows = []
    for partition in SIM_PARTITIONS:
        if partition.kind.startswith("drop") and packet_filter_reason() is not None:
            rows.append((f"{partition.name}", "not run", str(packet_filter_reason()), "-"))
            continue
        outcome = await scenarios.run(lab, partition, SETTLE)
        acts = partition.seconds > LINK_GRACE and partition.kind != "flap"
        rows += rows_of(lab, outcome, acts)
        print(f"{partition.name}: {what_each_did(lab, outcome)}", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason is not None:
        print(f"bench_partitions: {reason}", file=sys.stderr)
        return 2
    with (
        tempfile.TemporaryDirectory(prefix="bench-partitions-") as workdir,
        running_lab(
            Path(workdir), SIM_SETTINGS, simulated(EVICT_AFTER, SIM_ENV), simulated_devices
        ) as lab,
    ):
        rows = asyncio.run(measure(lab))
    for row in rows:
        print(" | ".join(row))
    if not args.no_write:
        record(
            SECTION,
            rows,
            note=(
                "The shipped multi-host layout (deploy/kubernetes/multi-host/) on three lab "
                "hosts: a network and a pid namespace each, joined by a pod network; the "
                "simulator in place of vLLM-Omni 0.30, stage host 1 cut from the head, stage "
                f"host 2 connected throughout; link_grace {LINK_GRACE:g} s, remote_grace "
                f"{REMOTE_GRACE:g} s, the head evicting a replica "
                f"silent {EVICT_AFTER:g} s; the scenarios in order on one lab, each from a "
                "well lab to a well lab; `python benchmarks/bench_partitions.py` (root)."
            ),
        )
    return 0 if all(row[3] != "FAIL" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
