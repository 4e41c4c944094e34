"""One incident as a self-contained HTML page, for the engineer paged by it.

The page is built from the incident's JSON form (`policy.incidents.to_jsonable`), the files
of its bundle (docs/design.md, "Remediation ladder") and the operator actions journaled for
it. It is one HTML5 document with inline CSS and inline SVG, no script and nothing fetched,
so it can be attached to a ticket and opened offline. Everything in a bundle is untrusted
(stack frames, process titles and causes come from the served processes), so every string
is escaped; a missing or malformed file costs its own section a message, never the page.
"""

from __future__ import annotations

import html
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from omni_watchdog.semconv import (
    DENOISE_STEP_COUNT,
    DENOISE_STEP_INDEX,
    DENOISE_STEP_SECONDS,
    DENOISE_STEP_SPAN,
    DIFFUSION_REQUEST_SPAN,
)
from omni_watchdog.types import PIPELINE, StageRef

# Outcome and state names, by the colour family that carries them; the text is always shown
# beside the colour, so the page reads the same in grey or without its CSS.
_GOOD = frozenset(
    {
        "ok",
        "recovered",
        "recovered_by_shutdown",
        "recovered_by_term",
        "recovered_by_kill",
        "healthy",
        "accepted",
    }
)
_INFO = frozenset({"planned", "observed", "starting"})
_WARN = frozenset(
    {
        "not_recovered",
        "timeout",
        "unreachable",
        "refused",
        "crashed",
        "degraded",
        "stalled",
        "bad_request",
        "unauthorized",
        "forbidden",
    }
)
_BAD = frozenset({"failed", "leaked", "unkillable", "dead"})
_FILL = {
    "good": "#2e7d32",
    "info": "#1565c0",
    "warn": "#ef6c00",
    "bad": "#c62828",
    "neutral": "#757575",
}
# A degraded stage is still serving: a lighter warning than stalled.
_STATE_FILL = {"degraded": "#f9a825", "stalled": "#ef6c00"}

STACK_FRAMES_SHOWN = 12
# A process with hundreds of threads would bury the ones that matter; the rest are counted.
STACK_THREADS_SHOWN = 64
_MIB = float(2**20)
# CLOCK_MONOTONIC counts from boot and never gets near this; wall-clock epoch seconds passed
# it in 2001. It tells the verdicts' monotonic times from wall times.
_WALL_CLOCK_FLOOR = 1e9
_WALL_CLOCK_CEILING = 1e11

# The timeline's drawing, in SVG user units.
_WIDTH = 1000.0
_PLOT_LEFT = 190.0
_PLOT_RIGHT = 900.0
_ROW = 22.0
_BAR = 14.0
_MARK_LABEL_ROW = 14.0
_MARK_LABEL_ROWS = 4
# An instantaneous step still gets a bar the eye (and a pointer) can find.
_MIN_BAR = 3.0
_CHAR_WIDTH = 6.6

_GPU_CHART_WIDTH = 360.0
_GPU_CHART_HEIGHT = 104.0

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0 auto;
max-width:1100px;padding:0 16px 48px;color:#1f1f1f;line-height:1.4}
h1{font-size:1.5em;margin:16px 0 4px}h2{border-bottom:2px solid #ddd;padding-bottom:4px}
h3{font-size:1.05em;margin:18px 0 6px}h4{font-size:.95em;margin:10px 0 2px;font-weight:600}
nav ul{list-style:none;padding:0;display:flex;flex-wrap:wrap;gap:4px 14px}
table{border-collapse:collapse;margin:6px 0 12px;font-size:.9em}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f4f4f4}td.num{text-align:right;font-variant-numeric:tabular-nums}
td.wrap{overflow-wrap:anywhere;max-width:520px}
dl.facts{display:grid;grid-template-columns:max-content 1fr;gap:2px 16px}
dl.facts dt{font-weight:600}dl.facts dd{margin:0;word-break:break-word}
.outcome{display:inline-block;padding:0 6px;border-radius:3px;color:#fff;font-weight:600;
font-size:.9em}
.tone-good{background:#2e7d32}.tone-info{background:#1565c0}.tone-warn{background:#ef6c00}
.tone-bad{background:#c62828}.tone-neutral{background:#757575}
.offset,.muted{color:#555}.problem{color:#8a4b00;font-style:italic}
pre{background:#f6f6f6;border:1px solid #e2e2e2;padding:6px 8px;overflow-x:auto;
font-size:.85em;margin:2px 0 8px;white-space:pre}
svg text{font-family:system-ui,sans-serif;font-size:11px;fill:#1f1f1f}
svg.timeline,svg.gpu-chart{max-width:100%;height:auto;border:1px solid #e2e2e2;
background:#fff}
ul.legend{list-style:none;padding:0;display:flex;flex-wrap:wrap;gap:2px 14px;font-size:.85em}
.swatch{display:inline-block;width:12px;height:12px;margin-right:4px;vertical-align:-1px}
figure{margin:8px 0}figcaption{font-size:.85em;color:#555}
"""

_SECTIONS = (
    ("summary", "Summary"),
    ("timeline", "Timeline"),
    ("evidence", "Evidence"),
    ("steps", "Ladder steps"),
    ("gpu", "GPU memory"),
    ("denoising", "Denoising"),
    ("stacks", "Stacks"),
    ("processes", "Processes"),
    ("actions", "Operator actions"),
)


def render_incident_report(
    incident: Mapping[str, Any],
    files: Mapping[str, str],
    actions: Sequence[Mapping[str, Any]] = (),
) -> str:
    """The whole HTML document for one incident, its bundle files and its operator actions."""
    try:
        report = _Report.build(incident, files, actions)
        unreadable = ""
    except Exception as error:
        # The sections each have a safety net; this is the one for reading the bundle.
        report = _Report.build({}, {}, ())
        unreadable = _problem(f"the incident could not be read: {type(error).__name__}: {error}")
    renderers: dict[str, Callable[[_Report], str]] = {
        "summary": _summary,
        "timeline": _timeline,
        "evidence": _evidence,
        "steps": _steps,
        "gpu": _gpu,
        "denoising": _denoising,
        "stacks": _stacks,
        "processes": _processes,
        "actions": _actions,
    }
    sections = [
        _section(section_id, heading, _guarded(renderers[section_id], report))
        for section_id, heading in _SECTIONS
    ]
    incident_id = _text(report.incident.get("incident_id")) or "(no incident id)"
    outcome = _text(report.incident.get("outcome")) or "unknown"
    title = f"Incident {incident_id}: {outcome}"
    nav = "".join(f'<li><a href="#{sid}">{_e(heading)}</a></li>' for sid, heading in _SECTIONS)
    document = (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        # Defence in depth: were an escape ever missed, the page still runs nothing and
        # loads nothing.
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\';'
        " style-src 'unsafe-inline'\">\n"
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{_e(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
        f"<header><h1>{_e(title)}</h1>"
        f'<p class="muted">omni-watchdog incident report; times are UTC, offsets are from'
        f" the incident's opening.</p>\n<nav><ul>{nav}</ul></nav></header>\n"
        f"<main>\n{unreadable}{''.join(sections)}</main>\n</body>\n</html>\n"
    )
    # Bundle text read with surrogateescape can hold lone surrogates, which no UTF-8 writer
    # accepts: the page must still be saveable.
    return document.encode("utf-8", errors="replace").decode("utf-8")


# ---------------------------------------------------------------------------------------
# Reading the bundle: every accessor tolerates any JSON value where it expects another.


@dataclass(frozen=True)
class _Loaded:
    """A bundle file parsed as JSON, or why it could not be."""

    value: Any
    problem: str = ""

    @property
    def ok(self) -> bool:
        return not self.problem


def _file_text(files: Mapping[str, object], name: str) -> str | None:
    """A bundle file's text; bytes are decoded leniently, anything else is unreadable."""
    content = files.get(name)
    if isinstance(content, bytes):
        return content.decode("utf-8", errors="replace")
    return content if isinstance(content, str) else None


def _load_json(files: Mapping[str, object], name: str) -> _Loaded:
    if name not in files:
        return _Loaded(None, f"{name} is not in the bundle")
    text = _file_text(files, name)
    if text is None:
        return _Loaded(None, f"{name} could not be read as text")
    try:
        return _Loaded(json.loads(text))
    except (ValueError, RecursionError) as error:
        return _Loaded(None, f"{name} is not valid JSON ({error})")


def _number(value: Any) -> float | None:
    """A finite number, or None (a bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _wall(value: Any) -> float | None:
    """A plausible wall-clock time in epoch seconds, or None."""
    number = _number(value)
    if number is None or not _WALL_CLOCK_FLOOR < number < _WALL_CLOCK_CEILING:
        return None
    return number


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else str(value)


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _items(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else []


def _stage_text(value: Any) -> str:
    """A stage as `to_jsonable` writes a StageRef (or as "1.0" already), "" when none;
    `PIPELINE` (the target, no stage proved the one) as "pipeline"."""
    if isinstance(value, Mapping):
        stage_id, replica = value.get("stage_id"), value.get("replica", 0)
        if stage_id is None:
            return ""
        if isinstance(stage_id, int) and StageRef(stage_id).whole_pipeline:
            return str(PIPELINE)
        return f"{_text(stage_id)}.{_text(replica)}"
    return _text(value)


@dataclass(frozen=True)
class _StateChange:
    time: float
    stage: str
    name: str
    state: str


@dataclass(frozen=True)
class _GpuPoint:
    time: float
    pids: Mapping[str, float]
    devices: Mapping[str, float]


@dataclass(frozen=True)
class _Report:
    """The incident and its bundle, read once and tolerantly, with the page's clock."""

    incident: Mapping[str, Any]
    files: Mapping[str, object]
    actions: list[Mapping[str, Any]]
    opened: float | None
    # Added to a monotonic time (verdicts, evidence) it gives the wall time, when known.
    monotonic_offset: float | None
    processes: _Processes
    stage_names: dict[str, str]
    states: _Loaded
    state_changes: list[_StateChange]
    states_skipped: int
    gpu_timeline: _Loaded
    gpu_points: list[_GpuPoint]
    gpu_skipped: int
    steps: list[Mapping[str, Any]]
    verdicts: list[Mapping[str, Any]]
    timeline_marks: list[tuple[str, float]]

    @classmethod
    def build(
        cls,
        incident: Mapping[str, Any],
        files: Mapping[str, object],
        actions: Sequence[Mapping[str, Any]],
    ) -> _Report:
        # The caller's incident wins; incident.json fills in what it lacks.
        from_file = _load_json(files, "incident.json")
        merged = {**_mapping(from_file.value), **_mapping(incident)}
        verdicts = [_mapping(v) for v in _items(merged.get("verdicts")) if isinstance(v, Mapping)]
        steps = [_mapping(s) for s in _items(merged.get("steps")) if isinstance(s, Mapping)]
        marks = sorted(
            (
                (_text(key), time)
                for key, value in _mapping(merged.get("timeline")).items()
                if (time := _wall(value)) is not None
            ),
            key=lambda mark: mark[1],
        )
        states = _load_json(files, "states.json")
        changes, states_skipped = _state_changes(states.value) if states.ok else ([], 0)
        gpu_timeline = _load_json(files, "gpu-timeline.json")
        points, gpu_skipped = _gpu_points(gpu_timeline.value) if gpu_timeline.ok else ([], 0)
        processes = _Processes.read(files)
        actions_list = (
            [a for a in actions if isinstance(a, Mapping)] if isinstance(actions, Sequence) else []
        )
        return cls(
            incident=merged,
            files=files,
            actions=actions_list,
            opened=_wall(merged.get("opened")),
            monotonic_offset=_monotonic_offset(merged, verdicts),
            processes=processes,
            stage_names=_stage_names(changes, files),
            states=states,
            state_changes=changes,
            states_skipped=states_skipped,
            gpu_timeline=gpu_timeline,
            gpu_points=points,
            gpu_skipped=gpu_skipped,
            steps=steps,
            verdicts=verdicts,
            timeline_marks=marks,
        )

    def wall_of(self, value: Any) -> float | None:
        """A verdict or evidence time as wall time, whichever clock it was recorded on."""
        wall = _wall(value)
        if wall is not None:
            return wall
        number = _number(value)
        if number is None or self.monotonic_offset is None:
            return None
        return number + self.monotonic_offset

    def reference(self) -> float | None:
        """What offsets are measured from: the opening, else the earliest time known."""
        if self.opened is not None:
            return self.opened
        times = self.known_times()
        return min(times) if times else None

    def known_times(self) -> list[float]:
        times = [time for _, time in self.timeline_marks]
        for key in ("opened", "closed"):
            wall = _wall(self.incident.get(key))
            if wall is not None:
                times.append(wall)
        for step in self.steps:
            started = _wall(step.get("started"))
            if started is not None:
                times.append(started)
                times.append(started + max(0.0, _number(step.get("duration")) or 0.0))
        for verdict in self.verdicts:
            wall = self.wall_of(verdict.get("time"))
            if wall is not None:
                times.append(wall)
        times.extend(change.time for change in self.state_changes)
        times.extend(point.time for point in self.gpu_points)
        return times

    def stage_label(self, stage: str) -> str:
        name = self.stage_names.get(stage, "")
        return f"{stage} {name}" if name else stage


@dataclass(frozen=True)
class _Processes:
    """processes.json by pid, with why it is unusable when it is."""

    by_pid: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)
    rows: tuple[Mapping[str, Any], ...] = ()
    problem: str = ""
    skipped: int = 0

    @classmethod
    def read(cls, files: Mapping[str, object]) -> _Processes:
        loaded = _load_json(files, "processes.json")
        if not loaded.ok:
            return cls(problem=loaded.problem)
        if not isinstance(loaded.value, list):
            return cls(problem="processes.json is malformed: expected a list of processes")
        rows = [row for row in loaded.value if isinstance(row, Mapping)]
        by_pid = {int(pid): row for row in rows if (pid := _number(row.get("pid"))) is not None}
        return cls(by_pid, tuple(rows), "", len(loaded.value) - len(rows))

    def describe(self, pid: int | None) -> str:
        """Role, stage and title of a pid, as far as processes.json knows it."""
        row = self.by_pid.get(pid) if pid is not None else None
        if row is None:
            return ""
        parts = [_text(row.get("role"))]
        stage = _stage_text(row.get("stage"))
        if stage:
            parts.append(f"stage {stage}")
        described = ", ".join(part for part in parts if part)
        title = _text(row.get("title"))
        return f"{described}: {title}" if described and title else described or title


def _monotonic_offset(
    incident: Mapping[str, Any], verdicts: list[Mapping[str, Any]]
) -> float | None:
    """Wall minus monotonic, from the timeline's wall copies of the verdict and evidence times.

    The policy records verdicts and evidence on the monotonic clock, and the timeline holds
    the wall time of the earliest of each: the pair anchors one clock to the other.
    """
    timeline = _mapping(incident.get("timeline"))
    verdict_times = [
        number
        for verdict in verdicts
        if (number := _number(verdict.get("time"))) is not None and _wall(number) is None
    ]
    verdict_wall = _wall(timeline.get("verdict"))
    if verdict_times and verdict_wall is not None:
        return verdict_wall - min(verdict_times)
    evidence_times = [
        number
        for verdict in verdicts
        for evidence in _items(verdict.get("evidence"))
        if (number := _number(_mapping(evidence).get("since"))) is not None
        and _wall(number) is None
    ]
    evidence_wall = _wall(timeline.get("first_evidence"))
    if evidence_times and evidence_wall is not None:
        return evidence_wall - min(evidence_times)
    return None


def _state_changes(value: Any) -> tuple[list[_StateChange], int]:
    """states.json's usable entries in time order, and how many were not usable."""
    entries = _items(value)
    changes = []
    for entry in entries:
        row = _mapping(entry)
        time = _wall(row.get("time"))
        stage, state = _stage_text(row.get("stage")), _text(row.get("state"))
        if time is not None and stage and state:
            changes.append(_StateChange(time, stage, _text(row.get("name")), state))
    return sorted(changes, key=lambda c: c.time), len(entries) - len(changes)


def _bytes_by_key(value: Any) -> dict[str, float]:
    return {
        _text(key): number
        for key, raw in _mapping(value).items()
        if (number := _number(raw)) is not None
    }


def _gpu_points(value: Any) -> tuple[list[_GpuPoint], int]:
    """gpu-timeline.json's usable readings in time order, and how many were not usable."""
    entries = _items(value)
    points = []
    for entry in entries:
        row = _mapping(entry)
        time = _wall(row.get("time"))
        if time is not None:
            points.append(
                _GpuPoint(time, _bytes_by_key(row.get("pids")), _bytes_by_key(row.get("devices")))
            )
    return sorted(points, key=lambda p: p.time), len(entries) - len(points)


def _stage_names(changes: list[_StateChange], files: Mapping[str, object]) -> dict[str, str]:
    """Stage names from states.json, else from the stage spans the capture step saved."""
    names: dict[str, str] = {}
    spans = _load_json(files, "spans.json")
    for stage, recent in _mapping(_mapping(spans.value).get("stages")).items():
        for span in _items(recent):
            name = _text(_mapping(span).get("stage_name"))
            if name:
                names[_text(stage)] = name
                break
    for change in changes:
        if change.name:
            names[change.stage] = change.name
    return names


# ---------------------------------------------------------------------------------------
# Formatting.


def _e(value: Any) -> str:
    """Escaped for text and for quoted attribute values alike; characters that do not print
    (an escape sequence or a bidi override in the target's command line, saved as is)
    shown as U+FFFD, line breaks kept for the stacks."""
    text = _text(value)
    if not text.isprintable():
        text = "".join(c if c.isprintable() or c == "\n" else "\ufffd" for c in text)
    return html.escape(text, quote=True)


def _iso(time: float) -> str:
    try:
        # Rounded to the millisecond shown, so that 12.0599999 reads 12.060.
        moment = datetime.fromtimestamp(round(time, 3), tz=timezone.utc)
    except (OverflowError, OSError, ValueError):
        return f"{time:.3f}"
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def _seconds(value: float) -> str:
    return f"{value:.2f} s"


def _offset(time: float, reference: float | None) -> str:
    if reference is None:
        return ""
    # Rounded first, so that half a millisecond before the opening reads +0.00, not -0.00.
    return f"{round(time - reference, 2) + 0.0:+.2f} s"


def _time_html(time: float | None, reference: float | None) -> str:
    """A wall time as UTC ISO-8601 with its offset from the reference, or a dash."""
    if time is None:
        return '<span class="muted">unknown</span>'
    offset = _offset(time, reference)
    shown = f' <span class="offset">({_e(offset)})</span>' if offset else ""
    return f'<time datetime="{_e(_iso(time))}">{_e(_iso(time))}</time>{shown}'


def _time_plain(time: float, reference: float | None) -> str:
    offset = _offset(time, reference)
    return f"{_iso(time)} ({offset})" if offset else _iso(time)


def _tone(name: str) -> str:
    if name in _GOOD:
        return "good"
    if name in _INFO:
        return "info"
    if name in _WARN:
        return "warn"
    if name in _BAD:
        return "bad"
    return "neutral"


def _fill(name: str) -> str:
    return _STATE_FILL.get(name, _FILL[_tone(name)])


def _badge(name: str) -> str:
    label = name or "unknown"
    return f'<span class="outcome tone-{_tone(name)}" data-outcome="{_e(name)}">{_e(label)}</span>'


def _mib(value: float) -> str:
    return f"{value / _MIB:,.0f} MiB"


def _problem(message: str) -> str:
    return f'<p class="problem">{_e(message)}</p>'


def _table(headers: Sequence[str], rows: Iterable[Sequence[str]], css: str = "") -> str:
    """A table of already escaped cells; a cell starting with a `<td` is taken whole."""
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join(
        "<tr>"
        + "".join(cell if cell.startswith("<td") else f"<td>{cell}</td>" for cell in row)
        + "</tr>\n"
        for row in rows
    )
    css_attr = f' class="{css}"' if css else ""
    return f"<table{css_attr}><thead><tr>{head}</tr></thead><tbody>\n{body}</tbody></table>\n"


def _num_cell(text: str) -> str:
    return f'<td class="num">{_e(text)}</td>'


def _wrap_cell(text: str) -> str:
    return f'<td class="wrap">{_e(text)}</td>'


def _section(section_id: str, heading: str, body: str) -> str:
    return f'<section id="{section_id}">\n<h2>{_e(heading)}</h2>\n{body}</section>\n'


def _guarded(render: Callable[[_Report], str], report: _Report) -> str:
    # The accessors above already absorb bad bundle content; this is the last line, so that
    # a shape nobody foresaw costs one section, never the report an operator is waiting for.
    try:
        return render(report)
    except Exception as error:
        return _problem(f"this section could not be rendered: {type(error).__name__}: {error}")


# ---------------------------------------------------------------------------------------
# Sections.


def _summary(report: _Report) -> str:
    incident = report.incident
    reference = report.reference()
    marks = dict(report.timeline_marks)
    closed = _wall(incident.get("closed"))
    facts: list[tuple[str, str]] = [
        ("Incident", _e(_text(incident.get("incident_id")) or "unknown")),
        ("Target", _e(_text(incident.get("target")) or "unknown")),
        ("Mode", _e(_text(incident.get("mode")) or "unknown")),
        ("Outcome", _badge(_text(incident.get("outcome")))),
        ("Cause", _e(_text(incident.get("cause")) or "unknown")),
        ("Opened", _time_html(report.opened, reference)),
        ("Closed", _time_html(closed, reference) if closed is not None else "still open"),
    ]
    if incident.get("crashed") is True:
        facts.append(("Crashed", "yes: the server went away by itself"))
    released = marks.get("released")
    for start_key, label in (("first_evidence", "first evidence"), ("verdict", "verdict")):
        start = marks.get(start_key)
        if start is None:
            continue
        span = _seconds(released - start) if released is not None else "not released"
        facts.append((f"From {label} to release", _e(span)))
    if report.opened is not None and closed is not None:
        facts.append(("From opening to close", _e(_seconds(closed - report.opened))))
    for name, label in (
        ("health.txt", "/health at capture"),
        ("metrics.txt", "/metrics at capture"),
    ):
        text = _file_text(report.files, name)
        if text is not None:
            first = text.strip().splitlines()[0] if text.strip() else "(empty)"
            facts.append((label, _e(first[:200])))
    bundle = _text(incident.get("bundle_dir"))
    names = sorted(_text(name) for name in report.files)
    listing = "".join(f"<li>{_e(name)}</li>" for name in names) or "<li>none</li>"
    facts.append(
        (
            "Bundle",
            f"{_e(bundle or '(no directory recorded)')}"
            f"<details><summary>{len(names)} files</summary><ul>{listing}</ul></details>",
        )
    )
    rows = "".join(f"<dt>{_e(label)}</dt><dd>{value}</dd>\n" for label, value in facts)
    return f'<dl class="facts">\n{rows}</dl>\n'


@dataclass(frozen=True)
class _Axis:
    start: float
    end: float
    reference: float

    def x(self, time: float) -> float:
        span = self.end - self.start
        return _PLOT_LEFT + (time - self.start) / span * (_PLOT_RIGHT - _PLOT_LEFT)

    def ticks(self) -> list[tuple[float, str]]:
        """Round offsets from the reference, about eight across the axis."""
        raw = (self.end - self.start) / 8
        magnitude = 10 ** math.floor(math.log10(raw))
        step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
        decimals = max(0, -math.floor(math.log10(step)))
        first = math.ceil((self.start - self.reference) / step)
        last = math.floor((self.end - self.reference) / step)
        return [
            (self.reference + k * step, f"{k * step:+.{decimals}f} s")
            for k in range(first, last + 1)
        ]


def _axis_for(report: _Report) -> _Axis | None:
    times = report.known_times()
    if not times:
        return None
    start, end = min(times), max(times)
    # A little room either side keeps the first and last marks off the frame.
    pad = max((end - start) * 0.03, 0.5)
    reference = report.reference()
    return _Axis(start - pad, end + pad, start if reference is None else reference)


def _timeline(report: _Report) -> str:
    axis = _axis_for(report)
    if axis is None:
        return _problem("no wall-clock times in this incident: nothing to draw")
    notes: list[str] = []
    lanes = _stage_lanes(report, axis, notes)
    marks = [(key, time, "mark") for key, time in report.timeline_marks]
    for action in report.actions:
        time = _wall(action.get("time"))
        if time is not None and axis.start <= time <= axis.end:
            marks.append((f"operator {_text(action.get('action'))}", time, "action"))
    marks.sort(key=lambda mark: mark[1])
    mark_rows = _mark_label_rows(marks, axis)
    label_rows = max(mark_rows, default=0) + 1
    top = 6.0 + label_rows * _MARK_LABEL_ROW
    parts: list[str] = []
    y = top + 4
    parts.append(_svg_text(8, y + _ROW - 8, "Ladder steps", weight="600"))
    y += _ROW
    for step in report.steps:
        parts.append(_step_bar(step, axis, y))
        y += _ROW
    if not report.steps:
        parts.append(_svg_text(_PLOT_LEFT, y + _ROW - 8, "no ladder steps recorded"))
        y += _ROW
    y += 6
    parts.append(_svg_text(8, y + _ROW - 8, "Stages", weight="600"))
    y += _ROW
    for lane in lanes:
        parts.append(lane.render(y))
        y += _ROW
    if not lanes:
        parts.append(_svg_text(_PLOT_LEFT, y + _ROW - 8, "no stage states known"))
        y += _ROW
    bottom = y + 4
    marks_svg = "".join(
        _mark(key, time, axis, row, top, bottom, css)
        for (key, time, css), row in zip(marks, mark_rows, strict=True)
    )
    ticks = "".join(
        f'<line x1="{axis.x(t):.1f}" y1="{bottom}" x2="{axis.x(t):.1f}" y2="{bottom + 5}"'
        ' stroke="#555"/>' + _svg_text(axis.x(t), bottom + 17, label, anchor="middle")
        for t, label in axis.ticks()
    )
    height = bottom + 26
    caption = (
        f"From {_time_plain(axis.start, axis.reference)} to"
        f" {_time_plain(axis.end, axis.reference)}; offsets from the incident's opening."
    )
    svg = (
        f'<svg class="timeline" role="img" aria-label="incident timeline"'
        f' viewBox="0 0 {_WIDTH:.0f} {height:.0f}" width="{_WIDTH:.0f}" height="{height:.0f}">\n'
        f"<title>Incident timeline</title>\n"
        f'<rect x="0" y="0" width="{_WIDTH:.0f}" height="{height:.0f}" fill="#fff"/>\n'
        f'<line x1="{_PLOT_LEFT}" y1="{bottom}" x2="{_PLOT_RIGHT}" y2="{bottom}"'
        f' stroke="#555"/>\n{ticks}\n{"".join(parts)}\n{marks_svg}\n</svg>\n'
    )
    moments = _table(
        ("moment", "time"),
        ([_e(key), _time_html(time, axis.reference)] for key, time in report.timeline_marks),
    )
    legend = _legend(report)
    notes_html = "".join(_problem(note) for note in notes)
    return (
        f"<figure>\n{svg}<figcaption>{_e(caption)}</figcaption>\n</figure>\n{legend}{notes_html}"
        f"<h3>Key moments</h3>\n{moments if report.timeline_marks else _problem('none recorded')}"
    )


def _svg_text(x: float, y: float, text: str, anchor: str = "start", weight: str = "") -> str:
    weight_attr = f' font-weight="{weight}"' if weight else ""
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}"{weight_attr}>{_e(text)}</text>'


def _mark_label_rows(marks: list[tuple[str, float, str]], axis: _Axis) -> list[int]:
    """A label row per mark, in order, so that marks close in time keep legible labels."""
    row_ends = [-math.inf] * _MARK_LABEL_ROWS
    rows = []
    for key, time, _ in marks:
        x = axis.x(time)
        row = next((i for i, end in enumerate(row_ends) if end < x), _MARK_LABEL_ROWS - 1)
        row_ends[row] = x + len(key) * _CHAR_WIDTH + 8
        rows.append(row)
    return rows


def _mark(
    key: str, time: float, axis: _Axis, row: int, top: float, bottom: float, css: str = "mark"
) -> str:
    x = axis.x(time)
    label_y = 6.0 + (max(row, 0) + 1) * _MARK_LABEL_ROW - 3
    anchor = "end" if x > _PLOT_RIGHT - 40 else "start"
    label_x = x - 2 if anchor == "end" else x + 2
    return (
        f'<g class="{css}" data-mark="{_e(key)}">'
        f"<title>{_e(key)}: {_e(_time_plain(time, axis.reference))}</title>"
        f'<line x1="{x:.1f}" y1="{top:.1f}" x2="{x:.1f}" y2="{bottom:.1f}" stroke="#444"'
        ' stroke-dasharray="3 3"/>'
        f"{_svg_text(label_x, label_y, key, anchor=anchor)}</g>\n"
    )


def _step_bar(step: Mapping[str, Any], axis: _Axis, y: float) -> str:
    name = _text(step.get("step")) or "unknown"
    outcome = _text(step.get("outcome")) or "unknown"
    started = _wall(step.get("started"))
    duration = max(0.0, _number(step.get("duration")) or 0.0)
    label = _svg_text(8, y + _ROW - 8, name)
    if started is None:
        return (
            f'<g class="step" data-step="{_e(name)}" data-outcome="{_e(outcome)}">{label}'
            f"{_svg_text(_PLOT_LEFT, y + _ROW - 8, f'{outcome}, start time unknown')}</g>\n"
        )
    x = axis.x(started)
    width = max(_MIN_BAR, axis.x(started + duration) - x)
    detail = _text(step.get("detail"))
    title = (
        f"{name}: {outcome}, {_seconds(duration)}, started {_time_plain(started, axis.reference)}"
        + (f"; {detail}" if detail else "")
    )
    summary = f"{outcome} · {_seconds(duration)}"
    text_right = x + width + 4
    if text_right + len(summary) * _CHAR_WIDTH > _WIDTH - 4:
        outcome_text = _svg_text(x - 4, y + _ROW - 8, summary, anchor="end")
    else:
        outcome_text = _svg_text(text_right, y + _ROW - 8, summary)
    return (
        f'<g class="step" data-step="{_e(name)}" data-outcome="{_e(outcome)}">'
        f"<title>{_e(title)}</title>{label}"
        f'<rect x="{x:.1f}" y="{y + (_ROW - _BAR) / 2:.1f}" width="{width:.1f}"'
        f' height="{_BAR:.0f}" fill="{_fill(outcome)}" stroke="#222" stroke-width="0.5"/>'
        f"{outcome_text}</g>\n"
    )


@dataclass(frozen=True)
class _Lane:
    """One stage's row: segments of its states, or marks at its verdicts."""

    stage: str
    label: str
    segments: tuple[tuple[float, float, str, str], ...]  # x, width, state, title
    css: str

    def render(self, y: float) -> str:
        rects = []
        for x, width, state, title in self.segments:
            rects.append(
                f'<rect class="{self.css}" data-stage="{_e(self.stage)}" data-state="{_e(state)}"'
                f' x="{x:.1f}" y="{y + (_ROW - _BAR) / 2:.1f}" width="{width:.1f}"'
                f' height="{_BAR:.0f}" fill="{_fill(state)}" stroke="#fff" stroke-width="0.5">'
                f"<title>{_e(title)}</title></rect>"
            )
            if width >= len(state) * _CHAR_WIDTH + 6 and self.css == "state":
                rects.append(
                    f'<text x="{x + 3:.1f}" y="{y + _ROW - 8:.1f}" fill="#fff"'
                    f' style="fill:#fff">{_e(state)}</text>'
                )
            elif self.css == "verdict":
                rects.append(_svg_text(x + width + 4, y + _ROW - 8, f"verdict: {state}"))
        return (
            f'<g class="lane" data-stage="{_e(self.stage)}">'
            f"{_svg_text(8, y + _ROW - 8, f'stage {self.label}')}{''.join(rects)}</g>\n"
        )


def _stage_lanes(report: _Report, axis: _Axis, notes: list[str]) -> list[_Lane]:
    if report.states.ok and isinstance(report.states.value, list):
        if report.states_skipped:
            notes.append(f"states.json: {report.states_skipped} malformed entries skipped")
        if report.state_changes:
            return _state_lanes(report, axis)
        if not report.states_skipped:
            notes.append("states.json lists no state changes: stage lanes show the verdicts")
    elif report.states.ok:
        notes.append("states.json is malformed (expected a list): stage lanes show the verdicts")
    else:
        notes.append(f"{report.states.problem}: stage lanes show the verdicts only")
    return _verdict_lanes(report, axis)


def _state_lanes(report: _Report, axis: _Axis) -> list[_Lane]:
    by_stage: dict[str, list[_StateChange]] = {}
    for change in report.state_changes:
        by_stage.setdefault(change.stage, []).append(change)
    lanes = []
    for stage in sorted(by_stage, key=_natural_key):
        changes = by_stage[stage]
        segments = []
        for index, change in enumerate(changes):
            end = changes[index + 1].time if index + 1 < len(changes) else axis.end
            x = axis.x(change.time)
            width = max(_MIN_BAR, axis.x(end) - x)
            title = (
                f"stage {report.stage_label(stage)}: {change.state} from"
                f" {_time_plain(change.time, axis.reference)}"
                + (f" for {_seconds(end - change.time)}" if index + 1 < len(changes) else "")
            )
            segments.append((x, width, change.state, title))
        lanes.append(_Lane(stage, report.stage_label(stage), tuple(segments), "state"))
    return lanes


def _verdict_lanes(report: _Report, axis: _Axis) -> list[_Lane]:
    marks: dict[str, list[tuple[float, float, str, str]]] = {}
    fallback = dict(report.timeline_marks).get("verdict")
    for verdict in report.verdicts:
        stage = _stage_text(verdict.get("stage")) or "?"
        state = _text(verdict.get("state")) or "unknown"
        time = report.wall_of(verdict.get("time")) or fallback
        if time is None:
            continue
        when = _time_plain(time, axis.reference)
        title = f"stage {report.stage_label(stage)}: verdict {state} at {when}"
        marks.setdefault(stage, []).append((axis.x(time), _MIN_BAR * 2, state, title))
    return [
        _Lane(stage, report.stage_label(stage), tuple(marks[stage]), "verdict")
        for stage in sorted(marks, key=_natural_key)
    ]


def _natural_key(text: str) -> tuple[tuple[int, float, str], ...]:
    """Sort "2.0" before "10.0" and numbers before words."""
    parts = re.split(r"(\d+)", text)
    return tuple((0, float(p), "") if p.isdigit() else (1, 0.0, p) for p in parts if p)


def _legend(report: _Report) -> str:
    names = [_text(step.get("outcome")) for step in report.steps]
    names += [change.state for change in report.state_changes]
    names += [_text(verdict.get("state")) for verdict in report.verdicts]
    seen = list(dict.fromkeys(name for name in names if name))
    if not seen:
        return ""
    items = "".join(
        f'<li><svg width="12" height="12" aria-hidden="true" class="swatch">'
        f'<rect width="12" height="12" fill="{_fill(name)}"/></svg>{_e(name)}</li>'
        for name in seen
    )
    return f'<ul class="legend">{items}</ul>\n'


def _evidence(report: _Report) -> str:
    if not report.verdicts:
        return _problem("no verdicts: this incident was not opened by the detector")
    reference = report.reference()
    blocks = []
    for verdict in report.verdicts:
        stage = _stage_text(verdict.get("stage")) or "unknown"
        state = _text(verdict.get("state")) or "unknown"
        raw_time = _number(verdict.get("time"))
        time = report.wall_of(verdict.get("time"))
        rows = []
        for item in _items(verdict.get("evidence")):
            evidence = _mapping(item)
            since_raw = _number(evidence.get("since"))
            since = report.wall_of(evidence.get("since"))
            before = (
                f' <span class="muted">({_seconds(raw_time - since_raw)} before the verdict)</span>'
                if since_raw is not None and raw_time is not None
                else ""
            )
            rows.append(
                [
                    _e(_text(evidence.get("kind")) or "unknown"),
                    _time_html(since, reference) + before
                    if since is not None
                    else _e(_raw_time(since_raw)) + before,
                    _e(_text(evidence.get("detail"))),
                ]
            )
        when = _time_html(time, reference) if time is not None else _e(_raw_time(raw_time))
        table = _table(("kind", "since", "detail"), rows) if rows else _problem("no evidence")
        cause = _mapping(verdict.get("cause"))
        doing = ""
        if cause:
            advancing = "its work advancing" if cause.get("working") else "nothing advancing"
            doing = (
                f'<p class="cause">Cause: <strong>{_e(_text(cause.get("cause")))}</strong>'
                f" ({advancing}): {_e(_text(cause.get('detail')))}</p>\n"
            )
        subject = (
            "Target, stage unknown"
            if stage == str(PIPELINE)
            else f"Stage {report.stage_label(stage)}"
        )
        blocks.append(
            f'<article class="verdict" data-stage="{_e(stage)}" data-state="{_e(state)}">\n'
            f"<h3>{_e(subject)}: {_badge(state)}</h3>\n"
            f"<p>Verdict at {when}</p>\n{doing}{table}</article>\n"
        )
    return "".join(blocks)


def _raw_time(value: float | None) -> str:
    return "unknown" if value is None else f"monotonic {value:.3f} s (no wall-clock anchor)"


def _steps(report: _Report) -> str:
    if not report.steps:
        return _problem("no ladder steps recorded")
    reference = report.reference()
    rows = []
    for step in report.steps:
        duration = _number(step.get("duration"))
        targets = ", ".join(_text(t) for t in _items(step.get("targets")))
        rows.append(
            [
                _e(_text(step.get("step")) or "unknown"),
                _badge(_text(step.get("outcome"))),
                _time_html(_wall(step.get("started")), reference),
                _num_cell(_seconds(duration) if duration is not None else "unknown"),
                _wrap_cell(targets or "none"),
                _wrap_cell(_text(step.get("detail"))),
            ]
        )
    return _table(("step", "outcome", "started", "duration", "targets", "detail"), rows)


def _gpu(report: _Report) -> str:
    notes = []
    if report.gpu_timeline.ok:
        if not isinstance(report.gpu_timeline.value, list):
            notes.append("gpu-timeline.json is malformed: expected a list of readings")
        elif report.gpu_skipped:
            notes.append(f"gpu-timeline.json: {report.gpu_skipped} malformed readings skipped")
        if report.gpu_points:
            return "".join(_problem(n) for n in notes) + _gpu_timeline(report)
        if isinstance(report.gpu_timeline.value, list):
            notes.append("gpu-timeline.json holds no readings")
    elif "gpu-timeline.json" in report.files:
        notes.append(report.gpu_timeline.problem)
    snapshot = _load_json(report.files, "gpu.json")
    problems = "".join(_problem(n) for n in notes)
    if snapshot.ok and snapshot.value is None:
        return problems + _problem("no GPU readings: NVML was not available at capture")
    if snapshot.ok and isinstance(snapshot.value, Mapping):
        return problems + _gpu_snapshot(report, snapshot.value)
    if snapshot.ok:
        return problems + _problem("gpu.json is malformed: expected a reading")
    if "gpu.json" in report.files:
        return problems + _problem(snapshot.problem)
    return problems + _problem("no GPU readings")


def _gpu_timeline(report: _Report) -> str:
    points = report.gpu_points
    reference = report.reference()
    pids = sorted({pid for p in points for pid in p.pids}, key=_natural_key)
    devices = sorted({d for p in points for d in p.devices}, key=_natural_key)
    peak_all = max((v for p in points for v in p.pids.values()), default=0.0)
    start, end = points[0].time, points[-1].time
    charts = []
    rows = []
    for pid in pids:
        # A pid NVML no longer lists holds nothing: the driver frees memory with its process.
        series = [(p.time, p.pids.get(pid, 0.0)) for p in points]
        values = [value for _, value in series]
        description = report.processes.describe(_pid_number(pid))
        charts.append(_gpu_chart(pid, description, series, start, end, peak_all, reference))
        rows.append(
            [
                _e(pid),
                _wrap_cell(description or "not in processes.json"),
                _num_cell(_mib(values[0])),
                _num_cell(_mib(max(values))),
                _num_cell(_mib(values[-1])),
            ]
        )
    device_rows = []
    for device in devices:
        values = [p.devices[device] for p in points if device in p.devices]
        device_rows.append(
            [
                _e(device),
                _num_cell(_mib(values[0])),
                _num_cell(_mib(max(values))),
                _num_cell(_mib(values[-1])),
            ]
        )
    span = (
        f"{len(points)} readings from {_time_plain(start, reference)}"
        f" to {_time_plain(end, reference)}; a pid no longer listed counts as 0 MiB."
    )
    pid_table = (
        _table(("pid", "process", "first", "peak", "last"), rows)
        if rows
        else _problem("no pid held GPU memory in these readings")
    )
    device_table = _table(("device", "first", "peak", "last"), device_rows) if device_rows else ""
    return (
        f"<p>{_e(span)}</p>\n<h3>Per process</h3>\n{pid_table}"
        f'<div class="gpu-charts">{"".join(charts)}</div>\n'
        + (f"<h3>Per device (used)</h3>\n{device_table}" if device_table else "")
    )


def _pid_number(pid: str) -> int | None:
    return int(pid) if pid.isdigit() else None


def _gpu_chart(
    pid: str,
    description: str,
    series: list[tuple[float, float]],
    start: float,
    end: float,
    peak: float,
    reference: float | None,
) -> str:
    left, right, top, bottom = 8.0, _GPU_CHART_WIDTH - 8, 22.0, _GPU_CHART_HEIGHT - 22
    span = end - start or 1.0
    scale = peak or 1.0

    def point(time: float, value: float) -> tuple[float, float]:
        x = left + (time - start) / span * (right - left) if end > start else (left + right) / 2
        return x, bottom - value / scale * (bottom - top)

    coordinates = [point(time, value) for time, value in series]
    path = " ".join(f"{x:.1f},{y:.1f}" for x, y in coordinates)
    dots = "".join(
        f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2" fill="#1565c0">'
        f"<title>{_e(_time_plain(time, reference))}: {_e(_mib(value))}</title></circle>"
        for (x, y), (time, value) in zip(coordinates, series, strict=True)
    )
    values = [value for _, value in series]
    heading = f"pid {pid}: peak {_mib(max(values))}, last {_mib(values[-1])}"
    return (
        f'<svg class="gpu-chart" data-pid="{_e(pid)}" role="img" aria-label="{_e(heading)}"'
        f' viewBox="0 0 {_GPU_CHART_WIDTH:.0f} {_GPU_CHART_HEIGHT:.0f}"'
        f' width="{_GPU_CHART_WIDTH:.0f}" height="{_GPU_CHART_HEIGHT:.0f}">'
        f"<title>{_e(heading)}{_e(f' ({description})' if description else '')}</title>"
        f'<rect x="0" y="0" width="{_GPU_CHART_WIDTH:.0f}" height="{_GPU_CHART_HEIGHT:.0f}"'
        ' fill="#fff"/>'
        f'<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="#999"/>'
        f"{_svg_text(left, 14, heading)}"
        f"{_svg_text(left, _GPU_CHART_HEIGHT - 6, _offset(start, reference))}"
        f"{_svg_text(right, _GPU_CHART_HEIGHT - 6, _offset(end, reference), anchor='end')}"
        f'<polyline points="{path}" fill="none" stroke="#1565c0" stroke-width="1.5"/>'
        f"{dots}</svg>\n"
    )


def _gpu_snapshot(report: _Report, reading: Mapping[str, Any]) -> str:
    device_rows = []
    for item in _items(reading.get("devices")):
        device = _mapping(item)
        used, total = _number(device.get("used_bytes")), _number(device.get("total_bytes"))
        utilization = _number(device.get("utilization"))
        device_rows.append(
            [
                _e(_text(device.get("index"))),
                _num_cell(_mib(used) if used is not None else "unknown"),
                _num_cell(_mib(total) if total is not None else "unknown"),
                _num_cell(f"{utilization:.0%}" if utilization is not None else "not reported"),
            ]
        )
    process_rows = []
    for item in _items(reading.get("processes")):
        held = _mapping(item)
        used = _number(held.get("used_bytes"))
        pid = _number(held.get("pid"))
        process_rows.append(
            [
                _e(_text(held.get("gpu"))),
                _e(_text(held.get("pid"))),
                _e(_stage_text(held.get("stage")) or "none"),
                _num_cell(_mib(used) if used is not None else "unknown"),
                _wrap_cell(report.processes.describe(int(pid) if pid is not None else None)),
            ]
        )
    parts = [
        "<p>No GPU timeline in the bundle: this is the one reading taken at capture"
        " (gpu.json).</p>\n"
    ]
    parts.append(
        _table(("device", "used", "total", "utilization"), device_rows)
        if device_rows
        else _problem("gpu.json lists no devices")
    )
    parts.append(
        _table(("device", "pid", "stage", "held", "process"), process_rows)
        if process_rows
        else _problem("gpu.json lists no process holding GPU memory")
    )
    return "".join(parts)


_STACK_NAME = re.compile(r"^stacks/(?P<name>[^/]+)\.txt$")


def _denoising(report: _Report) -> str:
    """Each request a diffusion stage was denoising when the bundle was made, at the step
    its latest step span told, and the stage's pace: from the spans the capture saved."""
    loaded = _load_json(report.files, "spans.json")
    if not loaded.ok:
        return _problem(loaded.problem)
    rows = []
    for stage, recent in sorted(_mapping(_mapping(loaded.value).get("stages")).items()):
        latest: dict[str, tuple[float, int, int]] = {}
        paces: list[float] = []
        ended: set[str] = set()
        for span in _items(recent):
            record = _mapping(span)
            attributes = _mapping(record.get("attributes"))
            request = _text(record.get("request_id"))
            if record.get("name") == DIFFUSION_REQUEST_SPAN:
                ended.add(request)
                continue
            if record.get("name") != DENOISE_STEP_SPAN:
                continue
            step = _number(attributes.get(DENOISE_STEP_INDEX))
            steps = _number(attributes.get(DENOISE_STEP_COUNT))
            at = _number(record.get("start_unix_nano"))
            pace = _number(attributes.get(DENOISE_STEP_SECONDS))
            if pace is not None and pace > 0:
                paces.append(pace)
            if step is None or at is None:
                continue
            if request not in latest or latest[request][0] < at:
                latest[request] = (at, int(step), int(steps or 0))
        pace_text = _seconds(sorted(paces)[len(paces) // 2]) if paces else "unknown"
        for request, (at, step, steps) in sorted(latest.items()):
            if request in ended:
                continue
            rows.append(
                [
                    _e(_stage_text(stage) or _text(stage)),
                    _e(request),
                    _num_cell(f"{step}/{steps or '?'}"),
                    _num_cell(pace_text),
                    _time_html(at / 1e9, report.reference()),
                ]
            )
    if not rows:
        return "<p>none</p>\n"
    headers = ("stage", "request", "step", "a step (median)", "step started")
    return _table(headers, rows)


def _stacks(report: _Report) -> str:
    found = [
        (match.group("name"), name)
        for name in report.files
        if (match := _STACK_NAME.match(_text(name)))
    ]
    if not found:
        return _problem(
            "no stacks in the bundle (capture did not run, py-spy is not installed, or no"
            " recorded process was alive)"
        )
    blocks = []
    for pid, name in sorted(found, key=lambda item: _natural_key(item[0])):
        text = _file_text(report.files, name)
        description = report.processes.describe(_pid_number(pid))
        heading = f"pid {pid}" + (f" ({description})" if description else "")
        body = (
            _stack_body(text, described=bool(description))
            if text is not None
            else _problem(f"{name} could not be read as text")
        )
        blocks.append(
            f'<article class="stack" data-pid="{_e(pid)}">\n<h3>{_e(heading)}</h3>\n'
            f"{body}</article>\n"
        )
    return "".join(blocks)


def _stack_body(text: str, described: bool) -> str:
    """py-spy dump's threads, each cut to its innermost frames (printed first)."""
    # The capture step's "# pid" line and py-spy's "Process" line name the process again:
    # noise under a heading that already describes it, the only name when none does.
    repeated = ("# pid ", "Process ") if described else ()
    preamble: list[str] = []
    threads: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("Thread "):
            threads.append((line.strip(), []))
        elif threads and line.strip():
            threads[-1][1].append(line.strip())
        elif not threads and line.strip() and not line.startswith(repeated):
            preamble.append(line.strip())
    if not threads:
        lines = text.splitlines()
        shown = "\n".join(lines[:STACK_FRAMES_SHOWN])
        return (
            _problem("no thread stacks in this file; its first lines:")
            + f"<pre>{_e(shown) or '(empty)'}</pre>\n"
        )
    parts = [f'<p class="muted">{_e(line)}</p>\n' for line in preamble[:3]]
    for header, frames in threads[:STACK_THREADS_SHOWN]:
        more = len(frames) - STACK_FRAMES_SHOWN
        shown = "\n".join(frames[:STACK_FRAMES_SHOWN]) or "(no frames)"
        tail = f"\n… {more} more frames" if more > 0 else ""
        parts.append(f"<h4>{_e(header)}</h4>\n<pre>{_e(shown)}{_e(tail)}</pre>\n")
    if len(threads) > STACK_THREADS_SHOWN:
        parts.append(_problem(f"{len(threads) - STACK_THREADS_SHOWN} more threads not shown"))
    return "".join(parts)


def _processes(report: _Report) -> str:
    loaded = report.processes
    parts = []
    if loaded.problem:
        parts.append(_problem(loaded.problem))
    elif not loaded.rows:
        parts.append(_problem("processes.json lists no processes"))
    else:
        if loaded.skipped:
            parts.append(_problem(f"processes.json: {loaded.skipped} malformed entries skipped"))
        reference = report.reference()
        rows = []
        for row in loaded.rows:
            cpu = _number(row.get("cpu_seconds"))
            rows.append(
                [
                    _e(_text(row.get("pid"))),
                    _e(_text(row.get("ppid"))),
                    _e(_text(row.get("pgid"))),
                    _e(_text(row.get("role"))),
                    _e(_stage_text(row.get("stage")) or "none"),
                    _e(_text(row.get("status"))),
                    _num_cell(_seconds(cpu) if cpu is not None else "unknown"),
                    _time_html(_wall(row.get("create_time")), reference),
                    _e("yes" if row.get("orphaned") is True else "no"),
                    _wrap_cell(_text(row.get("title"))),
                ]
            )
        headers = (
            "pid",
            "ppid",
            "pgid",
            "role",
            "stage",
            "status",
            "cpu",
            "started",
            "orphaned",
            "title",
        )
        parts.append(_table(headers, rows))
    parts.append(_unkillable(report))
    return "".join(parts)


def _unkillable(report: _Report) -> str:
    """Survivors of SIGKILL, which only verify writes: absent is the normal case."""
    if "unkillable.json" not in report.files:
        return ""
    loaded = _load_json(report.files, "unkillable.json")
    heading = "<h3>Unkillable processes (unkillable.json)</h3>\n"
    if not loaded.ok:
        return heading + _problem(loaded.problem)
    if not isinstance(loaded.value, list):
        return heading + _problem("unkillable.json is malformed: expected a list")
    rows = [
        [
            _e(_text(entry.get("pid"))),
            _e(_text(entry.get("state"))),
            _e(_text(entry.get("wait_channel")) or "unreadable"),
            _wrap_cell(_text(entry.get("title"))),
        ]
        for entry in (_mapping(item) for item in loaded.value)
    ]
    return heading + _table(("pid", "state", "wait channel", "title"), rows)


def _actions(report: _Report) -> str:
    if not report.actions:
        return "<p>none</p>\n"
    reference = report.reference()
    rows = [
        [
            _time_html(_wall(action.get("time")), reference),
            _e(_text(action.get("action")) or "unknown"),
            _badge(_text(action.get("outcome"))),
            _wrap_cell(_text(action.get("detail"))),
        ]
        for action in report.actions
    ]
    return _table(("time", "action", "outcome", "detail"), rows)
