"""The plugin in the simulated server: admitted, stage and heartbeat spans reach the watchdog,
and a stage's heartbeats stop exactly when its loop blocks."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from deadline import wait_for
from e2e.harness import FAST, SIM_ENV, attached, last_heartbeat, live_processes, run_scenario

from omni_watchdog.app import Watchdog
from omni_watchdog.demo import send_request
from omni_watchdog.semconv import (
    HEARTBEAT_SPAN,
    REQUEST_ADMITTED_SPAN,
    REQUEST_STAGE_PATH,
    STAGE_REQUEST_SPAN,
)
from omni_watchdog.types import StageRef

pytestmark = pytest.mark.e2e
STAGES = (StageRef(0), StageRef(1), StageRef(2))
# Heartbeats of each other stage that land while a blocked stage's stay away: first enough
# for the spans it sent before it blocked to land (about 1.5 s at SIM_ENV's 0.5 s interval),
# then the window in which none of its own may (about 3 s).
SETTLING_BEATS = 3
QUIET_BEATS = 6


def names(watchdog: Watchdog, stage: StageRef | None) -> list[str]:
    return [record.name for record in watchdog.spans.recent(stage)]


def all_beating(watchdog: Watchdog) -> bool:
    return all(last_heartbeat(watchdog, stage) for stage in STAGES)


async def quiet_while_others_beat(
    watchdog: Watchdog, blocked: StageRef, beats: int
) -> float | None:
    """Wait until every other stage's heartbeat has landed `beats` times in a row in which
    `blocked`'s did not; its last heartbeat then."""
    others = set(STAGES) - {blocked}

    def heartbeat(stage: StageRef) -> float | None:
        return last_heartbeat(watchdog, stage)

    quiet_at: float | None = heartbeat(blocked)
    last = {stage: heartbeat(stage) for stage in others}
    landed = dict.fromkeys(others, 0)
    moves = 0

    def others_landed() -> bool:
        nonlocal quiet_at, landed, moves
        if heartbeat(blocked) != quiet_at:
            quiet_at = heartbeat(blocked)
            landed = dict.fromkeys(others, 0)
            moves += 1
        for stage in others:
            if heartbeat(stage) != last[stage]:
                last[stage] = heartbeat(stage)
                landed[stage] += 1
        return min(landed.values()) >= beats

    def counts() -> str:
        counted = ", ".join(f"stage {stage}: {count}" for stage, count in landed.items())
        return (
            f"stage {blocked}'s heartbeat moved {moves} time(s); since its last move the"
            f" others' landed {counted} times, not {beats} each"
        )

    await wait_for(others_landed, 30, f"stage {blocked} quiet while others beat", 0.05, seen=counts)
    return quiet_at


def test_report_request_produces_admitted_stage_and_heartbeat_spans(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with attached(tmp_path, [], "0.11", "observe", FAST, None, SIM_ENV) as (wd, srv):
            await wait_for(lambda: all_beating(wd), 30)
            await send_request(srv.url)
            await wait_for(lambda: all(STAGE_REQUEST_SPAN in names(wd, s) for s in STAGES), 10)
            # The report's request and any canary: each went through all three stages.
            admitted = [r for r in wd.spans.recent(None) if r.name == REQUEST_ADMITTED_SPAN]
            assert admitted
            for span in admitted:
                assert span.attributes[REQUEST_STAGE_PATH] == [0, 1, 2]
            for stage in STAGES:
                spans = [r for r in wd.spans.recent(stage) if r.name == STAGE_REQUEST_SPAN]
                done = {r.request_id for r in spans}
                assert {a.request_id for a in admitted} <= done | {admitted[-1].request_id}
                assert all(r.status != "error" and r.duration > 0 for r in spans)
                assert HEARTBEAT_SPAN in names(wd, stage)
            # The resource names the process, so the watchdog maps pids to stages from spans.
            mapped = wd.spans.pid_stages()
            stage_pids = {p.pid: p.stage for p in live_processes(wd) if p.role.value == "stage"}
            assert {pid: stage for pid, (stage, _) in mapped.items() if pid in stage_pids} == (
                stage_pids
            )

    run_scenario(scenario())


@pytest.mark.parametrize(
    ("fault", "blocked"), [("1:engine-dead-hang", StageRef(1)), ("0:silent-stall", StageRef(0))]
)
def test_heartbeats_of_a_blocked_stage_stop(tmp_path: Path, fault: str, blocked: StageRef) -> None:
    async def scenario() -> None:
        async with attached(tmp_path, [fault], "0.11", "observe", FAST, None, SIM_ENV) as (
            wd,
            srv,
        ):
            await wait_for(lambda: all_beating(wd), 30)
            asyncio.get_running_loop().create_task(send_request(srv.url))
            await wait_for(lambda: srv.fault_time(), 10)
            stopped_at = await quiet_while_others_beat(wd, blocked, SETTLING_BEATS)
            assert await quiet_while_others_beat(wd, blocked, QUIET_BEATS) == stopped_at

    run_scenario(scenario())
