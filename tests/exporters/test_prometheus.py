"""The watchdog's /metrics: golden output, promtool, the family contract, the stats.

Set OMNI_WATCHDOG_UPDATE_GOLDEN=1 to rewrite `golden/metrics.txt` from the current output
instead of comparing with it (then review the diff).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
from aiohttp.test_utils import TestClient, TestServer
from exporters.watchdog_state import (
    HOST,
    REMOTE_HOST,
    START,
    Scripted,
    headless_state,
    scripted_incidents,
    scripted_state,
    working_state,
)
from fakes import FakePsutil
from prometheus_client.parser import text_string_to_metric_families

from omni_watchdog.config import WatchdogConfig
from omni_watchdog.exporters.api import JsonApi
from omni_watchdog.exporters.prometheus import CONTENT_TYPE, FAMILY_NAMES, UNKNOWN_HOST
from omni_watchdog.probes.processes import ProcessTracker
from omni_watchdog.self_health import ProbeBoard
from omni_watchdog.stats import Histogram, WatchdogStats
from omni_watchdog.target import TargetWatch
from omni_watchdog.types import (
    Evidence,
    EvidenceKind,
    HealthOutcome,
    IncidentOutcome,
    Observation,
    ObservationKind,
    StageRef,
    StageState,
    StepName,
    StepOutcome,
    Verdict,
)

GOLDEN = Path(__file__).parent / "golden" / "metrics.txt"
UPDATE_GOLDEN = os.environ.get("OMNI_WATCHDOG_UPDATE_GOLDEN") == "1"
# The only value the fake clock does not fix: the interpreter running the test.
_MASKS = ((re.compile(r'python_version="[^"]*"'), 'python_version="MASKED"'),)


def masked(text: str) -> str:
    for pattern, replacement in _MASKS:
        text = pattern.sub(replacement, text)
    return text


@pytest.fixture
def scripted() -> Scripted:
    return scripted_state()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_match_the_golden_file(scripted: Scripted) -> None:
    text = masked(scripted.rendered())
    if UPDATE_GOLDEN:
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), "set OMNI_WATCHDOG_UPDATE_GOLDEN=1 to rewrite"


@pytest.mark.parametrize("make", [scripted_state, headless_state], ids=["head", "headless"])
def test_promtool_check_metrics_is_clean(make: Callable[[], Scripted]) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package 'prometheus'); metrics not linted")
    result = subprocess.run(
        [promtool, "check", "metrics"],
        input=make().rendered(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == ""


def test_every_family_of_the_contract_is_present(scripted: Scripted) -> None:
    names = {family.name for family in text_string_to_metric_families(scripted.rendered())}
    # The parser names counters without their _total suffix.
    expected = {name.removesuffix("_total") for name in FAMILY_NAMES}
    assert names == expected
    assert len(FAMILY_NAMES) == 54


def test_content_type_is_the_text_format() -> None:
    assert CONTENT_TYPE.startswith("text/plain; version=0.0.4")


def test_state_shows_the_scripted_story(scripted: Scripted) -> None:
    found = samples(scripted.rendered())

    def value(name: str, **labels: str) -> float:
        return found[("omni_watchdog_" + name, tuple(sorted(labels.items())))]

    stalled = {"stage": "1", "stage_name": "stage-1", "replica": "0", "host": HOST}
    assert value("stage_state", state="stalled", **stalled) == 1
    assert value("stage_state", state="healthy", **stalled) == 0
    assert value("stage_remote", **stalled) == 0
    unseen = {"stage": "0", "stage_name": 'thinker "main"', "replica": "1", "host": HOST}
    assert value("stage_state", state="unknown", **unseen) == 1
    heartbeat_unseen = value("stage_heartbeat_age_seconds", **unseen)
    assert heartbeat_unseen != heartbeat_unseen  # NaN
    assert value("stage_heartbeat_age_seconds", **stalled) == 15.0
    # The stalled stage's processes sleep on a lock with nothing working for them; only a
    # silent stage has a series.
    assert value("stage_silence_seconds", **stalled, cause="lock_or_queue_wait") == 0.0
    silences = [key for key in found if key[0].endswith("silence_seconds")]
    assert len(silences) == 1, silences
    assert value("stage_requests_overdue", stage="1", stage_name="stage-1", host=HOST) == 6
    in_flight = value("stage_requests_in_flight", stage="0", stage_name='thinker "main"', host=HOST)
    assert in_flight == 0
    remote = {"stage": "2", "stage_name": "stage-2", "replica": "0", "host": REMOTE_HOST}
    assert value("stage_remote", **remote) == 1
    assert value("stage_state", state="healthy", **remote) == 1
    unseen_memory = value("stage_gpu_memory_bytes", **remote)
    assert unseen_memory != unseen_memory  # NaN: out of this host's NVML
    assert (
        value("stage_duration_seconds_count", stage="2", stage_name="stage-2", host=REMOTE_HOST)
        == 0
    )
    assert value("host_info", host=HOST, role="server") == 1
    verdict = {"stage": "1", "stage_name": "stage-1", "host": HOST, "state": "stalled"}
    assert value("verdicts_total", evidence="heartbeat_lost", **verdict) == 1
    assert value("verdicts_total", evidence="gpu_held", **verdict) == 1
    assert value("verdicts_total", evidence="process_exit", **verdict) == 0
    assert value("target_liveness") == 0
    assert value("target_health_status", outcome="ok") == 1
    assert value("probe_up", probe="canary") == 0
    assert value("probe_errors_total", probe="canary") == 3
    # Only the activity probe samples stacks: no other probe has a series for them.
    assert value("probe_stack_sample_errors_total", probe="activity") == 2
    stack_samples = [key for key in found if key[0].startswith("omni_watchdog_probe_stack")]
    assert len(stack_samples) == 1, stack_samples
    assert value("incidents_total", outcome="recovered_by_term") == 1
    assert value("incidents_total", outcome="planned") == 1
    assert value("incident_open") == 1
    assert value("ladder_steps_total", step="terminate", outcome="planned") == 1
    assert value("ladder_step_duration_seconds_count", step="terminate") == 1
    assert value("verdict_to_release_seconds_count") == 1
    assert value("verdict_to_release_seconds_sum") == pytest.approx(7.6)
    assert value("gpu_process_memory_bytes", gpu="0", pid="99999", stage="", host=HOST) == 2**29
    assert value("processes", role="helper", status="zombie") == 1
    assert value("orphaned_processes") == 1
    assert value("remediation_budget_exhausted_total") == 1
    assert value("remediation_records_exhausted_total") == 4
    assert not any(name.startswith("omni_watchdog_master_link") for name, _ in found)


def test_a_stage_working_past_its_budget_shows_its_work_beside_the_budget(
    scripted: Scripted,
) -> None:
    # A JIT build: 700 s of work advancing, its compiler child waited on for the last 100.
    found = samples(working_state().rendered())
    stage = (("host", HOST), ("replica", "0"), ("stage", "1"), ("stage_name", "stage-1"))
    cause = (("cause", "waiting_on_child"),)
    assert found[("omni_watchdog_stage_work_seconds", (*cause, *stage))] == 700.0
    assert found[("omni_watchdog_stage_silence_seconds", (*cause, *stage))] == 100.0
    assert found[("omni_watchdog_work_budget_seconds", cause)] == 600.0
    assert found[("omni_watchdog_work_budget_seconds", (("cause", "compiling"),))] == 1800.0
    # A cause that is no work has no work series, and a cause that cannot be work no budget.
    assert not any(name.endswith("stage_work_seconds") for name, _ in samples(scripted.rendered()))
    budgets = {dict(labels)["cause"] for name, labels in found if name.endswith("budget_seconds")}
    assert budgets == {"compiling", "waiting_on_child", "loading", "computing"}


def test_a_headless_stages_watchdog_shows_its_role_and_master_link() -> None:
    found = samples(headless_state().rendered())
    link = (("address", "10.0.0.1"), ("host", REMOTE_HOST), ("port", "29500"))
    assert found[("omni_watchdog_master_link_up", link)] == 0
    changed = found[("omni_watchdog_master_link_last_change_timestamp_seconds", link)]
    assert changed == START + 15.0 - 5.0 + 1_700_000_000.0
    role = (("host", REMOTE_HOST), ("role", "headless_stage"))
    assert found[("omni_watchdog_host_info", role)] == 1
    own = (("host", REMOTE_HOST), ("replica", "0"), ("stage", "2"), ("stage_name", "stage-2"))
    assert found[("omni_watchdog_stage_remote", own)] == 0
    assert {dict(labels)["host"] for _, labels in found if "stage" in dict(labels)} == {REMOTE_HOST}


def test_a_stage_on_a_host_not_yet_known_is_on_host_unknown(scripted: Scripted) -> None:
    state = scripted.state
    assert state.report is not None
    statuses = tuple(
        dataclasses.replace(s, host="") if s.remote else s for s in state.report.statuses
    )
    placed = dataclasses.replace(state.report, statuses=statuses)
    found = samples(Scripted(dataclasses.replace(state, report=placed), scripted.clock).rendered())
    remote = {"stage": "2", "stage_name": "stage-2", "replica": "0", "host": UNKNOWN_HOST}
    assert found[("omni_watchdog_stage_remote", tuple(sorted(remote.items())))] == 1
    hosts = {dict(labels).get("host") for _, labels in found if dict(labels).get("stage") == "2"}
    assert hosts == {UNKNOWN_HOST}


def test_a_host_renamed_at_every_scrape_keeps_the_series_and_labels_bounded(
    scripted: Scripted,
) -> None:
    state = scripted.state
    assert state.report is not None
    exposition = scripted.exposition()
    counts = set()
    for n in range(50):
        statuses = tuple(
            dataclasses.replace(s, host=f"host-{n}") if s.remote else s
            for s in state.report.statuses
        )
        exposition.export(
            dataclasses.replace(state, report=dataclasses.replace(state.report, statuses=statuses))
        )
        text = exposition.render().decode()
        assert f'host="host-{n}"' in text and f'host="host-{n - 1}"' not in text
        counts.add(sum(1 for line in text.splitlines() if not line.startswith("#")))
    assert len(counts) == 1
    # Three stages' lines and the pipeline's (its verdicts: no stage proved the one).
    assert len(exposition._replica_lines) == 4 and len(exposition._stage_lines) == 3 + 1


def test_every_series_exists_before_anything_happened() -> None:
    scripted = scripted_state()
    state = scripted.state
    probes = ProbeBoard(WatchdogConfig().probes.enabled)
    probes.failed("gpu", "no NVML backend (gpu_backend none)")
    nothing = dataclasses.replace(
        state,
        target=dataclasses.replace(state.target, health=None),
        report=None,
        gpu=None,
        probes=probes.snapshot(),
        counters=WatchdogStats().counters(),
    )
    scripted = Scripted(nothing, scripted.clock)
    found = samples(scripted.rendered())
    names = {name for name, _ in found}
    assert names >= {"omni_watchdog_verdicts_total", "omni_watchdog_ladder_steps_total"}
    refs = [labels for name, labels in found if name == "omni_watchdog_stage_state"]
    assert len(refs) == 4 * len(StageState)  # 4 replicas of 3 stages, every state
    # Before any judgement no stage is known to run elsewhere: all on this host, local.
    remote = {labels: v for (name, labels), v in found.items() if name.endswith("stage_remote")}
    assert len(remote) == 4 and set(remote.values()) == {0}
    assert all(dict(labels)["host"] == HOST for labels in remote)
    starting = {
        dict(labels)["replica"] + dict(labels)["stage"]
        for name, labels in found
        if name == "omni_watchdog_stage_state"
        and dict(labels)["state"] == "starting"
        and found[(name, labels)] == 1
    }
    assert len(starting) == 4
    verdicts = [k for k in found if k[0] == "omni_watchdog_verdicts_total"]
    # Three stages and the pipeline (a verdict no stage could be proved the one for).
    assert len(verdicts) == (3 + 1) * 2 * len(EvidenceKind)
    assert all(found[k] == 0 for k in verdicts)
    assert {dict(k[1])["stage"] for k in verdicts} == {"0", "1", "2", "pipeline"}
    steps = [k for k in found if k[0] == "omni_watchdog_ladder_steps_total"]
    assert len(steps) == len(StepName) * len(StepOutcome)
    assert found[("omni_watchdog_probe_up", (("probe", "gpu"),))] == 0
    assert (
        found[
            (
                "omni_watchdog_stage_duration_seconds_count",
                (("host", HOST), ("stage", "2"), ("stage_name", "stage-2")),
            )
        ]
        == 0
    )


def test_histogram_buckets_are_inclusive_and_cumulative() -> None:
    histogram = Histogram((1.0, 2.0))
    for value in (0.5, 1.0, 1.5, 3.0):
        histogram.observe(value)
    frozen = histogram.frozen()
    assert frozen.counts == (2, 1, 1)
    assert frozen.total == 6.0


def test_a_closed_incident_is_counted_once_and_journal_ones_never() -> None:
    stats = WatchdogStats()
    old, new, still_open = scripted_incidents()
    stats.ignore_closed([old])
    assert stats.count_incidents([old, new, still_open]) == [new]
    assert stats.count_incidents([old, new, still_open]) == []
    counters = stats.counters()
    assert sum(counters.incidents.values()) == 1
    assert sum(counters.ladder_steps.values()) == len(new.steps)


def test_each_ladder_step_is_counted_as_it_ends_not_when_the_incident_closes() -> None:
    stats = WatchdogStats()
    finished = scripted_incidents()[0]
    capture, shutdown, terminate, _ = finished.steps
    running = dataclasses.replace(finished, steps=(capture,), outcome=IncidentOutcome.OPEN)
    running = dataclasses.replace(running, closed=None)
    assert stats.count_incidents([running]) == []
    assert stats.counters().ladder_steps == {(StepName.CAPTURE, StepOutcome.OK): 1}
    assert stats.counters().step_durations[StepName.CAPTURE].total == capture.duration
    running = dataclasses.replace(running, steps=(capture, shutdown, terminate))
    stats.count_incidents([running])
    assert stats.counters().ladder_steps == {
        (StepName.CAPTURE, StepOutcome.OK): 1,
        (StepName.SHUTDOWN, StepOutcome.UNREACHABLE): 1,
        (StepName.TERMINATE, StepOutcome.RECOVERED): 1,
    }
    assert stats.counters().incidents == {}
    assert stats.count_incidents([finished]) == [finished]
    assert sum(stats.counters().ladder_steps.values()) == 4
    assert stats.counters().incidents == {IncidentOutcome.RECOVERED_BY_TERM: 1}


def test_time_held_by_a_pause_is_not_time_to_release() -> None:
    stats = WatchdogStats()
    finished = scripted_incidents()[0]
    verdict = 1_000.0
    timeline = {"verdict": verdict, "held": verdict + 2, "unheld": verdict + 602}
    held = dataclasses.replace(finished, timeline={**timeline, "released": verdict + 609})
    assert stats.count_incidents([held]) == [held]
    # 609 s from verdict to release, 600 of them the operator's.
    assert stats.counters().verdict_to_release.total == pytest.approx(9.0)


def test_verdicts_count_each_kind_of_evidence_once() -> None:
    stats = WatchdogStats()
    ref = StageRef(2, 1)
    evidence = (
        Evidence(EvidenceKind.SPAN_OVERDUE, ref, 1.0, "a"),
        Evidence(EvidenceKind.SPAN_OVERDUE, ref, 2.0, "b"),
        Evidence(EvidenceKind.PROCESS_EXIT, ref, 2.0, "c"),
    )
    stats.count_verdicts([Verdict(ref, StageState.DEAD, 3.0, evidence)])
    assert stats.counters().verdicts == {
        (2, StageState.DEAD, EvidenceKind.SPAN_OVERDUE): 1,
        (2, StageState.DEAD, EvidenceKind.PROCESS_EXIT): 1,
    }


class NoBundles:
    def names(self, incident_id: str) -> list[str]:
        return []

    def read(self, incident_id: str) -> dict[str, str]:
        return {}


def test_the_api_serves_metrics_in_the_text_format(scripted: Scripted) -> None:
    async def scrape() -> tuple[int, str, str]:
        api = JsonApi(scripted.clock, scripted.state, scripted.exposition(), NoBundles())
        async with TestClient(TestServer(api.app())) as client:
            response = await client.get("/metrics")
            return response.status, response.headers["Content-Type"], await response.text()

    status, content_type, body = asyncio.run(scrape())
    assert status == 200
    assert content_type == CONTENT_TYPE
    assert masked(body) == GOLDEN.read_text()


WITH_PROCESSES = ["spans", "metrics", "health", "canary", "processes", "gpu"]
# The admin-endpoint-only deployment: no shared PID namespace, so no process probe.
NETWORK_ONLY = ["spans", "metrics", "health", "canary"]


@pytest.mark.parametrize(
    ("probes", "root_alive", "health", "up"),
    [
        (WITH_PROCESSES, True, HealthOutcome.REFUSED, 1),
        (WITH_PROCESSES, False, HealthOutcome.OK, 0),
        (NETWORK_ONLY, False, HealthOutcome.OK, 1),
        (NETWORK_ONLY, False, HealthOutcome.UNHEALTHY, 1),
        (NETWORK_ONLY, True, HealthOutcome.REFUSED, 0),
        (NETWORK_ONLY, True, HealthOutcome.TIMEOUT, 0),
        (NETWORK_ONLY, True, None, 0),
    ],
)
def test_target_up_is_the_root_process_or_without_the_process_probe_health(
    probes: list[str], root_alive: bool, health: HealthOutcome | None, up: int
) -> None:
    tracker = cast(ProcessTracker, SimpleNamespace(target_alive=root_alive))
    target = TargetWatch(
        "http://127.0.0.1:8000",
        tracker,
        None,
        FakePsutil(),
        lambda pid: 0.0,
        by_process="processes" in probes,
        on_gpu_failure=lambda reason: None,
    )
    if health is not None:
        target.observe([Observation(ObservationKind.HEALTH, START, outcome=health)])
    assert target.up is bool(up)
    scripted = scripted_state()
    view = dataclasses.replace(scripted.state.target, up=target.up, by_process=target.by_process)
    shown = Scripted(dataclasses.replace(scripted.state, target=view), scripted.clock)
    assert samples(shown.rendered())[("omni_watchdog_target_up", ())] == up
