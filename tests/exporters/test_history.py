"""The incident history: what the report's stage lanes and GPU chart are drawn from."""

from __future__ import annotations

import dataclasses
from typing import Any

from exporters.watchdog_state import scripted_state

from omni_watchdog.exporters.history import GPU_READINGS_KEPT, LOOK_BACK, IncidentHistory
from omni_watchdog.types import (
    DetectorReport,
    GpuDevice,
    GpuProcess,
    GpuReading,
    Incident,
    Mode,
    StageRef,
    StageState,
    StageStatus,
    WatchdogState,
)

TALKER = StageRef(1)


def state_at(
    base: WatchdogState,
    now: float,
    talker: StageState,
    held: float,
    closed: tuple[Incident, ...] = (),
) -> WatchdogState:
    """`base` made at `now` (monotonic = wall here), the talker in `talker` since `now`."""
    report = DetectorReport(now, True, (StageStatus(TALKER, "talker", talker, now, ()),), ())
    gpu = GpuReading(now, (GpuDevice(0, 1e9 + held, 2e10, None),), (GpuProcess(0, 41, held),))
    return dataclasses.replace(
        base,
        made_at=now,
        wall_at=now,
        report=report,
        gpu=gpu,
        remediation=dataclasses.replace(base.remediation, closed_now=closed),
    )


def test_a_closing_incident_gets_its_state_changes_and_gpu_memory_per_pid() -> None:
    base = scripted_state().state
    written: dict[tuple[str, str], Any] = {}
    history = IncidentHistory(
        lambda incident, name, value: written.update({(incident, name): value})
    )
    states = [
        (1000.0, StageState.HEALTHY, 7e9),
        (1000.5, StageState.HEALTHY, 7e9),  # within a second: not kept again
        (1300.0, StageState.STALLED, 7e9),
        (1301.0, StageState.STALLED, 7e9),
        (1305.0, StageState.DEAD, 0.0),
    ]
    for now, talker, held in states:
        history.export(state_at(base, now, talker, held))
    incident = Incident("i1", "http://server", Mode.ENFORCE, 1300.0, "stalled", closed=1306.0)
    history.export(state_at(base, 1306.0, StageState.DEAD, 0.0, (incident,)))

    changes = written[("i1", "states.json")]
    # The state it was in when the window opens, then every change within it.
    assert [(c["time"], c["state"]) for c in changes] == [
        (1000.0, "healthy"),
        (1300.0, "stalled"),
        (1305.0, "dead"),
    ]
    assert {c["stage"] for c in changes} == {"1.0"} and changes[0]["name"] == "talker"
    readings = written[("i1", "gpu-timeline.json")]
    assert all(1300.0 - LOOK_BACK <= r["time"] <= 1306.0 for r in readings)
    assert [r["pids"]["41"] for r in readings] == [7e9, 7e9, 0.0, 0.0]
    assert readings[0]["devices"] == {"0": 1e9 + 7e9}


def test_the_history_is_bounded() -> None:
    base = scripted_state().state
    history = IncidentHistory(lambda *_: None)
    for second in range(GPU_READINGS_KEPT + 500):
        state = StageState.HEALTHY if second % 2 else StageState.DEGRADED
        history.export(state_at(base, float(second), state, 1e9))
    assert len(history.changes(0.0, 1e9)) <= 4096
    assert len(history._readings) == GPU_READINGS_KEPT
