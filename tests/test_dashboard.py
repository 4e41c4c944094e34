"""The Grafana dashboard: generated from dashboards/generate.py, valid PromQL, known metrics."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from test_alerts import EXPORTER_FAMILIES, rendered_families, run_promtool, unknown_metrics

ROOT = Path(__file__).resolve().parents[1]
GENERATOR = ROOT / "dashboards" / "generate.py"
DASHBOARD = ROOT / "dashboards" / "omni-watchdog.json"
# A value for each dashboard variable, as Grafana would interpolate it into a query.
VARIABLE_VALUES = {"instance": ".*", "host": ".*", "stage": "0|1", "__rate_interval": "1m"}
_VARIABLE = re.compile(r"\$\{?(\w+)\}?")
_LABEL_VALUES = re.compile(r"label_values\((.+), *\w+\)")


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dashboard_generator", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def panels() -> Iterator[dict[str, Any]]:
    return (p for p in dashboard()["panels"] if p["type"] != "row")


def queries() -> dict[str, str]:
    """Every PromQL expression of the dashboard, by where it is: panel targets, annotations."""
    found = {
        f"panel_{panel['id']}_{query['refId']}": query["expr"]
        for panel in panels()
        for query in panel["targets"]
    }
    for number, annotation in enumerate(dashboard()["annotations"]["list"]):
        found[f"annotation_{number}"] = annotation["expr"]
    return found


def interpolated(expression: str) -> str:
    return _VARIABLE.sub(lambda match: VARIABLE_VALUES[match.group(1)], expression)


def variables() -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dashboard()["templating"]["list"]}


def run_generator(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(GENERATOR), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_committed_dashboard_is_what_the_generator_writes() -> None:
    assert DASHBOARD.read_text() == generator().render()
    result = run_generator("--check")
    assert result.returncode == 0, result.stderr


def test_check_fails_on_a_stale_dashboard(tmp_path: Path) -> None:
    stale = tmp_path / "omni-watchdog.json"
    stale.write_text(DASHBOARD.read_text().replace('"refresh": "10s"', '"refresh": "1m"'))
    result = run_generator("--check", "--output", str(stale))
    assert result.returncode == 1
    assert "stale" in result.stderr
    assert run_generator("--output", str(stale)).returncode == 0
    assert stale.read_text() == DASHBOARD.read_text()


def test_every_expression_parses(tmp_path: Path) -> None:
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:{where}", "expr": interpolated(expr)}
                    for where, expr in queries().items()
                ],
            }
        ]
    }
    path = tmp_path / "dashboard.rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = run_promtool("check", "rules", path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_dashboard_names_only_metrics_of_the_contract() -> None:
    assert unknown_metrics(queries().values(), EXPORTER_FAMILIES) == {}
    # `label_values(<selector>, <label>)`: the selector is PromQL, the label is not.
    selectors = [
        _LABEL_VALUES.fullmatch(v["definition"]).group(1)  # type: ignore[union-attr]
        for v in variables().values()
        if v["type"] == "query"
    ]
    assert len(selectors) == 3
    assert unknown_metrics(selectors, EXPORTER_FAMILIES) == {}


def test_the_dashboard_names_only_metrics_the_exporter_writes() -> None:
    assert unknown_metrics(queries().values(), rendered_families()) == {}


def test_the_dashboard_has_the_variables_grafana_needs() -> None:
    board = dashboard()
    assert board["schemaVersion"] >= 38
    found = variables()
    assert found["datasource"]["type"] == "datasource"
    assert found["datasource"]["query"] == "prometheus"
    assert "omni_watchdog_stage_state" in found["stage"]["definition"]
    assert found["host"]["definition"].endswith(", host)")
    assert 'host=~"$host"' in found["stage"]["definition"]
    for panel in panels():
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert all(q["datasource"]["uid"] == "${datasource}" for q in panel["targets"])
    assert all(a["datasource"]["uid"] == "${datasource}" for a in board["annotations"]["list"])


def test_panel_ids_are_unique_and_panels_do_not_overlap() -> None:
    board = dashboard()["panels"]
    assert len({p["id"] for p in board}) == len(board)
    taken: set[tuple[int, int]] = set()
    for panel in board:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        cells = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells


@pytest.mark.parametrize(
    ("kind", "metric"),
    [
        ("stat", "omni_watchdog_target_up"),
        ("stat", "omni_watchdog_target_liveness"),
        ("stat", "omni_watchdog_remediation_budget_remaining"),
        ("timeseries", "omni_watchdog_incidents_total"),
        ("state-timeline", "omni_watchdog_stage_state"),
        ("timeseries", "omni_watchdog_stage_requests_in_flight"),
        ("timeseries", "omni_watchdog_stage_requests_overdue"),
        ("timeseries", "omni_watchdog_stage_duration_seconds_bucket"),
        ("timeseries", "omni_watchdog_stage_heartbeat_age_seconds"),
        ("timeseries", "omni_watchdog_stage_gpu_memory_bytes"),
        ("timeseries", "omni_watchdog_stage_silence_seconds"),
        ("timeseries", "omni_watchdog_stage_work_seconds"),
        ("timeseries", "omni_watchdog_work_budget_seconds"),
        ("stat", "omni_watchdog_evaluation_age_seconds"),
        ("stat", "omni_watchdog_target_lock_conflict"),
        ("stat", "omni_watchdog_internal_errors_total"),
        ("stat", "omni_watchdog_remediation_paused"),
        ("stat", "omni_watchdog_remediation_pause_end_timestamp_seconds"),
        ("stat", "omni_watchdog_state_write_errors_total"),
        ("timeseries", "omni_watchdog_evaluation_age_seconds"),
        ("timeseries", "omni_watchdog_blind_seconds_total"),
        ("timeseries", "omni_watchdog_internal_errors_total"),
        ("timeseries", "omni_watchdog_state_write_errors_total"),
        ("timeseries", "omni_watchdog_spans_rejected_total"),
        ("timeseries", "omni_watchdog_connections_closed_total"),
        ("table", "omni_watchdog_host_info"),
        ("table", "omni_watchdog_stage_remote"),
        ("table", "omni_watchdog_master_link_up"),
        ("timeseries", "omni_watchdog_master_link_up"),
    ],
)
def test_the_dashboard_shows(kind: str, metric: str) -> None:
    shown = [
        q["expr"]
        for p in panels()
        if p["type"] == kind
        for q in p["targets"]
        if metric in q["expr"]
    ]
    assert shown, f"no {kind} panel queries {metric}"


def test_stage_latency_is_a_quantile_of_the_duration_histogram() -> None:
    assert any(
        expr.startswith("histogram_quantile(")
        and "omni_watchdog_stage_duration_seconds_bucket" in expr
        for expr in queries().values()
    )


def test_incidents_and_ladder_steps_are_annotations_from_counter_changes() -> None:
    exprs = [a["expr"] for a in dashboard()["annotations"]["list"]]
    for counter in ("omni_watchdog_incidents_total", "omni_watchdog_ladder_steps_total"):
        assert any(f"changes({counter}" in e for e in exprs), counter


def test_the_watchdogs_own_health_is_in_its_row() -> None:
    board = dashboard()["panels"]
    start = next(i for i, p in enumerate(board) if p["type"] == "row" and p["title"] == "Watchdog")
    end = next((i for i, p in enumerate(board) if i > start and p["type"] == "row"), len(board))
    shown = " ".join(q["expr"] for p in board[start + 1 : end] for q in p["targets"])
    for family in (
        "omni_watchdog_evaluation_age_seconds",
        "omni_watchdog_blind_seconds_total",
        "omni_watchdog_internal_errors_total",
        "omni_watchdog_state_write_errors_total",
        "omni_watchdog_target_lock_conflict",
        "omni_watchdog_spans_rejected_total",
        "omni_watchdog_connections_closed_total",
    ):
        assert family in shown, family


def test_every_stage_panel_is_narrowed_to_the_chosen_hosts_and_names_the_host() -> None:
    stage_queries = [
        (panel["title"], query)
        for panel in panels()
        if panel["type"] != "table"
        for query in panel["targets"]
        if "omni_watchdog_stage_" in query["expr"]
    ]
    assert len(stage_queries) >= 7
    for title, query in stage_queries:
        assert 'host=~"$host"' in query["expr"], title
        assert "{{host}}" in query["legendFormat"], title


def test_the_hosts_table_merges_one_row_per_watchdog_and_host() -> None:
    table = next(p for p in panels() if p["type"] == "table" and p["title"] == "Hosts")
    for query in table["targets"]:
        assert query["format"] == "table" and query["instant"] is True
        # The rows merge only if every query keeps the same labels.
        assert query["expr"].startswith(
            ("count by (instance, host, role)", "max by (instance, host, role)")
        )
    organize = next(t for t in table["transformations"] if t["id"] == "organize")
    assert list(organize["options"]["renameByName"].values()) == [
        "Watchdog",
        "Host",
        "Role",
        "Stages",
        "Remote",
        "Master link",
    ]
