"""End to end: the watchdog against the simulated server, for every fault of the table.

Real processes, short configured timeouts, polling with deadlines; every process a test
started is gone at the end (the simulated server's state names them all).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
from deadline import wait_for
from e2e.harness import (
    FAST,
    RECOVERED,
    SIM_ENV,
    WAITS_FOR_A_CRASH,
    all_healthy,
    assert_released,
    attached,
    detection_of,
    in_background,
    incident_done,
    incidents_now,
    judged_for,
    live_processes,
    run_scenario,
    stage_requests,
    state,
    step,
    steps_of,
    warmed_up,
    with_fault,
)

from omni_watchdog.app import Watchdog
from omni_watchdog.config import ProbesConfig, merge_layers
from omni_watchdog.exporters.views import target_health
from omni_watchdog.log import configure_logging
from omni_watchdog.sim.engine import BUILD_S, BUILDER_NAMES
from omni_watchdog.sim.launcher import SimProcess
from omni_watchdog.types import (
    IncidentOutcome,
    SilenceCause,
    StageCause,
    StageRef,
    StageState,
    StepName,
    StepOutcome,
)

pytestmark = pytest.mark.e2e


def run(
    tmp_path: Path,
    faults: list[str],
    generation: str,
    body: Callable[[Watchdog, SimProcess], Awaitable[None]],
    mode: str = "enforce",
    sim_args: list[str] | None = None,
    remediated: bool = True,
    config: dict[str, Any] = FAST,
) -> None:
    configure_logging("debug", (tmp_path / "watchdog.log").open("a"))

    async def scenario() -> list[int]:
        async with attached(tmp_path, faults, generation, mode, config, sim_args, SIM_ENV) as (
            watchdog,
            server,
        ):
            await body(watchdog, server)
            # What the watchdog left behind, before the test's own clean-up runs.
            return server.leftover_pids() if remediated else []

    leftovers = run_scenario(scenario())
    assert not leftovers, f"processes left running: {leftovers}"


def test_engine_dead_hang_is_killed_and_memory_released(tmp_path: Path) -> None:
    async def body(watchdog: Watchdog, server: SimProcess) -> None:
        await warmed_up(watchdog)
        in_background(server.url)
        incident = await incident_done(watchdog)
        # Starved /health and canary can confirm a stall a moment before the exit is seen.
        assert incident.verdicts[0].stage == StageRef(1)
        assert incident.verdicts[0].state in (StageState.STALLED, StageState.DEAD)
        assert step(incident, StepName.SHUTDOWN).outcome in (
            StepOutcome.TIMEOUT,
            StepOutcome.UNREACHABLE,
        )
        assert step(incident, StepName.TERMINATE).outcome is StepOutcome.NOT_RECOVERED
        assert step(incident, StepName.KILL).outcome is StepOutcome.RECOVERED
        assert incident.outcome is IncidentOutcome.RECOVERED_BY_KILL
        assert_released(incident)
        stacks = list((Path(incident.bundle_dir) / "stacks").glob("*.txt"))
        assert any("_stage_worker_async" in p.read_text() for p in stacks)

    run(tmp_path, ["1:engine-dead-hang"], "0.11", body)


def test_stage_dead_503_shuts_down_gracefully(tmp_path: Path) -> None:
    async def body(watchdog: Watchdog, server: SimProcess) -> None:
        await warmed_up(watchdog)
        in_background(server.url)
        incident = await incident_done(watchdog)
        assert {v.stage.stage_id for v in incident.verdicts} == {1}
        assert incident.verdicts[0].state is StageState.DEAD
        assert incident.outcome is IncidentOutcome.RECOVERED_BY_SHUTDOWN
        assert_released(incident)

    run(tmp_path, ["1.0:stage-dead-503", "1.1:stage-dead-503"], "0.30", body)


def probes_without(probe: str) -> dict[str, Any]:
    """FAST with one probe off: the evidence that confirms a stall first is then certain."""
    enabled = [p for p in ProbesConfig().enabled if p != probe]
    return merge_layers(FAST, {"probes": {"enabled": enabled}})


@pytest.mark.parametrize("generation", ["0.11", "0.30"])
def test_silent_stall_is_detected_from_spans_and_counters(tmp_path: Path, generation: str) -> None:
    async def body(watchdog: Watchdog, server: SimProcess) -> None:
        await warmed_up(watchdog)
        in_background(server.url)
        incident = await incident_done(watchdog)
        verdict = incident.verdicts[0]
        assert verdict.stage.stage_id == 0 and verdict.state is StageState.STALLED
        kinds = {e.kind.value for e in verdict.evidence}
        assert "heartbeat_lost" in kinds
        assert incident.outcome in RECOVERED
        assert_released(incident)

    # A canary that was in flight when the stage locked up can fail before the heartbeat
    # times out, and confirm the stall together with the quiet CPUs.
    run(tmp_path, ["0:silent-stall"], generation, body, config=probes_without("canary"))


@pytest.mark.parametrize("generation", ["0.11", "0.30"])
def test_ignored_sigterm_escalates_to_sigkill(tmp_path: Path, generation: str) -> None:
    async def body(watchdog: Watchdog, server: SimProcess) -> None:
        await warmed_up(watchdog)
        in_background(server.url)
        incident = await incident_done(watchdog)
        assert step(incident, StepName.TERMINATE).outcome is StepOutcome.NOT_RECOVERED
        assert incident.outcome is IncidentOutcome.RECOVERED_BY_KILL
        assert_released(incident)

    run(tmp_path, ["ignore-sigterm", "0:silent-stall"], generation, body)


@pytest.mark.parametrize("generation", ["0.11", "0.30"])
def test_escaped_child_is_found_and_killed(tmp_path: Path, generation: str) -> None:
    async def body(watchdog: Watchdog, server: SimProcess) -> None:
        await warmed_up(watchdog)
        root = watchdog.state.target.root
        assert root is not None
        await wait_for(lambda: any(p.sid != root.sid for p in live_processes(watchdog)), 10)
        escaped = [p for p in live_processes(watchdog) if p.sid != root.sid]
        in_background(server.url)
        incident = await incident_done(watchdog)
        assert incident.outcome in RECOVERED
        assert_released(incident)
        assert not any(psutil.pid_exists(p.pid) and _not_zombie(p.pid) for p in escaped)

    run(tmp_path, ["1:escaped-child", "ignore-sigterm", "0:silent-stall"], generation, body)


def _not_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("generation", ["0.11", "0.30"])
def test_orphaned_stages_are_cleaned_up(tmp_path: Path, generation: str) -> None:
    async def body(watchdog: Watchdog, server: SimProcess) -> None:
        await warmed_up(watchdog)
        await with_fault(server, {"kind": "orphaned-stages"})
        if generation == "0.11":
            incident = await incident_done(watchdog)
            assert "orphaned" in incident.cause
            assert incident.outcome in RECOVERED
            assert_released(incident)
        else:
            # The parent-death signal takes the stages down with the server.
            await wait_for(lambda: not server.leftover_pids(), 10)
            incidents = await incidents_now(watchdog)
            assert not [i for i in incidents if i.outcome in RECOVERED]

    run(tmp_path, [], generation, body)


async def loaded_and_never_remediated(watchdog: Watchdog, server: SimProcess) -> None:
    """14 s of requests two at a time (past the default confirm_timeout, 10 s, and every
    shorter timeout): stage 1 is never worse than degraded, and nothing is done to the
    server."""
    await warmed_up(watchdog)
    seen: set[StageState | None] = set()
    deadline = asyncio.get_running_loop().time() + 14
    while asyncio.get_running_loop().time() < deadline:
        if len(asyncio.all_tasks()) < 6:
            in_background(server.url, 2)
        seen.add(state(watchdog, StageRef(1)))
        await asyncio.sleep(0.25)
    assert server.fault_time() is not None
    assert not await incidents_now(watchdog)
    assert seen <= {StageState.HEALTHY, StageState.DEGRADED}


@pytest.mark.parametrize("generation", ["0.11", "0.30"])
def test_slow_but_alive_is_never_remediated(tmp_path: Path, generation: str) -> None:
    run(
        tmp_path,
        ["1:slow-but-alive"],
        generation,
        loaded_and_never_remediated,
        sim_args=["--max-tokens-cap", "16"],
        remediated=False,
    )


@pytest.mark.parametrize("generation", ["0.11", "0.30"])
def test_long_steps_within_the_default_timeouts_are_never_remediated(
    tmp_path: Path, generation: str
) -> None:
    run(
        tmp_path,
        ["1:long-steps"],
        generation,
        loaded_and_never_remediated,
        remediated=False,
        # The timeouts the fault is within: the defaults, with a short warm-up.
        config={"detection": {"startup_grace": "1s"}},
    )


@pytest.mark.parametrize("generation", ["0.11", "0.30"])
def test_a_client_that_goes_away_is_not_waited_for(tmp_path: Path, generation: str) -> None:
    """vLLM drops a request whose client went away: the stages it had not reached never see
    it, and the watchdog must stop waiting for their spans rather than judge them stalled."""

    async def body(watchdog: Watchdog, server: SimProcess) -> None:
        await warmed_up(watchdog)
        (request,) = in_background(server.url)
        await wait_for(lambda: stage_requests(watchdog, 1).in_flight > 0, 15)
        request.cancel()
        await wait_for(
            lambda: all(stage_requests(watchdog, s).in_flight == 0 for s in (0, 1, 2)), 10
        )
        await all_healthy(watchdog, 15)
        assert not await incidents_now(watchdog)

    # Half a second a token: the request is still at stage 1 when its client leaves. No
    # canary: its requests would be at stage 1 too.
    run(
        tmp_path,
        [],
        generation,
        body,
        sim_args=["--token-delay", "0.5"],
        remediated=False,
        config=probes_without("canary"),
    )


@pytest.mark.parametrize("generation", ["0.11", "0.30"])
def test_slow_startup_is_never_judged(tmp_path: Path, generation: str) -> None:
    async def body(watchdog: Watchdog, server: SimProcess) -> None:
        await wait_for(lambda: watchdog.state.target.up, 15)
        for _ in range(40):
            report = watchdog.state.report
            assert report is not None and not report.verdicts
            assert all(s.state is StageState.STARTING for s in report.statuses)
            await asyncio.sleep(0.25)
        assert not await incidents_now(watchdog)
        await warmed_up(watchdog)
        assert not await incidents_now(watchdog)

    run(
        tmp_path,
        ["slow-startup"],
        generation,
        body,
        sim_args=["--startup-seconds", "12"],
        remediated=False,
    )


@pytest.mark.parametrize("generation", ["0.11", "0.30"])
def test_zombie_is_reported_not_remediated(tmp_path: Path, generation: str) -> None:
    async def body(watchdog: Watchdog, server: SimProcess) -> None:
        await warmed_up(watchdog)
        zombies = await wait_for(
            lambda: [p for p in live_processes(watchdog) if p.status.value == "zombie"], 10
        )
        assert len(zombies) == 1
        # Taken for a stuck process, it would be confirmed stuck_timeout + confirm_timeout
        # after it was first seen, which was before now.
        detection = detection_of(FAST)
        await judged_for(watchdog, detection.stuck_timeout + detection.confirm_timeout)
        assert not await incidents_now(watchdog)
        still = [p.pid for p in live_processes(watchdog) if p.status.value == "zombie"]
        assert still == [zombies[0].pid]
        report = watchdog.state.report
        assert report is not None
        assert all(s.state is StageState.HEALTHY for s in report.statuses)

    run(tmp_path, ["1:zombie"], generation, body, remediated=False)


def test_engine_dead_exit_is_a_crash_not_a_clean_stop(tmp_path: Path) -> None:
    async def body(watchdog: Watchdog, server: SimProcess) -> None:
        await warmed_up(watchdog)
        in_background(server.url)
        await wait_for(lambda: server.process.poll() is not None, 20)
        assert server.process.returncode == 0
        incident = await incident_done(watchdog)
        assert incident.outcome is IncidentOutcome.CRASHED
        assert not any(s.outcome is StepOutcome.RECOVERED for s in incident.steps)
        assert_released(incident)

    run(tmp_path, ["1:engine-dead-exit"], "0.11", body, config=WAITS_FOR_A_CRASH)


@pytest.mark.parametrize("generation", ["0.11", "0.30"])
def test_frozen_engine_is_detected_from_canary_and_process_state(
    tmp_path: Path, generation: str
) -> None:
    async def body(watchdog: Watchdog, server: SimProcess) -> None:
        await warmed_up(watchdog)
        in_background(server.url)
        incident = await incident_done(watchdog)
        verdict = incident.verdicts[0]
        assert verdict.stage.stage_id == 1 and verdict.state is StageState.STALLED
        assert "process_stuck" in {e.kind.value for e in verdict.evidence}
        assert incident.outcome in RECOVERED
        assert_released(incident)

    # Plain vLLM: in 0.30 the frozen replica is the engine, so with the plugin its lost
    # heartbeat and the canary can confirm the stall before the stopped state has lasted
    # the stuck timeout.
    run(tmp_path, ["1:frozen-engine"], generation, body, config=probes_without("spans"))


# The admin-endpoint-only deployment: no shared PID namespace, so nothing to signal.
NETWORK_ONLY = merge_layers(
    FAST,
    {
        "probes": {"enabled": ["spans", "metrics", "health", "canary"], "gpu_backend": "none"},
        "ladder": {"steps": ["capture", "shutdown", "verify"]},
    },
)


def test_without_the_process_probe_the_admin_endpoint_ends_a_stall(tmp_path: Path) -> None:
    configure_logging("debug", (tmp_path / "watchdog.log").open("a"))

    async def scenario() -> tuple[Any, bool, int]:
        async with attached(
            tmp_path, ["0:silent-stall"], "0.30", "enforce", NETWORK_ONLY, None, SIM_ENV
        ) as (watchdog, server):
            await warmed_up(watchdog)
            up_before = watchdog.state.target.up
            in_background(server.url)
            incident = await incident_done(watchdog)
            status, _ = target_health(watchdog.state)
            # Without a PID namespace of its own the simulated server's deadlocked stage
            # outlives its API, as it would not in a pod: the container's end takes it.
            # The test's own clean-up stops it.
            await incidents_now(watchdog)  # a state made after the incident closed
            return incident, up_before and not watchdog.state.target.up, status

    incident, up_then_down, health_status = run_scenario(scenario())
    assert up_then_down, "with no process visible, /health answering is what 'up' means"
    assert incident.verdicts[0].stage.stage_id == 0
    assert incident.verdicts[0].state is StageState.STALLED
    shutdown = step(incident, StepName.SHUTDOWN)
    assert shutdown.outcome is StepOutcome.RECOVERED
    assert "only its port can confirm the exit" in shutdown.detail
    verify = step(incident, StepName.VERIFY)
    assert verify.outcome is StepOutcome.OK
    assert "nothing listens on the server's port" in verify.detail
    assert step(incident, StepName.TERMINATE) is None
    assert incident.outcome is IncidentOutcome.RECOVERED_BY_SHUTDOWN
    assert health_status == 503


def cause_of(watchdog: Watchdog, stage: StageRef) -> StageCause | None:
    report = watchdog.state.report
    statuses = report.statuses if report else ()
    return next((s.cause for s in statuses if s.stage == stage), None)


def test_a_build_for_a_stage_is_waited_for_and_named(tmp_path: Path) -> None:
    """A compiler child working for the stage's forward: its silence outlasts every
    timeout of the shared profile, and it is never worse than degraded."""

    async def body(watchdog: Watchdog, server: SimProcess) -> None:
        await warmed_up(watchdog)
        (request,) = in_background(server.url)
        seen: list[StageCause] = []

        def compiling() -> bool:
            cause = cause_of(watchdog, StageRef(1))
            if cause is not None:
                seen.append(cause)
            return cause is not None and cause.cause is SilenceCause.COMPILING

        await wait_for(compiling, BUILD_S)
        assert seen[-1].working and "cc1plus pid" in seen[-1].detail, seen[-1]
        await asyncio.wait_for(request, BUILD_S + 30)
        incidents = await incidents_now(watchdog)
        assert not incidents, incidents
        assert state(watchdog, StageRef(1)) in (StageState.HEALTHY, StageState.DEGRADED)

    run(tmp_path, ["1:compile"], "0.30", body, remediated=False)


def test_a_build_whose_child_stops_is_a_stall_that_names_the_child(tmp_path: Path) -> None:
    async def body(watchdog: Watchdog, server: SimProcess) -> None:
        await warmed_up(watchdog)
        in_background(server.url)

        def building() -> bool:
            cause = cause_of(watchdog, StageRef(1))
            return cause is not None and cause.cause is SilenceCause.WAITING_ON_CHILD

        await wait_for(building, BUILD_S)
        builders = [
            child
            for info in live_processes(watchdog)
            if info.stage == StageRef(1)
            for child in psutil.Process(info.pid).children()
            if child.name() == BUILDER_NAMES["jit"]
        ]
        (builder,) = builders
        builder.suspend()  # the test's own child of its own server
        incident = await incident_done(watchdog)
        (verdict,) = incident.verdicts
        assert (verdict.stage, verdict.state) == (StageRef(1), StageState.STALLED), verdict
        assert verdict.cause is not None, verdict
        assert verdict.cause.cause is SilenceCause.WAITING_ON_CHILD, verdict.cause
        assert not verdict.cause.working
        assert f"pid {builder.pid}: stopped (T)" in verdict.cause.detail, verdict.cause
        assert incident.outcome in RECOVERED, steps_of(incident)

    run(tmp_path, ["1:jit"], "0.30", body)
