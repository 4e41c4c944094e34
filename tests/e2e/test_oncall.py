"""The on-call commands against a running watchdog and the simulated server.

The watchdog runs in this process (`attached`); each command is the real `omni-watchdog`
in a subprocess, as on-call types it, with the operator token in its environment.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import psutil
import pytest
from deadline import wait_for
from e2e.harness import (
    FAST,
    OPERATOR_TOKEN,
    RECOVERED,
    SIM_ENV,
    attached,
    closed_by_id,
    held_back,
    in_background,
    incident_by_id,
    metrics,
    oncall,
    run_scenario,
    warmed_up,
)
from exporters.browser import laid_out

from omni_watchdog.app import Watchdog
from omni_watchdog.config import merge_layers
from omni_watchdog.policy.incidents import IncidentJournal, StateWriteErrors
from omni_watchdog.sim.launcher import SimProcess
from omni_watchdog.types import IncidentOutcome, OperatorAction, StepName

pytestmark = pytest.mark.e2e

WITH_TOKEN = merge_layers(FAST, {"operator_token": OPERATOR_TOKEN})
# No canary: its request would trip the fault before an on-call command run at the
# same moment lands (a Python start-up takes seconds on two busy cores).
WITH_TOKEN_NO_CANARY = merge_layers(
    WITH_TOKEN, {"probes": {"enabled": ["spans", "metrics", "health", "processes", "gpu"]}}
)
# An engine that dies while its stage process lives on, holding its GPU memory: the
# report's hang.
HANG = ["1:engine-dead-hang"]


def tree_gone(server: SimProcess, pids: set[int]) -> bool:
    return server.process.poll() is not None and not any(psutil.pid_exists(p) for p in pids)


def journaled(workdir: Path) -> list[OperatorAction]:
    """The operator's actions in the journal of the watchdog `attached` in `workdir`:
    `demo_config` keeps its state there, under `watchdog`."""
    journal = workdir / "watchdog" / "journal.jsonl"
    return IncidentJournal(journal, StateWriteErrors()).actions()


def server_pids(watchdog: Watchdog) -> set[int]:
    return {p.pid for p in watchdog.state.processes}


def test_status_incidents_and_report_show_what_the_watchdog_sees(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with attached(tmp_path, HANG, "0.11", "dry-run", WITH_TOKEN, None, SIM_ENV) as (
            watchdog,
            server,
        ):
            await warmed_up(watchdog)
            code, out, _ = await oncall(watchdog, "status")
            assert code == 0
            for column in ("STAGE", "STATE", "EVIDENCE", "PIDS", "GPU MIB", "HEARTBEAT"):
                assert column in out.upper(), out
            for name in ("thinker", "talker", "code2wav"):
                assert name in out
            assert "dry-run" in out and "\x1b[" not in out  # no colours off a terminal

            in_background(server.url)
            plan = await wait_for(lambda: watchdog.state.remediation.incidents, 40)
            incident_id = plan[0].incident_id
            incident = await wait_for(lambda: closed_by_id(watchdog, incident_id), 40)
            # The history of the minutes around it is written as its closing is exported.
            assert incident.bundle_dir is not None
            bundle = Path(incident.bundle_dir)
            await wait_for(lambda: (bundle / "gpu-timeline.json").exists(), 5)

            code, out, _ = await oncall(watchdog, "status", "--json")
            status = json.loads(out)
            assert code == 0 and status["mode"] == "dry-run" and status["pause"] is None
            assert {s["name"]: s["state"] for s in status["stages"]}["talker"] in (
                "stalled",
                "dead",
            )

            code, out, _ = await oncall(watchdog, "incidents")
            assert code == 0 and incident_id in out and "planned" in out

            code, out, _ = await oncall(watchdog, "incidents", incident_id)
            assert code == 0
            for step in StepName:
                assert step.value in out, out
            for evidence in incident.verdicts[0].evidence:
                assert f"{evidence.kind.value}: {evidence.detail}" in out, out

            code, out, _ = await oncall(watchdog, "incidents", incident_id, "--json")
            assert code == 0 and json.loads(out)["outcome"] == "planned"

            page = tmp_path / "report.html"
            code, _, err = await oncall(watchdog, "report", incident_id, "--html", str(page))
            assert code == 0, err
            document = page.read_text(encoding="utf-8")
            for section in ("summary", "timeline", "evidence", "steps", "gpu", "stacks"):
                assert f'<section id="{section}"' in document, section
            # Stage lanes from the state changes, and GPU memory per pid over time.
            assert 'class="state" data-stage="1.0"' in document
            assert 'class="gpu-chart"' in document
            # A real browser lays out the timeline and a bar for every step of the plan.
            rendered = laid_out(document, tmp_path)
            assert all(size > 0 for size in rendered["timeline"])
            assert [name for name, *_ in rendered["steps"]] == [s.value for s in StepName]
            assert all(width > 0 and height > 0 for _, width, height in rendered["steps"])

            code, _, err = await oncall(watchdog, "incidents", "no-such-incident")
            assert code == 1 and "no incident" in err

    run_scenario(scenario())


def test_remediate_runs_the_plan_of_a_dry_run_and_the_tree_is_gone(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with attached(tmp_path, HANG, "0.11", "dry-run", WITH_TOKEN, None, SIM_ENV) as (
            watchdog,
            server,
        ):
            await warmed_up(watchdog)
            pids = server_pids(watchdog)
            in_background(server.url)
            plan = await wait_for(lambda: watchdog.state.remediation.incidents, 40)
            planned = await wait_for(lambda: closed_by_id(watchdog, plan[0].incident_id), 40)
            assert planned.outcome is IncidentOutcome.PLANNED and server.process.poll() is None

            code, out, err = await oncall(
                watchdog, "remediate", "--incident", planned.incident_id, "--yes"
            )
            assert code == 0, err
            approved_id = await wait_for(
                lambda: next(
                    (
                        i.incident_id
                        for i in watchdog.state.remediation.incidents
                        if i.incident_id != planned.incident_id
                    ),
                    None,
                ),
                10,
            )
            assert approved_id in out
            done = await wait_for(lambda: closed_by_id(watchdog, approved_id), 60)
            assert done.mode.value == "enforce" and done.outcome in RECOVERED, done.steps
            await wait_for(lambda: tree_gone(server, pids), 20)

            actions = journaled(tmp_path)
            assert [(a.action, a.outcome, a.incident_id) for a in actions] == [
                ("remediate", "accepted", approved_id)
            ]
            text = await metrics(watchdog)
            assert (
                'omni_watchdog_operator_actions_total{action="remediate",outcome="accepted"} 1'
                in text
            )

    run_scenario(scenario())


def test_a_pause_holds_an_enforced_action_during_a_real_hang_and_resume_lets_it_run(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        async with attached(
            tmp_path, HANG, "0.11", "enforce", WITH_TOKEN_NO_CANARY, None, SIM_ENV
        ) as (watchdog, server):
            await warmed_up(watchdog)
            pids = server_pids(watchdog)
            code, out, err = await oncall(
                watchdog, "pause", "--for", "10m", "--reason", "driver upgrade"
            )
            assert code == 0, err
            await wait_for(lambda: watchdog.state.remediation.pause, 5)
            code, out, _ = await oncall(watchdog, "status")
            assert "driver upgrade" in out
            assert "omni_watchdog_remediation_paused 1" in await metrics(watchdog)

            in_background(server.url)
            found = await wait_for(lambda: watchdog.state.remediation.incidents, 40)
            incident_id = found[0].incident_id
            await wait_for(lambda: held_back(watchdog, incident_id), 30)
            # Held: detected and captured, nothing done to the server for as long as it lasts.
            for _ in range(8):
                await asyncio.sleep(0.25)
                assert server.process.poll() is None
                assert closed_by_id(watchdog, incident_id) is None
            held = incident_by_id(watchdog, incident_id)
            assert held is not None
            assert [s.step for s in held.steps] == [StepName.CAPTURE]

            code, out, err = await oncall(watchdog, "resume")
            assert code == 0, err
            done = await wait_for(lambda: closed_by_id(watchdog, incident_id), 60)
            assert done.mode.value == "enforce" and done.outcome in RECOVERED, done.steps
            await wait_for(lambda: tree_gone(server, pids), 20)
            await wait_for(lambda: watchdog.state.remediation.pause is None, 5)
            assert "omni_watchdog_remediation_paused 0" in await metrics(watchdog)

    run_scenario(scenario())


@pytest.mark.parametrize(
    ("configured", "given", "code", "answer"),
    [
        (None, OPERATOR_TOKEN, 1, "HTTP 403"),
        (OPERATOR_TOKEN, None, 1, "HTTP 401"),
        (OPERATOR_TOKEN, "a-wrong-token", 1, "HTTP 401"),
        (OPERATOR_TOKEN, OPERATOR_TOKEN, 0, ""),
    ],
    ids=["none configured", "none given", "wrong", "right"],
)
def test_actions_need_the_operator_token(
    tmp_path: Path, configured: str | None, given: str | None, code: int, answer: str
) -> None:
    overrides = WITH_TOKEN if configured else FAST

    async def scenario() -> None:
        async with attached(tmp_path, [], "0.11", "enforce", overrides, None, SIM_ENV) as (
            watchdog,
            _,
        ):
            await warmed_up(watchdog)
            exit_code, _, err = await oncall(
                watchdog, "pause", "--for", "1m", "--reason", "test", token=given
            )
            assert exit_code == code, err
            assert answer in err
            outcome = "accepted" if code == 0 else ("forbidden" if configured is None else "")
            outcome = outcome or "unauthorized"
            await wait_for(
                lambda: watchdog.state.remediation.operator_actions.get(("pause", outcome)), 5
            )
            # Only an action that came with the token is journaled: anyone can send the rest.
            expected = [("pause", outcome)] if code == 0 else []
            assert [(a.action, a.outcome) for a in journaled(tmp_path)] == expected
            # Reads stay open whatever the token.
            status_code, _, _ = await oncall(watchdog, "status", token=None)
            assert status_code == 0

    run_scenario(scenario())
