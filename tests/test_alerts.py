"""The alerting rules: promtool checks and unit tests, metric names, runbook sections.

`promtool` comes from Debian's prometheus package (`make tools` installs it). Without it
these tests skip locally and fail in CI (where `CI` is set), so a missing tool never
passes silently there.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "alerts" / "omni-watchdog.rules.yml"
RULE_TESTS = ROOT / "alerts" / "tests"
RUNBOOK = ROOT / "docs" / "runbook.md"
GOLDEN_METRICS = ROOT / "tests" / "exporters" / "golden" / "metrics.txt"
RUNBOOK_BASE = "https://github.com/omni-watchdog/omni-watchdog/blob/main/docs/runbook.md"

ALERTS = (
    "OmniStageStalled",
    "OmniStageDead",
    "OmniStageDegraded",
    "OmniStageWorkPastBudget",
    "OmniGpuMemoryStuck",
    "OmniGpuMemoryNotReleased",
    "OmniRemediationFailed",
    "OmniWatchdogUnkillableProcess",
    "OmniRemediationBudgetExhausted",
    "OmniTargetDown",
    "OmniNoStageSpans",
    "OmniWatchdogDown",
    "OmniWatchdogNotEvaluating",
    "OmniWatchdogStarved",
    "OmniWatchdogInternalErrors",
    "OmniWatchdogStateWriteErrors",
    "OmniWatchdogLockConflict",
    "OmniWatchdogSpansRejected",
    "OmniStageRequestErrors",
    "OmniStageMasterLinkLost",
)

# The exporter's families and their types: the contract between the exporter, the alerts
# and the dashboard.
EXPORTER_FAMILIES = {
    "omni_watchdog_build_info": "gauge",
    "omni_watchdog_host_info": "gauge",
    "omni_watchdog_master_link_up": "gauge",
    "omni_watchdog_master_link_last_change_timestamp_seconds": "gauge",
    "omni_watchdog_target_up": "gauge",
    "omni_watchdog_target_warmed_up": "gauge",
    "omni_watchdog_target_health_status": "gauge",
    "omni_watchdog_target_liveness": "gauge",
    "omni_watchdog_probe_up": "gauge",
    "omni_watchdog_probe_errors_total": "counter",
    "omni_watchdog_probe_stack_sample_errors_total": "counter",
    "omni_watchdog_probe_duration_seconds": "gauge",
    "omni_watchdog_stage_state": "gauge",
    "omni_watchdog_stage_remote": "gauge",
    "omni_watchdog_stage_last_progress_timestamp_seconds": "gauge",
    "omni_watchdog_stage_heartbeat_age_seconds": "gauge",
    "omni_watchdog_stage_silence_seconds": "gauge",
    "omni_watchdog_stage_work_seconds": "gauge",
    "omni_watchdog_work_budget_seconds": "gauge",
    "omni_watchdog_stage_requests_in_flight": "gauge",
    "omni_watchdog_stage_requests_overdue": "gauge",
    "omni_watchdog_stage_request_errors_total": "counter",
    "omni_watchdog_stage_denoising_requests": "gauge",
    "omni_watchdog_stage_denoise_step_seconds": "gauge",
    "omni_watchdog_stage_duration_seconds": "histogram",
    "omni_watchdog_stage_gpu_memory_bytes": "gauge",
    "omni_watchdog_spans_received_total": "counter",
    "omni_watchdog_spans_rejected_total": "counter",
    "omni_watchdog_gpu_memory_used_bytes": "gauge",
    "omni_watchdog_gpu_utilization_ratio": "gauge",
    "omni_watchdog_gpu_process_memory_bytes": "gauge",
    "omni_watchdog_processes": "gauge",
    "omni_watchdog_orphaned_processes": "gauge",
    "omni_watchdog_verdicts_total": "counter",
    "omni_watchdog_incidents_total": "counter",
    "omni_watchdog_incident_open": "gauge",
    "omni_watchdog_ladder_steps_total": "counter",
    "omni_watchdog_ladder_step_duration_seconds": "histogram",
    "omni_watchdog_verdict_to_release_seconds": "histogram",
    "omni_watchdog_remediation_budget_remaining": "gauge",
    "omni_watchdog_remediation_budget_exhausted_total": "counter",
    "omni_watchdog_remediation_records_exhausted_total": "counter",
    "omni_watchdog_remediation_paused": "gauge",
    "omni_watchdog_remediation_pause_end_timestamp_seconds": "gauge",
    "omni_watchdog_operator_actions_total": "counter",
    "omni_watchdog_internal_errors_total": "counter",
    "omni_watchdog_evaluation_age_seconds": "gauge",
    "omni_watchdog_blind_seconds_total": "counter",
    "omni_watchdog_blind_spells_total": "counter",
    "omni_watchdog_probe_timeouts_set_aside_total": "counter",
    "omni_watchdog_state_write_errors_total": "counter",
    "omni_watchdog_target_lock_conflict": "gauge",
    "omni_watchdog_connections_closed_total": "counter",
    "omni_watchdog_bundle_reads_refused_total": "counter",
}
# Series Prometheus itself writes for every scrape target.
PROMETHEUS_SERIES = {"up"}

_PROMQL_KEYWORDS = {
    "and",
    "or",
    "unless",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
    "inf",
    "nan",
}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_LABEL_LIST = re.compile(
    r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", re.IGNORECASE
)
_IDENTIFIER = re.compile(r"(?<![\w.$])([A-Za-z_:][\w:]*)(\s*\()?")


def prometheus_tool(name: str) -> str:
    """The `promtool` or `prometheus` binary; skips locally and fails in CI when missing."""
    found = shutil.which(name)
    if found is None:
        message = f"{name} not found: `make tools` installs Debian's prometheus package"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found


def run_promtool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [prometheus_tool("promtool"), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def metric_names(expression: str) -> set[str]:
    """Names of the series a PromQL expression selects (functions and keywords left out)."""
    text = _STRING.sub('""', expression)
    text = _MATCHERS.sub("", text)
    text = _RANGE.sub("", text)
    text = _LABEL_LIST.sub(" ", text)
    return {
        match.group(1)
        for match in _IDENTIFIER.finditer(text)
        if match.group(2) is None and match.group(1).lower() not in _PROMQL_KEYWORDS
    }


def sample_names(families: dict[str, str]) -> set[str]:
    """The names series of these families are written under (histograms have three)."""
    names = set()
    for family, kind in families.items():
        if kind == "histogram":
            names |= {f"{family}_bucket", f"{family}_sum", f"{family}_count"}
        else:
            names.add(family)
    return names


def rendered_families() -> dict[str, str]:
    """The exporter's own families: from its golden `/metrics` if present, else as declared."""
    if GOLDEN_METRICS.exists():
        kinds = re.findall(r"^# TYPE (\S+) (\S+)$", GOLDEN_METRICS.read_text(), re.MULTILINE)
        return dict(kinds)
    from omni_watchdog.exporters import prometheus

    return {prometheus.PREFIX + name: kind for name, kind, _ in prometheus.FAMILIES}


def unknown_metrics(expressions: Iterable[str], families: dict[str, str]) -> dict[str, set[str]]:
    """For each expression naming a series the families do not write, those names."""
    known = sample_names(families) | PROMETHEUS_SERIES
    unknown = {expr: metric_names(expr) - known for expr in expressions}
    return {expr: names for expr, names in unknown.items() if names}


def rules() -> list[dict[str, Any]]:
    document = yaml.safe_load(RULES.read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def runbook_anchors() -> set[str]:
    """GitHub's anchors for the runbook's headings: lower case, spaces to dashes."""
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+)$", RUNBOOK.read_text(), re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


def test_promtool_checks_the_rules() -> None:
    result = run_promtool("check", "rules", RULES)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in result.stdout


def test_promtool_unit_tests_pass() -> None:
    result = run_promtool("test", "rules", *sorted(RULE_TESTS.glob("*.yml")))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_rules_are_exactly_the_alerts_of_the_design() -> None:
    assert [rule["alert"] for rule in rules()] == list(ALERTS)


@pytest.mark.parametrize("rule", rules(), ids=lambda rule: rule["alert"])
def test_every_alert_is_labelled_annotated_and_linked(rule: dict[str, Any]) -> None:
    assert rule["labels"]["severity"] in ("critical", "warning")
    assert {"summary", "description", "runbook_url"} <= set(rule["annotations"])
    assert rule["annotations"]["runbook_url"] == f"{RUNBOOK_BASE}#{rule['alert'].lower()}"


def test_every_alert_has_a_firing_and_a_quiet_unit_test() -> None:
    firing: set[str] = set()
    quiet: set[str] = set()
    for path in RULE_TESTS.glob("*.yml"):
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    assert set(ALERTS) - firing == set(), "alerts never tested firing"
    assert set(ALERTS) - quiet == set(), "alerts never tested not firing"


def test_every_runbook_url_anchor_exists_in_the_runbook() -> None:
    anchors = runbook_anchors()
    missing = [
        rule["alert"]
        for rule in rules()
        if rule["annotations"]["runbook_url"].partition("#")[2] not in anchors
    ]
    assert missing == []


@pytest.mark.parametrize("alert", ALERTS)
def test_every_alert_has_a_complete_runbook_section(alert: str) -> None:
    sections = re.split(r"^## ", RUNBOOK.read_text(), flags=re.MULTILINE)
    section = next((s for s in sections if s.startswith(alert + "\n")), None)
    assert section is not None, f"docs/runbook.md has no '## {alert}' section"
    for part in ("Meaning", "Impact", "Diagnosis", "Mitigation"):
        assert f"\n### {part}\n" in section, f"{alert}: no '### {part}'"
    assert "curl" in section, f"{alert}: the diagnosis names no command"


@pytest.mark.parametrize(
    "rule",
    [r for r in rules() if re.search(r"omni_watchdog_(stage_|master_link)", r["expr"])],
    ids=lambda rule: rule["alert"],
)
def test_every_alert_on_a_stage_or_a_link_says_which_host_to_go_to(rule: dict[str, Any]) -> None:
    assert "{{ $labels.host }}" in rule["annotations"]["summary"]
    assert "{{ $labels.host }}" in rule["annotations"]["description"]


@pytest.mark.parametrize(
    "rule",
    [r for r in rules() if "omni_watchdog_stage_state{" in r["expr"].split()[0]],
    ids=lambda rule: rule["alert"],
)
def test_every_stage_state_alert_drops_the_remote_view_of_a_stage_seen_locally(
    rule: dict[str, Any],
) -> None:
    # Else one failure of a headless stage pages twice: from the head and from its host.
    assert "unless ignoring (state)" in rule["expr"]
    assert "on (stage, replica, host) omni_watchdog_stage_remote == 0" in rule["expr"]


def test_the_rules_name_only_metrics_of_the_contract() -> None:
    assert unknown_metrics((rule["expr"] for rule in rules()), EXPORTER_FAMILIES) == {}


def test_the_rules_name_only_metrics_the_exporter_writes() -> None:
    assert unknown_metrics((rule["expr"] for rule in rules()), rendered_families()) == {}


def test_the_exporter_writes_the_families_of_the_contract() -> None:
    assert rendered_families() == EXPORTER_FAMILIES


@pytest.mark.parametrize(
    ("expression", "names"),
    [
        ('omni_watchdog_stage_state{state="stalled"} == 1', {"omni_watchdog_stage_state"}),
        (
            "increase(omni_watchdog_incidents_total[30m]) > 0 and on (instance, job) up == 1",
            {"omni_watchdog_incidents_total", "up"},
        ),
        (
            'histogram_quantile(0.99, sum by (le) (rate(x_bucket{stage=~"$stage"}[5m])))',
            {"x_bucket"},
        ),
        ('absent(up{job=~".*omni-watchdog.*"}) or vector(0)', {"up"}),
    ],
)
def test_metric_names_finds_the_selected_series(expression: str, names: set[str]) -> None:
    assert metric_names(expression) == names
