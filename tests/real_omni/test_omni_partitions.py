"""Stages on other hosts through network partitions: the real vLLM-Omni 0.30 (CPU).

The real-server twin of `e2e/test_partitions.py`. The shipped multi-host layout
(`deploy/kubernetes/multi-host/`: the head pod with stage 0 and stage pods 1 and 2, each
with its watchdog, the same ports, names and tokens) runs on three lab hosts (`netlab`),
the real `vllm serve --omni` of `.venv-omni` on the tiny local model in place of the
image (`real_omni.lab_server`): the head, and stages 1 and 2 headless, registered with
the head's master across the pod network. Stage host 1 is cut from the head; stage host
2 stays connected all along. The scenarios run in order on one lab, each from a lab
where everything is well to a lab where everything is well again with nobody's help.

What must hold: a partition shorter than `link_grace` makes nobody act; a longer one,
past the head's eviction too, makes stage host 1's watchdog end its orphaned stage,
naming the lost link; its init starts it again, the new stage registers once the link is
back, and the head, which vLLM-Omni 0.30 lets take a new registration, serves again
with no restart. No process of a host that stayed connected is ever signalled.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import explain
import pytest
from netlab import expect
from netlab.lab import Lab
from netlab.network import unavailable_reason
from netlab.scenarios import Partition
from real_omni.headless import READY_TIMEOUT
from real_omni.lab_server import host_logs, real_lab, run_scenario
from real_omni.server import OMNI_FAST

from omni_watchdog.config import merge_layers

# Starting the head and two headless stages took about 80 s on two cores; a loaded CI
# machine takes longer. The first test pays for the start, the last for the clean-up.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(480)]

LINK_GRACE = 10.0
# The head evicts a replica silent this long: longer than link_grace, or a partition
# between the two would leave an evicted stage that its own watchdog sees linked. A 0.30
# replica beats every 5 s, and the head looks every min(EVICT_AFTER / 2, 5) s: a replica
# is evicted 10 to 20 s after its last beat. A short partition must not reach it: its
# beat held back by the cut comes at TCP's next retry after the heal, up to the cut's
# length later, so the silence it makes is up to 5 s + twice the cut.
EVICT_AFTER = 15.0
SETTINGS: dict[str, Any] = merge_layers(
    # Without `otlp_token`: the manifests give each watchdog its token, or none (a stage
    # host's watchdog receives from its own stage alone, whose plugin sends none to it).
    {key: value for key, value in OMNI_FAST.items() if key != "otlp_token"},
    {
        "detection": {
            "link_grace": f"{LINK_GRACE:g}s",
            # The head never acts here: longer than any scenario.
            "remote_grace": "600s",
            # The watchdogs start before their servers, as in a pod, and three real
            # servers start at once here: not judged before they could be ready.
            "startup_timeout": f"{READY_TIMEOUT:g}s",
        },
        # Every scenario is a failure of its own, minutes apart in life; here seconds.
        "ladder": {"budget_per_hour": 50},
    },
)
# Waiting for a well lab: a stage started again registers once the link is back, then
# loads its model and warms up: 23 to 26 s after the heal on two cores, more under load.
SETTLE = 180.0

SHORT = Partition("link down both ways, healed before link_grace", "down", 3.0)
# Past link_grace, and past the head's eviction of the silent replica (at most 20 s after
# the cut, see EVICT_AFTER) with a margin: the stage started again cannot register before
# the heal, so the head has evicted the old one by then.
LONG = Partition("link down both ways, past link_grace and the eviction", "down", 24.0)
# From the cut to the orphan's exit: its link seen down (a probe's connect attempt),
# link_grace, the capture, then SIGTERM, which a headless stage cut from its head did not
# obey within term_grace (2 s) in any run, and SIGKILL: 12 to 13 s in all here.
ENDED_WITHIN = LINK_GRACE + 15.0


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Lab]:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"lab hosts: {reason}")
    # After the check above: the omni environment's fixtures skip (or fail in CI) alone.
    model: Path = request.getfixturevalue("omni_model")
    with (
        real_lab(
            tmp_path_factory.mktemp("lab"), SETTINGS, model, EVICT_AFTER, READY_TIMEOUT
        ) as running,
        explain.witnessed("the lab hosts", lambda: host_logs(running)),
    ):
        yield running


def test_a_partition_shorter_than_link_grace_makes_nobody_act(lab: Lab) -> None:
    outcome = run_scenario(lab, SHORT, SETTLE)
    print(f"\n{SHORT.name}: healthy_after_heal {outcome.healthy_after_heal:.1f}s")
    expect.nobody_acted(outcome)


def test_a_partition_past_link_grace_ends_the_orphan_and_the_head_takes_its_successor(
    lab: Lab,
) -> None:
    """Stage host 1's watchdog ends its stage, which its init starts again; once the link
    is back the new stage registers with the head, which had evicted the old one and now
    serves again, never restarted; the head's and stage host 2's watchdogs never acted."""
    outcome = run_scenario(lab, LONG, SETTLE)
    print(
        f"\n{LONG.name}: orphan_ended_after {outcome.orphan_ended_after}s,"
        f" healthy_after_heal {outcome.healthy_after_heal:.1f}s"
    )
    expect.only_the_orphan_was_ended(lab, outcome, LINK_GRACE, ENDED_WITHIN)
    # The plugin of the stage started again exports across the pod network to the head's
    # watchdog, which names the node each remote stage runs on. The master numbered the
    # new replica anew (replica 1): the evicted one, silent, was retired in its favour.
    seen = remote_view(lab)
    print(f"the head's watchdog sees: {seen}")
    assert {(s, state, node) for s, _, state, node in seen} == {
        (stage_id, "healthy", host.name) for stage_id, host in lab.stages.items()
    }, seen
    assert len(seen) == len(lab.stages), seen


def remote_view(lab: Lab) -> list[tuple[int, int, str, str]]:
    """(stage, replica, state, host) of each remote stage in the head's watchdog's status."""
    status = asyncio.run(lab.head.status()) or {}
    return [
        (s["stage_id"], s["replica"], s["state"], s["host"])
        for s in status.get("stages") or ()
        if s["remote"]
    ]
