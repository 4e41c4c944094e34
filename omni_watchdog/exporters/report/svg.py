"""The incident report's drawings, as inline SVG: the timeline (ladder steps, stage lanes
and key moments on one wall-clock axis) and a GPU memory chart per process.

Nothing here reads the bundle: it draws what `bundle.BundleReading` read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from omni_watchdog.exporters.report.bundle import BundleReading, StateChange, Step
from omni_watchdog.exporters.report.markup import (
    escape,
    fill,
    mib,
    natural_key,
    offset,
    seconds,
    svg_text,
    time_plain,
)

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


@dataclass(frozen=True)
class Axis:
    """The timeline's wall-clock span, and the time its offsets count from."""

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


@dataclass(frozen=True)
class TimelineDrawing:
    """The timeline's SVG, its axis, and what the reader should know about its lanes."""

    svg: str
    axis: Axis
    notes: tuple[str, ...]


def _axis_for(reading: BundleReading) -> Axis | None:
    times = reading.known_times()
    if not times:
        return None
    start, end = min(times), max(times)
    # A little room either side keeps the first and last marks off the frame.
    pad = max((end - start) * 0.03, 0.5)
    reference = reading.reference()
    return Axis(start - pad, end + pad, start if reference is None else reference)


def timeline(reading: BundleReading) -> TimelineDrawing | None:
    """The incident on one axis; None without a single wall-clock time to place."""
    axis = _axis_for(reading)
    if axis is None:
        return None
    notes: list[str] = []
    lanes = _stage_lanes(reading, axis, notes)
    marks = [(key, time, "mark") for key, time in reading.incident.moments]
    for action in reading.actions:
        if action.time is not None and axis.start <= action.time <= axis.end:
            marks.append((f"operator {action.action}", action.time, "action"))
    marks.sort(key=lambda mark: mark[1])
    mark_rows = _mark_label_rows(marks, axis)
    label_rows = max(mark_rows, default=0) + 1
    top = 6.0 + label_rows * _MARK_LABEL_ROW
    parts: list[str] = []
    y = top + 4
    parts.append(svg_text(8, y + _ROW - 8, "Ladder steps", weight="600"))
    y += _ROW
    for step in reading.incident.steps:
        parts.append(_step_bar(step, axis, y))
        y += _ROW
    if not reading.incident.steps:
        parts.append(svg_text(_PLOT_LEFT, y + _ROW - 8, "no ladder steps recorded"))
        y += _ROW
    y += 6
    parts.append(svg_text(8, y + _ROW - 8, "Stages", weight="600"))
    y += _ROW
    for lane in lanes:
        parts.append(lane.render(y))
        y += _ROW
    if not lanes:
        parts.append(svg_text(_PLOT_LEFT, y + _ROW - 8, "no stage states known"))
        y += _ROW
    bottom = y + 4
    marks_svg = "".join(
        _mark(key, time, axis, row, top, bottom, css)
        for (key, time, css), row in zip(marks, mark_rows, strict=True)
    )
    ticks = "".join(
        f'<line x1="{axis.x(t):.1f}" y1="{bottom}" x2="{axis.x(t):.1f}" y2="{bottom + 5}"'
        ' stroke="#555"/>' + svg_text(axis.x(t), bottom + 17, label, anchor="middle")
        for t, label in axis.ticks()
    )
    height = bottom + 26
    svg = (
        f'<svg class="timeline" role="img" aria-label="incident timeline"'
        f' viewBox="0 0 {_WIDTH:.0f} {height:.0f}" width="{_WIDTH:.0f}" height="{height:.0f}">\n'
        f"<title>Incident timeline</title>\n"
        f'<rect x="0" y="0" width="{_WIDTH:.0f}" height="{height:.0f}" fill="#fff"/>\n'
        f'<line x1="{_PLOT_LEFT}" y1="{bottom}" x2="{_PLOT_RIGHT}" y2="{bottom}"'
        f' stroke="#555"/>\n{ticks}\n{"".join(parts)}\n{marks_svg}\n</svg>\n'
    )
    return TimelineDrawing(svg, axis, tuple(notes))


def _mark_label_rows(marks: list[tuple[str, float, str]], axis: Axis) -> list[int]:
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
    key: str, time: float, axis: Axis, row: int, top: float, bottom: float, css: str = "mark"
) -> str:
    x = axis.x(time)
    label_y = 6.0 + (max(row, 0) + 1) * _MARK_LABEL_ROW - 3
    anchor = "end" if x > _PLOT_RIGHT - 40 else "start"
    label_x = x - 2 if anchor == "end" else x + 2
    return (
        f'<g class="{css}" data-mark="{escape(key)}">'
        f"<title>{escape(key)}: {escape(time_plain(time, axis.reference))}</title>"
        f'<line x1="{x:.1f}" y1="{top:.1f}" x2="{x:.1f}" y2="{bottom:.1f}" stroke="#444"'
        ' stroke-dasharray="3 3"/>'
        f"{svg_text(label_x, label_y, key, anchor=anchor)}</g>\n"
    )


def _step_bar(step: Step, axis: Axis, y: float) -> str:
    name = step.name or "unknown"
    outcome = step.outcome or "unknown"
    group = f'<g class="step" data-step="{escape(name)}" data-outcome="{escape(outcome)}">'
    label = svg_text(8, y + _ROW - 8, name)
    if step.started is None:
        return (
            f"{group}{label}"
            f"{svg_text(_PLOT_LEFT, y + _ROW - 8, f'{outcome}, start time unknown')}</g>\n"
        )
    x = axis.x(step.started)
    width = max(_MIN_BAR, axis.x(step.started + step.span) - x)
    title = (
        f"{name}: {outcome}, {seconds(step.span)},"
        f" started {time_plain(step.started, axis.reference)}"
        + (f"; {step.detail}" if step.detail else "")
    )
    summary = f"{outcome} · {seconds(step.span)}"
    text_right = x + width + 4
    if text_right + len(summary) * _CHAR_WIDTH > _WIDTH - 4:
        outcome_text = svg_text(x - 4, y + _ROW - 8, summary, anchor="end")
    else:
        outcome_text = svg_text(text_right, y + _ROW - 8, summary)
    return (
        f"{group}<title>{escape(title)}</title>{label}"
        f'<rect x="{x:.1f}" y="{y + (_ROW - _BAR) / 2:.1f}" width="{width:.1f}"'
        f' height="{_BAR:.0f}" fill="{fill(outcome)}" stroke="#222" stroke-width="0.5"/>'
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
                f'<rect class="{self.css}" data-stage="{escape(self.stage)}"'
                f' data-state="{escape(state)}"'
                f' x="{x:.1f}" y="{y + (_ROW - _BAR) / 2:.1f}" width="{width:.1f}"'
                f' height="{_BAR:.0f}" fill="{fill(state)}" stroke="#fff" stroke-width="0.5">'
                f"<title>{escape(title)}</title></rect>"
            )
            if width >= len(state) * _CHAR_WIDTH + 6 and self.css == "state":
                rects.append(
                    f'<text x="{x + 3:.1f}" y="{y + _ROW - 8:.1f}" fill="#fff"'
                    f' style="fill:#fff">{escape(state)}</text>'
                )
            elif self.css == "verdict":
                rects.append(svg_text(x + width + 4, y + _ROW - 8, f"verdict: {state}"))
        return (
            f'<g class="lane" data-stage="{escape(self.stage)}">'
            f"{svg_text(8, y + _ROW - 8, f'stage {self.label}')}{''.join(rects)}</g>\n"
        )


def _stage_lanes(reading: BundleReading, axis: Axis, notes: list[str]) -> list[_Lane]:
    if reading.states.ok and isinstance(reading.states.value, list):
        if reading.states_skipped:
            notes.append(f"states.json: {reading.states_skipped} malformed entries skipped")
        if reading.state_changes:
            return _state_lanes(reading, axis)
        if not reading.states_skipped:
            notes.append("states.json lists no state changes: stage lanes show the verdicts")
    elif reading.states.ok:
        notes.append("states.json is malformed (expected a list): stage lanes show the verdicts")
    else:
        notes.append(f"{reading.states.problem}: stage lanes show the verdicts only")
    return _verdict_lanes(reading, axis)


def _state_lanes(reading: BundleReading, axis: Axis) -> list[_Lane]:
    by_stage: dict[str, list[StateChange]] = {}
    for change in reading.state_changes:
        by_stage.setdefault(change.stage, []).append(change)
    lanes = []
    for stage in sorted(by_stage, key=natural_key):
        changes = by_stage[stage]
        segments = []
        for index, change in enumerate(changes):
            end = changes[index + 1].time if index + 1 < len(changes) else axis.end
            x = axis.x(change.time)
            width = max(_MIN_BAR, axis.x(end) - x)
            title = (
                f"stage {reading.stage_label(stage)}: {change.state} from"
                f" {time_plain(change.time, axis.reference)}"
                + (f" for {seconds(end - change.time)}" if index + 1 < len(changes) else "")
            )
            segments.append((x, width, change.state, title))
        lanes.append(_Lane(stage, reading.stage_label(stage), tuple(segments), "state"))
    return lanes


def _verdict_lanes(reading: BundleReading, axis: Axis) -> list[_Lane]:
    marks: dict[str, list[tuple[float, float, str, str]]] = {}
    # An incident that did not record its clocks still has its first verdict's wall time.
    fallback = dict(reading.incident.moments).get("verdict")
    for verdict in reading.incident.verdicts:
        stage = verdict.stage or "?"
        state = verdict.state or "unknown"
        time = verdict.wall or fallback
        if time is None:
            continue
        when = time_plain(time, axis.reference)
        title = f"stage {reading.stage_label(stage)}: verdict {state} at {when}"
        marks.setdefault(stage, []).append((axis.x(time), _MIN_BAR * 2, state, title))
    return [
        _Lane(stage, reading.stage_label(stage), tuple(marks[stage]), "verdict")
        for stage in sorted(marks, key=natural_key)
    ]


def legend(reading: BundleReading) -> str:
    """A swatch for each outcome and state the timeline colours."""
    names = [step.outcome for step in reading.incident.steps]
    names += [change.state for change in reading.state_changes]
    names += [verdict.state for verdict in reading.incident.verdicts]
    seen = list(dict.fromkeys(name for name in names if name))
    if not seen:
        return ""
    items = "".join(
        f'<li><svg width="12" height="12" aria-hidden="true" class="swatch">'
        f'<rect width="12" height="12" fill="{fill(name)}"/></svg>{escape(name)}</li>'
        for name in seen
    )
    return f'<ul class="legend">{items}</ul>\n'


def gpu_chart(
    pid: str,
    description: str,
    series: list[tuple[float, float]],
    start: float,
    end: float,
    peak: float,
    reference: float | None,
) -> str:
    """One pid's GPU memory over the readings, on a scale shared with the other pids."""
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
        f"<title>{escape(time_plain(time, reference))}: {escape(mib(value))}</title></circle>"
        for (x, y), (time, value) in zip(coordinates, series, strict=True)
    )
    values = [value for _, value in series]
    heading = f"pid {pid}: peak {mib(max(values))}, last {mib(values[-1])}"
    return (
        f'<svg class="gpu-chart" data-pid="{escape(pid)}" role="img"'
        f' aria-label="{escape(heading)}"'
        f' viewBox="0 0 {_GPU_CHART_WIDTH:.0f} {_GPU_CHART_HEIGHT:.0f}"'
        f' width="{_GPU_CHART_WIDTH:.0f}" height="{_GPU_CHART_HEIGHT:.0f}">'
        f"<title>{escape(heading)}{escape(f' ({description})' if description else '')}</title>"
        f'<rect x="0" y="0" width="{_GPU_CHART_WIDTH:.0f}" height="{_GPU_CHART_HEIGHT:.0f}"'
        ' fill="#fff"/>'
        f'<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="#999"/>'
        f"{svg_text(left, 14, heading)}"
        f"{svg_text(left, _GPU_CHART_HEIGHT - 6, offset(start, reference))}"
        f"{svg_text(right, _GPU_CHART_HEIGHT - 6, offset(end, reference), anchor='end')}"
        f'<polyline points="{path}" fill="none" stroke="#1565c0" stroke-width="1.5"/>'
        f"{dots}</svg>\n"
    )
