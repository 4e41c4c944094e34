"""The simulated server when nothing goes wrong: answers, metrics, process tree, shutdown."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil
import pytest
from deadline import wait_until
from sim.sim_helpers import CONFIGS, V030_CONFIG, Sim

pytestmark = pytest.mark.e2e

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "real-vllm"
GIB = 1024**3


def test_the_reports_request_goes_through_three_stages_and_moves_their_counters(
    sim: Sim,
) -> None:
    sim.start()
    for stage in ("0", "1", "2"):
        assert sim.metric("vllm:generation_tokens_total", stage=stage) == 0
    answer = sim.chat()
    assert answer.status == 200
    body = answer.json()
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    assert body["model"] == "yujiepan/qwen2.5-omni-tiny-random"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["message"]["content"]
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 8
    for stage in ("0", "1", "2"):
        assert sim.metric("vllm:generation_tokens_total", stage=stage, replica="0") == 8
        assert sim.metric("vllm:iteration_tokens_total_count", stage=stage) == 8
        assert sim.metric("vllm_omni:stage_gen_time_s_count", stage=stage) == 1
        assert sim.metric("vllm:num_requests_running", stage=stage) == 0
    models = sim.get("/v1/models").json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == "yujiepan/qwen2.5-omni-tiny-random"


def test_metrics_use_the_real_families_help_and_types(sim: Sim) -> None:
    sim.start()
    page = sim.get("/metrics").body.decode()
    real = "".join(path.read_text() for path in FIXTURES.glob("*.metrics.txt"))
    families = [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:generation_tokens_total",
        "vllm:prompt_tokens_total",
        "vllm:iteration_tokens_total",
        "vllm_omni:num_requests_running",
        "vllm_omni:stage_gen_time_s",
        "vllm_omni:stage_waiting_requests",
        "vllm_omni:requests_failed_total",
    ]
    for family in families:
        for kind in ("HELP", "TYPE"):
            line = next(x for x in page.splitlines() if x.startswith(f"# {kind} {family} "))
            assert line in real.splitlines(), line
    for reason in ("client_abort", "client_disconnect", "stage_error", "unknown"):
        assert sim.metric("vllm_omni:requests_failed_total", reason=reason) == 0


def test_0_11_process_tree_is_stage_workers_with_engine_children_in_one_group(sim: Sim) -> None:
    sim.start()
    state = sim.state()
    assert state["generation"] == "0.11"
    api = psutil.Process(sim.pid)
    for stage in state["stages"]:
        worker = psutil.Process(stage["pid"])
        engine = psutil.Process(stage["engine_pid"])
        assert worker.ppid() == api.pid and engine.ppid() == worker.pid
        assert "VLLM::" not in " ".join(worker.cmdline())
        assert engine.cmdline()[0].startswith("VLLM::EngineCore")
        assert {os.getpgid(worker.pid), os.getpgid(engine.pid)} == {sim.pid}
    holders = sim.gpu_pids()
    assert holders == {p for s in state["stages"] for p in (s["pid"], s["engine_pid"])}
    assert sim.used_bytes() == pytest.approx((0.1 + 0.7 + 0.1) * 24 * GIB + 3 * GIB / 2, rel=1e-6)


def test_0_30_replicas_are_titled_engines_spread_round_robin(sim: Sim) -> None:
    sim.start("--model-generation", "0.30", "--stage-config", str(V030_CONFIG))
    state = sim.state()
    assert [(s["stage"], s["replica"]) for s in state["stages"]] == [(0, 0), (1, 0), (1, 1), (2, 0)]
    for stage in state["stages"]:
        title = psutil.Process(stage["pid"]).cmdline()[0]
        assert (
            title
            == f"VLLM::StageEngineCoreProc_stage{stage['stage']}_replica{stage['replica']}_DP0"
        )
        assert stage["engine_pid"] is None
        assert psutil.Process(stage["pid"]).children() == []
    assert sim.chat().status == 200
    assert sim.chat().status == 200
    for replica in ("0", "1"):
        assert sim.metric("vllm:generation_tokens_total", stage="1", replica=replica) == 8
    assert sim.used_bytes() == pytest.approx((0.3 + 0.25 * 2 + 0.1) * 24 * GIB, rel=1e-6)


@pytest.mark.parametrize("generation", ["0.11", "0.30"])
def test_sigterm_shuts_down_gracefully_with_nothing_left(sim: Sim, generation: str) -> None:
    sim.start("--model-generation", generation, "--stage-config", str(CONFIGS[generation]))
    assert sim.chat().status == 200
    psutil.Process(sim.pid).send_signal(signal.SIGTERM)
    assert sim.wait_exit(8) == 0
    wait_until(lambda: not sim.group(), 3)
    assert sim.used_bytes() == 0


def test_the_admin_route_shuts_down_like_sigterm(sim: Sim) -> None:
    sim.start(env={"OMNI_WATCHDOG_ADMIN_TOKEN": "secret"})
    assert sim.post("/admin/shutdown", {}).status == 401
    answer = sim.request("POST", "/admin/shutdown", {}, headers={"Authorization": "Bearer secret"})
    assert answer.status == 202
    assert sim.wait_exit(8) == 0
    wait_until(lambda: not sim.group(), 3)


def test_030_stage_gauges_keep_their_last_batch_count_when_idle(sim: Sim) -> None:
    # As the real vLLM-Omni 0.30: the gauges come from the stages' output batches, and an
    # idle stage sends none, so each still says one request running after the reply.
    sim.start("--stage-config", str(V030_CONFIG), "--model-generation", "0.30")
    assert sim.chat().status == 200
    for stage in ("0", "1", "2"):
        assert sim.metric("vllm:num_requests_running", stage=stage, replica="0") == 1
    assert sim.metric("vllm_omni:num_requests_running") == 0
