"""The minutes around an incident, for its report: stage state changes and GPU memory per
pid, kept from the states the evaluation loop pushes and written into the bundle of each
incident as it closes (`states.json`, `gpu-timeline.json`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from omni_watchdog.types import Incident, StageRef, StageState, WatchdogState

# Bounded whatever the server does: a flapping stage makes at most this many changes kept,
# and GPU memory is kept once a second for an hour.
STATE_CHANGES_KEPT = 4096
GPU_READINGS_KEPT = 3600
GPU_READING_EVERY = 1.0
# How far before an incident opened its report looks: the verdict's evidence goes back a
# confirmation window and more.
LOOK_BACK = 120.0


class IncidentHistory:
    """An exporter that remembers, and writes each closing incident's share of it."""

    def __init__(self, write_json: Callable[[str, str, object], None]) -> None:
        """`write_json(incident_id, name, value)` writes a file into the incident's bundle."""
        self._write_json = write_json
        self._changes: deque[dict[str, Any]] = deque(maxlen=STATE_CHANGES_KEPT)
        self._last_state: dict[StageRef, StageState] = {}
        self._readings: deque[dict[str, Any]] = deque(maxlen=GPU_READINGS_KEPT)

    def export(self, state: WatchdogState) -> None:
        if state.report is not None:
            for status in state.report.statuses:
                if self._last_state.get(status.stage) is not status.state:
                    self._last_state[status.stage] = status.state
                    self._changes.append(
                        {
                            "time": state.wall(status.since),
                            "stage": str(status.stage),
                            "name": status.name,
                            "state": status.state.value,
                        }
                    )
        reading = state.gpu
        if reading is not None:
            wall = state.wall(reading.time)
            if not self._readings or wall - self._readings[-1]["time"] >= GPU_READING_EVERY:
                self._readings.append(
                    {
                        "time": wall,
                        "pids": {str(pid): used for pid, used in reading.used_by_pid.items()},
                        "devices": {
                            str(device): used for device, used in reading.used_by_device.items()
                        },
                    }
                )
        for incident in state.remediation.closed_now:
            self._write(incident)

    def _write(self, incident: Incident) -> None:
        start = incident.opened - LOOK_BACK
        end = incident.closed or incident.opened
        self._write_json(incident.incident_id, "states.json", self.changes(start, end))
        readings = [r for r in self._readings if start <= r["time"] <= end]
        self._write_json(incident.incident_id, "gpu-timeline.json", readings)

    def changes(self, start: float, end: float) -> list[dict[str, Any]]:
        """The changes between `start` and `end`, after each stage's state at `start`."""
        before: dict[str, dict[str, Any]] = {}
        during = []
        for change in self._changes:
            if change["time"] < start:
                before[change["stage"]] = change
            elif change["time"] <= end:
                during.append(change)
        return [*before.values(), *during]
