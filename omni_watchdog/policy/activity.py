"""The activity readings behind a stalled verdict's cause, as one bounded file of its bundle.

A verdict names its cause in words ("cc1plus pid 123: stopped (T)"); the readings it was
found from (each thread's kernel state, wait channel and CPU times, the descendants, the
Python frames sampled) are what an operator checks those words against. The detector keeps
them only while the stage stays silent, so they are written as the incident opens, from
the evaluation that gave the verdict.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from omni_watchdog.jsonable import to_jsonable
from omni_watchdog.types import ProcessActivity, ProcessReadings, StageRef, Verdict

ACTIVITY_FILE = "activity.json"
# One reading of a process with hundreds of threads, each with its frames, takes hundreds
# of KiB, and a stage keeps up to ten sampled readings of each of its processes. The file
# keeps every process's latest reading first, then the sampled ones, newest first, while
# they fit; well under what the incident report reads of one bundle file (4 MiB).
MAX_ACTIVITY_BYTES = 2**20
# The bundle's JSON is indented by 2 per level, and a reading sits 5 levels down
# (document, stages, stage, processes, process, readings): each of its lines grows by this.
_READING_INDENT = 2 * 5


def activity_document(
    verdicts: Sequence[Verdict],
    readings_of: Callable[[StageRef], Sequence[ProcessReadings]],
    limit: int = MAX_ACTIVITY_BYTES,
) -> dict[str, Any] | None:
    """Per verdict that names a cause, that cause and the readings of each process of the
    stage, with the number left out to stay within about `limit` bytes; None when no
    verdict names a cause."""
    named = [verdict for verdict in verdicts if verdict.cause is not None]
    if not named:
        return None
    stages: list[dict[str, Any]] = []
    # Every process's latest reading goes in before any sampled one: it is what the cause
    # was found from last. Then the samples, the newest of every process first.
    latest: list[tuple[list[Any], ProcessActivity]] = []
    sampled: list[tuple[list[Any], ProcessActivity]] = []
    for verdict in named:
        processes = []
        for process in readings_of(verdict.stage):
            kept: list[Any] = []
            latest.append((kept, process.latest))
            sampled += (
                (kept, reading) for reading in process.sampled if reading is not process.latest
            )
            processes.append(
                {
                    "pid": process.latest.pid,
                    "cause": None if process.cause is None else process.cause.value,
                    "working": process.working,
                    "detail": process.detail,
                    "readings": kept,
                }
            )
        stages.append(
            {
                "stage": str(verdict.stage),
                "cause": to_jsonable(verdict.cause),
                "processes": processes,
            }
        )
    sampled.sort(key=lambda entry: entry[1].time, reverse=True)
    room = limit
    left_out = 0
    for kept, reading in (*latest, *sampled):
        shown = to_jsonable(reading)
        text = json.dumps(shown, indent=2)
        size = len(text) + text.count("\n") * _READING_INDENT
        if size > room:
            left_out += 1
            continue
        room -= size
        kept.append(shown)
    for process in (p for stage in stages for p in stage["processes"]):
        process["readings"].sort(key=lambda reading: reading["time"])
    return {"stages": stages, "readings_left_out": left_out, "limit_bytes": limit}
