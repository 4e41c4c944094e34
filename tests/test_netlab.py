"""The lab of the partition tests, where it can be checked without root: it reads every
part of the shipped multi-host manifests it needs, so a change to the manifests that the
lab could not run fails here first (the lab itself needs network namespaces), and two labs
at once (two test workers) claim control addresses of their own."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from netlab import layout, network
from netlab.lab import TEST_SECRETS

POD_IP = "198.19.0.9"


def test_the_layout_is_a_head_and_a_pod_for_each_remote_stage() -> None:
    shipped = layout.shipped_layout()
    assert shipped.remote_stages == tuple(sorted(shipped.stages)) == (1, 2)
    assert shipped.head.flag("--stage-id") == "0"
    for stage in shipped.stages.values():
        assert "--headless" in stage.server_args
        assert stage.flag("--omni-master-address") in shipped.head_names
        assert stage.flag("--omni-master-port") == str(shipped.head.ports["omni-master"])
    # The lab's tokens stand for exactly the Secrets the manifests read.
    assert {name for name, _ in shipped.secrets} == set(TEST_SECRETS)


@pytest.mark.parametrize("pod_name", ["head", "stage-1", "stage-2"])
def test_every_container_environment_resolves_as_the_kubelet_would(pod_name: str) -> None:
    shipped = layout.shipped_layout()
    pod = shipped.head if pod_name == "head" else shipped.stages[int(pod_name[-1])]
    for env in (pod.watchdog_env, pod.server_env):
        resolved = layout.resolve_env(env, node_name="node-a", pod_ip=POD_IP, secrets=TEST_SECRETS)
        assert not set(resolved) & layout.REPLACED_ENV
        assert resolved["OMNI_WATCHDOG_HOST"] == "node-a"
        assert all(isinstance(value, str) for value in resolved.values())
    server_env = layout.resolve_env(
        pod.server_env, node_name="node-a", pod_ip=POD_IP, secrets=TEST_SECRETS
    )
    args = layout.expand(pod.server_args, server_env)
    assert not any("$(" in arg for arg in args), args
    if pod_name == "head":
        # The head serves the master on its own pod address.
        assert args[args.index("--omni-master-address") + 1] == POD_IP


def test_a_value_from_the_lab_cannot_resolve_is_named() -> None:
    env = {"SOMETHING": {"configMapKeyRef": {"name": "x", "key": "y"}}}
    with pytest.raises(AssertionError, match="SOMETHING"):
        layout.resolve_env(env, node_name="n", pod_ip=POD_IP, secrets={})


def test_the_simulator_takes_the_flags_it_shares_with_vllm_omni(tmp_path: Path) -> None:
    stage = layout.shipped_layout().stages[1]
    argv = layout.sim_server_argv(
        list(stage.server_args),
        state_dir=tmp_path,
        stage_config=tmp_path / "stages.yaml",
        head_extra=["--remote-stage", "1"],
    )
    assert argv[1:3] == ["-m", "omni_watchdog.sim"]
    assert "--headless" in argv and "--remote-stage" not in argv
    for flag in ("--stage-id", "--omni-master-address", "--omni-master-port"):
        assert argv[argv.index(flag) + 1] == stage.flag(flag)
    assert "--stage-overrides" not in argv and "Qwen/Qwen2.5-Omni-7B" not in argv


def test_two_labs_at_once_claim_different_control_slots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(network, "SLOTS", tmp_path)
    first, second = network.claim_slot(), network.claim_slot()
    assert first != second
    network.release_slot(first)
    assert network.claim_slot() == first


def test_a_slot_whose_holder_died_is_taken_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(network, "SLOTS", tmp_path)
    gone = subprocess.Popen(["true"])
    gone.wait()
    (tmp_path / "0").mkdir()
    (tmp_path / "0" / "pid").write_text(str(gone.pid))
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "pid").write_text(str(os.getpid()))
    assert network.claim_slot() == 0
    assert (tmp_path / "0" / "pid").read_text() == str(os.getpid())
    assert network.claim_slot() == 2
