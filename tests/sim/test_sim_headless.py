"""A stage on another host (vLLM-Omni 0.30 `--headless`): a head and a headless stage, each
its own process tree with its own simulated GPUs, on one machine."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from deadline import holds_for, wait_until
from sim.sim_helpers import START_TIMEOUT_S, V030_CONFIG, Sim

from omni_watchdog.sim.coordinator import MAX_PENDING_PEERS
from omni_watchdog.sim.wire import MAX_LINE_BYTES

pytestmark = pytest.mark.e2e

GIB = 1024**3
HEARTBEAT_TIMEOUT_S = 3.0
# Stage 2 (code2wav) has one replica and 0.1 of a device; stage 1 (talker) two, 0.25 each.
REMOTE = 2
MARGIN_S = 1.5


@pytest.fixture
def sims(tmp_path: Path) -> Iterator[Callable[[str], Sim]]:
    """Makes simulators with state dirs of their own; all they started is killed at the end."""
    made: list[Sim] = []

    def make(name: str) -> Sim:
        sim = Sim(tmp_path / name, tmp_path / f"{name}.log")
        sim.state_dir.mkdir()
        made.append(sim)
        return sim

    try:
        yield make
    finally:
        for sim in made:
            if sim.process is not None:
                sim.kill_everything()


def start_head(head: Sim, remote: int = REMOTE, master_port: int = 0) -> int:
    """A head whose stage `remote` runs headless, answering; its coordinator's port."""
    head.start(
        "--model-generation",
        "0.30",
        "--stage-config",
        str(V030_CONFIG),
        "--remote-stage",
        str(remote),
        "--omni-master-port",
        str(master_port),
        "--omni-heartbeat-timeout",
        str(HEARTBEAT_TIMEOUT_S),
        wait=False,
    )
    master = wait_until(lambda: head.state_file("master.json"), START_TIMEOUT_S)
    wait_until(lambda: head.get("/health", timeout=0.5).status != 0, START_TIMEOUT_S)
    return int(master["port"])


def start_stage(stage: Sim, master_port: int, *args: str, stage_id: int = REMOTE) -> None:
    stage.launch(
        "--model-generation",
        "0.30",
        "--stage-config",
        str(V030_CONFIG),
        "--headless",
        "--stage-id",
        str(stage_id),
        "--omni-master-address",
        "127.0.0.1",
        "--omni-master-port",
        str(master_port),
        *args,
    )
    wait_until(lambda: stage.state_file("headless.json"), START_TIMEOUT_S)


def pair(sims: Callable[[str], Sim], *stage_args: str, remote: int = REMOTE) -> tuple[Sim, Sim]:
    """A head and its headless stage, every replica registered: the head answers 200."""
    head, stage = sims("head"), sims("stage")
    port = start_head(head, remote)
    assert head.get("/health").status == 503  # until the stage registers
    start_stage(stage, port, *stage_args, stage_id=remote)
    replicas = len(headless_status(stage)["replicas"])
    wait_until(lambda: len(live_remote_replicas(head)) == replicas, START_TIMEOUT_S)
    assert head.get("/health").status == 200
    return head, stage


def live_remote_replicas(head: Sim) -> list[dict[str, Any]]:
    return [s for s in head.state()["stages"] if s["remote"] and s["alive"]]


def healthy(head: Sim) -> None:
    wait_until(lambda: head.get("/health", timeout=0.5).status == 200, START_TIMEOUT_S)


def master_port(head: Sim) -> int:
    master = head.state_file("master.json")
    assert master is not None
    return int(master["port"])


def headless_status(stage: Sim) -> dict[str, Any]:
    status = stage.state_file("headless.json")
    assert status is not None
    return status


def replica_pid(stage: Sim, replica: int = 0) -> int:
    return int(headless_status(stage)["replicas"][replica]["pid"])


def chat_in_background(head: Sim, timeout: float) -> tuple[threading.Thread, list[Any]]:
    """One chat on its own thread; the list gets its status and body when it ends."""
    answers: list[Any] = []

    def chat() -> None:
        answer = head.chat(timeout=timeout)
        answers.append((answer.status, answer.body))

    thread = threading.Thread(target=chat)
    thread.start()
    return thread, answers


def test_requests_through_the_head_run_on_the_headless_stage(
    sims: Callable[[str], Sim],
) -> None:
    head, stage = pair(sims, remote=1)
    root = psutil.Process(stage.pid)
    command_line = " ".join(root.cmdline())
    for flag in ("--headless", "--stage-id 1", "--omni-master-address 127.0.0.1"):
        assert flag in command_line
    assert f"--omni-master-port {master_port(head)}" in command_line
    remote = [s for s in head.state()["stages"] if s["stage"] == 1]
    assert [(s["replica"], s["remote"], s["alive"]) for s in remote] == [
        (0, True, True),
        (1, True, True),
    ]
    for entry in remote:
        assert entry["pid"] == replica_pid(stage, entry["replica"])
        replica = psutil.Process(entry["pid"])
        assert replica.ppid() == root.pid
        assert (
            replica.cmdline()[0]
            == f"VLLM::StageEngineCoreProc_stage1_replica{entry['replica']}_DP0"
        )
    assert all(not s["remote"] for s in head.state()["stages"] if s["stage"] != 1)
    refused = head.post("/sim/faults", {"kind": "silent-stall", "stage": 1})
    assert refused.status == 400
    assert "headless" in refused.json()["error"]
    assert head.chat().status == 200
    assert head.chat().status == 200
    for index in ("0", "1"):
        assert head.metric("vllm:generation_tokens_total", stage="1", replica=index) == 8
    # Each host's devices hold its own stages only.
    assert stage.used_bytes() == pytest.approx(2 * 0.25 * 24 * GIB, rel=1e-6)
    assert head.used_bytes() == pytest.approx((0.3 + 0.1) * 24 * GIB, rel=1e-6)
    root.send_signal(signal.SIGTERM)
    assert stage.wait_exit(8) == 0
    wait_until(lambda: head.get("/health").status == 503, MARGIN_S)
    wait_until(lambda: not stage.group(), 3)
    assert stage.used_bytes() == 0


def test_a_killed_remote_replica_is_evicted_and_a_restarted_stage_comes_back(
    sims: Callable[[str], Sim],
) -> None:
    head, stage = pair(sims)
    assert head.chat().status == 200
    os.kill(replica_pid(stage), signal.SIGKILL)
    wait_until(lambda: head.get("/health").status == 503, HEARTBEAT_TIMEOUT_S + MARGIN_S)
    began = time.monotonic()
    answer = head.chat()
    assert answer.status == 500
    assert time.monotonic() - began < 1
    assert "stage 2 has no live replica" in answer.json()["error"]["message"]
    assert not head.stage(REMOTE)["alive"]
    assert psutil.Process(stage.pid).is_running()  # the headless server stays up
    assert "died with exit code -9" in stage.output()
    psutil.Process(stage.pid).send_signal(signal.SIGTERM)
    assert stage.wait_exit(8) == 0
    again = sims("stage-again")
    start_stage(again, master_port(head))
    healthy(head)
    assert head.stage(REMOTE)["pid"] == replica_pid(again)
    assert head.chat().status == 200


def test_a_stopped_remote_replica_is_evicted_after_the_heartbeat_timeout(
    sims: Callable[[str], Sim],
) -> None:
    head, stage = pair(sims)
    replica = psutil.Process(replica_pid(stage))
    replica.suspend()
    began = time.monotonic()
    wait_until(lambda: head.get("/health").status == 503, HEARTBEAT_TIMEOUT_S + MARGIN_S)
    # Its last beat came up to a beat period before it stopped.
    assert time.monotonic() - began > HEARTBEAT_TIMEOUT_S - 1.2
    wait_until(lambda: "no heartbeat for" in head.output(), 1)
    assert head.chat().status == 500
    replica.resume()  # beating again: the stage registers it anew
    healthy(head)
    assert head.chat().status == 200


def test_a_stalled_forward_keeps_beating_and_is_never_evicted(sims: Callable[[str], Sim]) -> None:
    head, stage = pair(sims, "--fault", f"{REMOTE}:silent-stall")
    assert head.chat(timeout=1.0).status == 0  # it hangs
    assert [e["kind"] for e in stage.events()] == ["silent-stall"]
    assert stage.events()[0]["pid"] == replica_pid(stage)
    holds_for(
        lambda: head.get("/health").status == 200, HEARTBEAT_TIMEOUT_S + MARGIN_S, interval=0.25
    )
    assert head.metric("vllm:num_requests_running", stage="2", replica="0") == 1
    # A request in flight on it fails at once when the replica dies.
    thread, answers = chat_in_background(head, timeout=10)
    wait_until(lambda: head.metric("vllm:num_requests_waiting", stage="2") == 1, 5)
    os.kill(replica_pid(stage), signal.SIGKILL)
    began = time.monotonic()
    thread.join(5)
    assert time.monotonic() - began < 1
    status, body = answers[0]
    assert status == 500
    assert json.loads(body)["error"]["message"] == "stage 2 replica died"
    assert head.get("/health").status == 503


def test_faults_reach_a_headless_stage_through_its_state_dir(sims: Callable[[str], Sim]) -> None:
    head, stage = pair(sims)
    lines = [
        "not json",
        json.dumps({"kind": "ignore-sigterm"}),  # the head's, not a stage's
        json.dumps({"kind": "silent-stall", "stage": 1}),  # not this stage
        json.dumps({"kind": "frozen-engine"}),
    ]
    with (stage.state_dir / "faults.jsonl").open("a") as faults:
        faults.write("".join(line + "\n" for line in lines))
    armed = wait_until(lambda: headless_status(stage)["armed_faults"], 5)
    assert armed == [{"kind": "frozen-engine", "stage": 2, "replica": 0}]
    assert stage.output().count("fault not armed") == 3
    assert head.chat(timeout=1.0).status == 0
    replica = psutil.Process(replica_pid(stage))
    assert replica.status() == psutil.STATUS_STOPPED
    assert stage.events()[0]["pid"] == replica.pid
    # A stopped replica beats no more: evicted like any stopped process.
    wait_until(lambda: head.get("/health").status == 503, HEARTBEAT_TIMEOUT_S + MARGIN_S)


def test_a_headless_stage_outlives_its_master_and_registers_with_the_next(
    sims: Callable[[str], Sim],
) -> None:
    head, stage = pair(sims)
    port = master_port(head)
    held = stage.used_bytes()
    assert held == pytest.approx(0.1 * 24 * GIB, rel=1e-6)
    replica = replica_pid(stage)
    os.killpg(head.pid, signal.SIGKILL)
    head.wait_exit(5)
    wait_until(lambda: "unreachable" in stage.output(), 5)
    # Orphaned: the stage keeps running and holding its memory, trying again each second.
    holds_for(
        lambda: stage.gpu_pids() == {replica} and stage.used_bytes() == held, 2.5, interval=0.25
    )
    assert psutil.Process(stage.pid).is_running()
    assert stage.output().count("unreachable") == 1  # said once per outage
    successor = sims("successor")
    start_head(successor, master_port=port)
    healthy(successor)
    assert successor.stage(REMOTE)["pid"] == replica
    assert successor.chat().status == 200


def dropped(port: int, payload: bytes) -> bool:
    """Whether the coordinator closes a connection that sends `payload`."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as peer:
        with contextlib.suppress(OSError):  # it may close while we still send
            peer.sendall(payload)
        try:
            return peer.recv(1) == b""
        except ConnectionResetError:
            return True


def test_bad_peers_are_dropped_and_counted_while_the_head_stays_healthy(
    sims: Callable[[str], Sim],
) -> None:
    head, _ = pair(sims)
    port = master_port(head)
    register_stage_0 = {"type": "register", "stage": 0, "replica": 0, "pid": 1, "host": "x"}
    assert dropped(port, b"garbage\n")
    assert dropped(port, b"[" * 50_000 + b"\n")  # deeper than the JSON parser goes
    assert dropped(port, b"x" * (MAX_LINE_BYTES + 1024))
    assert dropped(port, json.dumps(register_stage_0).encode() + b"\n")  # a local stage
    waiting = [socket.create_connection(("127.0.0.1", port)) for _ in range(MAX_PENDING_PEERS)]
    try:
        wait_until(lambda: head.state()["master"]["peers"] >= MAX_PENDING_PEERS + 1, 5)
        assert dropped(port, b"")
    finally:
        for peer in waiting:
            peer.close()
    refused = head.state()["master"]["refused"]
    assert refused == {
        "too_many_peers": 1,
        "registration_timeout": 0,
        "bad_registration": 1,
        "garbage": 2,
        "oversized": 1,
    }
    assert head.output().count("dropped peer") == 5
    assert head.get("/health").status == 200
    assert head.chat().status == 200


@pytest.mark.parametrize(
    "args",
    [
        ["--headless", "--model-generation", "0.30", "--stage-id", "2"],
        ["--remote-stage", "2", "--omni-master-port", "0"],
        ["--model-generation", "0.30", "--remote-stage", "9", "--omni-master-port", "0"],
        [
            "--model-generation",
            "0.30",
            "--remote-stage",
            "2",
            "--omni-master-port",
            "0",
            "--fault",
            "2:silent-stall",
        ],
        [
            "--model-generation",
            "0.30",
            "--headless",
            "--stage-id",
            "2",
            "--omni-master-address",
            "127.0.0.1",
            "--omni-master-port",
            "1",
            "--fault",
            "ignore-sigterm",
        ],
    ],
)
def test_command_lines_that_cannot_work_are_refused(tmp_path: Path, args: list[str]) -> None:
    command = [sys.executable, "-m", "omni_watchdog.sim", "--stage-config", str(V030_CONFIG)]
    command += ["--state-dir", str(tmp_path), *args]
    done = subprocess.run(command, capture_output=True, timeout=30, check=False)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(b"omni-watchdog sim: ")
