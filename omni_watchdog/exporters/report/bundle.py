"""One incident read for its report: the incident's JSON form (`to_jsonable`), the files
of its bundle (docs/design.md, "Remediation ladder") and the operator actions journaled
for it, as typed records.

Everything in a bundle is untrusted (stack frames, process titles and causes come from the
served processes) and may come from an older or broken watchdog: every field is read
tolerantly (`tolerant_json`), and a missing or malformed file is a problem its own section
reports, never an exception.

Times are read on the clock the policy records them on, never guessed from their size: the
incident's, its steps', its timeline's and the history files' times are wall-clock times,
and the verdicts' and their evidence's are monotonic ones, placed on the wall clock by the
clock pair the incident recorded as it opened (`Incident.opened_monotonic`). An incident
written before that pair was recorded has none: its verdict and evidence times stay
unknown (shown with their raw monotonic value), and its timeline's wall-clock `verdict`
moment still places its verdicts on the drawing.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from omni_watchdog.semconv import (
    DENOISE_STEP_COUNT,
    DENOISE_STEP_INDEX,
    DENOISE_STEP_SECONDS,
    DENOISE_STEP_SPAN,
    DIFFUSION_REQUEST_SPAN,
)
from omni_watchdog.tolerant_json import items, mapping, mappings, number
from omni_watchdog.types import PIPELINE, StageRef

# The last second a datetime holds (9999-12-31T23:59:59Z): a later "time" is none a page
# can print or place on an axis.
_LATEST_WALL_TIME = 253_402_300_799.0


@dataclass(frozen=True)
class Loaded:
    """A bundle file parsed as JSON, or why it could not be."""

    value: Any
    problem: str = ""

    @property
    def ok(self) -> bool:
        return not self.problem


def file_text(files: Mapping[str, object], name: str) -> str | None:
    """A bundle file's text; bytes are decoded leniently, anything else is unreadable."""
    content = files.get(name)
    if isinstance(content, bytes):
        return content.decode("utf-8", errors="replace")
    return content if isinstance(content, str) else None


def load_json(files: Mapping[str, object], name: str) -> Loaded:
    if name not in files:
        return Loaded(None, f"{name} is not in the bundle")
    text_of_file = file_text(files, name)
    if text_of_file is None:
        return Loaded(None, f"{name} could not be read as text")
    try:
        return Loaded(json.loads(text_of_file))
    except (ValueError, RecursionError) as error:
        return Loaded(None, f"{name} is not valid JSON ({error})")


def wall_time(value: object) -> float | None:
    """A wall-clock time in epoch seconds that a page can show, or None."""
    time = number(value)
    return time if time is not None and 0.0 <= time <= _LATEST_WALL_TIME else None


def text(value: object) -> str:
    """Any value as the page shows it; "" for none."""
    if value is None:
        return ""
    return value if isinstance(value, str) else str(value)


def stage_text(value: object) -> str:
    """A stage as `to_jsonable` writes a StageRef (or as "1.0" already), "" when none;
    `PIPELINE` (the target, no stage proved the one) as "pipeline"."""
    if isinstance(value, Mapping):
        stage_id, replica = value.get("stage_id"), value.get("replica", 0)
        if stage_id is None:
            return ""
        if isinstance(stage_id, int) and StageRef(stage_id).whole_pipeline:
            return str(PIPELINE)
        return f"{text(stage_id)}.{text(replica)}"
    return text(value)


def pid_number(pid: str) -> int | None:
    """A pid written in ASCII digits (a file name, a key), or None."""
    if not (pid.isascii() and pid.isdigit()):
        return None
    try:
        return int(pid)
    except ValueError:  # more digits than Python converts: no pid
        return None


# ---------------------------------------------------------------------------------------
# The incident.


@dataclass(frozen=True)
class Step:
    """One ladder step as the incident recorded it."""

    name: str
    outcome: str
    started: float | None
    duration: float | None
    detail: str
    targets: tuple[str, ...]

    @property
    def span(self) -> float:
        """Its length on the timeline: an unknown or negative duration is an instant."""
        return max(0.0, self.duration or 0.0)


@dataclass(frozen=True)
class EvidenceItem:
    """One reason behind a verdict; `since` as recorded (monotonic), `since_wall` placed."""

    kind: str
    since: float | None
    since_wall: float | None
    detail: str


@dataclass(frozen=True)
class SilenceCauseItem:
    """What a stalled stage was doing when judged."""

    cause: str
    working: bool
    detail: str


@dataclass(frozen=True)
class VerdictItem:
    """A verdict; `time` as recorded (monotonic), `wall` placed on the wall clock."""

    stage: str
    state: str
    time: float | None
    wall: float | None
    evidence: tuple[EvidenceItem, ...]
    cause: SilenceCauseItem | None


@dataclass(frozen=True)
class IncidentRecord:
    """The incident's fields, each read tolerantly; times on the wall clock."""

    incident_id: str
    target: str
    mode: str
    outcome: str
    cause: str
    opened: float | None
    closed: float | None
    crashed: bool
    bundle_dir: str
    # The timeline's moments, in time order.
    moments: tuple[tuple[str, float], ...]
    steps: tuple[Step, ...]
    verdicts: tuple[VerdictItem, ...]

    @classmethod
    def read(cls, incident: Mapping[str, Any]) -> IncidentRecord:
        opened = wall_time(incident.get("opened"))
        opened_monotonic = number(incident.get("opened_monotonic"))

        def on_wall_clock(monotonic_time: float | None) -> float | None:
            if monotonic_time is None or opened is None or opened_monotonic is None:
                return None
            return wall_time(opened - (opened_monotonic - monotonic_time))

        moments = sorted(
            (
                (text(key), time)
                for key, value in mapping(incident.get("timeline")).items()
                if (time := wall_time(value)) is not None
            ),
            key=lambda moment: moment[1],
        )
        return cls(
            incident_id=text(incident.get("incident_id")),
            target=text(incident.get("target")),
            mode=text(incident.get("mode")),
            outcome=text(incident.get("outcome")),
            cause=text(incident.get("cause")),
            opened=opened,
            closed=wall_time(incident.get("closed")),
            crashed=incident.get("crashed") is True,
            bundle_dir=text(incident.get("bundle_dir")),
            moments=tuple(moments),
            steps=tuple(_step(step) for step in mappings(incident.get("steps"))),
            verdicts=tuple(
                _verdict(verdict, on_wall_clock) for verdict in mappings(incident.get("verdicts"))
            ),
        )


def _step(step: Mapping[str, Any]) -> Step:
    return Step(
        name=text(step.get("step")),
        outcome=text(step.get("outcome")),
        started=wall_time(step.get("started")),
        duration=number(step.get("duration")),
        detail=text(step.get("detail")),
        targets=tuple(text(target) for target in items(step.get("targets"))),
    )


def _verdict(
    verdict: Mapping[str, Any], on_wall_clock: Callable[[float | None], float | None]
) -> VerdictItem:
    time = number(verdict.get("time"))
    evidence = []
    for item in items(verdict.get("evidence")):
        reason = mapping(item)
        since = number(reason.get("since"))
        evidence.append(
            EvidenceItem(
                kind=text(reason.get("kind")),
                since=since,
                since_wall=on_wall_clock(since),
                detail=text(reason.get("detail")),
            )
        )
    cause = mapping(verdict.get("cause"))
    return VerdictItem(
        stage=stage_text(verdict.get("stage")),
        state=text(verdict.get("state")),
        time=time,
        wall=on_wall_clock(time),
        evidence=tuple(evidence),
        cause=SilenceCauseItem(
            text(cause.get("cause")), bool(cause.get("working")), text(cause.get("detail"))
        )
        if cause
        else None,
    )


@dataclass(frozen=True)
class Action:
    """An operator action journaled for the incident; `time` on the wall clock."""

    time: float | None
    action: str
    outcome: str
    detail: str


def _actions(actions: object) -> tuple[Action, ...]:
    listed = actions if isinstance(actions, Sequence) else ()
    return tuple(
        Action(
            wall_time(action.get("time")),
            text(action.get("action")),
            text(action.get("outcome")),
            text(action.get("detail")),
        )
        for action in listed
        if isinstance(action, Mapping)
    )


# ---------------------------------------------------------------------------------------
# The bundle's files read by every section.


@dataclass(frozen=True)
class ProcessRow:
    """One process of processes.json; `started` on the wall clock."""

    pid: str
    ppid: str
    pgid: str
    role: str
    stage: str
    status: str
    cpu_seconds: float | None
    started: float | None
    orphaned: bool
    title: str


@dataclass(frozen=True)
class Processes:
    """processes.json by pid, with why it is unusable when it is."""

    by_pid: Mapping[int, ProcessRow] = field(default_factory=dict)
    rows: tuple[ProcessRow, ...] = ()
    problem: str = ""
    skipped: int = 0

    @classmethod
    def read(cls, files: Mapping[str, object]) -> Processes:
        loaded = load_json(files, "processes.json")
        if not loaded.ok:
            return cls(problem=loaded.problem)
        if not isinstance(loaded.value, list):
            return cls(problem="processes.json is malformed: expected a list of processes")
        entries = mappings(loaded.value)
        rows = tuple(
            ProcessRow(
                pid=text(row.get("pid")),
                ppid=text(row.get("ppid")),
                pgid=text(row.get("pgid")),
                role=text(row.get("role")),
                stage=stage_text(row.get("stage")),
                status=text(row.get("status")),
                cpu_seconds=number(row.get("cpu_seconds")),
                started=wall_time(row.get("create_time")),
                orphaned=row.get("orphaned") is True,
                title=text(row.get("title")),
            )
            for row in entries
        )
        by_pid = {
            int(pid): row
            for entry, row in zip(entries, rows, strict=True)
            if (pid := number(entry.get("pid"))) is not None
        }
        return cls(by_pid, rows, "", len(loaded.value) - len(rows))

    def describe(self, pid: int | None) -> str:
        """Role, stage and title of a pid, as far as processes.json knows it."""
        row = self.by_pid.get(pid) if pid is not None else None
        if row is None:
            return ""
        parts = [row.role]
        if row.stage:
            parts.append(f"stage {row.stage}")
        described = ", ".join(part for part in parts if part)
        return f"{described}: {row.title}" if described and row.title else described or row.title


@dataclass(frozen=True)
class StateChange:
    time: float
    stage: str
    name: str
    state: str


@dataclass(frozen=True)
class GpuPoint:
    time: float
    pids: Mapping[str, float]
    devices: Mapping[str, float]


def _state_changes(value: Any) -> tuple[list[StateChange], int]:
    """states.json's usable entries in time order, and how many were not usable."""
    entries = items(value)
    changes = []
    for entry in entries:
        row = mapping(entry)
        time = wall_time(row.get("time"))
        stage, state = stage_text(row.get("stage")), text(row.get("state"))
        if time is not None and stage and state:
            changes.append(StateChange(time, stage, text(row.get("name")), state))
    return sorted(changes, key=lambda c: c.time), len(entries) - len(changes)


def _bytes_by_key(value: Any) -> dict[str, float]:
    return {
        text(key): used for key, raw in mapping(value).items() if (used := number(raw)) is not None
    }


def _gpu_points(value: Any) -> tuple[list[GpuPoint], int]:
    """gpu-timeline.json's usable readings in time order, and how many were not usable."""
    entries = items(value)
    points = []
    for entry in entries:
        row = mapping(entry)
        time = wall_time(row.get("time"))
        if time is not None:
            points.append(
                GpuPoint(time, _bytes_by_key(row.get("pids")), _bytes_by_key(row.get("devices")))
            )
    return sorted(points, key=lambda p: p.time), len(entries) - len(points)


def _stage_names(changes: list[StateChange], files: Mapping[str, object]) -> dict[str, str]:
    """Stage names from states.json, else from the stage spans the capture step saved."""
    names: dict[str, str] = {}
    spans = load_json(files, "spans.json")
    for stage, recent in mapping(mapping(spans.value).get("stages")).items():
        for span in items(recent):
            name = text(mapping(span).get("stage_name"))
            if name:
                names[text(stage)] = name
                break
    for change in changes:
        if change.name:
            names[change.stage] = change.name
    return names


@dataclass(frozen=True)
class BundleReading:
    """The incident and its bundle, read once and tolerantly, with the page's clock."""

    incident: IncidentRecord
    files: Mapping[str, object]
    actions: tuple[Action, ...]
    processes: Processes
    stage_names: dict[str, str]
    states: Loaded
    state_changes: list[StateChange]
    states_skipped: int
    gpu_timeline: Loaded
    gpu_points: list[GpuPoint]
    gpu_skipped: int

    @classmethod
    def read(
        cls,
        incident: Mapping[str, Any],
        files: Mapping[str, object],
        actions: Sequence[Mapping[str, Any]],
    ) -> BundleReading:
        # The caller's incident wins; incident.json fills in what it lacks.
        from_file = load_json(files, "incident.json")
        merged = {**mapping(from_file.value), **mapping(incident)}
        states = load_json(files, "states.json")
        changes, states_skipped = _state_changes(states.value) if states.ok else ([], 0)
        gpu_timeline = load_json(files, "gpu-timeline.json")
        points, gpu_skipped = _gpu_points(gpu_timeline.value) if gpu_timeline.ok else ([], 0)
        return cls(
            incident=IncidentRecord.read(merged),
            files=files,
            actions=_actions(actions),
            processes=Processes.read(files),
            stage_names=_stage_names(changes, files),
            states=states,
            state_changes=changes,
            states_skipped=states_skipped,
            gpu_timeline=gpu_timeline,
            gpu_points=points,
            gpu_skipped=gpu_skipped,
        )

    def reference(self) -> float | None:
        """What offsets are measured from: the opening, else the earliest time known."""
        if self.incident.opened is not None:
            return self.incident.opened
        times = self.known_times()
        return min(times) if times else None

    def known_times(self) -> list[float]:
        incident = self.incident
        times = [time for _, time in incident.moments]
        times.extend(time for time in (incident.opened, incident.closed) if time is not None)
        for step in incident.steps:
            if step.started is not None:
                times.append(step.started)
                times.append(step.started + step.span)
        times.extend(verdict.wall for verdict in incident.verdicts if verdict.wall is not None)
        times.extend(change.time for change in self.state_changes)
        times.extend(point.time for point in self.gpu_points)
        return times

    def stage_label(self, stage: str) -> str:
        name = self.stage_names.get(stage, "")
        return f"{stage} {name}" if name else stage


# ---------------------------------------------------------------------------------------
# The files only one section reads: read inside that section, so that a shape nobody
# foresaw costs that section alone.


@dataclass(frozen=True)
class GpuDeviceRow:
    index: str
    used: float | None
    total: float | None
    utilization: float | None


@dataclass(frozen=True)
class GpuHolder:
    device: str
    pid: str
    pid_number: int | None
    stage: str
    used: float | None


@dataclass(frozen=True)
class GpuSnapshot:
    """gpu.json: the one reading the capture step took."""

    devices: tuple[GpuDeviceRow, ...]
    holders: tuple[GpuHolder, ...]


def read_gpu_snapshot(files: Mapping[str, object]) -> GpuSnapshot | str:
    """gpu.json's reading, or what to say instead of it."""
    loaded = load_json(files, "gpu.json")
    if not loaded.ok:
        return loaded.problem if "gpu.json" in files else "no GPU readings"
    if loaded.value is None:
        return "no GPU readings: NVML was not available at capture"
    if not isinstance(loaded.value, Mapping):
        return "gpu.json is malformed: expected a reading"
    devices = []
    for item in items(loaded.value.get("devices")):
        device = mapping(item)
        devices.append(
            GpuDeviceRow(
                text(device.get("index")),
                number(device.get("used_bytes")),
                number(device.get("total_bytes")),
                number(device.get("utilization")),
            )
        )
    holders = []
    for item in items(loaded.value.get("processes")):
        held = mapping(item)
        pid = number(held.get("pid"))
        holders.append(
            GpuHolder(
                text(held.get("gpu")),
                text(held.get("pid")),
                int(pid) if pid is not None else None,
                stage_text(held.get("stage")),
                number(held.get("used_bytes")),
            )
        )
    return GpuSnapshot(tuple(devices), tuple(holders))


@dataclass(frozen=True)
class DenoisingRow:
    """A request a diffusion stage was denoising when the bundle was made: its latest
    step, the stage's median step time, and when that step started (wall clock)."""

    stage: str
    request: str
    step: int
    steps: int
    pace: float | None
    started: float


def read_denoising(files: Mapping[str, object]) -> list[DenoisingRow] | str:
    """From the spans the capture step saved; what to say instead when they are unusable."""
    loaded = load_json(files, "spans.json")
    if not loaded.ok:
        return loaded.problem
    rows = []
    for stage, recent in sorted(mapping(mapping(loaded.value).get("stages")).items()):
        latest: dict[str, tuple[float, int, int]] = {}
        paces: list[float] = []
        ended: set[str] = set()
        for span in items(recent):
            record = mapping(span)
            attributes = mapping(record.get("attributes"))
            request = text(record.get("request_id"))
            if record.get("name") == DIFFUSION_REQUEST_SPAN:
                ended.add(request)
                continue
            if record.get("name") != DENOISE_STEP_SPAN:
                continue
            step = number(attributes.get(DENOISE_STEP_INDEX))
            steps = number(attributes.get(DENOISE_STEP_COUNT))
            at = number(record.get("start_unix_nano"))
            pace = number(attributes.get(DENOISE_STEP_SECONDS))
            if pace is not None and pace > 0:
                paces.append(pace)
            if step is None or at is None:
                continue
            if request not in latest or latest[request][0] < at:
                latest[request] = (at, int(step), int(steps or 0))
        median = sorted(paces)[len(paces) // 2] if paces else None
        for request, (at, step, steps) in sorted(latest.items()):
            if request not in ended:
                rows.append(DenoisingRow(text(stage), request, step, steps, median, at / 1e9))
    return rows


@dataclass(frozen=True)
class Survivor:
    """A process that outlived SIGKILL (unkillable.json)."""

    pid: str
    state: str
    wait_channel: str
    title: str


def read_unkillable(files: Mapping[str, object]) -> list[Survivor] | str:
    """unkillable.json's survivors, or why they cannot be listed."""
    loaded = load_json(files, "unkillable.json")
    if not loaded.ok:
        return loaded.problem
    if not isinstance(loaded.value, list):
        return "unkillable.json is malformed: expected a list"
    return [
        Survivor(
            text(entry.get("pid")),
            text(entry.get("state")),
            text(entry.get("wait_channel")),
            text(entry.get("title")),
        )
        for entry in (mapping(item) for item in loaded.value)
    ]
