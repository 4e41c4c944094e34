"""Writes the omni-watchdog Grafana dashboard, `dashboards/omni-watchdog.json`.

The JSON is generated so that it stays reviewable and consistent; edit this script, run
`python dashboards/generate.py`, and commit both. `--check` exits 1 when the committed
file differs from what this script writes (tests/test_dashboard.py runs it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

OUTPUT = Path(__file__).resolve().with_name("omni-watchdog.json")
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# Every query is narrowed to the chosen watchdogs; stage queries to the chosen hosts (where
# the stages run) and stages too.
INSTANCE = 'instance=~"$instance"'
HOST = 'instance=~"$instance", host=~"$host"'
STAGE = 'instance=~"$instance", host=~"$host", stage=~"$stage"'
WIDTH = 24

# The detector's states in the order of a stage's life, with the colour each is drawn in.
STATES = (
    ("starting", "blue"),
    ("healthy", "green"),
    ("degraded", "yellow"),
    ("stalled", "orange"),
    ("dead", "red"),
    ("unknown", "purple"),
)


class Layout:
    """Hands out panel ids and grid positions, row by row, left to right."""

    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self._x = 0
        self._y = 0
        self._row_height = 0

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append(
            {
                "type": "row",
                "id": len(self.panels) + 1,
                "title": title,
                "collapsed": False,
                "gridPos": {"x": 0, "y": self._y, "w": WIDTH, "h": 1},
                "panels": [],
            }
        )
        self._y += 1

    def add(self, panel: dict[str, Any], width: int, height: int) -> None:
        if self._x + width > WIDTH:
            self._newline()
        panel["id"] = len(self.panels) + 1
        panel["gridPos"] = {"x": self._x, "y": self._y, "w": width, "h": height}
        self.panels.append(panel)
        self._x += width
        self._row_height = max(self._row_height, height)

    def _newline(self) -> None:
        self._y += self._row_height
        self._x = 0
        self._row_height = 0


def target(expr: str, legend: str = "__auto", ref: str = "A") -> dict[str, Any]:
    return {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": ref}


def stat(
    title: str,
    description: str,
    expr: str,
    mappings: list[dict[str, Any]] | None = None,
    thresholds: list[tuple[float | None, str]] | None = None,
    legend: str = "__auto",
    unit: str = "short",
) -> dict[str, Any]:
    steps = [{"value": v, "color": c} for v, c in thresholds or [(None, "green")]]
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": [target(expr, legend)],
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "mappings": mappings or [],
                "thresholds": {"mode": "absolute", "steps": steps},
                "color": {"mode": "thresholds"},
            },
            "overrides": [],
        },
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "background",
            "graphMode": "none",
            "textMode": "auto",
        },
    }


def yes_no(no: str, yes: str, bad_when_zero: bool = True) -> dict[str, Any]:
    """A value mapping for a 0/1 gauge, coloured by which value is the bad one."""
    bad, good = ("red", "green") if bad_when_zero else ("green", "red")
    return {
        "type": "value",
        "options": {
            "0": {"text": no, "color": bad, "index": 0},
            "1": {"text": yes, "color": good, "index": 1},
        },
    }


def timeseries(
    title: str,
    description: str,
    targets: list[dict[str, Any]],
    unit: str = "short",
    bars: bool = False,
) -> dict[str, Any]:
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": targets,
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "custom": {
                    "drawStyle": "bars" if bars else "line",
                    "fillOpacity": 80 if bars else 10,
                    "stacking": {"mode": "normal" if bars else "none"},
                },
            },
            "overrides": [],
        },
        "options": {
            "legend": {"displayMode": "table", "placement": "right", "calcs": ["lastNotNull"]},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    }


def stage_state_expression() -> str:
    """One series per stage replica whose value is its state's number (1 = starting...)."""
    parts = [
        f'omni_watchdog_stage_state{{{STAGE}, state="{state}"}} * {number}'
        for number, (state, _) in enumerate(STATES, start=1)
    ]
    return (
        "max by (instance, host, stage, stage_name, replica) (\n  " + "\n  or ".join(parts) + "\n)"
    )


def state_timeline() -> dict[str, Any]:
    mapping = {
        str(number): {"text": state, "color": colour, "index": number - 1}
        for number, (state, colour) in enumerate(STATES, start=1)
    }
    return {
        "type": "state-timeline",
        "title": "Stage state",
        "description": "The detector's state of each stage replica over time, by the host it"
        " runs on and the watchdog that judged it: a stage on another host shows twice, as"
        " the head's watchdog sees it from its spans and as the one beside it does.",
        "datasource": DATASOURCE,
        "targets": [
            target(
                stage_state_expression(),
                "{{stage}}.{{replica}} {{stage_name}} on {{host}} ({{instance}})",
            )
        ],
        "fieldConfig": {
            "defaults": {
                "mappings": [{"type": "value", "options": mapping}],
                "color": {"mode": "thresholds"},
                "thresholds": {"mode": "absolute", "steps": [{"value": None, "color": "gray"}]},
            },
            "overrides": [],
        },
        "options": {
            "showValue": "never",
            "mergeValues": True,
            "rowHeight": 0.8,
            "legend": {"showLegend": True, "displayMode": "list", "placement": "bottom"},
        },
    }


def quantiles(metric: str, by: str, legend: str, selector: str = INSTANCE) -> list[dict[str, Any]]:
    """p50 and p99 of a histogram over the dashboard's rate interval."""
    return [
        target(
            f"histogram_quantile({q}, sum by ({by}, le)"
            f" (rate({metric}_bucket{{{selector}}}[$__rate_interval])))",
            f"p{round(q * 100)} {legend}",
            ref,
        )
        for q, ref in ((0.5, "A"), (0.99, "B"))
    ]


def overview(layout: Layout) -> None:
    layout.row("Overview")
    layout.add(
        stat(
            "Watchdog scraped",
            "Whether Prometheus reaches the watchdog's /metrics.",
            f'up{{job=~".*omni-watchdog.*", {INSTANCE}}}',
            [yes_no("down", "up")],
            legend="{{instance}}",
        ),
        4,
        4,
    )
    layout.add(
        stat(
            "Target up",
            "Whether the server's root process is alive.",
            f"omni_watchdog_target_up{{{INSTANCE}}}",
            [yes_no("down", "up")],
            legend="{{instance}}",
        ),
        4,
        4,
    )
    layout.add(
        stat(
            "Liveness",
            "Whether /v1/target/health answers 200: every stage healthy or degraded.",
            f"omni_watchdog_target_liveness{{{INSTANCE}}}",
            [yes_no("failing", "live")],
            legend="{{instance}}",
        ),
        4,
        4,
    )
    layout.add(
        stat(
            "Warmed up",
            "Whether the start-up grace is over; nothing is judged before.",
            f"omni_watchdog_target_warmed_up{{{INSTANCE}}}",
            [yes_no("starting", "yes")],
            legend="{{instance}}",
        ),
        4,
        4,
    )
    layout.add(
        stat(
            "Incident open",
            "Whether the watchdog is handling an incident now.",
            f"omni_watchdog_incident_open{{{INSTANCE}}}",
            [yes_no("no", "open", bad_when_zero=False)],
            legend="{{instance}}",
        ),
        4,
        4,
    )
    layout.add(
        stat(
            "Remediation budget",
            "Enforced incidents still allowed in the current rolling hour.",
            f"omni_watchdog_remediation_budget_remaining{{{INSTANCE}}}",
            thresholds=[(None, "red"), (1, "yellow"), (2, "green")],
            legend="{{instance}}",
        ),
        4,
        4,
    )
    layout.add(
        stat(
            "Remediation paused",
            "An operator's maintenance pause holds the watchdog's actions (omni-watchdog"
            " pause); detection and alerts go on.",
            f"omni_watchdog_remediation_paused{{{INSTANCE}}}",
            [yes_no("acting", "paused", bad_when_zero=False)],
            legend="{{instance}}",
        ),
        4,
        4,
    )
    layout.add(
        stat(
            "Pause ends",
            "When the maintenance pause in force ends; empty when none is.",
            f"omni_watchdog_remediation_pause_end_timestamp_seconds{{{INSTANCE}}} * 1000 > 0",
            legend="{{instance}}",
            unit="dateTimeFromNow",
        ),
        4,
        4,
    )
    layout.add(
        timeseries(
            "Incidents by outcome",
            "Incidents closed in each interval, by how they ended.",
            [
                target(
                    "sum by (outcome) (increase(omni_watchdog_incidents_total"
                    f"{{{INSTANCE}}}[$__rate_interval]))",
                    "{{outcome}}",
                )
            ],
            bars=True,
        ),
        12,
        7,
    )
    layout.add(
        timeseries(
            "Target /health outcome",
            "The outcome of the watchdog's last call to the server's /health.",
            [
                target(
                    f"max by (outcome) (omni_watchdog_target_health_status{{{INSTANCE}}}) == 1",
                    "{{outcome}}",
                )
            ],
        ),
        12,
        7,
    )


def hosts_table() -> dict[str, Any]:
    """One row per watchdog and host its stages run on: the watchdog's role, how many
    stage replicas, whether they are remote to it, and a headless stage's master link."""
    # The watchdog's role joined onto each of its stage series; every query keeps the same
    # labels, so that the rows merge into one.
    with_role = (
        f"omni_watchdog_stage_remote{{{HOST}}}"
        " * on (instance, job) group_left (role) omni_watchdog_host_info"
    )
    link = (
        f"omni_watchdog_master_link_up{{{INSTANCE}}}"
        " * on (instance, job) group_left (role) omni_watchdog_host_info"
    )
    by = "by (instance, host, role)"
    targets = [
        dict(target(f"count {by} ({with_role})", "", "A"), format="table", instant=True),
        dict(target(f"max {by} ({with_role})", "", "B"), format="table", instant=True),
        dict(target(f"max {by} ({link})", "", "C"), format="table", instant=True),
    ]
    columns = {
        "instance": "Watchdog",
        "host": "Host",
        "role": "Role",
        "Value #A": "Stages",
        "Value #B": "Remote",
        "Value #C": "Master link",
    }

    def mapped(column: str, mapping: dict[str, Any]) -> dict[str, Any]:
        return {
            "matcher": {"id": "byName", "options": column},
            "properties": [
                {"id": "mappings", "value": [mapping]},
                {"id": "custom.cellOptions", "value": {"type": "color-text"}},
            ],
        }

    return {
        "type": "table",
        "title": "Hosts",
        "description": "Each watchdog (`instance`) and each host its stages run on: its role"
        " (beside a server, or beside a headless stage), how many stage replicas, whether"
        " they are remote to it (judged from their spans, never signalled: the watchdog on"
        " that host acts on them), and a headless stage's link to its master.",
        "datasource": DATASOURCE,
        "targets": targets,
        "transformations": [
            {"id": "merge", "options": {}},
            {
                "id": "organize",
                "options": {
                    "excludeByName": {"Time": True},
                    "indexByName": {name: index for index, name in enumerate(columns)},
                    "renameByName": columns,
                },
            },
        ],
        "fieldConfig": {
            "defaults": {"custom": {"align": "auto"}},
            "overrides": [
                # Neither is wrong: a remote stage is only somebody else's to act on.
                mapped(
                    "Remote",
                    {
                        "type": "value",
                        "options": {
                            "0": {"text": "local", "color": "green", "index": 0},
                            "1": {"text": "remote", "color": "blue", "index": 1},
                        },
                    },
                ),
                mapped("Master link", yes_no("down", "up")),
            ],
        },
        "options": {"showHeader": True, "sortBy": [{"displayName": "Host", "desc": False}]},
    }


def hosts(layout: Layout) -> None:
    layout.row("Hosts")
    layout.add(hosts_table(), 16, 8)
    layout.add(
        timeseries(
            "Master links",
            "Whether each headless stage's link to its master is up (1); its watchdog ends"
            " the stage once the link has been down for the link grace.",
            [
                target(
                    f"omni_watchdog_master_link_up{{{INSTANCE}}}",
                    "{{host}} to {{address}}:{{port}}",
                )
            ],
        ),
        8,
        8,
    )


def stages(layout: Layout) -> None:
    layout.row("Stages")
    layout.add(state_timeline(), WIDTH, 8)
    layout.add(
        timeseries(
            "Requests in flight and overdue",
            "Admitted requests waiting for each stage's span, and those past their deadline.",
            [
                target(
                    "sum by (host, stage, stage_name)"
                    f" (omni_watchdog_stage_requests_in_flight{{{STAGE}}})",
                    "in flight {{stage}} {{stage_name}} on {{host}}",
                    "A",
                ),
                target(
                    "sum by (host, stage, stage_name)"
                    f" (omni_watchdog_stage_requests_overdue{{{STAGE}}})",
                    "overdue {{stage}} {{stage_name}} on {{host}}",
                    "B",
                ),
            ],
        ),
        12,
        8,
    )
    layout.add(
        timeseries(
            "Stage latency",
            "p50 and p99 of each stage's span durations.",
            quantiles(
                "omni_watchdog_stage_duration_seconds",
                "host, stage, stage_name",
                "{{stage}} {{stage_name}} on {{host}}",
                STAGE,
            ),
            unit="s",
        ),
        12,
        8,
    )
    layout.add(
        timeseries(
            "Heartbeat age",
            "Seconds since each stage loop's last heartbeat span (empty: never seen).",
            [
                target(
                    f"omni_watchdog_stage_heartbeat_age_seconds{{{STAGE}}}",
                    "{{stage}}.{{replica}} {{stage_name}} on {{host}} ({{instance}})",
                )
            ],
            unit="s",
        ),
        12,
        8,
    )
    layout.add(
        timeseries(
            "Time since last progress",
            "Seconds since each stage's progress counters last moved.",
            [
                target(
                    "time() - (omni_watchdog_stage_last_progress_timestamp_seconds"
                    f"{{{STAGE}}} > 0)",
                    "{{stage}}.{{replica}} {{stage_name}} on {{host}} ({{instance}})",
                )
            ],
            unit="s",
        ),
        12,
        8,
    )
    layout.add(
        timeseries(
            "GPU memory per stage",
            "Device memory held by each stage replica's processes, as the watchdog on its"
            " host sees it (the head's watchdog cannot see a remote stage's).",
            [
                target(
                    f"omni_watchdog_stage_gpu_memory_bytes{{{STAGE}}}",
                    "{{stage}}.{{replica}} {{stage_name}} on {{host}}",
                )
            ],
            unit="bytes",
        ),
        12,
        8,
    )
    layout.add(
        timeseries(
            "Verdicts by evidence",
            "Stalled and dead verdicts in each interval, once per kind of evidence carried.",
            [
                target(
                    "sum by (host, stage, state, evidence) (increase(omni_watchdog_verdicts_total"
                    f"{{{STAGE}}}[$__rate_interval])) > 0",
                    "{{stage}} on {{host}} {{state}} {{evidence}}",
                )
            ],
            bars=True,
        ),
        12,
        8,
    )
    layout.add(
        timeseries(
            "Silent stages: their cause, and work against its budget",
            "Seconds each silent stage has been doing what its cause names; for work that"
            " advances (compiling, waiting_on_child, loading, computing), the time charged"
            " against its budget, and the budget of each cause. Work past its budget is"
            " judged like a hang.",
            [
                target(
                    f"omni_watchdog_stage_silence_seconds{{{STAGE}}}",
                    "silent {{stage}}.{{replica}} {{stage_name}} on {{host}}: {{cause}}",
                    "A",
                ),
                target(
                    f"omni_watchdog_stage_work_seconds{{{STAGE}}}",
                    "working {{stage}}.{{replica}} {{stage_name}} on {{host}}: {{cause}}",
                    "B",
                ),
                target(
                    f"max by (cause) (omni_watchdog_work_budget_seconds{{{INSTANCE}}})",
                    "budget {{cause}}",
                    "C",
                ),
            ],
            unit="s",
        ),
        12,
        8,
    )


def gpus(layout: Layout) -> None:
    layout.row("GPUs")
    layout.add(
        timeseries(
            "GPU memory used",
            "Device memory in use on each GPU.",
            [target(f"omni_watchdog_gpu_memory_used_bytes{{{INSTANCE}}}", "gpu {{gpu}}")],
            unit="bytes",
        ),
        8,
        8,
    )
    layout.add(
        timeseries(
            "GPU utilization",
            "Utilization of each GPU.",
            [target(f"omni_watchdog_gpu_utilization_ratio{{{INSTANCE}}}", "gpu {{gpu}}")],
            unit="percentunit",
        ),
        8,
        8,
    )
    layout.add(
        timeseries(
            "GPU memory per process",
            "Device memory per pid, with its stage (empty when the pid is not mapped).",
            [
                target(
                    f"omni_watchdog_gpu_process_memory_bytes{{{INSTANCE}}}",
                    "gpu {{gpu}} pid {{pid}} stage {{stage}}",
                )
            ],
            unit="bytes",
        ),
        8,
        8,
    )


def remediation(layout: Layout) -> None:
    layout.row("Remediation")
    layout.add(
        timeseries(
            "Ladder steps by outcome",
            "Remediation ladder steps in each interval, by step and outcome.",
            [
                target(
                    "sum by (step, outcome) (increase(omni_watchdog_ladder_steps_total"
                    f"{{{INSTANCE}}}[$__rate_interval])) > 0",
                    "{{step}} {{outcome}}",
                )
            ],
            bars=True,
        ),
        8,
        8,
    )
    layout.add(
        timeseries(
            "Ladder step duration",
            "p50 and p99 of each ladder step's duration.",
            quantiles("omni_watchdog_ladder_step_duration_seconds", "step", "{{step}}"),
            unit="s",
        ),
        8,
        8,
    )
    layout.add(
        timeseries(
            "Verdict to memory released",
            "p50 and p99 of the time from a verdict to GPU memory back to baseline.",
            quantiles("omni_watchdog_verdict_to_release_seconds", "instance", "{{instance}}"),
            unit="s",
        ),
        8,
        8,
    )


def watchdog(layout: Layout) -> None:
    layout.row("Watchdog")
    layout.add(
        stat(
            "Evaluation age",
            "Seconds since the detector last judged the stages; normally under 1 s. Past 10 s"
            " the watchdog cannot detect a hang (OmniWatchdogNotEvaluating).",
            f"omni_watchdog_evaluation_age_seconds{{{INSTANCE}}}",
            thresholds=[(None, "green"), (5, "orange"), (10, "red")],
            legend="{{instance}}",
            unit="s",
        ),
        6,
        4,
    )
    layout.add(
        stat(
            "Target lock",
            "Whether another watchdog or a foreign file holds the target's lock, so this"
            " watchdog only observes (/v1/status has the reason under lock).",
            f"omni_watchdog_target_lock_conflict{{{INSTANCE}}}",
            [yes_no("no conflict", "observing only", bad_when_zero=False)],
            legend="{{instance}}",
        ),
        6,
        4,
    )
    layout.add(
        stat(
            "Internal errors, last hour",
            "Exceptions caught in the watchdog's own loops in the last hour; each loop went on.",
            f"sum by (instance) (increase(omni_watchdog_internal_errors_total{{{INSTANCE}}}[1h]))",
            thresholds=[(None, "green"), (1, "orange")],
            legend="{{instance}}",
        ),
        6,
        4,
    )
    layout.add(
        stat(
            "State write errors, last hour",
            "Failed writes of the incident journal and bundles in the last hour; remediation"
            " went on without them.",
            "sum by (instance) (increase(omni_watchdog_state_write_errors_total"
            f"{{{INSTANCE}}}[1h]))",
            thresholds=[(None, "green"), (1, "orange")],
            legend="{{instance}}",
        ),
        6,
        4,
    )
    layout.add(
        timeseries(
            "Evaluation age",
            "Seconds since the detector last judged the stages.",
            [target(f"omni_watchdog_evaluation_age_seconds{{{INSTANCE}}}", "{{instance}}")],
            unit="s",
        ),
        8,
        8,
    )
    layout.add(
        timeseries(
            "Time the watchdog could not run",
            "Share of time the watchdog's own event loop was starved or blocked; that time"
            " is not held against the server, so a hang is judged later by as much.",
            [
                target(
                    f"rate(omni_watchdog_blind_seconds_total{{{INSTANCE}}}[$__rate_interval])",
                    "{{instance}}",
                )
            ],
            unit="percentunit",
        ),
        8,
        8,
    )
    layout.add(
        timeseries(
            "Internal errors by loop",
            "Exceptions caught in each of the watchdog's loops in each interval.",
            [
                target(
                    "sum by (loop) (increase(omni_watchdog_internal_errors_total"
                    f"{{{INSTANCE}}}[$__rate_interval])) > 0",
                    "{{loop}}",
                )
            ],
            bars=True,
        ),
        8,
        8,
    )
    layout.add(
        timeseries(
            "State write errors",
            "Failed writes to the state directory (journal, bundles) in each interval.",
            [
                target(
                    "sum by (instance) (increase(omni_watchdog_state_write_errors_total"
                    f"{{{INSTANCE}}}[$__rate_interval])) > 0",
                    "{{instance}}",
                )
            ],
            bars=True,
        ),
        8,
        8,
    )
    layout.add(
        timeseries(
            "Probes up",
            "Whether each probe's last run succeeded.",
            [target(f"omni_watchdog_probe_up{{{INSTANCE}}}", "{{probe}}")],
        ),
        8,
        8,
    )
    layout.add(
        timeseries(
            "Probe errors and duration",
            "Failed probe runs per second, and how long each probe's last run took.",
            [
                target(
                    f"rate(omni_watchdog_probe_errors_total{{{INSTANCE}}}[$__rate_interval])",
                    "errors/s {{probe}}",
                    "A",
                ),
                target(
                    f"omni_watchdog_probe_duration_seconds{{{INSTANCE}}}",
                    "duration {{probe}}",
                    "B",
                ),
            ],
        ),
        8,
        8,
    )
    layout.add(
        timeseries(
            "Spans received and rejected",
            "Spans per second accepted by the OTLP receiver, and rejections by reason.",
            [
                target(
                    f"rate(omni_watchdog_spans_received_total{{{INSTANCE}}}[$__rate_interval])",
                    "received",
                    "A",
                ),
                target(
                    "sum by (reason) (rate(omni_watchdog_spans_rejected_total"
                    f"{{{INSTANCE}}}[$__rate_interval]))",
                    "rejected {{reason}}",
                    "B",
                ),
            ],
            unit="ops",
        ),
        8,
        8,
    )
    layout.add(
        timeseries(
            "Connections closed",
            "Connections the API and OTLP listeners closed in each interval: over their"
            " connection cap, or without a whole request head in time.",
            [
                target(
                    "sum by (listener, reason) (increase(omni_watchdog_connections_closed_total"
                    f"{{{INSTANCE}}}[$__rate_interval])) > 0",
                    "{{listener}} {{reason}}",
                )
            ],
            bars=True,
        ),
        8,
        8,
    )
    layout.add(
        timeseries(
            "Target processes",
            "Recorded live processes of the server by role and status, and orphans.",
            [
                target(
                    f"sum by (role, status) (omni_watchdog_processes{{{INSTANCE}}}) > 0",
                    "{{role}} {{status}}",
                    "A",
                ),
                target(f"omni_watchdog_orphaned_processes{{{INSTANCE}}}", "orphaned", "B"),
            ],
        ),
        8,
        8,
    )
    layout.add(
        timeseries(
            "Build",
            "The watchdog's version and Python version.",
            [
                target(
                    f"omni_watchdog_build_info{{{INSTANCE}}}",
                    "{{instance}} {{version}} python {{python_version}}",
                )
            ],
        ),
        8,
        8,
    )


def annotation_queries() -> list[dict[str, Any]]:
    """Incidents and ladder steps marked on every panel, from their counters' changes."""
    return [
        {
            "name": "Incidents",
            "datasource": DATASOURCE,
            "enable": True,
            "iconColor": "red",
            "expr": "sum by (instance, outcome) (changes(omni_watchdog_incidents_total"
            f"{{{INSTANCE}}}[1m])) > 0",
            "step": "30s",
            "titleFormat": "Incident {{outcome}}",
            "textFormat": "{{instance}}",
            "tagKeys": "outcome",
            "useValueForTime": False,
        },
        {
            "name": "Ladder steps",
            "datasource": DATASOURCE,
            "enable": True,
            "iconColor": "orange",
            "expr": "sum by (instance, step, outcome) (changes(omni_watchdog_ladder_steps_total"
            f"{{{INSTANCE}}}[1m])) > 0",
            "step": "30s",
            "titleFormat": "{{step}} {{outcome}}",
            "textFormat": "{{instance}}",
            "tagKeys": "step,outcome",
            "useValueForTime": False,
        },
    ]


def variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "type": "query",
        "name": name,
        "label": label,
        "datasource": DATASOURCE,
        "query": {"query": query, "refId": f"{name}-variable"},
        "definition": query,
        "refresh": 2,
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 3,
    }


def build_dashboard() -> dict[str, Any]:
    """The whole dashboard as Grafana's JSON model."""
    layout = Layout()
    for section in (overview, hosts, stages, gpus, remediation, watchdog):
        section(layout)
    return {
        "uid": "omni-watchdog",
        "title": "omni-watchdog",
        "description": "Stage health, stalls and remediation of vLLM / vLLM-Omni servers.",
        "tags": ["omni-watchdog", "vllm"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "10s",
        "timezone": "",
        "links": [
            {
                "title": "Runbook",
                "type": "link",
                "url": "https://github.com/omni-watchdog/omni-watchdog/blob/main/docs/runbook.md",
                "targetBlank": True,
            }
        ],
        "templating": {
            "list": [
                {
                    "type": "datasource",
                    "name": "datasource",
                    "label": "Data source",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                variable("instance", "Watchdog", "label_values(omni_watchdog_target_up, instance)"),
                variable(
                    "host",
                    "Host",
                    'label_values(omni_watchdog_stage_state{instance=~"$instance"}, host)',
                ),
                variable(
                    "stage",
                    "Stage",
                    "label_values(omni_watchdog_stage_state"
                    '{instance=~"$instance", host=~"$host"}, stage)',
                ),
            ]
        },
        "annotations": {"list": annotation_queries()},
        "panels": layout.panels,
    }


def render() -> str:
    return json.dumps(build_dashboard(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if the committed file is not up to date"
    )
    parser.add_argument("--output", type=Path, default=OUTPUT, help="the dashboard file")
    args = parser.parse_args(argv)
    output: Path = args.output
    text = render()
    if args.check:
        if not output.exists() or output.read_text() != text:
            print(f"{output} is stale: run python dashboards/generate.py", file=sys.stderr)
            return 1
        return 0
    output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
