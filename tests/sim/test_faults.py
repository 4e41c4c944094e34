"""One test per row of the fault table (docs/design.md, Fault table): the server, no watchdog."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
from deadline import holds_for, wait_until
from sim.sim_helpers import CONFIGS, Sim, voluntary_switches, wait_delivered

from omni_watchdog.sim.engine import BUILD_S, BUILDER_NAMES, LONG_STEP_EVERY, LONG_STEP_S
from omni_watchdog.sim.orchestrator import FATAL_EXIT_DELAY_S

pytestmark = pytest.mark.e2e

BOTH = pytest.mark.parametrize("generation", ["0.11", "0.30"])
MIB = 1024**2


def start(sim: Sim, generation: str, *args: str, **options: Any) -> Sim:
    config = str(CONFIGS[generation])
    return sim.start("--model-generation", generation, "--stage-config", config, *args, **options)


def unchanged_for(seconds: float, read: object) -> None:
    """`read()` gives the same value over `seconds` (sampled a few times)."""
    assert callable(read)
    first = read()
    holds_for(lambda: read() == first, seconds, f"{first!r} unchanged", seconds / 4, seen=read)


def test_engine_dead_hang_starves_the_api_and_ignores_sigint_and_sigterm(sim: Sim) -> None:
    start(sim, "0.11", "--fault", "1:engine-dead-hang")
    state = sim.state()
    talker_engine = state["stages"][1]["engine_pid"]
    held_before = sim.used_bytes()
    assert sim.chat(timeout=1.0).status == 0  # times out: no answer, no error
    assert [e["kind"] for e in sim.events()] == ["engine-dead-hang"]
    assert sim.events()[0]["pid"] == talker_engine
    assert "'XBLOCK' too large. Maximum: 4096. Actual: 8192" in sim.output()
    assert "EngineDeadError" in sim.output()
    assert (
        not psutil.pid_exists(talker_engine) or psutil.Process(talker_engine).status() == "zombie"
    )
    assert sim.get("/health", timeout=0.5).status == 0
    api = psutil.Process(sim.pid)
    api.send_signal(signal.SIGINT)
    api.send_signal(signal.SIGTERM)
    wait_delivered(api.pid, signal.SIGINT, signal.SIGTERM)
    # The loop is starved by a poll that sleeps 5 ms, one voluntary switch a time: 50 more
    # show the process ran on after both, ignoring them.
    switches = voluntary_switches(api.pid)
    wait_until(
        lambda: voluntary_switches(api.pid) >= switches + 50,
        20,
        seen=lambda: f"{voluntary_switches(api.pid) - switches} switches, {api.status()}",
    )
    assert api.is_running() and api.status() != "zombie"
    assert "shutting down" not in sim.output()
    assert sim.get("/health", timeout=0.3).status == 0
    survivors = {p.pid for p in sim.group()}
    assert {s["pid"] for s in state["stages"]} <= survivors
    # The engine's share of the talker is gone with it; every other holder keeps its memory.
    assert sim.used_bytes() == held_before - int(0.7 * 24 * 1024**3)
    os.killpg(sim.pid, signal.SIGKILL)
    wait_until(lambda: not sim.group(), 3)
    wait_until(lambda: sim.used_bytes() == 0, 3)


def test_stage_dead_503_evicts_replicas_then_answers_503_and_still_shuts_down(sim: Sim) -> None:
    start(sim, "0.30", "--fault", "1.0:stage-dead-503")
    replica0, replica1 = sim.stage(1, 0), sim.stage(1, 1)
    began = time.monotonic()
    assert sim.chat().status == 500  # the request on the dying replica fails quickly
    assert time.monotonic() - began < 3
    wait_until(lambda: not sim.stage(1, 0)["alive"], 3)
    assert not psutil.pid_exists(replica0["pid"])
    assert sim.get("/health").status == 200  # replica 1 still serves the stage
    assert sim.chat().status == 200
    sim.inject("stage-dead-503", stage=1, replica=1)
    assert sim.chat().status == 500
    wait_until(lambda: sim.get("/health").status == 503, 3)
    assert sim.metric("vllm_omni:requests_failed_total", reason="stage_error") >= 2
    assert not psutil.pid_exists(replica1["pid"])
    assert sim.gpu_pids() == {sim.stage(0)["pid"], sim.stage(2)["pid"]}
    began = time.monotonic()
    assert sim.chat().status == 500
    assert time.monotonic() - began < 1
    psutil.Process(sim.pid).send_signal(signal.SIGTERM)
    assert sim.wait_exit(8) == 0
    wait_until(lambda: not sim.group(), 3)


@BOTH
def test_silent_stall_keeps_health_200_with_flat_counters(sim: Sim, generation: str) -> None:
    start(sim, generation, "--fault", "1:silent-stall")
    assert sim.chat(timeout=1.0).status == 0
    assert sim.events()[0]["pid"] == sim.stage(1)["pid"]
    assert sim.get("/health").status == 200
    assert sim.metric("vllm:num_requests_running", stage="1", replica="0") == 1
    assert sim.metric("vllm:generation_tokens_total", stage="0") == 8
    unchanged_for(0.6, lambda: sim.metric("vllm:generation_tokens_total", stage="1"))
    assert sim.metric("vllm:generation_tokens_total", stage="1") == 0


@BOTH
def test_ignore_sigterm_leaves_sigkill_as_the_way_out(sim: Sim, generation: str) -> None:
    start(sim, generation, "--fault", "ignore-sigterm", env={"OMNI_WATCHDOG_ADMIN_TOKEN": "t"})
    api = psutil.Process(sim.pid)
    api.send_signal(signal.SIGTERM)
    answer = sim.request("POST", "/admin/shutdown", {}, headers={"Authorization": "Bearer t"})
    assert answer.status == 202
    wait_delivered(api.pid, signal.SIGTERM)
    # The admin shutdown sends its SIGTERM on the loop right after logging this. The
    # answers below come from that loop later, by when a SIGTERM it took would have begun
    # the shutdown, which logs "shutting down".
    wait_until(lambda: "shutdown requested through /admin/shutdown" in sim.output(), 10)
    assert sim.get("/health").status == 200
    assert sim.chat().status == 200
    assert "shutting down" not in sim.output()
    os.killpg(sim.pid, signal.SIGKILL)
    assert sim.wait_exit(3) == -signal.SIGKILL


@BOTH
def test_escaped_child_leaves_the_group_and_holds_memory(sim: Sim, generation: str) -> None:
    start(sim, generation)
    sim.inject("escaped-child", stage=1)
    child = wait_until(lambda: sim.stage(1)["children"], 5)[0]
    assert child["kind"] == "escaped-child"
    wait_until(lambda: child["pid"] in sim.gpu_pids(), 5)
    escaped = psutil.Process(child["pid"])
    assert escaped.ppid() == sim.stage(1)["pid"]
    assert os.getsid(escaped.pid) == escaped.pid != os.getsid(sim.pid)
    os.killpg(sim.pid, signal.SIGKILL)
    wait_until(lambda: not sim.group(), 3)
    assert escaped.is_running()
    wait_until(lambda: sim.gpu_pids() == {escaped.pid}, 3)
    assert sim.used_bytes() == 512 * MIB


@BOTH
def test_orphaned_stages(sim: Sim, generation: str) -> None:
    start(sim, generation)
    stages = sim.state()["stages"]
    held = sim.used_bytes()
    sim.inject("orphaned-stages")
    assert sim.wait_exit(3) == -signal.SIGKILL
    assert sim.events()[0]["pid"] == sim.pid
    if generation == "0.11":
        time.sleep(0.5)
        for stage in stages:
            worker = psutil.Process(stage["pid"])
            assert worker.is_running() and worker.ppid() != sim.pid  # re-parented
            assert psutil.Process(stage["engine_pid"]).ppid() == worker.pid
        assert sim.used_bytes() == held
    else:
        # The parent-death signal ends every replica.
        wait_until(lambda: not any(psutil.pid_exists(s["pid"]) for s in stages), 3)
        wait_until(lambda: sim.used_bytes() == 0, 3)


def stage_1_tokens(sim: Sim) -> float:
    return sim.metric("vllm:generation_tokens_total", stage="1", replica="0")


@contextlib.contextmanager
def chat_in_background(sim: Sim, timeout: float) -> Iterator[list[int]]:
    """One chat on its own thread; its status is in the list once the block ends."""
    answers: list[int] = []
    request = threading.Thread(target=lambda: answers.append(sim.chat(timeout=timeout).status))
    request.start()
    try:
        yield answers
    finally:
        request.join(timeout + 5)


@BOTH
def test_slow_but_alive_is_ten_times_slower_with_tokens_flowing(sim: Sim, generation: str) -> None:
    start(sim, generation, "--fault", "1:slow-but-alive", "--token-delay", "0.02")
    tokens = functools.partial(stage_1_tokens, sim)
    began = time.monotonic()
    with chat_in_background(sim, 10) as answers:
        wait_until(lambda: tokens() >= 1, 5)
        first = tokens()
        wait_until(lambda: tokens() > first, 3)  # still flowing, just slowly
        assert sim.get("/health").status == 200
    assert answers == [200]
    assert time.monotonic() - began >= 8 * 0.02 * 10  # stage 1's 8 tokens at 10 x the delay
    assert tokens() == 8
    assert [e["kind"] for e in sim.events()] == ["slow-but-alive"]


@BOTH
def test_long_steps_hold_the_stage_for_one_step_at_a_time(sim: Sim, generation: str) -> None:
    start(sim, generation, "--fault", "1:long-steps", "--token-delay", "0.02")
    tokens = functools.partial(stage_1_tokens, sim)
    began = time.monotonic()
    with chat_in_background(sim, 15) as answers:
        wait_until(lambda: tokens() >= 1, 5)
        # Three quick tokens, then one step that holds the stage: the counter waits with it.
        wait_until(lambda: tokens() >= LONG_STEP_EVERY - 1, 5)
        unchanged_for(LONG_STEP_S * 0.6, tokens)
        assert sim.get("/health").status == 200
    assert answers == [200]
    # Stage 1's 8 tokens hold two long steps.
    assert time.monotonic() - began >= 2 * LONG_STEP_S
    assert tokens() == 8
    assert [e["kind"] for e in sim.events()] == ["long-steps"]


@pytest.mark.parametrize(("generation", "kind"), [("0.30", "compile"), ("0.11", "jit")])
def test_a_build_holds_the_request_on_a_child_working_at_full_cpu(
    sim: Sim, generation: str, kind: str
) -> None:
    start(sim, generation, "--fault", f"1:{kind}", "--token-delay", "0.02")
    tokens = functools.partial(stage_1_tokens, sim)
    began = time.monotonic()
    with chat_in_background(sim, BUILD_S + 20) as answers:
        wait_until(sim.events, 10)
        (event,) = sim.events()
        stage_process = psutil.Process(event["pid"])

        def builders() -> list[psutil.Process]:
            return [c for c in stage_process.children() if c.name() == BUILDER_NAMES[kind]]

        wait_until(builders, 5)
        (builder,) = builders()
        ran = builder.cpu_times().user
        wait_until(lambda: builder.cpu_times().user - ran >= 0.5, 10)
        # The forward waits on it: the stage makes no step meanwhile.
        assert tokens() == 0
        assert sim.get("/health").status == 200
    assert answers == [200]
    assert time.monotonic() - began >= BUILD_S
    assert tokens() == 8


@BOTH
def test_slow_startup_holds_memory_before_health_answers(sim: Sim, generation: str) -> None:
    start(sim, generation, "--fault", "slow-startup", "--startup-seconds", "2.5", wait=False)
    wait_until(sim.events, 10)  # every stage is up and holds its memory
    assert [e["kind"] for e in sim.events()] == ["slow-startup"]
    assert sim.used_bytes() > 0
    assert sim.get("/health", timeout=0.3).status == 0  # the connection waits: a timeout
    wait_until(lambda: sim.get("/health", timeout=0.5).status == 200, 10)


@BOTH
def test_zombie_child_is_never_reaped_and_holds_nothing(sim: Sim, generation: str) -> None:
    start(sim, generation)
    sim.inject("zombie", stage=2)
    child = wait_until(lambda: sim.stage(2)["children"], 5)[0]
    zombie = psutil.Process(child["pid"])
    wait_until(lambda: zombie.status() == psutil.STATUS_ZOMBIE, 5)
    assert zombie.ppid() == sim.stage(2)["pid"]
    assert child["pid"] not in sim.gpu_pids()
    # A request through its parent's stage: the parent ran on, with every chance to reap it.
    assert sim.chat().status == 200
    assert zombie.status() == psutil.STATUS_ZOMBIE


def test_engine_dead_exit_answers_503_then_exits_0_with_nothing_left(sim: Sim) -> None:
    start(sim, "0.11", "--fault", "1:engine-dead-exit")
    began = time.monotonic()
    assert sim.chat().status == 500
    assert sim.get("/health").status == 503
    # The server exits by itself; the limit only guards against a hang.
    assert sim.wait_exit(FATAL_EXIT_DELAY_S + 30) == 0
    # It asks for its exit this long after the engine's death, which the chat after
    # `began` caused: 503 until then.
    assert time.monotonic() - began >= FATAL_EXIT_DELAY_S
    wait_until(lambda: not sim.group(), 3)
    assert sim.used_bytes() == 0


@pytest.mark.parametrize(
    ("generation", "fault"),
    [
        # The real vLLM-Omni 0.30 stays up, answering 503, after any stage death.
        ("0.30", "1:engine-dead-exit"),
        ("0.30", "1:engine-dead-hang"),
        ("0.11", "1:stage-dead-503"),
    ],
)
def test_a_fault_the_generation_does_not_have_is_refused(generation: str, fault: str) -> None:
    config = str(CONFIGS[generation])
    command = [sys.executable, "-m", "omni_watchdog.sim", "--model-generation", generation]
    command += ["--stage-config", config, "--fault", fault]
    done = subprocess.run(command, capture_output=True, timeout=30, check=False)
    assert done.returncode == 2, done.stderr
    assert f"exists only in generation {'0.11' if generation == '0.30' else '0.30'}" in (
        done.stderr.decode()
    )


@BOTH
def test_frozen_engine_stops_itself_with_health_200(sim: Sim, generation: str) -> None:
    start(sim, generation, "--fault", "1:frozen-engine")
    engine = sim.stage(1)["engine_pid"] or sim.stage(1)["pid"]
    assert sim.chat(timeout=1.0).status == 0
    assert psutil.Process(engine).status() == psutil.STATUS_STOPPED
    assert sim.events()[0]["pid"] == engine
    assert sim.get("/health").status == 200
    assert sim.metric("vllm:num_requests_running", stage="1") == 1
    unchanged_for(0.5, lambda: sim.metric("vllm:generation_tokens_total", stage="1"))
