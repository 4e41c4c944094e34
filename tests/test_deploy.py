"""The deployment files: Dockerfile, Kubernetes manifests and the compose stack.

No image is built and no cluster is reached here: the Dockerfile is checked statically,
the Kubernetes manifests against the Kubernetes API schemas (`kubernetes-validate` ships
them) and for the properties the watchdog relies on, and the compose stack for files it
mounts and the configuration it hands Prometheus and Grafana.
"""

from __future__ import annotations

import fnmatch
import importlib
import importlib.util
import json
import os
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from test_alerts import run_promtool

from omni_watchdog.cli import build_parser, overrides_of
from omni_watchdog.config import (
    ENV_PREFIX,
    WatchdogConfig,
    describe_defaults,
    is_loopback,
    load_config,
    split_host_port,
)
from omni_watchdog.instrument import admin, telemetry
from omni_watchdog.policy.capture import PTRACE_PY_SPY
from omni_watchdog.types import Mode

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
MAIN_MANIFEST = KUBERNETES / "vllm-omni.yaml"
ADMIN_ONLY_MANIFEST = KUBERNETES / "admin-only" / "vllm-omni.yaml"
POD_MONITOR = KUBERNETES / "podmonitor.yaml"
PROMETHEUS_RULE = KUBERNETES / "prometheusrule.yaml"
MULTI_HOST = KUBERNETES / "multi-host"
HEAD_MANIFEST = MULTI_HOST / "head.yaml"
STAGE_MANIFESTS = sorted(MULTI_HOST.glob("stage-*.yaml"))
MULTI_HOST_POD_MONITOR = MULTI_HOST / "podmonitor.yaml"
COMPOSE_DIR = DEPLOY / "compose"
COMPOSE = COMPOSE_DIR / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"
RULES = ROOT / "alerts" / "omni-watchdog.rules.yml"
KUBERNETES_VERSION = "1.33.0"
WATCHDOG_CONTAINER = "omni-watchdog"
VLLM_CONTAINER = "vllm"
# Variables the instrument plugin reads inside the served processes.
PLUGIN_VARIABLES = {
    telemetry.ENDPOINT_ENV,
    telemetry.TOKEN_ENV,
    telemetry.HEAD_ENDPOINT_ENV,
    telemetry.HEAD_TOKEN_ENV,
    telemetry.HOST_ENV,
    telemetry.HEARTBEAT_INTERVAL_ENV,
    admin.ADMIN_TOKEN_ENV,
}
# vLLM-Omni's own `vllm.general_plugins` entry point, which registers its models.
# What OmniWatchdogDown selects the watchdog's scrape job by.
WATCHDOG_JOB = re.compile(r".*omni-watchdog.*")


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def deploy_yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


def manifests() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in sorted(KUBERNETES.rglob("*.yaml")):
        for doc in documents(path):
            yield path, doc


def deployment(path: Path) -> dict[str, Any]:
    (found,) = [doc for doc in documents(path) if doc["kind"] == "Deployment"]
    return found


def pod_spec(path: Path) -> dict[str, Any]:
    spec: dict[str, Any] = deployment(path)["spec"]["template"]["spec"]
    return spec


def container(spec: dict[str, Any], name: str) -> dict[str, Any]:
    every: list[dict[str, Any]] = spec.get("initContainers", []) + spec["containers"]
    (found,) = [c for c in every if c["name"] == name]
    return found


def environment(container_spec: dict[str, Any]) -> dict[str, str]:
    """A container's variables; those read from a Secret or a field get a stand-in value."""
    return {var["name"]: var.get("value", "from-a-secret") for var in container_spec.get("env", [])}


def value_from(container_spec: dict[str, Any], name: str) -> dict[str, Any]:
    """Where a container's variable is read from (a Secret's key, a field of the pod)."""
    (found,) = [var["valueFrom"] for var in container_spec["env"] if var["name"] == name]
    return dict(found)


def argument(args: list[str], flag: str) -> str:
    """The value after `flag` on a command line."""
    assert args.count(flag) == 1, f"{flag} appears {args.count(flag)} times in {args}"
    return args[args.index(flag) + 1]


def watchdog_config(watchdog: dict[str, Any]) -> WatchdogConfig:
    """The config `omni-watchdog` builds from the container's command line and variables."""
    parsed = build_parser().parse_args(watchdog.get("args", ["run"]))
    assert parsed.command == "run"
    return load_config(environ=environment(watchdog), overrides=overrides_of(parsed))


def config_variables() -> set[str]:
    """Every `OMNI_WATCHDOG_*` variable that names a config field."""
    return {ENV_PREFIX + name.replace(".", "_").upper() for name, _, _ in describe_defaults()}


def api_port(env: dict[str, str]) -> int:
    """The port of the watchdog's API (`/metrics`, `/v1/target/health`) with this environment."""
    return split_host_port(load_config(environ=env).listen, "listen")[1]


def otlp_port(env: dict[str, str]) -> int:
    """The port of the watchdog's OTLP receiver with this environment."""
    return split_host_port(load_config(environ=env).spans.otlp_listen, "spans.otlp_listen")[1]


def check_watchdog_environment(env: dict[str, str]) -> None:
    unknown = {name for name in env if name.startswith(ENV_PREFIX)} - config_variables()
    assert not unknown, f"no config field is named by {sorted(unknown)}"
    load_config(environ=env)


def check_plugin_environment(env: dict[str, str], admin_route: bool = True) -> None:
    unknown = {name for name in env if name.startswith(ENV_PREFIX)} - PLUGIN_VARIABLES
    assert not unknown, f"the instrument plugin reads no {sorted(unknown)}"
    # Set, VLLM_PLUGINS drops every plugin it does not name, vLLM-Omni's models and any
    # out-of-tree platform too; the admin token alone asks for the admin route.
    assert "VLLM_PLUGINS" not in env
    assert ("OMNI_WATCHDOG_ADMIN_TOKEN" in env) is admin_route


# ---- every file ------------------------------------------------------------------------


@pytest.mark.parametrize("path", deploy_yaml_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_yaml_file_parses(path: Path) -> None:
    loaded = documents(path)
    assert loaded, f"{path} holds no document"
    assert all(isinstance(doc, dict) for doc in loaded)


# ---- the PrometheusRule ----------------------------------------------------------------


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("deploy_generator", DEPLOY / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prometheus_rule_holds_the_groups_of_the_rules_file() -> None:
    (rule,) = documents(PROMETHEUS_RULE)
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["kind"] == "PrometheusRule"
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


def test_generated_files_are_fresh() -> None:
    assert generator().main(["--check"]) == 0


def test_check_mode_reports_a_stale_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = generator()
    stale = tmp_path / "prometheusrule.yaml"
    stale.write_text(PROMETHEUS_RULE.read_text().replace("OmniStageStalled", "Renamed"))
    monkeypatch.setattr(module, "OUTPUT", stale)
    assert module.main(["--check"]) == 1


def test_check_mode_reports_a_stale_or_missing_multi_host_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = generator()
    rule = tmp_path / "prometheusrule.yaml"
    rule.write_text(module.render())
    monkeypatch.setattr(module, "OUTPUT", rule)
    monkeypatch.setattr(module, "MULTI_HOST", tmp_path / "multi-host")
    assert module.main([]) == 0
    assert module.main(["--check"]) == 0
    head = tmp_path / "multi-host" / HEAD_MANIFEST.name
    head.write_text(head.read_text() + "# edited by hand\n")
    assert module.main(["--check"]) == 1
    head.unlink()
    assert module.main(["--check"]) == 1


def test_prometheus_rule_passes_promtool(tmp_path: Path) -> None:
    (rule,) = documents(PROMETHEUS_RULE)
    rules_file = tmp_path / "rules.yml"
    rules_file.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    result = run_promtool("check", "rules", rules_file)
    assert result.returncode == 0, result.stdout + result.stderr


# ---- Kubernetes ------------------------------------------------------------------------


def kubernetes_validate() -> ModuleType:
    """The schema validator; skips locally and fails in CI when it is not installed."""
    try:
        return importlib.import_module("kubernetes_validate")
    except ImportError:
        message = "kubernetes-validate is not installed (pip install kubernetes-validate)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


@pytest.mark.parametrize(
    "path, resource",
    [
        (path, doc)
        for path, doc in manifests()
        if not doc["apiVersion"].startswith("monitoring.coreos.com/")
    ],
    ids=lambda value: value["kind"] if isinstance(value, dict) else str(value.name),
)
def test_manifest_validates_against_the_kubernetes_schema(
    path: Path, resource: dict[str, Any]
) -> None:
    validator = kubernetes_validate()
    try:
        validator.validate(resource, KUBERNETES_VERSION, strict=True)
    except validator.ValidationError as error:
        pytest.fail(f"{path.relative_to(ROOT)}: {resource['kind']}: {error.message}")


def test_every_manifest_has_a_known_kind() -> None:
    kinds = {(doc["apiVersion"], doc["kind"]) for _, doc in manifests()}
    assert kinds == {
        ("apps/v1", "Deployment"),
        ("v1", "Service"),
        ("monitoring.coreos.com/v1", "PodMonitor"),
        ("monitoring.coreos.com/v1", "PrometheusRule"),
    }


@pytest.mark.parametrize("path", [MAIN_MANIFEST, ADMIN_ONLY_MANIFEST], ids=["shared", "admin"])
def test_watchdog_is_a_native_sidecar_with_a_valid_config(path: Path) -> None:
    spec = pod_spec(path)
    watchdog = container(spec, WATCHDOG_CONTAINER)
    assert watchdog in spec["initContainers"]
    assert watchdog["restartPolicy"] == "Always"
    env = environment(watchdog)
    check_watchdog_environment(env)
    ports = [port["containerPort"] for port in watchdog["ports"]]
    assert ports == [api_port(env)]
    security = watchdog["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"]["drop"] == ["ALL"]


@pytest.mark.parametrize(
    "path",
    [MAIN_MANIFEST, ADMIN_ONLY_MANIFEST, HEAD_MANIFEST, *STAGE_MANIFESTS],
    ids=lambda path: str(path.relative_to(KUBERNETES)),
)
def test_vllm_runs_as_its_images_user(path: Path) -> None:
    # vLLM's images are built for root: under another uid torch's compile cache fails on
    # getpwuid() and the caches under HOME cannot be written.
    spec = pod_spec(path)
    vllm = container(spec, VLLM_CONTAINER)
    for context in (spec.get("securityContext", {}), vllm.get("securityContext", {})):
        assert "runAsUser" not in context
        assert not context.get("runAsNonRoot", False)


@pytest.mark.parametrize("path", [MAIN_MANIFEST, ADMIN_ONLY_MANIFEST], ids=["shared", "admin"])
def test_vllm_runs_omni_on_a_gpu_with_the_plugin(path: Path) -> None:
    spec = pod_spec(path)
    vllm = container(spec, VLLM_CONTAINER)
    assert vllm["command"][:2] == ["vllm", "serve"]
    assert "--omni" in vllm["args"]
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 1
    env = environment(vllm)
    check_plugin_environment(env)
    watchdog_env = environment(container(spec, WATCHDOG_CONTAINER))
    receiver = otlp_port(watchdog_env)
    assert env[telemetry.ENDPOINT_ENV] == f"http://127.0.0.1:{receiver}{telemetry.TRACES_PATH}"
    # The plugin checks the token the watchdog sends: both read the same Secret key.
    tokens = [
        next(var["valueFrom"] for var in c["env"] if var["name"] == admin.ADMIN_TOKEN_ENV)
        for c in (vllm, container(spec, WATCHDOG_CONTAINER))
    ]
    assert tokens[0] == tokens[1]
    assert "secretKeyRef" in tokens[0]
    assert vllm["startupProbe"]["failureThreshold"] * vllm["startupProbe"]["periodSeconds"] >= 600


def test_shared_variant_probes_liveness_through_the_watchdog() -> None:
    spec = pod_spec(MAIN_MANIFEST)
    assert spec["shareProcessNamespace"] is True
    watchdog_env = environment(container(spec, WATCHDOG_CONTAINER))
    probe = container(spec, VLLM_CONTAINER)["livenessProbe"]["httpGet"]
    assert probe["path"] == "/v1/target/health"
    assert probe["port"] == api_port(watchdog_env)
    config = load_config(environ=watchdog_env)
    assert {"processes", "gpu"} <= set(config.probes.enabled)
    # Signals to root's processes need root's uid with CAP_KILL (an added capability never
    # reaches a non-root container's processes); py-spy needs SYS_PTRACE; nothing else.
    security = container(spec, WATCHDOG_CONTAINER)["securityContext"]
    assert security["runAsUser"] == 0
    assert sorted(security["capabilities"]["add"]) == ["KILL", "SYS_PTRACE"]


def test_admin_only_variant_needs_no_shared_namespace_nor_privileges() -> None:
    spec = pod_spec(ADMIN_ONLY_MANIFEST)
    assert not spec.get("shareProcessNamespace", False)
    watchdog = container(spec, WATCHDOG_CONTAINER)
    assert "add" not in watchdog["securityContext"]["capabilities"]
    # Kubernetes' runAsNonRoot needs a numeric non-root user.
    assert watchdog["securityContext"]["runAsNonRoot"] is True
    assert watchdog["securityContext"]["runAsUser"] != 0
    config = load_config(environ=environment(watchdog))
    assert not {"processes", "gpu"} & set(config.probes.enabled)
    assert config.probes.gpu_backend == "none"
    assert "shutdown" in config.ladder.steps
    assert not {"terminate", "kill"} & set(config.ladder.steps)


def test_pod_monitor_scrapes_the_watchdog_port_of_the_pods() -> None:
    (monitor,) = documents(POD_MONITOR)
    assert WATCHDOG_JOB.fullmatch(monitor["metadata"]["name"])
    template = deployment(MAIN_MANIFEST)["spec"]["template"]
    labels = template["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    watchdog = container(template["spec"], WATCHDOG_CONTAINER)
    port_names = {port["name"] for port in watchdog["ports"]}
    for endpoint in monitor["spec"]["podMetricsEndpoints"]:
        assert endpoint["port"] in port_names
        assert endpoint["path"] == "/metrics"


def test_service_targets_the_pods_ports() -> None:
    (service,) = [doc for doc in documents(MAIN_MANIFEST) if doc["kind"] == "Service"]
    template = deployment(MAIN_MANIFEST)["spec"]["template"]
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    spec = template["spec"]
    names = {
        port["name"]
        for c in spec["containers"] + spec["initContainers"]
        for port in c.get("ports", [])
    }
    assert {port["targetPort"] for port in service["spec"]["ports"]} <= names


# ---- Kubernetes, several hosts ---------------------------------------------------------


def head_pod() -> dict[str, Any]:
    return pod_spec(HEAD_MANIFEST)


def master_service() -> dict[str, Any]:
    """The head's Service the stage pods reach its master and its watchdog through."""
    (found,) = [
        doc
        for doc in documents(HEAD_MANIFEST)
        if doc["kind"] == "Service" and doc["spec"].get("clusterIP") == "None"
    ]
    return found


def service_port(service: dict[str, Any], name: str) -> int:
    (port,) = [port["port"] for port in service["spec"]["ports"] if port["name"] == name]
    return int(port)


def container_ports(spec: dict[str, Any]) -> dict[str, int]:
    """Every named container port of a pod, init containers included."""
    every = spec.get("initContainers", []) + spec["containers"]
    return {port["name"]: port["containerPort"] for c in every for port in c.get("ports", [])}


def stage_id(path: Path) -> int:
    return int(argument(container(pod_spec(path), VLLM_CONTAINER)["args"], "--stage-id"))


def test_the_layout_has_a_head_and_a_pod_for_each_stage_it_does_not_run() -> None:
    assert STAGE_MANIFESTS
    head_args = container(head_pod(), VLLM_CONTAINER)["args"]
    stages = [stage_id(path) for path in STAGE_MANIFESTS]
    assert len(set(stages)) == len(stages)
    assert int(argument(head_args, "--stage-id")) not in stages


@pytest.mark.parametrize(
    "path", [HEAD_MANIFEST, *STAGE_MANIFESTS], ids=lambda path: path.name.removesuffix(".yaml")
)
def test_every_pod_has_its_own_watchdog_acting_on_the_processes_it_shares(path: Path) -> None:
    spec = pod_spec(path)
    # The watchdog acts on the processes of its own pod only, which it sees through the
    # shared PID namespace, with the privileges of the single-host pod.
    assert spec["shareProcessNamespace"] is True
    watchdog = container(spec, WATCHDOG_CONTAINER)
    assert watchdog in spec["initContainers"]
    assert watchdog["restartPolicy"] == "Always"
    check_watchdog_environment(environment(watchdog))
    config = watchdog_config(watchdog)
    assert config.mode is Mode.ENFORCE
    assert {"processes", "gpu"} <= set(config.probes.enabled)
    security = watchdog["securityContext"]
    assert security["runAsUser"] == 0
    assert sorted(security["capabilities"]["add"]) == ["KILL", "SYS_PTRACE"]
    assert security["allowPrivilegeEscalation"] is False
    # Every stage series, and every span the plugin sends, names the node it comes from.
    for name in (WATCHDOG_CONTAINER, VLLM_CONTAINER):
        field = value_from(container(spec, name), telemetry.HOST_ENV)
        assert field == {"fieldRef": {"fieldPath": "spec.nodeName"}}


def test_the_heads_watchdog_judges_the_remote_stages_from_their_spans() -> None:
    spec = head_pod()
    watchdog = container(spec, WATCHDOG_CONTAINER)
    env = environment(watchdog)
    config = watchdog_config(watchdog)
    assert "OMNI_WATCHDOG_REMOTE_STAGES" in env or "--remote-stage" in watchdog["args"]
    assert sorted(config.remote_stages) == sorted(stage_id(path) for path in STAGE_MANIFESTS)
    assert not config.headless
    # The stage pods' spans come across the cluster network, so the receiver listens beyond
    # loopback and wants a token, kept in a Secret.
    host, otlp = split_host_port(config.spans.otlp_listen, "spans.otlp_listen")
    assert not is_loopback(host)
    token = value_from(watchdog, "OMNI_WATCHDOG_OTLP_TOKEN")
    assert "secretKeyRef" in token
    ports = {port["name"]: port["containerPort"] for port in watchdog["ports"]}
    assert ports == {"watchdog": api_port(env), "otlp": otlp}
    # Its own server's plugin sends to it over the pod's loopback, with the same token.
    vllm = container(spec, VLLM_CONTAINER)
    vllm_env = environment(vllm)
    check_plugin_environment(vllm_env)
    assert vllm_env[telemetry.ENDPOINT_ENV] == f"http://127.0.0.1:{otlp}{telemetry.TRACES_PATH}"
    assert value_from(vllm, telemetry.TOKEN_ENV) == token
    admin_tokens = [value_from(c, admin.ADMIN_TOKEN_ENV) for c in (vllm, watchdog)]
    assert admin_tokens[0] == admin_tokens[1]
    assert "secretKeyRef" in admin_tokens[0]


def test_the_head_serves_the_master_on_its_own_address() -> None:
    vllm = container(head_pod(), VLLM_CONTAINER)
    args = vllm["args"]
    assert vllm["command"][:2] == ["vllm", "serve"]
    assert "--omni" in args and "--headless" not in args
    # The master binds the address it is given and tells the stages that address.
    assert argument(args, "--omni-master-address") == "$(POD_IP)"
    assert value_from(vllm, "POD_IP") == {"fieldRef": {"fieldPath": "status.podIP"}}
    master_port = int(argument(args, "--omni-master-port"))
    assert container_ports(head_pod())["omni-master"] == master_port
    assert vllm["startupProbe"]["failureThreshold"] * vllm["startupProbe"]["periodSeconds"] >= 600
    # /v1/target/health fails while a remote stage is unwell too: a probe on it would
    # restart the head for a stage on another node before its watchdog's remote_grace.
    assert "livenessProbe" not in vllm


def test_the_stages_reach_the_heads_master_and_watchdog_through_a_headless_service() -> None:
    service = master_service()
    template = deployment(HEAD_MANIFEST)["spec"]["template"]
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    # Its name resolves to the head pod's own IP, where the ZMQ ports the master hands
    # out at run time are too; and it does so before the head is ready, which the head is
    # only once every stage has registered with it.
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    ports = container_ports(template["spec"])
    for port in service["spec"]["ports"]:
        assert ports[port["targetPort"]] == port["port"]
    assert {port["name"] for port in service["spec"]["ports"]} == {"omni-master", "otlp"}


def test_the_clients_service_targets_the_heads_api_and_watchdog() -> None:
    (service,) = [
        doc
        for doc in documents(HEAD_MANIFEST)
        if doc["kind"] == "Service" and "clusterIP" not in doc["spec"]
    ]
    template = deployment(HEAD_MANIFEST)["spec"]["template"]
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    ports = container_ports(template["spec"])
    assert {port["targetPort"] for port in service["spec"]["ports"]} == {"http", "watchdog"}
    for port in service["spec"]["ports"]:
        assert ports[port["targetPort"]] == port["port"]


@pytest.mark.parametrize("path", STAGE_MANIFESTS, ids=lambda path: path.name.removesuffix(".yaml"))
def test_a_stage_pod_runs_one_headless_stage_registered_with_the_head(path: Path) -> None:
    spec = pod_spec(path)
    vllm = container(spec, VLLM_CONTAINER)
    args = vllm["args"]
    assert vllm["command"][:2] == ["vllm", "serve"]
    assert "--omni" in args and "--headless" in args
    assert "--port" not in args
    service = master_service()
    assert argument(args, "--omni-master-address") == service["metadata"]["name"]
    assert int(argument(args, "--omni-master-port")) == service_port(service, "omni-master")
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 1
    # A headless stage serves no HTTP: nothing to expose or probe.
    assert not {"ports", "startupProbe", "readinessProbe", "livenessProbe"} & set(vllm)


@pytest.mark.parametrize("path", STAGE_MANIFESTS, ids=lambda path: path.name.removesuffix(".yaml"))
def test_a_stage_pods_watchdog_is_headless_and_acts_on_its_stage_alone(path: Path) -> None:
    watchdog = container(pod_spec(path), WATCHDOG_CONTAINER)
    assert "--headless" in watchdog["args"]
    config = watchdog_config(watchdog)
    assert config.headless
    assert not config.remote_stages
    env = environment(watchdog)
    # No admin endpoint to ask, no HTTP API to target.
    assert not {"OMNI_WATCHDOG_ADMIN_TOKEN", "OMNI_WATCHDOG_TARGET"} & set(env)
    assert [port["containerPort"] for port in watchdog["ports"]] == [api_port(env)]
    # Only the pod's own processes send to it, over the pod's loopback.
    host, _ = split_host_port(config.spans.otlp_listen, "spans.otlp_listen")
    assert is_loopback(host)


@pytest.mark.parametrize("path", STAGE_MANIFESTS, ids=lambda path: path.name.removesuffix(".yaml"))
def test_a_stage_pods_plugin_sends_to_its_own_watchdog_and_to_the_heads(path: Path) -> None:
    spec = pod_spec(path)
    vllm = container(spec, VLLM_CONTAINER)
    env = environment(vllm)
    # A headless stage serves no HTTP, so no admin route: its watchdog terminates it.
    check_plugin_environment(env, admin_route=False)
    local = otlp_port(environment(container(spec, WATCHDOG_CONTAINER)))
    assert env[telemetry.ENDPOINT_ENV] == f"http://127.0.0.1:{local}{telemetry.TRACES_PATH}"
    service = master_service()
    head = f"http://{service['metadata']['name']}:{service_port(service, 'otlp')}"
    assert env[telemetry.HEAD_ENDPOINT_ENV] == head + telemetry.TRACES_PATH
    # The token the head's receiver wants, from the same Secret key.
    head_watchdog = container(head_pod(), WATCHDOG_CONTAINER)
    token = value_from(vllm, telemetry.HEAD_TOKEN_ENV)
    assert token == value_from(head_watchdog, "OMNI_WATCHDOG_OTLP_TOKEN")
    assert "secretKeyRef" in token


def test_prometheus_scrapes_the_watchdog_of_every_pod_of_the_layout() -> None:
    (monitor,) = documents(MULTI_HOST_POD_MONITOR)
    assert monitor["kind"] == "PodMonitor"
    assert WATCHDOG_JOB.fullmatch(monitor["metadata"]["name"])
    selector = monitor["spec"]["selector"]["matchLabels"].items()
    (single_host,) = documents(POD_MONITOR)
    assert monitor["metadata"]["name"] != single_host["metadata"]["name"]
    single_selector = single_host["spec"]["selector"]["matchLabels"].items()
    for path in [HEAD_MANIFEST, *STAGE_MANIFESTS]:
        template = deployment(path)["spec"]["template"]
        labels = template["metadata"]["labels"].items()
        assert selector <= labels
        # Scraped once: the single-host PodMonitor does not select these pods.
        assert not single_selector <= labels
        watchdog = container(template["spec"], WATCHDOG_CONTAINER)
        port_names = {port["name"] for port in watchdog["ports"]}
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            assert endpoint["port"] in port_names
            assert endpoint["path"] == "/metrics"


# ---- compose ---------------------------------------------------------------------------


def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return loaded


def bind_mounts(service: dict[str, Any]) -> dict[str, Path]:
    """Container path -> host path of a service's bind mounts (named volumes left out)."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/")):
            mounts[target] = (COMPOSE_DIR / source).resolve()
    return mounts


def host_path(service: dict[str, Any], container_path: str) -> Path:
    """Where a path inside a service's container comes from on the host."""
    for target, source in bind_mounts(service).items():
        if container_path == target or container_path.startswith(target.rstrip("/") + "/"):
            return source / os.path.relpath(container_path, target)
    raise AssertionError(f"{container_path} is not mounted from the repository")


def test_compose_bind_mounts_and_build_context_exist() -> None:
    services = compose()["services"]
    for name, service in services.items():
        for source in bind_mounts(service).values():
            assert source.exists(), f"{name}: {source} does not exist"
        if "build" in service:
            context = (COMPOSE_DIR / service["build"]["context"]).resolve()
            assert (context / service["build"].get("dockerfile", "Dockerfile")).is_file()
    named = {
        volume.split(":")[0]
        for service in services.values()
        for volume in service.get("volumes", [])
        if not volume.startswith((".", "/"))
    }
    assert named == set(compose()["volumes"])


def test_compose_watchdog_shares_the_servers_pid_namespace() -> None:
    services = compose()["services"]
    watchdog = services["watchdog"]
    assert watchdog["pid"] == "service:vllm"
    assert watchdog["network_mode"] == "service:vllm"
    assert watchdog["cap_drop"] == ["ALL"]
    assert sorted(watchdog["cap_add"]) == ["KILL", "SYS_PTRACE"]
    env = {name: str(value) for name, value in watchdog["environment"].items()}
    check_watchdog_environment(env)
    api = api_port(env)
    vllm = services["vllm"]
    assert f"{api}:{api}" in vllm["ports"]
    vllm_env = {name: str(value) for name, value in vllm["environment"].items()}
    check_plugin_environment(vllm_env)
    receiver = otlp_port(env)
    assert vllm_env[telemetry.ENDPOINT_ENV].startswith(f"http://127.0.0.1:{receiver}/")
    assert "--omni" in vllm["command"]


def test_compose_prometheus_loads_the_rules_and_scrapes_the_watchdog(tmp_path: Path) -> None:
    prometheus = compose()["services"]["prometheus"]
    config_path = host_path(prometheus, "/etc/prometheus/prometheus.yml")
    config = yaml.safe_load(config_path.read_text())
    rule_files = [host_path(prometheus, rule) for rule in config["rule_files"]]
    assert rule_files == [RULES.resolve()]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    watchdog_jobs = [name for name in jobs if WATCHDOG_JOB.fullmatch(name)]
    assert watchdog_jobs
    targets = jobs[watchdog_jobs[0]]["static_configs"][0]["targets"]
    assert targets == ["vllm:9464"]
    # promtool checks the configuration with the rule files where the container sees them.
    config["rule_files"] = [str(path) for path in rule_files]
    local = tmp_path / "prometheus.yml"
    local.write_text(yaml.safe_dump(config))
    result = run_promtool("check", "config", local)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_grafana_provisions_the_datasource_and_the_dashboard() -> None:
    grafana = compose()["services"]["grafana"]
    provisioning = host_path(grafana, "/etc/grafana/provisioning")
    (datasources,) = documents(provisioning / "datasources" / "prometheus.yml")
    (datasource,) = datasources["datasources"]
    assert datasource["type"] == "prometheus"
    assert datasource["url"] == "http://prometheus:9090"
    (providers,) = documents(provisioning / "dashboards" / "omni-watchdog.yml")
    (provider,) = providers["providers"]
    folder = host_path(grafana, provider["options"]["path"])
    dashboard = json.loads((folder / "omni-watchdog.json").read_text())
    # The dashboard picks any Prometheus data source, so the provisioned one fits.
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == datasource["type"]


# ---- the Dockerfile --------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    instructions = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            word, _, rest = stripped.partition(" ")
            instructions.append((word.upper(), rest.strip()))
    return instructions


def stages() -> list[tuple[str, list[tuple[str, str]]]]:
    """The build stages by name, each with its instructions."""
    found: list[tuple[str, list[tuple[str, str]]]] = []
    for word, rest in dockerfile_instructions():
        if word == "FROM":
            found.append((rest.split()[-1] if " AS " in rest.upper() else "", []))
        elif found:
            found[-1][1].append((word, rest))
    return found


def docker_ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore leaves `path` out of the build context (last match wins)."""
    ignored = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        body = pattern.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(path, body) or path.startswith(body + "/"):
            ignored = not negated
    return ignored


def test_dockerfile_builds_a_wheel_then_a_slim_runtime() -> None:
    names = [name for name, _ in stages()]
    assert names == ["build", "runtime"]
    build, runtime = (body for _, body in stages())
    assert any(word == "RUN" and "pip wheel" in rest for word, rest in build)
    assert any(word == "COPY" and rest.startswith("--from=build") for word, rest in runtime)
    bases = [rest for word, rest in dockerfile_instructions() if word == "FROM"]
    assert all("-slim" in base for base in bases)


def test_dockerfile_runs_as_a_non_root_user_with_a_healthcheck() -> None:
    runtime = stages()[-1][1]
    users = [rest for word, rest in runtime if word == "USER"]
    assert users and users[-1] not in ("root", "0")
    assert users[-1].isdigit(), "runAsNonRoot can only check a numeric user"
    (healthcheck,) = [rest for word, rest in runtime if word == "HEALTHCHECK"]
    assert "/healthz" in healthcheck
    assert ("ENTRYPOINT", '["omni-watchdog"]') in runtime
    (command,) = [json.loads(rest) for word, rest in runtime if word == "CMD"]
    assert command[0] == "run"


def test_dockerfile_environment_is_a_valid_config() -> None:
    runtime = stages()[-1][1]
    env: dict[str, str] = {}
    for word, rest in runtime:
        if word == "ENV":
            for item in shlex.split(rest):
                name, _, value = item.partition("=")
                env[name] = value
    check_watchdog_environment(env)
    exposed = {int(port) for word, rest in runtime if word == "EXPOSE" for port in rest.split()}
    assert api_port(env) in exposed
    # The receiver takes no token on loopback, where only the server's namespace reaches it.
    otlp = load_config(environ=env).spans.otlp_listen
    assert is_loopback(split_host_port(otlp, "spans.otlp_listen")[0])
    assert otlp_port(env) not in exposed


def test_dockerfile_copies_only_what_exists_in_the_build_context() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    sources = []
    for word, rest in dockerfile_instructions():
        if word == "COPY" and not rest.startswith("--from="):
            sources += rest.split()[:-1]
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: no such file"
        assert not docker_ignored(source, patterns), f"COPY {source}: left out by .dockerignore"


def test_py_spy_comes_with_the_package() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^\s*"py-spy[>=<]', pyproject, re.MULTILINE)
    runtime = " ".join(rest for word, rest in stages()[-1][1] if word == "RUN")
    assert "pip install" in runtime and "omni-watchdog" in runtime


def test_only_a_copy_of_py_spy_carries_the_ptrace_capability() -> None:
    runtime = " ".join(rest for word, rest in stages()[-1][1] if word == "RUN")
    (capped,) = re.findall(r"setcap cap_sys_ptrace\+ep (\S+)", runtime)
    # Without SYS_PTRACE the kernel will not start a program with that capability; plain
    # py-spy must stay, and the watchdog must know the copy's name.
    assert Path(capped).name == PTRACE_PY_SPY
    assert f'cp "$(command -v py-spy)" {capped}' in runtime
