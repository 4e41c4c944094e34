"""One incident as a self-contained HTML page, for the engineer paged by it.

The page is one HTML5 document with inline CSS and inline SVG, no script and nothing
fetched, so it can be attached to a ticket and opened offline. It shows what
`bundle.BundleReading` read of the incident, its bundle and its operator actions, with the
drawings of `svg`; every string from the bundle is escaped, and a section that cannot be
made costs a message, never the page.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from omni_watchdog.exporters.report import svg
from omni_watchdog.exporters.report.bundle import (
    BundleReading,
    GpuSnapshot,
    file_text,
    pid_number,
    read_denoising,
    read_gpu_snapshot,
    read_unkillable,
    text,
)
from omni_watchdog.exporters.report.markup import (
    badge,
    escape,
    mib,
    natural_key,
    num_cell,
    problem,
    seconds,
    table,
    time_html,
    time_plain,
    wrap_cell,
)
from omni_watchdog.types import PIPELINE

STACK_FRAMES_SHOWN = 12
# A process with hundreds of threads would bury the ones that matter; the rest are counted.
STACK_THREADS_SHOWN = 64

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

_STACK_NAME = re.compile(r"^stacks/(?P<name>[^/]+)\.txt$")


def render_incident_report(
    incident: Mapping[str, Any],
    files: Mapping[str, str],
    actions: Sequence[Mapping[str, Any]] = (),
) -> str:
    """The whole HTML document for one incident (its JSON form, `to_jsonable`), its bundle
    files and its operator actions."""
    try:
        reading = BundleReading.read(incident, files, actions)
        unreadable = ""
    except Exception as error:
        # The sections each have a safety net; this is the one for reading the bundle.
        reading = BundleReading.read({}, {}, ())
        unreadable = problem(f"the incident could not be read: {type(error).__name__}: {error}")
    renderers: dict[str, Callable[[BundleReading], str]] = {
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
        _section(section_id, heading, _guarded(renderers[section_id], reading))
        for section_id, heading in _SECTIONS
    ]
    incident_id = reading.incident.incident_id or "(no incident id)"
    outcome = reading.incident.outcome or "unknown"
    title = f"Incident {incident_id}: {outcome}"
    nav = "".join(f'<li><a href="#{sid}">{escape(heading)}</a></li>' for sid, heading in _SECTIONS)
    document = (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        # Defence in depth: were an escape ever missed, the page still runs nothing and
        # loads nothing.
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\';'
        " style-src 'unsafe-inline'\">\n"
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{escape(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
        f"<header><h1>{escape(title)}</h1>"
        f'<p class="muted">omni-watchdog incident report; times are UTC, offsets are from'
        f" the incident's opening.</p>\n<nav><ul>{nav}</ul></nav></header>\n"
        f"<main>\n{unreadable}{''.join(sections)}</main>\n</body>\n</html>\n"
    )
    # Bundle text read with surrogateescape can hold lone surrogates, which no UTF-8 writer
    # accepts: the page must still be saveable.
    return document.encode("utf-8", errors="replace").decode("utf-8")


def _section(section_id: str, heading: str, body: str) -> str:
    return f'<section id="{section_id}">\n<h2>{escape(heading)}</h2>\n{body}</section>\n'


def _guarded(render: Callable[[BundleReading], str], reading: BundleReading) -> str:
    # The readers already absorb bad bundle content; this is the last line, so that a
    # shape nobody foresaw costs one section, never the report an operator is waiting for.
    try:
        return render(reading)
    except Exception as error:
        return problem(f"this section could not be rendered: {type(error).__name__}: {error}")


def _summary(reading: BundleReading) -> str:
    incident = reading.incident
    reference = reading.reference()
    moments = dict(incident.moments)
    opened, closed = incident.opened, incident.closed
    facts: list[tuple[str, str]] = [
        ("Incident", escape(incident.incident_id or "unknown")),
        ("Target", escape(incident.target or "unknown")),
        ("Mode", escape(incident.mode or "unknown")),
        ("Outcome", badge(incident.outcome)),
        ("Cause", escape(incident.cause or "unknown")),
        ("Opened", time_html(opened, reference)),
        ("Closed", time_html(closed, reference) if closed is not None else "still open"),
    ]
    if incident.crashed:
        facts.append(("Crashed", "yes: the server went away by itself"))
    released = moments.get("released")
    for start_key, label in (("first_evidence", "first evidence"), ("verdict", "verdict")):
        start = moments.get(start_key)
        if start is None:
            continue
        span = seconds(released - start) if released is not None else "not released"
        facts.append((f"From {label} to release", escape(span)))
    if opened is not None and closed is not None:
        facts.append(("From opening to close", escape(seconds(closed - opened))))
    for name, label in (
        ("health.txt", "/health at capture"),
        ("metrics.txt", "/metrics at capture"),
    ):
        content = file_text(reading.files, name)
        if content is not None:
            first = content.strip().splitlines()[0] if content.strip() else "(empty)"
            facts.append((label, escape(first[:200])))
    names = sorted(text(name) for name in reading.files)
    listing = "".join(f"<li>{escape(name)}</li>" for name in names) or "<li>none</li>"
    facts.append(
        (
            "Bundle",
            f"{escape(incident.bundle_dir or '(no directory recorded)')}"
            f"<details><summary>{len(names)} files</summary><ul>{listing}</ul></details>",
        )
    )
    rows = "".join(f"<dt>{escape(label)}</dt><dd>{value}</dd>\n" for label, value in facts)
    return f'<dl class="facts">\n{rows}</dl>\n'


def _timeline(reading: BundleReading) -> str:
    drawing = svg.timeline(reading)
    if drawing is None:
        return problem("no wall-clock times in this incident: nothing to draw")
    axis = drawing.axis
    caption = (
        f"From {time_plain(axis.start, axis.reference)} to"
        f" {time_plain(axis.end, axis.reference)}; offsets from the incident's opening."
    )
    moments = reading.incident.moments
    listed = table(
        ("moment", "time"),
        ([escape(key), time_html(time, axis.reference)] for key, time in moments),
    )
    notes = "".join(problem(note) for note in drawing.notes)
    return (
        f"<figure>\n{drawing.svg}<figcaption>{escape(caption)}</figcaption>\n</figure>\n"
        f"{svg.legend(reading)}{notes}"
        f"<h3>Key moments</h3>\n{listed if moments else problem('none recorded')}"
    )


def _evidence(reading: BundleReading) -> str:
    verdicts = reading.incident.verdicts
    if not verdicts:
        return problem("no verdicts: this incident was not opened by the detector")
    reference = reading.reference()
    blocks = []
    for verdict in verdicts:
        stage = verdict.stage or "unknown"
        state = verdict.state or "unknown"
        rows = []
        for evidence in verdict.evidence:
            before = (
                f' <span class="muted">({seconds(verdict.time - evidence.since)}'
                " before the verdict)</span>"
                if evidence.since is not None and verdict.time is not None
                else ""
            )
            since = (
                time_html(evidence.since_wall, reference)
                if evidence.since_wall is not None
                else escape(_raw_time(evidence.since))
            )
            rows.append(
                [escape(evidence.kind or "unknown"), since + before, escape(evidence.detail)]
            )
        when = (
            time_html(verdict.wall, reference)
            if verdict.wall is not None
            else escape(_raw_time(verdict.time))
        )
        listed = table(("kind", "since", "detail"), rows) if rows else problem("no evidence")
        doing = ""
        if verdict.cause is not None:
            advancing = "its work advancing" if verdict.cause.working else "nothing advancing"
            doing = (
                f'<p class="cause">Cause: <strong>{escape(verdict.cause.cause)}</strong>'
                f" ({advancing}): {escape(verdict.cause.detail)}</p>\n"
            )
        subject = (
            "Target, stage unknown"
            if stage == str(PIPELINE)
            else f"Stage {reading.stage_label(stage)}"
        )
        blocks.append(
            f'<article class="verdict" data-stage="{escape(stage)}" data-state="{escape(state)}">\n'
            f"<h3>{escape(subject)}: {badge(state)}</h3>\n"
            f"<p>Verdict at {when}</p>\n{doing}{listed}</article>\n"
        )
    return "".join(blocks)


def _raw_time(value: float | None) -> str:
    return "unknown" if value is None else f"monotonic {value:.3f} s (no wall-clock anchor)"


def _steps(reading: BundleReading) -> str:
    steps = reading.incident.steps
    if not steps:
        return problem("no ladder steps recorded")
    reference = reading.reference()
    rows = [
        [
            escape(step.name or "unknown"),
            badge(step.outcome),
            time_html(step.started, reference),
            num_cell(seconds(step.duration) if step.duration is not None else "unknown"),
            wrap_cell(", ".join(step.targets) or "none"),
            wrap_cell(step.detail),
        ]
        for step in steps
    ]
    return table(("step", "outcome", "started", "duration", "targets", "detail"), rows)


def _gpu(reading: BundleReading) -> str:
    notes = []
    if reading.gpu_timeline.ok:
        if not isinstance(reading.gpu_timeline.value, list):
            notes.append("gpu-timeline.json is malformed: expected a list of readings")
        elif reading.gpu_skipped:
            notes.append(f"gpu-timeline.json: {reading.gpu_skipped} malformed readings skipped")
        if reading.gpu_points:
            return "".join(problem(n) for n in notes) + _gpu_timeline(reading)
        if isinstance(reading.gpu_timeline.value, list):
            notes.append("gpu-timeline.json holds no readings")
    elif "gpu-timeline.json" in reading.files:
        notes.append(reading.gpu_timeline.problem)
    problems = "".join(problem(n) for n in notes)
    snapshot = read_gpu_snapshot(reading.files)
    if isinstance(snapshot, str):
        return problems + problem(snapshot)
    return problems + _gpu_snapshot(reading, snapshot)


def _gpu_timeline(reading: BundleReading) -> str:
    points = reading.gpu_points
    reference = reading.reference()
    pids = sorted({pid for p in points for pid in p.pids}, key=natural_key)
    devices = sorted({d for p in points for d in p.devices}, key=natural_key)
    peak_all = max((v for p in points for v in p.pids.values()), default=0.0)
    start, end = points[0].time, points[-1].time
    charts = []
    rows = []
    for pid in pids:
        # A pid NVML no longer lists holds nothing: the driver frees memory with its process.
        series = [(p.time, p.pids.get(pid, 0.0)) for p in points]
        values = [value for _, value in series]
        description = reading.processes.describe(pid_number(pid))
        charts.append(svg.gpu_chart(pid, description, series, start, end, peak_all, reference))
        rows.append(
            [
                escape(pid),
                wrap_cell(description or "not in processes.json"),
                num_cell(mib(values[0])),
                num_cell(mib(max(values))),
                num_cell(mib(values[-1])),
            ]
        )
    device_rows = []
    for device in devices:
        values = [p.devices[device] for p in points if device in p.devices]
        device_rows.append(
            [
                escape(device),
                num_cell(mib(values[0])),
                num_cell(mib(max(values))),
                num_cell(mib(values[-1])),
            ]
        )
    span = (
        f"{len(points)} readings from {time_plain(start, reference)}"
        f" to {time_plain(end, reference)}; a pid no longer listed counts as 0 MiB."
    )
    pid_table = (
        table(("pid", "process", "first", "peak", "last"), rows)
        if rows
        else problem("no pid held GPU memory in these readings")
    )
    device_table = table(("device", "first", "peak", "last"), device_rows) if device_rows else ""
    return (
        f"<p>{escape(span)}</p>\n<h3>Per process</h3>\n{pid_table}"
        f'<div class="gpu-charts">{"".join(charts)}</div>\n'
        + (f"<h3>Per device (used)</h3>\n{device_table}" if device_table else "")
    )


def _gpu_snapshot(reading: BundleReading, snapshot: GpuSnapshot) -> str:
    device_rows = [
        [
            escape(device.index),
            num_cell(mib(device.used) if device.used is not None else "unknown"),
            num_cell(mib(device.total) if device.total is not None else "unknown"),
            num_cell(
                f"{device.utilization:.0%}" if device.utilization is not None else "not reported"
            ),
        ]
        for device in snapshot.devices
    ]
    process_rows = [
        [
            escape(held.device),
            escape(held.pid),
            escape(held.stage or "none"),
            num_cell(mib(held.used) if held.used is not None else "unknown"),
            wrap_cell(reading.processes.describe(held.pid_number)),
        ]
        for held in snapshot.holders
    ]
    parts = [
        "<p>No GPU timeline in the bundle: this is the one reading taken at capture"
        " (gpu.json).</p>\n"
    ]
    parts.append(
        table(("device", "used", "total", "utilization"), device_rows)
        if device_rows
        else problem("gpu.json lists no devices")
    )
    parts.append(
        table(("device", "pid", "stage", "held", "process"), process_rows)
        if process_rows
        else problem("gpu.json lists no process holding GPU memory")
    )
    return "".join(parts)


def _denoising(reading: BundleReading) -> str:
    """Each request a diffusion stage was denoising when the bundle was made, at the step
    its latest step span told, and the stage's pace: from the spans the capture saved."""
    denoising = read_denoising(reading.files)
    if isinstance(denoising, str):
        return problem(denoising)
    if not denoising:
        return "<p>none</p>\n"
    reference = reading.reference()
    rows = [
        [
            escape(row.stage),
            escape(row.request),
            num_cell(f"{row.step}/{row.steps or '?'}"),
            num_cell(seconds(row.pace) if row.pace is not None else "unknown"),
            time_html(row.started, reference),
        ]
        for row in denoising
    ]
    return table(("stage", "request", "step", "a step (median)", "step started"), rows)


def _stacks(reading: BundleReading) -> str:
    found = [
        (match.group("name"), name)
        for name in reading.files
        if (match := _STACK_NAME.match(text(name)))
    ]
    if not found:
        return problem(
            "no stacks in the bundle (capture did not run, py-spy is not installed, or no"
            " recorded process was alive)"
        )
    blocks = []
    for pid, name in sorted(found, key=lambda item: natural_key(item[0])):
        content = file_text(reading.files, name)
        description = reading.processes.describe(pid_number(pid))
        heading = f"pid {pid}" + (f" ({description})" if description else "")
        body = (
            _stack_body(content, described=bool(description))
            if content is not None
            else problem(f"{name} could not be read as text")
        )
        blocks.append(
            f'<article class="stack" data-pid="{escape(pid)}">\n<h3>{escape(heading)}</h3>\n'
            f"{body}</article>\n"
        )
    return "".join(blocks)


def _stack_body(dump: str, described: bool) -> str:
    """py-spy dump's threads, each cut to its innermost frames (printed first)."""
    # The capture step's "# pid" line and py-spy's "Process" line name the process again:
    # noise under a heading that already describes it, the only name when none does.
    repeated = ("# pid ", "Process ") if described else ()
    preamble: list[str] = []
    threads: list[tuple[str, list[str]]] = []
    for line in dump.splitlines():
        if line.startswith("Thread "):
            threads.append((line.strip(), []))
        elif threads and line.strip():
            threads[-1][1].append(line.strip())
        elif not threads and line.strip() and not line.startswith(repeated):
            preamble.append(line.strip())
    if not threads:
        lines = dump.splitlines()
        shown = "\n".join(lines[:STACK_FRAMES_SHOWN])
        return (
            problem("no thread stacks in this file; its first lines:")
            + f"<pre>{escape(shown) or '(empty)'}</pre>\n"
        )
    parts = [f'<p class="muted">{escape(line)}</p>\n' for line in preamble[:3]]
    for header, frames in threads[:STACK_THREADS_SHOWN]:
        more = len(frames) - STACK_FRAMES_SHOWN
        shown = "\n".join(frames[:STACK_FRAMES_SHOWN]) or "(no frames)"
        tail = f"\n… {more} more frames" if more > 0 else ""
        parts.append(f"<h4>{escape(header)}</h4>\n<pre>{escape(shown)}{escape(tail)}</pre>\n")
    if len(threads) > STACK_THREADS_SHOWN:
        parts.append(problem(f"{len(threads) - STACK_THREADS_SHOWN} more threads not shown"))
    return "".join(parts)


def _processes(reading: BundleReading) -> str:
    loaded = reading.processes
    parts = []
    if loaded.problem:
        parts.append(problem(loaded.problem))
    elif not loaded.rows:
        parts.append(problem("processes.json lists no processes"))
    else:
        if loaded.skipped:
            parts.append(problem(f"processes.json: {loaded.skipped} malformed entries skipped"))
        reference = reading.reference()
        rows = [
            [
                escape(row.pid),
                escape(row.ppid),
                escape(row.pgid),
                escape(row.role),
                escape(row.stage or "none"),
                escape(row.status),
                num_cell(seconds(row.cpu_seconds) if row.cpu_seconds is not None else "unknown"),
                time_html(row.started, reference),
                escape("yes" if row.orphaned else "no"),
                wrap_cell(row.title),
            ]
            for row in loaded.rows
        ]
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
        parts.append(table(headers, rows))
    parts.append(_unkillable(reading))
    return "".join(parts)


def _unkillable(reading: BundleReading) -> str:
    """Survivors of SIGKILL, which only verify writes: absent is the normal case."""
    if "unkillable.json" not in reading.files:
        return ""
    heading = "<h3>Unkillable processes (unkillable.json)</h3>\n"
    survivors = read_unkillable(reading.files)
    if isinstance(survivors, str):
        return heading + problem(survivors)
    rows = [
        [
            escape(survivor.pid),
            escape(survivor.state),
            escape(survivor.wait_channel or "unreadable"),
            wrap_cell(survivor.title),
        ]
        for survivor in survivors
    ]
    return heading + table(("pid", "state", "wait channel", "title"), rows)


def _actions(reading: BundleReading) -> str:
    if not reading.actions:
        return "<p>none</p>\n"
    reference = reading.reference()
    rows = [
        [
            time_html(action.time, reference),
            escape(action.action or "unknown"),
            badge(action.outcome),
            wrap_cell(action.detail),
        ]
        for action in reading.actions
    ]
    return table(("time", "action", "outcome", "detail"), rows)
