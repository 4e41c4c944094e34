"""What every partition scenario must show, for both tiers (the simulator's and the real
vLLM-Omni's): who acted, on what, and when."""

from __future__ import annotations

from typing import Any

from netlab.lab import Lab
from netlab.scenarios import PARTITIONED, Outcome


def link_lost_verdicts(incident: dict[str, Any]) -> set[int]:
    """The stages an incident's verdicts judged dead for the lost link."""
    return {
        verdict["stage"]["stage_id"]
        for verdict in incident["verdicts"]
        if verdict["state"] == "dead" and any(e["kind"] == "link_lost" for e in verdict["evidence"])
    }


def no_verdict_after_the_heal(outcome: Outcome) -> None:
    """What arrives after the heal (spans held by the stage's exporter among it) judges
    nothing: every verdict came while the link was cut."""
    late = {host: found for host, found in outcome.verdicts_after_heal.items() if found}
    assert late == {}, late


def nobody_acted(outcome: Outcome) -> None:
    assert outcome.incidents == {host: [] for host in outcome.incidents}, outcome.incidents
    assert set(outcome.server_restarts.values()) == {0}, outcome.server_restarts
    assert outcome.orphan_ended_after is None, outcome
    assert outcome.healthy_signalled == []
    no_verdict_after_the_heal(outcome)


def only_the_orphan_was_ended(
    lab: Lab, outcome: Outcome, link_grace: float, ended_within: float
) -> None:
    """Stage host 1's watchdog ended its own stage for the lost link, between link_grace
    and `ended_within` after the cut; nobody else acted, the head judged the stage it could
    no longer hear, and nothing was judged after the heal."""
    partitioned = lab.stages[PARTITIONED].name
    ended = outcome.incidents[partitioned]
    assert ended, outcome.incidents
    for incident in ended:
        assert link_lost_verdicts(incident) == {PARTITIONED}, incident["verdicts"]
        assert incident["outcome"].startswith("recovered"), incident
    assert outcome.orphan_ended_after is not None, outcome
    assert link_grace <= outcome.orphan_ended_after < ended_within, outcome
    assert outcome.server_restarts[partitioned] >= 1, outcome.server_restarts
    others = {host: found for host, found in outcome.incidents.items() if host != partitioned}
    assert others == {host: [] for host in others}, others
    assert outcome.server_restarts[lab.head.name] == 0, outcome.server_restarts
    assert outcome.healthy_signalled == []
    assert outcome.head_saw - {"healthy"}, outcome.head_saw
    no_verdict_after_the_heal(outcome)
