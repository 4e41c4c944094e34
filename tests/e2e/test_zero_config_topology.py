"""Without a stage config the watchdog learns the simulated server's stages as it runs."""

from __future__ import annotations

from pathlib import Path

import pytest
from deadline import wait_for
from e2e.harness import FAST, SIM_ENV, attached, run_scenario
from e2e.test_watchdog_api import get

from omni_watchdog.demo import demo_config
from omni_watchdog.sim.launcher import example_config
from omni_watchdog.types import TopologyOrigin

pytestmark = pytest.mark.e2e
NAMES = ["thinker", "talker", "code2wav"]


@pytest.mark.parametrize(
    ("generation", "origin", "source_prefix"),
    [
        # The plugin-equivalent telemetry of the 0.30 orchestrator reports its pipeline.
        ("0.30", TopologyOrigin.PLUGIN, "plugin"),
        # 0.11 reports nothing: the stage config on the server's command line is read.
        ("0.11", TopologyOrigin.SERVER_CONFIG, "cmdline:"),
    ],
)
def test_status_shows_the_servers_stages_and_where_they_came_from(
    tmp_path: Path, generation: str, origin: TopologyOrigin, source_prefix: str
) -> None:
    async def scenario() -> None:
        no_stage_config = {**FAST, "stage_config": ""}
        config = demo_config(
            tmp_path, "http://127.0.0.1:9", example_config(generation), "observe", no_stage_config
        )
        assert config.stage_config == ""
        async with attached(
            tmp_path, [], generation, "observe", no_stage_config, None, SIM_ENV
        ) as (watchdog, _):
            await wait_for(lambda: watchdog.state.topology.origin is origin, 30)
            await wait_for(lambda: watchdog.state.report and watchdog.state.report.warmed_up, 30)
            code, status = await get(watchdog, "/v1/status")
            assert code == 200
            topology = status["topology"]
            assert topology["source"].startswith(source_prefix)
            assert [s["name"] for s in topology["stages"]] == NAMES
            replicas = [s["replicas"] for s in topology["stages"]]
            assert replicas == ([1, 2, 1] if generation == "0.30" else [1, 1, 1])
            served = [(s["stage_id"], s["replica"], s["name"]) for s in status["stages"]]
            assert served == [
                (stage["stage_id"], replica, stage["name"])
                for stage in topology["stages"]
                for replica in range(stage["replicas"])
            ]
            assert all(s["pids"] for s in status["stages"])

    run_scenario(scenario())
