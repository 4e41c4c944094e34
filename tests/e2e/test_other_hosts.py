"""End to end: a stage on another host. Each host's watchdog acts only on its own
processes; the head's sees the remote stage through its spans and its server's /health,
alerts on it and never signals across; a head whose remote stage never comes back is
restarted; an orphaned headless stage is ended by its own watchdog.

Two "hosts" on one machine (see `e2e.hosts`): real processes, short configured timeouts,
polling with deadlines.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from deadline import wait_for
from e2e.harness import (
    FAST,
    RECOVERED,
    in_background,
    incident_done,
    incidents_now,
    live_processes,
    metrics,
    run_scenario,
    state,
)
from e2e.hosts import (
    HEAD_HOST,
    REMOTE_STAGE,
    STAGE_HOST,
    StageHost,
    chat,
    head_with_remote_stage,
    running_stage_host,
)

from omni_watchdog.config import merge_layers
from omni_watchdog.types import StageRef, StageState

pytestmark = pytest.mark.e2e

REMOTE = StageRef(REMOTE_STAGE, 0)
# The stage host's watchdog: an orphan is ended 3 s after its link went down.
STAGE_WATCHDOG = merge_layers(FAST, {"detection": {"link_grace": "3s"}})
# The head waits this long for a remote stage to come back before it restarts itself.
LONG_GRACE = merge_layers(FAST, {"detection": {"remote_grace": "120s"}})
FAST_CONFIRM = 6.0  # FAST's confirm_timeout
RECOVERED_OUTCOMES = {outcome.value for outcome in RECOVERED}
UNWELL = (StageState.DEAD, StageState.STALLED, StageState.UNKNOWN)


def test_a_remote_stage_serves_and_each_watchdog_shows_it_where_it_runs(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with (
            head_with_remote_stage(tmp_path / "head", LONG_GRACE) as head,
            running_stage_host(head, tmp_path / "stage", watchdog_config=STAGE_WATCHDOG) as stage,
        ):
            assert await chat(head) == 200
            await wait_for(lambda: state(head.watchdog, REMOTE) is StageState.HEALTHY, 20)
            report = head.watchdog.state.report
            assert report is not None
            remote = next(s for s in report.statuses if s.stage == REMOTE)
            assert remote.remote and remote.host == STAGE_HOST
            body = await metrics(head.watchdog)
            assert (
                f'omni_watchdog_stage_remote{{stage="1",stage_name="talker",replica="0",'
                f'host="{STAGE_HOST}"}} 1' in body
            )
            assert f'omni_watchdog_host_info{{host="{HEAD_HOST}",role="server"}} 1' in body
            seen = await stage.status()
            assert seen["host"] == STAGE_HOST and seen["link"]["up"]
            local = next(s for s in seen["stages"] if s["stage_id"] == REMOTE_STAGE)
            assert not local["remote"] and local["host"] == STAGE_HOST

    run_scenario(scenario())


def kill_replica(stage: StageHost) -> None:
    stage.replicas()[0].send_signal(signal.SIGKILL)


def stop_replica(stage: StageHost) -> None:
    stage.replicas()[0].send_signal(signal.SIGSTOP)


def block_forward(stage: StageHost) -> None:
    """The stage loop deadlocks on the next request that reaches the stage."""
    stage.inject("silent-stall")


@pytest.mark.parametrize(
    ("fault", "verdict"),
    [(kill_replica, "dead"), (stop_replica, "stalled"), (block_forward, "stalled")],
    ids=["SIGKILL of a replica", "SIGSTOP of a replica", "a blocked forward"],
)
def test_a_fault_on_the_headless_stage_is_ended_by_its_own_host_s_watchdog(
    tmp_path: Path, fault: Callable[[StageHost], None], verdict: str
) -> None:
    async def scenario() -> None:
        async with (
            head_with_remote_stage(tmp_path / "head", LONG_GRACE) as head,
            running_stage_host(head, tmp_path / "stage", watchdog_config=STAGE_WATCHDOG) as stage,
        ):
            head_pids = {p.pid for p in live_processes(head.watchdog)}
            assert stage.gpu_bytes() > 0
            fault(stage)
            requests = in_background(head.sim.url, 2)
            incident = await stage.closed_incident(60)
            assert incident["verdicts"][0]["state"] == verdict, incident
            assert incident["outcome"] in RECOVERED_OUTCOMES, incident
            steps = [s["step"] for s in incident["steps"]]
            # No admin endpoint on a headless stage: terminate, kill, verify.
            assert "shutdown" not in steps and steps[-1] == "verify", steps
            assert incident["steps"][-1]["outcome"] == "ok", incident["steps"]
            assert stage.gpu_bytes() == 0
            assert not stage.leftovers()
            # The head's watchdog judged the remote stage, opened nothing and signalled
            # nothing: its own tree is whole.
            await wait_for(lambda: state(head.watchdog, REMOTE) in UNWELL, 20)
            assert await incidents_now(head.watchdog) == ()
            assert {p.pid for p in live_processes(head.watchdog)} == head_pids
            for request in requests:
                request.cancel()

    run_scenario(scenario())


def test_an_orphaned_headless_stage_is_ended_once_its_link_is_down_past_its_grace(
    tmp_path: Path,
) -> None:
    """The head is gone for good: nothing will send the stage work again, and it holds its
    GPU memory until its own watchdog ends it."""

    async def scenario() -> None:
        async with (
            head_with_remote_stage(tmp_path / "head", LONG_GRACE) as head,
            running_stage_host(head, tmp_path / "stage", watchdog_config=STAGE_WATCHDOG) as stage,
        ):
            await head.watchdog.stop()
            head.sim.stop()
            incident = await stage.closed_incident(60)
            verdict = incident["verdicts"][0]
            assert verdict["state"] == "dead"
            assert {e["kind"] for e in verdict["evidence"]} >= {"link_lost"}
            assert incident["outcome"] in RECOVERED_OUTCOMES, incident
            assert stage.gpu_bytes() == 0
            assert not stage.leftovers()

    run_scenario(scenario())


def test_a_remote_stage_the_head_cannot_hear_is_unknown_and_never_acted_on(
    tmp_path: Path,
) -> None:
    """The stage's spans never reach the head (its plugin was not told to export there):
    the head serves, and its watchdog neither blames nor acts on what it cannot see."""

    async def scenario() -> None:
        async with (
            head_with_remote_stage(tmp_path / "head", FAST) as head,
            running_stage_host(head, tmp_path / "stage", to_head=False, with_watchdog=False),
        ):
            assert await chat(head) == 200
            await wait_for(lambda: state(head.watchdog, REMOTE) is StageState.UNKNOWN, 20)
            # Well past every timeout: still unknown, still nothing done.
            await asyncio.sleep(FAST_CONFIRM + 1)
            assert state(head.watchdog, REMOTE) is StageState.UNKNOWN
            assert await incidents_now(head.watchdog) == ()

    run_scenario(scenario())


def test_a_stage_back_within_the_grace_spares_the_head_no_double_remediation(
    tmp_path: Path,
) -> None:
    """Both watchdogs see one failure: the stage host's ends the stage, "Kubernetes"
    starts it again, it registers, and the head's, which only alerted, acts on nothing."""

    async def scenario() -> None:
        async with head_with_remote_stage(tmp_path / "head", LONG_GRACE) as head:
            async with running_stage_host(
                head, tmp_path / "stage", watchdog_config=STAGE_WATCHDOG
            ) as stage:
                kill_replica(stage)
                incident = await stage.closed_incident(60)
                assert incident["outcome"] in RECOVERED_OUTCOMES
                await wait_for(lambda: state(head.watchdog, REMOTE) in UNWELL, 20)
            async with running_stage_host(
                head, tmp_path / "stage-again", watchdog_config=STAGE_WATCHDOG
            ):
                await wait_for(lambda: state(head.watchdog, REMOTE) is StageState.HEALTHY, 20)
                assert await chat(head) == 200
                assert await incidents_now(head.watchdog) == ()
                assert head.watchdog.state.target.up

    run_scenario(scenario())


def test_a_head_whose_remote_stage_never_comes_back_is_restarted(tmp_path: Path) -> None:
    """The head stays up answering 503 for good (vLLM-Omni 0.30) while only its remote
    stage is missing: past the grace its own ladder restarts it, as for any dead stage,
    and it never signals the stage host."""
    grace = merge_layers(FAST, {"detection": {"remote_grace": "6s"}})

    async def scenario() -> None:
        async with (
            head_with_remote_stage(tmp_path / "head", grace) as head,
            running_stage_host(head, tmp_path / "stage", with_watchdog=False) as stage,
        ):
            await wait_for(lambda: state(head.watchdog, REMOTE) is StageState.HEALTHY, 20)
            stage_pids = {p.pid for p in stage.replicas()} | {stage.sim.process.pid}
            stage.sim.stop()
            incident = await incident_done(head.watchdog, 60)
            assert incident.verdicts[0].stage == REMOTE
            assert not incident.verdicts[0].remote
            assert "every local stage is well" in incident.verdicts[0].evidence[0].detail
            assert incident.outcome in RECOVERED
            assert not head.sim.leftover_pids()
            signalled = {pid for step in incident.steps for pid in step.targets}
            assert not signalled & stage_pids

    run_scenario(scenario())
