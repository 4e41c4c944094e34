"""The shipped multi-host layout running in lab hosts: the head and each stage host in a
namespace of its own (`network`), each host's containers under its own init
(`host_init`), started from the manifests (`layout`).

The test reads every host over its control link: the watchdogs' APIs, the head's /health,
and, from this machine's /proc, which process each container runs now.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import yaml
from netlab import layout as shipped
from netlab.network import Host, Network, enter

from omni_watchdog.sim.launcher import example_config

HOST_INIT = Path(__file__).with_name("host_init.py")
HEAD_NODE = "head-node"
STAGE_NODE = "stage-node-{}"
# The test's value of each Secret the manifests read.
TEST_SECRETS = {
    "omni-watchdog-otlp": "lab-otlp-token",
    "omni-watchdog-admin": "lab-admin-token",
}
HTTP_TIMEOUT = aiohttp.ClientTimeout(total=2)


@dataclass(frozen=True)
class Identity:
    """A process as the machine names it for life."""

    pid: int
    create_time: float

    def alive(self) -> bool:
        try:
            return psutil.Process(self.pid).create_time() == self.create_time
        except psutil.Error:
            return False


@dataclass
class LabHost:
    """One host: its network, its init (the `unshare` that started it) and its pod."""

    net: Host
    pod: shipped.Pod
    workdir: Path
    unshare: subprocess.Popen[bytes] | None = None

    @property
    def name(self) -> str:
        return self.net.name

    @property
    def watchdog_url(self) -> str:
        return f"http://{self.net.control_ip}:{self.pod.ports['watchdog']}"

    @property
    def server_url(self) -> str:
        return f"http://{self.net.control_ip}:{self.pod.ports['http']}"

    def events(self) -> list[dict[str, Any]]:
        """The init's record of its containers' starts and exits, oldest first."""
        path = self.workdir / "events.jsonl"
        found = []
        if path.exists():
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    found.append(json.loads(line))
        return found

    def _events(self, event: str, container: str) -> list[dict[str, Any]]:
        return [e for e in self.events() if e["event"] == event and e["container"] == container]

    def starts(self, container: str) -> int:
        return len(self._events("started", container))

    def exits(self, container: str) -> list[dict[str, Any]]:
        return self._events("exited", container)

    def container(self, container: str) -> Identity | None:
        """The process running `container` now, as this machine numbers it."""
        started = self._events("started", container)
        if not started or self.unshare is None:
            return None
        inner = started[-1]["pid"]
        try:
            init = psutil.Process(self.unshare.pid).children()[0]
            for child in init.children():
                if _namespace_pid(child.pid) == inner:
                    return Identity(child.pid, child.create_time())
        except (psutil.Error, IndexError):
            return None
        return None

    def tree(self, container: str) -> list[Identity]:
        """The container's process and all its descendants."""
        top = self.container(container)
        if top is None:
            return []
        try:
            processes = [psutil.Process(top.pid)]
            processes += processes[0].children(recursive=True)
            return [Identity(p.pid, p.create_time()) for p in processes]
        except psutil.Error:
            return []

    async def get(self, url: str) -> tuple[int, Any]:
        """(status, JSON or None) of one GET over the control link; (0, None) unanswered."""
        try:
            async with (
                aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as session,
                session.get(url) as answer,
            ):
                body = await answer.read()
                with contextlib.suppress(ValueError):
                    return answer.status, json.loads(body)
                return answer.status, None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return 0, None

    async def status(self) -> dict[str, Any] | None:
        code, body = await self.get(self.watchdog_url + "/v1/status")
        return body if code == 200 and isinstance(body, dict) else None

    async def incidents(self) -> list[dict[str, Any]]:
        code, body = await self.get(self.watchdog_url + "/v1/incidents")
        return list(body["incidents"]) if code == 200 else []

    def verdicts_logged(self, since: float) -> list[dict[str, Any]]:
        """The verdicts its watchdog logged at or after `since` (wall time), any start of it."""
        found = []
        path = self.workdir / "watchdog.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        for line in text.splitlines():
            try:
                entry = json.loads(line)
                logged = datetime.fromisoformat(entry["time"].replace("Z", "+00:00"))
            except (ValueError, KeyError, AttributeError, TypeError):
                continue  # a line of something else the watchdog's process printed
            if entry.get("event") == "verdict" and logged.timestamp() >= since:
                found.append(entry)
        return found

    async def incident(self, incident_id: str) -> dict[str, Any]:
        code, body = await self.get(f"{self.watchdog_url}/v1/incidents/{incident_id}")
        assert code == 200 and isinstance(body, dict), (code, body)
        return body

    def stop(self) -> None:
        if self.unshare is None or self.unshare.poll() is not None:
            return
        with contextlib.suppress(psutil.Error, IndexError):
            psutil.Process(self.unshare.pid).children()[0].send_signal(signal.SIGTERM)
        try:
            self.unshare.wait(timeout=15)
        except subprocess.TimeoutExpired:
            # The pid namespace ends with its init, and its init with the unshare.
            self.unshare.kill()
            self.unshare.wait(timeout=10)


def _namespace_pid(pid: int) -> int | None:
    """`pid`'s number in the innermost pid namespace it is in (its NSpid's last field)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    except (OSError, ValueError):
        return None
    return None


def write_config(path: Path, settings: Mapping[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(dict(settings)))
    return path


@dataclass(frozen=True)
class ServerCommand:
    """What a host's `vllm` container runs in place of the manifest's image."""

    argv: list[str]
    env: dict[str, str]


# (host, the manifest's server arguments with $(VAR) expanded, its resolved environment)
# -> the command that stands in for the image's `vllm serve`.
ServerFactory = Callable[["LabHost", list[str], dict[str, str]], ServerCommand]
# host -> what the host's watchdog has in place of the manifest's GPU backend and volumes.
WatchdogEnvFactory = Callable[["LabHost"], dict[str, str]]


class Lab:
    """The shipped layout on lab hosts: the head pod and a stage pod per remote stage."""

    def __init__(
        self,
        workdir: Path,
        watchdog_settings: Mapping[str, Any],
        server: ServerFactory,
        watchdog_env: WatchdogEnvFactory,
    ) -> None:
        self.layout = shipped.shipped_layout()
        stage_ids = sorted(self.layout.stages)
        self.network = Network(
            HEAD_NODE,
            [STAGE_NODE.format(k) for k in stage_ids],
            {name: name for name in self.layout.head_names},
        )
        self.head = LabHost(self.network.head, self.layout.head, workdir / HEAD_NODE)
        self.stages = {
            k: LabHost(
                self.network.host(STAGE_NODE.format(k)),
                self.layout.stages[k],
                workdir / STAGE_NODE.format(k),
            )
            for k in stage_ids
        }
        self._settings = watchdog_settings
        self._server = server
        self._watchdog_env = watchdog_env

    @property
    def hosts(self) -> list[LabHost]:
        return [self.head, *self.stages.values()]

    def start(self) -> None:
        for host in self.hosts:
            self._start(host)

    def _start(self, host: LabHost) -> None:
        host.workdir.mkdir(parents=True, exist_ok=True)
        pod, node = host.pod, host.net

        def env_of(container_env: Mapping[str, Any]) -> dict[str, str]:
            return shipped.resolve_env(
                container_env, node_name=node.name, pod_ip=node.pod_ip, secrets=TEST_SECRETS
            )

        watchdog_env = {
            **env_of(pod.watchdog_env),
            "OMNI_WATCHDOG_STATE_DIR": str(host.workdir / "watchdog"),
            **self._watchdog_env(host),
        }
        server_env = env_of(pod.server_env)
        server = self._server(host, shipped.expand(pod.server_args, server_env), server_env)
        config = write_config(host.workdir / "timings.yaml", self._settings)
        spec = {
            "events": str(host.workdir / "events.jsonl"),
            "containers": [
                {
                    "name": shipped.WATCHDOG_CONTAINER,
                    "argv": shipped.watchdog_argv(pod.watchdog_args, config),
                    "env": watchdog_env,
                    "log": str(host.workdir / "watchdog.log"),
                },
                {
                    "name": shipped.SERVER_CONTAINER,
                    "argv": server.argv,
                    "env": {**server_env, **server.env},
                    "log": str(host.workdir / "server.log"),
                },
            ],
        }
        spec_path = host.workdir / "init.json"
        spec_path.write_text(json.dumps(spec))
        with (host.workdir / "init.log").open("ab") as log:
            host.unshare = subprocess.Popen(
                [*enter(node), sys.executable, str(HOST_INIT), str(spec_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def close(self) -> None:
        for host in self.hosts:
            host.stop()
        self.network.close()


def simulated(evict_after: float, plugin_env: Mapping[str, str]) -> ServerFactory:
    """The simulator in place of vLLM-Omni: the manifest's flags it shares, the head's
    remote stages from its watchdog's OMNI_WATCHDOG_REMOTE_STAGES, a replica silent
    `evict_after` evicted, and its own simulated devices."""

    def server(host: LabHost, args: list[str], env: dict[str, str]) -> ServerCommand:
        remote = shipped.shipped_layout().remote_stages
        head_extra = [
            *[arg for k in remote for arg in ("--remote-stage", str(k))],
            "--omni-heartbeat-timeout",
            str(evict_after),
        ]
        state = sim_state(host)
        argv = shipped.sim_server_argv(
            args, state_dir=state, stage_config=example_config("0.30"), head_extra=head_extra
        )
        return ServerCommand(argv, {**plugin_env, **shipped.sim_state_env(state)})

    return server


def sim_state(host: LabHost) -> Path:
    state = host.workdir / "sim-state"
    state.mkdir(parents=True, exist_ok=True)
    return state


def simulated_devices(host: LabHost) -> dict[str, str]:
    """The host's watchdog reads the simulated devices of the host's server."""
    return {"OMNI_WATCHDOG_PROBES_GPU_BACKEND": "sim", **shipped.sim_state_env(sim_state(host))}


@contextlib.contextmanager
def running_lab(
    workdir: Path,
    settings: Mapping[str, Any],
    server: ServerFactory,
    watchdog_env: WatchdogEnvFactory,
) -> Iterator[Lab]:
    lab = Lab(workdir, settings, server, watchdog_env)
    try:
        lab.start()
        yield lab
    finally:
        lab.close()
