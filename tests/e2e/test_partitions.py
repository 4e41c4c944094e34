"""Stages on other hosts through network partitions: the simulated tier.

The shipped multi-host layout (`deploy/kubernetes/multi-host/`: the head pod with stage 0
and stage pods 1 and 2, each with its watchdog, the same ports, names and tokens) runs on
three lab hosts, a network namespace and a pid namespace each, joined by a pod network
(`netlab`). The simulator stands in for vLLM-Omni. Stage host 1 is cut from the head in
each of the ways real networks fail; stage host 2 stays connected all along. The
scenarios run in order on one lab, each from a lab where everything is well to a lab
where everything is well again with nobody's help, which each asserts first.

What must hold, for every partition: no process of a host that stayed connected is ever
signalled; a partition shorter than `link_grace` makes nobody act; a longer one makes
stage host 1's watchdog end its orphaned stage, naming the lost link, and nobody else act
on it; the head's watchdog acts only after `remote_grace`, and only on the head.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e.harness import SIM_ENV
from netlab import expect, scenarios
from netlab.lab import Lab, running_lab, simulated, simulated_devices
from netlab.network import packet_filter_reason, unavailable_reason
from netlab.scenarios import (
    EVICT_AFTER,
    FLAPPING,
    LINK_GRACE,
    LONG,
    PARTITIONED,
    PAST_REMOTE_GRACE,
    SETTLE,
    SHORT,
    SIM_SETTINGS,
    TO_HEAD,
    TO_STAGE,
    Outcome,
    Partition,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"lab hosts: {reason}")
    with running_lab(
        tmp_path_factory.mktemp("lab"),
        SIM_SETTINGS,
        simulated(EVICT_AFTER, SIM_ENV),
        simulated_devices,
    ) as running:
        yield running


# From the cut to the orphan's end: its link seen down, link_grace, the capture, SIGTERM.
ENDED_WITHIN = LINK_GRACE + 5.0


def scenario(lab: Lab, partition: Partition) -> Outcome:
    return asyncio.run(scenarios.run(lab, partition, SETTLE))


def test_a_partition_shorter_than_link_grace_makes_nobody_act(lab: Lab) -> None:
    expect.nobody_acted(scenario(lab, SHORT))


def test_a_flapping_link_makes_nobody_act(lab: Lab) -> None:
    """Each outage is shorter than link_grace: the grace counts from the last time the
    link was seen up, so outages do not add up to an orphan."""
    expect.nobody_acted(scenario(lab, FLAPPING))


def test_a_partition_past_link_grace_ends_the_orphan_and_only_it(lab: Lab) -> None:
    """Stage host 1's watchdog ends its stage, which its init starts again; the new stage
    registers once the link is back, and the head never acted: its remote_grace is
    longer than the stage host takes to come back."""
    expect.only_the_orphan_was_ended(lab, scenario(lab, LONG), LINK_GRACE, ENDED_WITHIN)


@pytest.mark.parametrize("partition", [TO_HEAD, TO_STAGE], ids=["to-head", "to-stage"])
def test_one_direction_dropped_is_a_lost_link_too(lab: Lab, partition: Partition) -> None:
    reason = packet_filter_reason()
    if reason is not None:
        pytest.skip(reason)
    expect.only_the_orphan_was_ended(lab, scenario(lab, partition), LINK_GRACE, ENDED_WITHIN)


def test_a_partition_past_remote_grace_restarts_the_head_and_nothing_of_stage_2(
    lab: Lab,
) -> None:
    """The head's /health fails while stage 1 has no live replica: past remote_grace its
    watchdog restarts the head (its own processes only); stage host 1's watchdog ends its
    orphan meanwhile; stage 2, connected all along, is never signalled."""
    outcome = scenario(lab, PAST_REMOTE_GRACE)
    head = outcome.incidents[lab.head.name]
    assert len(head) == 1, head
    (restart,) = head
    assert restart["outcome"].startswith("recovered"), restart
    evidence = [e for verdict in restart["verdicts"] for e in verdict["evidence"]]
    assert {e["kind"] for e in evidence} == {"health_failed"}, evidence
    assert all(f"remote stage {PARTITIONED}." in e["detail"] for e in evidence), evidence
    assert outcome.server_restarts[lab.head.name] == 1
    partitioned = lab.stages[PARTITIONED].name
    assert outcome.incidents[partitioned], outcome.incidents
    assert all(
        expect.link_lost_verdicts(i) == {PARTITIONED} for i in outcome.incidents[partitioned]
    )
    untouched = [host for host in lab.stages.values() if host.name != partitioned]
    assert all(outcome.incidents[host.name] == [] for host in untouched), outcome.incidents
    assert outcome.healthy_signalled == []
    expect.no_verdict_after_the_heal(outcome)


def test_the_lab_runs_the_shipped_layout(lab: Lab) -> None:
    """The hosts run what the manifests say: ports, names and tokens are the shipped ones."""
    head, stage = lab.layout.head, lab.layout.stages[PARTITIONED]
    assert head.ports == {"watchdog": 9464, "otlp": 4318, "http": 8000, "omni-master": 25000}
    assert stage.flag("--omni-master-address") in lab.layout.head_names
    assert stage.flag("--omni-master-port") == str(head.ports["omni-master"])
    assert lab.head.watchdog_url.endswith(f":{head.ports['watchdog']}")
    spec = (lab.stages[PARTITIONED].workdir / "init.json").read_text()
    assert "lab-otlp-token" in spec
    assert f"http://{stage.flag('--omni-master-address')}:4318/v1/traces" in spec
    assert Path(lab.head.workdir / "events.jsonl").exists()
