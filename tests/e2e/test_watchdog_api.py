"""The watchdog's JSON API and a plain single-stage server without the plugin."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from deadline import wait_for
from e2e.harness import (
    FAST,
    RECOVERED,
    SIM_ENV,
    attached,
    in_background,
    incident_done,
    run_scenario,
    steps_of,
    warmed_up,
    with_fault,
)

from omni_watchdog.app import Watchdog
from omni_watchdog.demo import send_request
from omni_watchdog.types import PIPELINE, EvidenceKind, StageRef, StageState

pytestmark = pytest.mark.e2e
STAGE_FIELDS = {
    "stage_id",
    "name",
    "replica",
    "state",
    "since",
    "evidence",
    "pids",
    "gpu_memory_bytes",
}


async def get(watchdog: Watchdog, path: str) -> tuple[int, Any]:
    url = f"http://127.0.0.1:{watchdog.api_port}{path}"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        if response.content_type == "application/json":
            return response.status, await response.json()
        return response.status, await response.text()


def test_status_target_health_and_incidents(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with attached(
            tmp_path, ["0:silent-stall"], "0.30", "observe", FAST, None, SIM_ENV
        ) as (watchdog, server):
            await wait_for(lambda: watchdog.state.report and watchdog.state.report.warmed_up, 30)
            await asyncio.sleep(1)
            code, text = await get(watchdog, "/v1/target/health")
            assert code == 200, text
            code, status = await get(watchdog, "/v1/status")
            assert code == 200
            assert [(s["stage_id"], s["replica"]) for s in status["stages"]] == [
                (ref.stage_id, ref.replica) for ref in watchdog.state.topology.refs()
            ]
            for stage in status["stages"]:
                assert set(stage) >= STAGE_FIELDS
                # A canary caught by a busy machine may show as slow for a moment: still live.
                assert stage["state"] in ("healthy", "degraded"), stage["evidence"]
                assert stage["pids"]
                assert stage["gpu_memory_bytes"] > 0
            assert status["target"]["pid"] == server.process.pid
            # A 0.30 replica process is its stage's engine: "stage" or "engine", by who says.
            roles = {p["role"] for p in status["processes"]}
            assert "api" in roles and roles & {"stage", "engine"}
            assert status["probes"]["health"]["up"] is True

            # Armed now, not at start: the canary is a request too and would fire it early.
            await with_fault(server, {"kind": "silent-stall", "stage": 0})
            asyncio.get_running_loop().create_task(send_request(server.url))
            await wait_for(lambda: watchdog.state.remediation.incidents, 30)
            code, text = await get(watchdog, "/v1/target/health")
            assert code == 503 and "stage 0.0 (thinker) stalled" in text
            code, status = await get(watchdog, "/v1/status")
            stage0 = status["stages"][0]
            assert stage0["state"] == "stalled"
            # A 0.30 stage's gauges freeze when it stalls: flat counters prove no queued work.
            assert {"heartbeat_lost", "canary_failed"} <= {e["kind"] for e in stage0["evidence"]}

            # The API serves the state of the last evaluation: wait for the one after the close.
            incident = await wait_for(
                lambda: next((i for i in watchdog.state.remediation.incidents if i.closed), None),
                20,
            )
            code, listing = await get(watchdog, "/v1/incidents")
            assert [i["incident_id"] for i in listing["incidents"]] == [incident.incident_id]
            assert listing["incidents"][0]["outcome"] == "observed"
            code, detail = await get(watchdog, f"/v1/incidents/{incident.incident_id}")
            assert code == 200 and detail["verdicts"][0]["stage"]["stage_id"] == 0
            assert {"incident.json", "spans.json", "gpu.json", "metrics.txt"} <= set(
                detail["files"]
            )
            assert any(f.startswith("stacks/") for f in detail["files"])
            code, _ = await get(watchdog, "/v1/incidents/no-such-incident")
            assert code == 404

    run_scenario(scenario())


ONE_STAGE = """\
stages:
  - stage_id: 0
    devices: "0"
    gpu_memory_utilization: 0.5
"""


def test_plain_single_stage_server_without_the_plugin(tmp_path: Path) -> None:
    """No spans at all: metrics, health, canary and processes have to be enough."""
    config = tmp_path / "one-stage.yaml"
    config.write_text(ONE_STAGE)

    async def scenario() -> None:
        async with attached(
            tmp_path,
            ["0:frozen-engine"],
            "0.30",
            "observe",
            FAST,
            None,
            {**SIM_ENV, "OMNI_WATCHDOG_OTLP_ENDPOINT": ""},
            config,
        ) as (watchdog, server):
            await wait_for(lambda: watchdog.state.report and watchdog.state.report.warmed_up, 30)
            asyncio.get_running_loop().create_task(send_request(server.url))
            incident = await wait_for(lambda: watchdog.state.remediation.incidents, 40)
            verdict = incident[0].verdicts[0]
            assert verdict.stage == StageRef(0) and verdict.state is StageState.STALLED
            kinds = {e.kind for e in verdict.evidence}
            assert EvidenceKind.PROCESS_STUCK in kinds
            assert kinds.isdisjoint({EvidenceKind.HEARTBEAT_LOST, EvidenceKind.SPAN_OVERDUE})
            assert watchdog.state.receiver.spans_accepted == 0

    run_scenario(scenario())


def test_without_the_plugin_a_stall_blames_no_stage_it_cannot_prove(tmp_path: Path) -> None:
    """0.30, the sidecar alone: a silent stall on the thinker leaves no heartbeat to lose,
    and the stage's gauges freeze, so only the canary says the target is stuck. The
    thinker or the target as a whole is judged and the server ended; the talker and
    code2wav, idle and fine, are never judged stalled for it."""
    neighbours = (StageRef(1), StageRef(2))
    seen: dict[StageRef, set[StageState]] = {ref: set() for ref in neighbours}

    async def note_states(watchdog: Watchdog) -> None:
        # Until the incident opens: once the ladder ends the server, every stage is dead
        # with it ("the server exited"), which is no verdict.
        while not (state := watchdog.state).remediation.incidents:
            report = state.report
            for status in report.statuses if report else ():
                if status.stage in seen:
                    seen[status.stage].add(status.state)
            await asyncio.sleep(0.05)

    async def scenario() -> Any:
        async with attached(
            tmp_path,
            [],
            "0.30",
            "enforce",
            FAST,
            None,
            {**SIM_ENV, "OMNI_WATCHDOG_OTLP_ENDPOINT": ""},
        ) as (watchdog, server):
            await warmed_up(watchdog)
            noting = asyncio.get_running_loop().create_task(note_states(watchdog))
            # Armed now, not at start: the canary is a request too and would fire it early.
            await with_fault(server, {"kind": "silent-stall", "stage": 0})
            in_background(server.url)
            incident = await incident_done(watchdog, 60)
            noting.cancel()
            assert watchdog.state.receiver.spans_accepted == 0
            return incident, server.leftover_pids()

    incident, leftovers = run_scenario(scenario())
    assert [v.stage for v in incident.verdicts] in ([StageRef(0)], [PIPELINE])
    assert incident.verdicts[0].state is StageState.STALLED
    assert EvidenceKind.CANARY_FAILED in {e.kind for e in incident.verdicts[0].evidence}
    for ref, states in seen.items():
        assert StageState.STALLED not in states and StageState.DEAD not in states, (ref, states)
    # Acted on all the same: a real hang is never left standing for want of a stage.
    assert incident.outcome in RECOVERED, steps_of(incident)
    assert not leftovers, f"processes left running: {leftovers}"
