"""The shipped multi-host layout (`deploy/kubernetes/multi-host/`), read into what each lab
host runs: the tested layout is the shipped one.

From each pod's manifest come its containers in the kubelet's order (the watchdog, a
native sidecar, first), their arguments, ports and environment, with `valueFrom` resolved
as the kubelet would: a Secret's key to the test's token of that Secret, `spec.nodeName`
to the host's name, `status.podIP` to its pod address, and `$(VAR)` in arguments expanded.
The Services give the names the stage hosts resolve to the head.

What a test host does not have is replaced, and only that: the server's model and image
(the simulator, or the real vLLM-Omni with a tiny local model), the watchdog's GPU backend
and state directory, the plugin's volume (it is on the interpreter's path already), and
the test's short timings (a config file under the manifest's environment, which wins).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from omni_watchdog.sim.nvml import STATE_ENV

REPO = Path(__file__).resolve().parents[2]
LAYOUT = REPO / "deploy" / "kubernetes" / "multi-host"
HEAD_MANIFEST = LAYOUT / "head.yaml"
WATCHDOG_CONTAINER = "omni-watchdog"
SERVER_CONTAINER = "vllm"
# Variables that name what a test host has in another place, set by the test instead.
REPLACED_ENV = {
    "PYTHONPATH",  # the plugin's volume: the plugin is on the interpreter's path
    "HF_HOME",  # the model cache: a test's model is local
    "NVIDIA_VISIBLE_DEVICES",
    "NVIDIA_DRIVER_CAPABILITIES",
    "OMNI_WATCHDOG_STATE_DIR",
    "OMNI_WATCHDOG_PROBES_GPU_BACKEND",
}
_REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


@dataclass(frozen=True)
class Pod:
    """One pod of the layout as the manifests give it."""

    name: str
    watchdog_args: tuple[str, ...]
    watchdog_env: dict[str, Any]
    server_args: tuple[str, ...]
    server_env: dict[str, Any]
    ports: dict[str, int]

    def flag(self, name: str) -> str | None:
        """The server's value of `--name`, or None."""
        args = list(self.server_args)
        return args[args.index(name) + 1] if name in args else None


@dataclass(frozen=True)
class Layout:
    head: Pod
    stages: dict[int, Pod]
    # Service names the stage hosts resolve to the head (the headless Service).
    head_names: tuple[str, ...]
    # Secret name -> the key's value, as the manifests read them.
    secrets: tuple[tuple[str, str], ...]
    remote_stages: tuple[int, ...] = field(default=())


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if isinstance(doc, dict)]


def _pod(path: Path) -> tuple[Pod, list[dict[str, Any]]]:
    documents = _documents(path)
    deployment = next(doc for doc in documents if doc["kind"] == "Deployment")
    spec = deployment["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in spec.get("initContainers", []) + spec["containers"]}
    watchdog, server = containers[WATCHDOG_CONTAINER], containers[SERVER_CONTAINER]
    ports = {
        port["name"]: int(port["containerPort"])
        for container in (watchdog, server)
        for port in container.get("ports", [])
    }
    pod = Pod(
        deployment["metadata"]["name"],
        tuple(watchdog.get("args", [])),
        {e["name"]: e.get("value", e.get("valueFrom")) for e in watchdog.get("env", [])},
        tuple(server.get("command", [])[2:] + server.get("args", [])),
        {e["name"]: e.get("value", e.get("valueFrom")) for e in server.get("env", [])},
        ports,
    )
    return pod, documents


def shipped_layout() -> Layout:
    head, documents = _pod(HEAD_MANIFEST)
    names = tuple(
        doc["metadata"]["name"]
        for doc in documents
        if doc["kind"] == "Service" and doc["spec"].get("clusterIP") == "None"
    )
    stages = {}
    for path in sorted(LAYOUT.glob("stage-*.yaml")):
        pod, _ = _pod(path)
        stage_id = pod.flag("--stage-id")
        assert stage_id is not None, f"{path.name}: no --stage-id"
        stages[int(stage_id)] = pod
    secrets = {
        value["secretKeyRef"]["name"]: value["secretKeyRef"]["key"]
        for pod in (head, *stages.values())
        for env in (pod.watchdog_env, pod.server_env)
        for value in env.values()
        if isinstance(value, dict) and "secretKeyRef" in value
    }
    remote = str(head.watchdog_env.get("OMNI_WATCHDOG_REMOTE_STAGES", ""))
    return Layout(
        head,
        stages,
        names,
        tuple(sorted(secrets.items())),
        tuple(int(part) for part in remote.split(",") if part.strip()),
    )


def resolve_env(
    env: Mapping[str, Any], *, node_name: str, pod_ip: str, secrets: Mapping[str, str]
) -> dict[str, str]:
    """The container's environment as the kubelet gives it, less what a test host has
    elsewhere (`REPLACED_ENV`); `secrets`: Secret name -> the test's value."""
    resolved: dict[str, str] = {}
    for name, value in env.items():
        if name in REPLACED_ENV:
            continue
        if isinstance(value, dict):
            if "secretKeyRef" in value:
                resolved[name] = secrets[value["secretKeyRef"]["name"]]
            elif value.get("fieldRef", {}).get("fieldPath") == "spec.nodeName":
                resolved[name] = node_name
            elif value.get("fieldRef", {}).get("fieldPath") == "status.podIP":
                resolved[name] = pod_ip
            else:
                raise AssertionError(f"{name}: a valueFrom the lab does not resolve: {value}")
        else:
            resolved[name] = str(value)
    return resolved


def expand(args: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """`$(VAR)` in arguments, as Kubernetes expands them from the container's environment."""
    return [_REFERENCE.sub(lambda m: env.get(m.group(1), m.group(0)), arg) for arg in args]


# The flags of the manifest's `vllm serve` that place the server (and that the simulator
# takes as vLLM-Omni does), with `--headless`; the model, `--omni` and the stage overrides
# (a GPU index) are the image's, replaced on a lab host.
PLACING_FLAGS = (
    "--host",
    "--port",
    "--stage-id",
    "--omni-master-address",
    "--omni-master-port",
)


def placing_flags(args: Sequence[str]) -> list[str]:
    """The manifest's server flags that place it (`PLACING_FLAGS`, `--headless`)."""
    kept: list[str] = []
    for index, arg in enumerate(args):
        if arg in PLACING_FLAGS and index + 1 < len(args):
            kept += [arg, args[index + 1]]
        elif arg == "--headless":
            kept.append(arg)
    return kept


def sim_server_argv(
    args: Sequence[str], *, state_dir: Path, stage_config: Path, head_extra: Sequence[str]
) -> list[str]:
    """The simulator started with the manifest's placing flags; `head_extra`: the
    simulator's own flags for the head (which stages are remote, its eviction timeout),
    empty for a headless stage."""
    kept = placing_flags(args)
    return [
        sys.executable,
        "-m",
        "omni_watchdog.sim",
        "--model-generation",
        "0.30",
        "--stage-config",
        str(stage_config),
        "--state-dir",
        str(state_dir),
        *kept,
        *([] if "--headless" in kept else head_extra),
    ]


def watchdog_argv(args: Sequence[str], config: Path) -> list[str]:
    """The watchdog's command as the manifest gives it, with the test's timings file."""
    return [str(Path(sys.executable).with_name("omni-watchdog")), *args, "--config", str(config)]


def sim_state_env(state_dir: Path) -> dict[str, str]:
    """The simulated devices of one host, for its server and its watchdog alike."""
    return {STATE_ENV: str(state_dir)}
