"""The real vLLM-Omni 0.30 (CPU) in distributed mode, a watchdog on each "host": a head
running stage 0 with its watchdog, and stages 1 and 2 headless, each a process tree of its
own with its own `--headless` watchdog, as on other hosts.

One deployment, in order: a request goes through all three stages and every watchdog
shows each stage where it runs; stage 1's engine core is killed: its own watchdog ends
what is left of its tree, while the head's only judges the remote stage and signals
nothing; then the head dies: headless stage 2, orphaned for good (vLLM-Omni never ends it),
is ended by its own watchdog once its link has been down past its grace. Only processes
this test started are signalled.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import explain
import psutil
import pytest
from deadline import wait_for
from e2e.harness import RECOVERED, incident_done, incidents_now, live_processes
from ports import free_port
from real_omni.headless import READY_TIMEOUT, Deployment, HeadlessStage, start_deployment
from real_omni.server import OMNI_FAST, watched
from real_vllm.client import ASK_EVERY, answer, health_status
from real_vllm.server import start_ready

from omni_watchdog.app import Watchdog
from omni_watchdog.clock import SystemClock
from omni_watchdog.config import load_config, merge_layers
from omni_watchdog.factory import build_watchdog
from omni_watchdog.types import EvidenceKind, IncidentOutcome, StageRef, StageState

# The head and two headless stages start in about 80 s on two cores; a loaded CI machine
# takes longer.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

REMOTE_STAGES = (1, 2)
LINK_GRACE_S = 5.0


def stage_host(stage_id: int) -> str:
    return f"stage-{stage_id}-host"


@pytest.fixture
def receivers() -> dict[int, int]:
    """The OTLP port of each headless stage's own watchdog, known before either starts."""
    return {stage_id: free_port() for stage_id in REMOTE_STAGES}


@pytest.fixture
def deployment(omni_model: Path, tmp_path: Path, receivers: dict[int, int]) -> Iterator[Deployment]:
    stage_env = {
        stage_id: {
            "OMNI_WATCHDOG_OTLP_ENDPOINT": f"http://127.0.0.1:{port}/v1/traces",
            "OMNI_WATCHDOG_HOST": stage_host(stage_id),
        }
        for stage_id, port in receivers.items()
    }
    workdir = tmp_path / "deployment"
    started = start_ready(
        lambda: start_deployment(omni_model, workdir, stage_env=stage_env),
        READY_TIMEOUT,
        alone=True,
    )
    try:
        with explain.witnessed("the deployment", started.account):
            yield started
    finally:
        started.stop()


@contextlib.asynccontextmanager
async def stage_watchdog(
    stage: HeadlessStage, otlp_port: int, workdir: Path
) -> AsyncIterator[Watchdog]:
    """`omni-watchdog run --headless --pid P` for one headless stage, in this process."""
    config = load_config(
        environ={},
        overrides=merge_layers(
            OMNI_FAST,
            {
                "headless": True,
                "pid": stage.pid,
                "mode": "enforce",
                "host": stage_host(stage.stage_id),
                "listen": "127.0.0.1:0",
                "state_dir": str(workdir / "watchdog"),
                "spans": {"otlp_listen": f"127.0.0.1:{otlp_port}"},
                "detection": {"link_grace": f"{LINK_GRACE_S:g}s"},
            },
        ),
    )
    watchdog = await build_watchdog(config, clock=SystemClock())
    await watchdog.start()
    try:
        yield watchdog
    finally:
        await watchdog.stop()


def watching_its_stage(watchdog: Watchdog) -> bool:
    """Warm, its stage (whichever replica the master numbered it) judged, its link up."""
    report, link = watchdog.state.report, watchdog.state.link
    return bool(report and report.warmed_up and report.statuses and link is not None and link.up)


def seen_remote(head: Watchdog, stage_id: int) -> bool:
    """The head's watchdog hears remote stage `stage_id` well, from the host it runs on."""
    found = status_of(head, StageRef(stage_id, 0))
    return bool(
        found is not None
        and found.remote
        and found.state is StageState.HEALTHY
        and found.host == stage_host(stage_id)
    )


def remote_unwell(head: Watchdog, stage: StageRef) -> bool:
    found = status_of(head, stage)
    return bool(
        found is not None and found.remote and found.state in (StageState.DEAD, StageState.UNKNOWN)
    )


def status_of(watchdog: Watchdog, stage: StageRef) -> Any:
    report = watchdog.state.report
    return next((s for s in report.statuses if s.stage == stage), None) if report else None


def test_each_host_s_watchdog_acts_on_its_own_stage_and_the_head_s_never_across(
    deployment: Deployment, receivers: dict[int, int], tmp_path: Path
) -> None:
    (tmp_path / "head").mkdir()

    async def scenario() -> None:
        talker, code2wav = deployment.stages[1], deployment.stages[2]
        async with (
            watched(
                deployment.head, tmp_path / "head", overrides={"remote_stages": list(REMOTE_STAGES)}
            ) as head,
            stage_watchdog(talker, receivers[1], tmp_path / "stage-1") as talker_dog,
            stage_watchdog(code2wav, receivers[2], tmp_path / "stage-2") as code2wav_dog,
            aiohttp.ClientSession() as session,
        ):
            status, body = await answer(session, deployment.head.url, max_tokens=4)
            assert status == 200, body
            await wait_for(lambda: watching_its_stage(talker_dog), 60)
            await wait_for(lambda: watching_its_stage(code2wav_dog), 60)
            await wait_for(lambda: seen_remote(head, 1) and seen_remote(head, 2), 60)
            head_pids = {p.pid for p in live_processes(head)}

            # Stage 1's engine core dies: vLLM-Omni evicts it and its tree ends by itself;
            # its own watchdog records that and whatever was left, the head's only judges.
            talker.signal(talker.engine(), signal.SIGKILL)

            async def unhealthy() -> bool:
                return await health_status(session, deployment.head) == 503

            await wait_for(unhealthy, 30, "the head's /health answering 503", ASK_EVERY)
            incident = await incident_done(talker_dog, 90)
            assert incident.outcome in RECOVERED | {IncidentOutcome.CRASHED}, incident
            await wait_for(lambda: not talker.leftovers(), 30)
            remote = StageRef(1, 0)
            await wait_for(
                lambda: (
                    (found := status_of(head, remote)) is not None
                    and found.remote
                    and found.state in (StageState.DEAD, StageState.UNKNOWN)
                ),
                30,
            )
            assert await incidents_now(head) == ()
            assert all(psutil.pid_exists(pid) for pid in head_pids)
            assert await incidents_now(code2wav_dog) == ()

            # The head dies for good: stage 2 is orphaned and holds on; its own watchdog
            # ends it once the link has been down past its grace.
            await head.stop()
            deployment.head.stop()
            orphaned = await incident_done(code2wav_dog, 90)
            kinds = {e.kind for v in orphaned.verdicts for e in v.evidence}
            assert EvidenceKind.LINK_LOST in kinds, orphaned
            assert orphaned.outcome in RECOVERED, orphaned
            assert not code2wav.leftovers()

    asyncio.run(scenario())
