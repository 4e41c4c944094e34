"""`omni-watchdog run` as a user starts it, and re-attachment to a restarted server."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from e2e.harness import FAST, SIM_ENV, in_background, incident_done, warmed_up

from omni_watchdog.demo import SimProcess, attached, example_config, free_port, wait_for
from omni_watchdog.types import IncidentOutcome, StageState

pytestmark = pytest.mark.e2e


def get_json(url: str) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return json.loads(response.read())
    except OSError:
        return None


def test_run_command_attaches_and_stops_on_sigterm(tmp_path: Path) -> None:
    server = SimProcess.start(tmp_path, [], "0.11")
    api = free_port()
    watchdog = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "omni_watchdog.cli",
            "run",
            "--target",
            server.url,
            "--stage-config",
            str(example_config("0.11")),
            "--listen",
            f"127.0.0.1:{api}",
            "--otlp-listen",
            f"127.0.0.1:{free_port()}",
            "--mode",
            "observe",
            "--gpu-backend",
            "none",
            "--state-dir",
            str(tmp_path / "watchdog"),
            "--set",
            "detection.startup_grace=1s",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 40
        status = None
        while time.monotonic() < deadline:
            status = get_json(f"http://127.0.0.1:{api}/v1/status")
            if status and status["target"]["warmed_up"]:
                break
            time.sleep(0.25)
        assert status is not None and status["target"]["pid"] == server.process.pid
        assert [s["name"] for s in status["stages"]] == ["thinker", "talker", "code2wav"]
        assert status["probes"]["gpu"]["up"] is False  # no NVML: reported, the rest goes on
        watchdog.send_signal(signal.SIGTERM)
        assert watchdog.wait(timeout=15) == 0
        log = watchdog.stderr.read() if watchdog.stderr else ""
        events = [json.loads(line)["event"] for line in log.splitlines() if line.startswith("{")]
        assert "watchdog_started" in events and "attached" in events
    finally:
        if watchdog.poll() is None:
            watchdog.kill()
            watchdog.wait()
        server.stop()


def test_a_crashed_server_is_recorded_and_its_successor_attached(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with attached(
            tmp_path, ["1:engine-dead-exit"], "0.11", "enforce", FAST, None, SIM_ENV
        ) as (watchdog, server):
            await warmed_up(watchdog)
            in_background(server.url)
            incident = await incident_done(watchdog)
            assert incident.outcome is IncidentOutcome.CRASHED
            first_pid = server.process.pid
            successor = SimProcess.start(
                tmp_path / "successor", [], "0.11", env=server.env, port=server.port
            )
            try:
                await wait_for(lambda: watchdog.tracker.generation == 2, 30)
                assert watchdog.tracker.root.pid == successor.process.pid != first_pid
                await warmed_up(watchdog)
                await wait_for(
                    lambda: all(
                        s.state is StageState.HEALTHY for s in watchdog.last_report.statuses
                    ),
                    20,
                )
                assert len(watchdog.policy.incidents()) == 1
            finally:
                successor.stop()

    asyncio.run(scenario())
