"""A hand-built incident and bundle for the HTML report's tests, shaped like a real one.

The shapes follow what the policy writes: the incident through `to_jsonable`, verdict and
evidence times on the monotonic clock, which the incident read as it opened
(`opened_monotonic`), the timeline holding their wall times, and py-spy dump output under
the capture step's "# pid" header.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from omni_watchdog.jsonable import to_jsonable
from omni_watchdog.types import (
    Evidence,
    EvidenceKind,
    GpuDevice,
    GpuProcess,
    GpuReading,
    Incident,
    IncidentOutcome,
    Mode,
    ProcessInfo,
    ProcessRole,
    ProcessStatus,
    StageRef,
    StageState,
    StepName,
    StepOutcome,
    StepResult,
    Verdict,
)

OPENED = 1_796_343_429.75
# The monotonic time the verdict was reached, and how far the wall clock is ahead of it.
VERDICT_MONOTONIC = 33_730.5
WALL_AHEAD = OPENED - VERDICT_MONOTONIC
MIB = 2**20

API_PID, STAGE_PID, ENGINE_PID = 4100, 4101, 4102

# (step, outcome, offset from the opening, duration): a hang that only SIGKILL ended.
LADDER = (
    (StepName.CAPTURE, StepOutcome.OK, 0.01, 2.09),
    (StepName.SHUTDOWN, StepOutcome.TIMEOUT, 2.31, 1.0),
    (StepName.TERMINATE, StepOutcome.NOT_RECOVERED, 3.31, 3.06),
    (StepName.KILL, StepOutcome.RECOVERED, 6.37, 0.0),
    (StepName.VERIFY, StepOutcome.OK, 6.38, 0.004),
)


def sample_incident(**changes: Any) -> dict[str, Any]:
    """An enforced incident on stage 1.0 that the kill step recovered, as JSON."""
    stage = StageRef(1, 0)
    evidence = (
        Evidence(EvidenceKind.PROCESS_EXIT, stage, VERDICT_MONOTONIC - 2.8, "engine exited"),
        Evidence(EvidenceKind.HEARTBEAT_LOST, stage, VERDICT_MONOTONIC - 0.1, "no heartbeat"),
    )
    steps = tuple(
        StepResult(step, outcome, OPENED + offset, duration, f"{step.value} detail", (4100, 4101))
        for step, outcome, offset, duration in LADDER
    )
    released = steps[-1].started + steps[-1].duration
    fields: dict[str, Any] = {
        "incident_id": "20261204T001709Z-637b24",
        "target": "http://127.0.0.1:8000",
        "mode": Mode.ENFORCE,
        "opened": OPENED,
        "cause": "stage 1.0 dead",
        "verdicts": (Verdict(stage, StageState.DEAD, VERDICT_MONOTONIC, evidence),),
        "steps": steps,
        "outcome": IncidentOutcome.RECOVERED_BY_KILL,
        "closed": released + 0.01,
        "bundle_dir": "incidents/20261204T001709Z-637b24",
        "timeline": {
            "first_evidence": VERDICT_MONOTONIC - 2.8 + WALL_AHEAD,
            "verdict": VERDICT_MONOTONIC + WALL_AHEAD,
            "opened": OPENED,
            "released": released,
            "closed": released + 0.01,
        },
        "opened_monotonic": OPENED - WALL_AHEAD,
    }
    fields.update(changes)
    jsonable = to_jsonable(Incident(**fields))
    assert isinstance(jsonable, dict)
    return jsonable


def processes(api_title: str = "python -m vllm.entrypoints.openai.api_server") -> list[Any]:
    rows = [
        ProcessInfo(
            API_PID, OPENED - 60, 1, API_PID, API_PID, api_title, ProcessStatus.SLEEPING, 12.5,
            ProcessRole.API,
        ),
        ProcessInfo(
            STAGE_PID, OPENED - 59, API_PID, API_PID, API_PID, "SpawnProcess-2",
            ProcessStatus.SLEEPING, 3.0, ProcessRole.STAGE, StageRef(1, 0),
        ),
        ProcessInfo(
            ENGINE_PID, OPENED - 58, STAGE_PID, API_PID, API_PID, "VLLM::EngineCore",
            ProcessStatus.EXITED, 40.0, ProcessRole.ENGINE, StageRef(1, 0),
        ),
    ]  # fmt: skip
    jsonable = to_jsonable(rows)
    assert isinstance(jsonable, list)
    return jsonable


def py_spy_dump(pid: int, title: str, frames: int = 3) -> str:
    """A `py-spy dump` as the capture step saves it: its header, then the tool's output."""
    main = "\n".join(f"    frame_{i} (module.py:{i + 1})" for i in range(frames))
    return (
        f"# pid {pid} {title} (stage, stage 1.0)\n"
        f"Process {pid}: {title}\n"
        "Python v3.11.7 (/usr/bin/python3.11)\n\n"
        f'Thread {pid} (idle): "MainThread"\n{main}\n'
        f'Thread {pid + 7} (idle): "QueueFeederThread"\n'
        "    Condition.wait (threading.py:327)\n"
        "    Queue._feed (multiprocessing/queues.py:231)\n"
    )


def states() -> list[dict[str, Any]]:
    return [
        {"time": OPENED - 3.0, "stage": "0.0", "name": "thinker", "state": "healthy"},
        {"time": OPENED - 3.0, "stage": "1.0", "name": "talker", "state": "healthy"},
        {"time": OPENED - 2.8, "stage": "1.0", "name": "talker", "state": "degraded"},
        {"time": OPENED - 0.01, "stage": "1.0", "name": "talker", "state": "dead"},
        {"time": OPENED + 6.4, "stage": "1.0", "name": "talker", "state": "unknown"},
    ]


def gpu_timeline() -> list[dict[str, Any]]:
    """Readings each second; the stage's 512 MiB and the engine's 1 GiB go at the kill."""
    readings = []
    for second in range(9):
        held = second < 7
        pids = {str(STAGE_PID): 512 * MIB, str(ENGINE_PID): 1024 * MIB} if held else {}
        readings.append(
            {
                "time": OPENED + second,
                "pids": pids,
                "devices": {"0": (1600 if held else 64) * MIB},
            }
        )
    return readings


def gpu_snapshot() -> Any:
    reading = GpuReading(
        VERDICT_MONOTONIC,
        (GpuDevice(0, 1600 * MIB, 24576 * MIB, 0.0),),
        (GpuProcess(0, STAGE_PID, 512 * MIB, StageRef(1, 0)),),
    )
    return to_jsonable(reading)


def sample_files(
    incident: dict[str, Any] | None = None, replace: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Every file a bundle can hold, with the two timelines; `replace` overrides by name."""
    files = {
        "incident.json": json.dumps(incident or sample_incident()),
        "processes.json": json.dumps(processes()),
        "gpu.json": json.dumps(gpu_snapshot()),
        "spans.json": json.dumps(
            {"ring_size": 256, "stages": {"1.0": [{"stage_name": "talker"}]}, "pids": {}}
        ),
        f"stacks/{API_PID}.txt": py_spy_dump(API_PID, "python -m vllm"),
        f"stacks/{STAGE_PID}.txt": py_spy_dump(STAGE_PID, "SpawnProcess-2", frames=20),
        "health.txt": "timeout\n",
        "metrics.txt": "HTTP 200\n# HELP vllm:num_requests_running\n",
        "states.json": json.dumps(states()),
        "gpu-timeline.json": json.dumps(gpu_timeline()),
    }
    files.update(replace or {})
    return files
