"""`omni-watchdog demo`, the command `make demo` runs, as a user sees it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from ports import free_port

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(
    ("fault", "generation"),
    [("1:engine-dead-exit", "0.30"), ("1:stage-dead-503", "0.11"), ("1:no-such-fault", "0.11")],
)
def test_a_fault_the_demo_cannot_inject_is_one_line_and_exit_2(fault: str, generation: str) -> None:
    command = [sys.executable, "-m", "omni_watchdog.cli", "demo", "--fault", fault]
    command += ["--model-generation", generation]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith(f"omni-watchdog demo: --fault {fault}: ")
    assert len(done.stderr.splitlines()) == 1, done.stderr


def test_the_demo_prints_the_timeline_and_exits_0_once_memory_is_released() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "omni_watchdog.cli", "demo", "--json", "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # The timeline is the whole output: the watchdog's log goes to a file.
    assert done.stderr == ""
    lines = done.stdout.splitlines()
    # Offsets are right-aligned: "+9.55s" and "+10.01s" start at different columns.
    labels = [line.split()[1] for line in lines if re.match(r"\s+\+\d+\.\d+s ", line)]
    for label in ("fault", "verdict", "capture", "shutdown", "terminate", "kill", "verify"):
        assert label in labels, done.stdout
    assert labels.index("fault") < labels.index("verdict") < labels.index("kill")
    assert labels[-1] == "released"
    summary = json.loads(lines[-1])
    assert summary["outcome"] == "recovered_by_kill"
    assert 0 < summary["fault_to_verdict_s"] < summary["fault_to_released_s"]
    bundle = Path(next(line.split()[1] for line in lines if line.split()[:1] == ["bundle"]))
    assert (bundle / "incident.json").is_file()
    log = Path(next(line.split()[1] for line in lines if line.split()[:1] == ["log"]))
    events = [json.loads(line)["event"] for line in log.read_text().splitlines()]
    assert "watchdog_started" in events and "incident_closed" in events
