"""End to end: the simulator's stage types, and the watchdog against its diffusion stage.

The image pipeline (`--pipeline image`): text (`LLM_AR`) -> DiT (`DIFFUSION`, a
`vLLM-Omni::DiffusionWorker` process running a denoising loop per request), with the
diffusion faults of the fault table: a step that blocks, a step that raises, slow steps.
Real processes, short configured timeouts, polling with deadlines.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
from deadline import wait_for, wait_until
from e2e.forgery import forge, traces_url
from e2e.harness import (
    FAST,
    RECOVERED,
    SIM_ENV,
    all_healthy,
    assert_released,
    attached,
    described,
    detection_of,
    incident_done,
    incidents_now,
    judged_for,
    live_processes,
    note_worse_than_degraded,
    run_scenario,
    state,
    steps_of,
    warmed_up,
    with_fault,
)
from sim.sim_helpers import CONFIGS, Sim

from omni_watchdog.app import Watchdog
from omni_watchdog.config import merge_layers
from omni_watchdog.demo import REPORT_REQUEST
from omni_watchdog.log import configure_logging
from omni_watchdog.process_start import sender_attributes
from omni_watchdog.semconv import PROCESS_PID
from omni_watchdog.sim.diffusion import DIFFUSION_TITLE
from omni_watchdog.sim.launcher import SimProcess
from omni_watchdog.sim.pipelines import IMAGE_PIPELINE, write_stage_config
from omni_watchdog.types import SilenceCause, StageRef, StageState

pytestmark = pytest.mark.e2e

TEXT, DIT = StageRef(0), StageRef(1)
IMAGE_ARGS = ["--pipeline", IMAGE_PIPELINE]
# A request's answer on two loaded cores: the tiny image takes a fraction of a second.
ANSWER_LIMIT = 60.0


def run(
    tmp_path: Path,
    body: Callable[[Watchdog, SimProcess], Awaitable[None]],
    sim_args: list[str] | None = None,
    remediated: bool = True,
    config: dict[str, Any] = FAST,
    otlp_token: str = "",
) -> None:
    """`body(watchdog, server)` against the image pipeline, the watchdog told its stages,
    and the receiver and the plugin given `otlp_token` where there is one."""
    configure_logging("debug", (tmp_path / "watchdog.log").open("a"))
    stage_config = write_stage_config(IMAGE_PIPELINE, tmp_path / "image-pipeline.yaml")
    sim_env = dict(SIM_ENV)
    if otlp_token:
        config = merge_layers(config, {"otlp_token": otlp_token})
        sim_env["OMNI_WATCHDOG_OTLP_TOKEN"] = otlp_token

    async def scenario() -> list[int]:
        async with attached(
            tmp_path,
            [],
            "0.30",
            "enforce",
            config,
            [*IMAGE_ARGS, *(sim_args or [])],
            sim_env,
            stage_config,
        ) as (watchdog, server):
            await body(watchdog, server)
            return server.leftover_pids() if remediated else []

    leftovers = run_scenario(scenario())
    assert not leftovers, f"processes left running: {leftovers}"


async def image(url: str, steps: int | None = None) -> tuple[int, dict[str, Any]]:
    """POST one image request (the report's, with `num_inference_steps`); status, body."""
    request = dict(REPORT_REQUEST)
    if steps is not None:
        request["num_inference_steps"] = steps
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            url + "/v1/chat/completions",
            json=request,
            timeout=aiohttp.ClientTimeout(total=ANSWER_LIMIT),
        ) as response,
    ):
        return response.status, await response.json()


async def get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        assert response.status == 200, await response.text()
        return await response.json()


def dit_status(watchdog: Watchdog) -> Any:
    report = watchdog.state.report
    return next((s for s in report.statuses if s.stage == DIT), None) if report else None


def of_dit(watchdog: Watchdog, name: str) -> Any:
    """A field of the diffusion stage's last status; None before it has one."""
    return getattr(dit_status(watchdog), name, None)


def test_the_image_pipeline_answers_and_its_diffusion_stage_is_mapped_and_healthy(
    tmp_path: Path,
) -> None:
    async def body(watchdog: Watchdog, server: SimProcess) -> None:
        await warmed_up(watchdog)
        sim_state = await get_json(server.url + "/sim/state")
        assert sim_state["pipeline"] == IMAGE_PIPELINE
        stages = {(s["stage"], s["name"], s["execution_type"]) for s in sim_state["stages"]}
        assert stages == {(0, "text", "LLM_AR"), (1, "dit", "DIFFUSION")}
        dit_pid = next(s["pid"] for s in sim_state["stages"] if s["stage"] == 1)
        assert psutil.Process(dit_pid).cmdline()[0] == DIFFUSION_TITLE
        status, answer = await image(server.url, steps=6)
        assert status == 200, answer
        assert answer["object"] == "chat.completion"
        # The watchdog maps the DiffusionWorker to its stage (from its spans' resource) and
        # learned its steps from their spans.
        await wait_for(
            lambda: any(p.pid == dit_pid and p.stage == DIT for p in live_processes(watchdog)),
            30,
        )
        await wait_for(lambda: of_dit(watchdog, "seconds_per_step"), 30)
        await all_healthy(watchdog, 30)
        incidents = await incidents_now(watchdog)
        assert not incidents, described(incidents)
        assert dit_status(watchdog).request_errors == 0
        page = await get_json(f"http://127.0.0.1:{watchdog.api_port}/v1/status")
        (entry,) = [s for s in page["stages"] if (s["stage_id"], s["replica"]) == (1, 0)]
        assert entry["name"] == "dit" and entry["state"] == "healthy"
        assert dit_pid in entry["pids"]

    run(tmp_path, body, remediated=False)


def test_a_blocked_denoising_step_is_a_stall_that_is_remediated(tmp_path: Path) -> None:
    async def body(watchdog: Watchdog, server: SimProcess) -> None:
        await warmed_up(watchdog)
        # One image first: the stage's step time is learned, as on a server in service.
        status, answer = await image(server.url)
        assert status == 200, answer
        await with_fault(server, {"kind": "denoise-block", "stage": 1})
        blocked = asyncio.create_task(image(server.url))
        incident = await incident_done(watchdog, 60)
        blocked.cancel()
        verdict = incident.verdicts[0]
        assert (verdict.stage, verdict.state) == (DIT, StageState.STALLED), described([incident])
        assert [e["kind"] for e in server.events()] == ["denoise-block"]
        assert incident.outcome in RECOVERED, steps_of(incident)
        assert_released(incident)

    run(tmp_path, body)


def test_a_blocked_step_is_judged_whatever_a_holder_of_the_otlp_token_forges(
    tmp_path: Path,
) -> None:
    """Beats and successful stage spans come every 0.2 s in the DiT's name and in the API
    server's, with the receiver's token, while a denoising step blocks. Its steps stop,
    its process is read asleep on a lock, and the image canary, sent once a step is
    late, fails behind it: those outweigh the forged beats (before, no incident in 60 s)."""
    token = "the-otlp-token"

    async def body(watchdog: Watchdog, server: SimProcess) -> None:
        await warmed_up(watchdog)
        status, answer = await image(server.url)
        assert status == 200, answer
        dit = next(p for p in live_processes(watchdog) if p.stage == DIT).pid
        senders = [
            {PROCESS_PID: pid, **sender_attributes(pid)} for pid in (dit, server.process.pid)
        ]
        stop = asyncio.Event()
        url = traces_url(watchdog)
        forging = [asyncio.create_task(forge(url, s, [1], stop, token)) for s in senders]
        await with_fault(server, {"kind": "denoise-block", "stage": 1})
        blocked = asyncio.create_task(image(server.url))
        try:
            incident = await incident_done(watchdog, 60)
        finally:
            stop.set()
            taken = await asyncio.gather(*forging)
            blocked.cancel()
        assert min(taken) > 10, taken
        (verdict,) = incident.verdicts
        assert (verdict.stage, verdict.state) == (DIT, StageState.STALLED), described([incident])
        assert verdict.cause is not None, described([incident])
        assert verdict.cause.cause is SilenceCause.LOCK_OR_QUEUE_WAIT, verdict.cause
        assert incident.outcome in RECOVERED, steps_of(incident)

    run(tmp_path, body, otlp_token=token)


def test_a_denoising_step_that_raises_fails_one_request_and_nothing_else(tmp_path: Path) -> None:
    async def body(watchdog: Watchdog, server: SimProcess) -> None:
        await warmed_up(watchdog)
        await with_fault(server, {"kind": "denoise-raise", "stage": 1})
        status, answer = await image(server.url)
        assert status == 500, answer
        assert "DenoiseError" in answer["error"]["message"]
        status, answer = await image(server.url)
        assert status == 200, answer  # the stage serves the next request
        await wait_for(lambda: of_dit(watchdog, "request_errors"), 30)
        assert dit_status(watchdog).request_errors == 1
        detection = detection_of(FAST)
        await judged_for(watchdog, detection.heartbeat_timeout + detection.confirm_timeout)
        await all_healthy(watchdog, 30)
        incidents = await incidents_now(watchdog)
        assert not incidents, described(incidents)

    run(tmp_path, body, remediated=False)


def test_a_slow_image_is_followed_step_by_step_and_never_remediated(tmp_path: Path) -> None:
    async def body(watchdog: Watchdog, server: SimProcess) -> None:
        await warmed_up(watchdog)
        found: list[str] = []
        watching = asyncio.create_task(note_worse_than_degraded(watchdog, [TEXT, DIT], found))
        await with_fault(server, {"kind": "denoise-slow", "stage": 1})
        slow = asyncio.create_task(image(server.url, steps=4))
        status_url = f"http://127.0.0.1:{watchdog.api_port}/v1/status"
        # (request id, step): canaries denoise too, behind the image.
        seen: set[tuple[str, int]] = set()

        async def steps_shown() -> set[tuple[str, int]]:
            page = await get_json(status_url)
            (entry,) = [s for s in page["stages"] if (s["stage_id"], s["replica"]) == (1, 0)]
            return {(d["request_id"], d["step"]) for d in entry["denoising"] if d["steps"] == 4}

        # The status shows the request's step while it denoises, and the step moves on.
        while not slow.done():
            seen |= await steps_shown()
            await asyncio.sleep(0.2)
        status, answer = slow.result()
        assert status == 200, answer
        steps = sorted(step for request_id, step in seen if request_id == answer["id"])
        assert len(set(steps)) >= 2, f"the image's denoising steps in /v1/status: {steps}"
        assert server.events()[0]["kind"] == "denoise-slow"
        # Its request spans end what the status showed.
        await wait_for(
            lambda: all(d.request_id != answer["id"] for d in of_dit(watchdog, "denoising")), 30
        )
        watching.cancel()
        assert not found, found
        incidents = await incidents_now(watchdog)
        assert not incidents, described(incidents)
        assert state(watchdog, DIT) in (StageState.HEALTHY, StageState.DEGRADED)

    run(tmp_path, body, sim_args=["--slow-denoise-step-seconds", "2"], remediated=False)


# --- the simulator alone ----------------------------------------------------------------


def sim_alone(tmp_path: Path) -> Sim:
    (tmp_path / "state").mkdir(parents=True)
    return Sim(tmp_path / "state", tmp_path / "sim.log")


def test_a_diffusion_step_works_on_the_cpu_and_a_blocked_one_sleeps(tmp_path: Path) -> None:
    sim = sim_alone(tmp_path)
    try:
        sim.start("--model-generation", "0.30", *IMAGE_ARGS, "--slow-denoise-step-seconds", "1")
        dit = psutil.Process(sim.stage(1)["pid"])
        assert dit.cmdline()[0] == DIFFUSION_TITLE
        sim.inject("denoise-slow", stage=1)
        before = dit.cpu_times()
        answer = sim.post("/v1/chat/completions", {**REPORT_REQUEST, "num_inference_steps": 2}, 30)
        assert answer.status == 200, answer.body
        after = dit.cpu_times()
        # Two steps of a second of work each: most of it on the CPU, even on a busy host.
        assert after.user + after.system - before.user - before.system > 0.5
        sim.inject("denoise-block", stage=1)
        assert sim.chat(timeout=2.0).status == 0  # no answer: the step never returns
        wait_until(lambda: dit.status() == psutil.STATUS_SLEEPING, 10, seen=dit.status)
        assert sim.get("/health").status == 200
        assert [e["kind"] for e in sim.events()] == ["denoise-slow", "denoise-block"]
    finally:
        sim.kill_everything()


def test_code2wav_runs_one_forward_per_request_in_the_omni_pipeline(tmp_path: Path) -> None:
    sim = sim_alone(tmp_path)
    try:
        sim.start("--model-generation", "0.30", "--stage-config", str(CONFIGS["0.30"]))
        types = {s["name"]: s["execution_type"] for s in sim.state()["stages"]}
        assert set(types.values()) == {"LLM_AR"}  # without --pipeline, as it always was
    finally:
        sim.kill_everything()
    sim = sim_alone(tmp_path / "omni")
    try:
        sim.start(
            "--model-generation",
            "0.30",
            "--stage-config",
            str(CONFIGS["0.30"]),
            "--pipeline",
            "qwen2_5_omni",
        )
        types = {s["name"]: s["execution_type"] for s in sim.state()["stages"]}
        assert types == {"thinker": "LLM_AR", "talker": "LLM_AR", "code2wav": "LLM_GENERATION"}
        assert sim.chat().status == 200
        assert sim.metric("vllm:generation_tokens_total", stage="1", replica="0") == 8
        assert sim.metric("vllm:iteration_tokens_total_count", stage="2") == 1
        assert sim.metric("vllm_omni:stage_gen_time_s_count", stage="2") == 1
    finally:
        sim.kill_everything()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--model-generation", "0.11", *IMAGE_ARGS], "needs --model-generation 0.30"),
        (
            ["--model-generation", "0.30", *IMAGE_ARGS, "--fault", "0:denoise-block"],
            "stage 0 is not a diffusion stage",
        ),
        (
            ["--model-generation", "0.30", "--stage-config", str(CONFIGS["0.30"]), *IMAGE_ARGS],
            "stage 0 (thinker) is not a stage of the image pipeline",
        ),
    ],
)
def test_a_pipeline_that_does_not_fit_is_refused(arguments: list[str], message: str) -> None:
    command = [sys.executable, "-m", "omni_watchdog.sim", *arguments]
    done = subprocess.run(command, capture_output=True, timeout=30, check=False)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr.decode()
