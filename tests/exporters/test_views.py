"""/v1/status of a head's watchdog and of a headless stage's: where each stage runs."""

from __future__ import annotations

import dataclasses

from exporters.watchdog_state import HOST, REMOTE_HOST, headless_state, scripted_state

from omni_watchdog.exporters.views import status_of, target_health
from omni_watchdog.types import StageState


def test_the_status_says_where_each_stage_runs_and_which_are_remote() -> None:
    scripted = scripted_state()
    status = status_of(scripted.state, scripted.clock.monotonic())
    assert status["host"] == HOST and status["link"] is None
    where = {
        (s["stage_id"], s["replica"]): (s["remote"], s["host"], s["gpu_memory_bytes"])
        for s in status["stages"]
    }
    assert where[(1, 0)][:2] == (False, HOST) and where[(1, 0)][2] > 0
    # This host's NVML cannot see a remote stage's memory: unknown, not none held.
    assert where[(2, 0)] == (True, REMOTE_HOST, None)


def test_a_headless_stages_status_shows_its_link_to_the_master() -> None:
    scripted = headless_state()
    status = status_of(scripted.state, scripted.clock.monotonic())
    assert status["host"] == REMOTE_HOST
    assert status["link"] == {
        "address": "10.0.0.1",
        "port": 29500,
        "up": False,
        "since": scripted.state.wall(scripted.state.made_at - 5.0),
        "detail": "connection refused",
    }
    assert [(s["stage_id"], s["remote"], s["host"]) for s in status["stages"]] == [
        (2, False, REMOTE_HOST)
    ]


def test_a_remote_stage_unwell_leaves_the_head_s_liveness_answer_alone() -> None:
    """The stage's own host restarts it; a probe that followed it would restart the head."""
    scripted = scripted_state()
    report = scripted.state.report
    assert report is not None
    statuses = tuple(
        dataclasses.replace(s, state=StageState.DEAD) if s.remote else s for s in report.statuses
    )
    assert any(s.remote for s in statuses)
    local_ok = dataclasses.replace(
        scripted.state,
        report=dataclasses.replace(
            report,
            statuses=tuple(
                dataclasses.replace(s, state=StageState.HEALTHY) if not s.remote else s
                for s in statuses
            ),
        ),
    )
    assert target_health(local_ok)[0] == 200
    local_dead = dataclasses.replace(
        local_ok,
        report=dataclasses.replace(
            report,
            statuses=tuple(dataclasses.replace(s, state=StageState.DEAD) for s in statuses),
        ),
    )
    code, reason = target_health(local_dead)
    assert code == 503 and "stage 2" not in reason


def test_the_status_shows_the_stack_samples_only_of_the_probe_that_takes_them() -> None:
    scripted = scripted_state()
    probes = status_of(scripted.state, scripted.clock.monotonic())["probes"]
    assert probes["activity"]["stack_sample_errors_total"] == 2
    assert probes["activity"]["last_stack_sample_error"].startswith("pid 1002: py-spy")
    assert "stack_sample_errors_total" not in probes["health"]
