"""Partitions of one stage host from the head, the way real networks fail, and what each
host's watchdog did about them.

Each scenario starts from a lab where every host is well, cuts the pod network between
the head and stage host `PARTITIONED` (the link down, or one direction dropped), heals it,
and waits until everything is well again without anyone's help. It reads what happened
from the hosts themselves: the incidents each watchdog opened, which containers their
inits started again and when, and whether the processes of the hosts that stayed
connected are the ones that ran before.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from deadline import wait_for
from e2e.harness import FAST
from netlab.lab import Lab, LabHost
from netlab.layout import SERVER_CONTAINER

from omni_watchdog.config import merge_layers

PARTITIONED = 1
POLL = 0.25


@dataclass(frozen=True)
class Partition:
    """One way the pod network fails between the head and stage host `PARTITIONED`."""

    name: str
    kind: str  # "down" (both ways), "drop-to-head", "drop-to-stage", "flap"
    seconds: float
    # For "flap": seconds down, then up, repeated for `seconds` in all.
    flap_down: float = 0.0
    flap_up: float = 0.0


# The simulated tier's timings (tests/e2e/test_partitions.py, benchmarks/bench_partitions.py).
LINK_GRACE = 5.0
REMOTE_GRACE = 14.0
# The head evicts a replica silent this long: longer than link_grace, or a partition
# between the two would leave an evicted stage that its own watchdog sees linked (the
# shipped defaults: 30 s against 10 s).
EVICT_AFTER = 7.0
SIM_SETTINGS: dict[str, Any] = merge_layers(
    FAST,
    {
        "detection": {"link_grace": f"{LINK_GRACE}s", "remote_grace": f"{REMOTE_GRACE}s"},
        # Every scenario is a failure of its own, minutes apart in life; here seconds.
        "ladder": {"budget_per_hour": 50},
    },
)
# Waiting for a well lab: a stage started again, registered and warmed up takes seconds.
SETTLE = 60.0

SHORT = Partition("link down both ways, healed before link_grace", "down", 2.0)
FLAPPING = Partition("link flapping, 1.5 s down / 1.5 s up", "flap", 10.0, 1.5, 1.5)
LONG = Partition("link down both ways, past link_grace", "down", 9.0)
TO_HEAD = Partition("stage -> head dropped (nft), past link_grace", "drop-to-head", 9.0)
TO_STAGE = Partition("head -> stage dropped (nft), past link_grace", "drop-to-stage", 9.0)
PAST_REMOTE_GRACE = Partition("link down both ways, past remote_grace", "down", 22.0)
# In the order the tier runs them, each from the well lab the one before left.
SIM_PARTITIONS = (SHORT, FLAPPING, LONG, TO_HEAD, TO_STAGE, PAST_REMOTE_GRACE)


@dataclass
class Outcome:
    """What happened in one scenario, as the hosts tell it."""

    partition: Partition
    # Per host name: the incidents its watchdog opened, whole, as its API gives them.
    incidents: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    # Per host name: how many times its server was started again.
    server_restarts: dict[str, int] = field(default_factory=dict)
    # From the cut to the partitioned stage's end (None: it was not ended).
    orphan_ended_after: float | None = None
    # From the heal to every host well again.
    healthy_after_heal: float = 0.0
    # Hosts that were well and connected whose server was signalled or restarted.
    healthy_signalled: list[str] = field(default_factory=list)
    # The states the head's watchdog gave the partitioned stage while it was cut off.
    head_saw: set[str] = field(default_factory=set)
    # Per host name: the verdicts its watchdog logged after the heal (late spans among
    # what came then).
    verdicts_after_heal: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


def apply(lab: Lab, partition: Partition) -> Callable[[], Awaitable[None]]:
    """Cut the network as `partition` says; the coroutine it gives holds the cut for its
    seconds (a flap goes down and up meanwhile), and heals it."""
    network, stage = lab.network, lab.stages[PARTITIONED].net
    head = network.head
    if partition.kind == "down":
        network.link_down(stage)
    elif partition.kind == "drop-to-head":
        network.drop_from(stage, head)
    elif partition.kind == "drop-to-stage":
        network.drop_from(head, stage)
    elif partition.kind == "flap":
        network.link_down(stage)
    else:
        raise ValueError(partition.kind)

    async def hold() -> None:
        if partition.kind == "flap":
            end = time.monotonic() + partition.seconds
            while True:
                await asyncio.sleep(partition.flap_down)
                network.link_up(stage)
                if time.monotonic() + partition.flap_up >= end:
                    break
                await asyncio.sleep(partition.flap_up)
                network.link_down(stage)
        else:
            await asyncio.sleep(partition.seconds)
        network.heal()

    return hold


async def everything_well(lab: Lab) -> dict[str, Any]:
    """What is not well yet, per host; empty when the head serves, every watchdog is warm
    and sees all its stages healthy (the head's, its remote ones too), and every stage
    host's link to the master is up."""
    missing: dict[str, Any] = {}
    code, _ = await lab.head.get(lab.head.server_url + "/health")
    if code != 200:
        missing["head /health"] = code
    for host in lab.hosts:
        status = await host.status()
        if status is None:
            missing[host.name] = "no answer"
            continue
        # A stage host's watchdog answers for its own stage; the head's for all of them.
        own = {k for k, stage in lab.stages.items() if stage is host}
        states = {
            f"{s['stage_id']}.{s['replica']}": s["state"]
            for s in status.get("stages") or ()
            if not own or s["stage_id"] in own
        }
        link = status.get("link")
        unwell = {k: v for k, v in states.items() if v != "healthy"}
        if not status["target"]["warmed_up"] or unwell or not states:
            missing[host.name] = {"warmed_up": status["target"]["warmed_up"], **unwell}
        elif host is not lab.head and not (link or {}).get("up"):
            missing[host.name] = {"link": link}
    return missing


async def wait_well(lab: Lab, timeout: float) -> float:
    """Seconds until everything is well (`everything_well`)."""
    started = time.monotonic()
    seen: dict[str, Any] = {}

    async def well() -> bool:
        seen.clear()
        seen.update(await everything_well(lab))
        return not seen

    await wait_for(well, timeout, "every host well", interval=POLL, seen=lambda: dict(seen))
    return time.monotonic() - started


async def _watch_head(lab: Lab, seen: set[str]) -> None:
    """Every state the head's watchdog gives the partitioned stage, until cancelled."""
    while True:
        status = await lab.head.status()
        for stage in (status or {}).get("stages") or ():
            if stage["stage_id"] == PARTITIONED:
                seen.add(stage["state"])
        await asyncio.sleep(POLL)


async def _incident_ids(host: LabHost) -> set[str]:
    return {i["incident_id"] for i in await host.incidents()}


async def run(lab: Lab, partition: Partition, settle: float) -> Outcome:
    """One scenario from a well lab to a well lab; `settle`: how long to wait for it."""
    await wait_well(lab, settle)
    before = {host.name: await _incident_ids(host) for host in lab.hosts}
    starts = {host.name: host.starts(SERVER_CONTAINER) for host in lab.hosts}
    trees = {host.name: host.tree(SERVER_CONTAINER) for host in lab.hosts}
    cut = time.time()
    hold = apply(lab, partition)
    head_saw: set[str] = set()
    watching = asyncio.ensure_future(_watch_head(lab, head_saw))
    try:
        await hold()
    finally:
        watching.cancel()
    healed, healed_wall = time.monotonic(), time.time()
    await wait_well(lab, settle)
    outcome = Outcome(partition, healthy_after_heal=time.monotonic() - healed, head_saw=head_saw)
    for host in lab.hosts:
        outcome.verdicts_after_heal[host.name] = host.verdicts_logged(healed_wall)
    for host in lab.hosts:
        outcome.incidents[host.name] = [
            await host.incident(summary["incident_id"])
            for summary in await host.incidents()
            if summary["incident_id"] not in before[host.name]
        ]
        outcome.server_restarts[host.name] = host.starts(SERVER_CONTAINER) - starts[host.name]
    partitioned = lab.stages[PARTITIONED]
    ended = [e["time"] for e in partitioned.exits(SERVER_CONTAINER) if e["time"] >= cut]
    outcome.orphan_ended_after = min(ended) - cut if ended else None
    for host in lab.hosts:
        if host is partitioned or host is lab.head:
            continue
        if outcome.incidents[host.name] or not all(p.alive() for p in trees[host.name]):
            outcome.healthy_signalled.append(host.name)
    head_acted = bool(outcome.incidents[lab.head.name])
    if not head_acted and not all(p.alive() for p in trees[lab.head.name]):
        outcome.healthy_signalled.append(lab.head.name)
    return outcome
