"""Two "hosts" on one machine, for the tests of stages on other hosts.

The head: the simulated vLLM-Omni 0.30 server with stage 1 remote (`--remote-stage 1`),
and its watchdog in this process. The stage host: a headless simulated stage 1
(`--headless --stage-id 1`) registered with the head's coordinator, and its own
`omni-watchdog run --headless` as a separate process. Two process trees, two simulated GPU
state directories, two watchdogs; every process here is started, and ended, by the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import yaml
from deadline import wait_for
from e2e.harness import FAST, SIM_ENV, live_processes, warmed_up
from ports import free_port

from omni_watchdog.app import Watchdog
from omni_watchdog.clock import SystemClock
from omni_watchdog.config import merge_layers
from omni_watchdog.demo import REPORT_REQUEST, demo_config
from omni_watchdog.factory import build_watchdog
from omni_watchdog.sim.faults import FAULTS_FILE
from omni_watchdog.sim.launcher import SimProcess, example_config
from omni_watchdog.sim.nvml import STATE_ENV, SimulatedNvml
from omni_watchdog.sim.wire import MASTER_FILE

TOKEN = "head-receiver-token"
HEAD_HOST, STAGE_HOST = "head-host", "stage-host"
REMOTE_STAGE = 1
# The head's `--omni-heartbeat-timeout`: a silent remote replica is evicted after this.
EVICT_AFTER_S = 3.0
REPLICA_TITLE = f"StageEngineCoreProc_stage{REMOTE_STAGE}_replica"
# How often a wait asks the servers and watchdogs over HTTP.
POLL_INTERVAL = 0.2


@dataclass
class StageHost:
    """A headless stage and, unless left out, its own watchdog process."""

    workdir: Path
    sim: SimProcess
    watchdog: subprocess.Popen[bytes] | None
    api_url: str

    @property
    def state_dir(self) -> Path:
        return self.sim.state_dir

    async def get(self, path: str) -> dict[str, Any]:
        """One JSON answer of the stage's watchdog's API."""
        async with (
            aiohttp.ClientSession() as session,
            session.get(self.api_url + path) as response,
        ):
            found: dict[str, Any] = await response.json()
            return found

    async def status(self) -> dict[str, Any]:
        return await self.get("/v1/status")

    async def incidents(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = (await self.get("/v1/incidents"))["incidents"]
        return found

    async def closed_incident(self, timeout: float) -> dict[str, Any]:
        """The first incident of the stage's watchdog, whole, once it has closed."""

        async def closed() -> dict[str, Any] | None:
            with contextlib.suppress(aiohttp.ClientError):
                for summary in await self.incidents():
                    if summary.get("closed") is not None:
                        return await self.get(f"/v1/incidents/{summary['incident_id']}")
            return None

        return await wait_for(closed, timeout, "a closed incident", interval=POLL_INTERVAL)

    def leftovers(self) -> list[int]:
        """Live processes of the headless stage (its watchdog reads the same state
        directory for its simulated devices, and is not one)."""
        own = {self.watchdog.pid} if self.watchdog is not None else set()
        return [pid for pid in self.sim.leftover_pids() if pid not in own]

    def replicas(self) -> list[psutil.Process]:
        """The stage's replica processes, oldest first."""
        root = psutil.Process(self.sim.process.pid)
        found = []
        for child in root.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if REPLICA_TITLE in " ".join(child.cmdline()):
                    found.append(child)
        return sorted(found, key=lambda p: p.create_time())

    def inject(self, kind: str, replica: int = 0) -> None:
        """A fault at run time, the way a headless stage takes one (it serves no HTTP)."""
        with (self.state_dir / FAULTS_FILE).open("a") as faults:
            faults.write(json.dumps({"kind": kind, "replica": replica}) + "\n")

    def gpu_bytes(self) -> int:
        """Simulated GPU memory held on this host's devices now."""
        nvml = SimulatedNvml(self.state_dir)
        return sum(nvml.memory(nvml.handle(i)).used for i in range(nvml.device_count()))

    def stop(self) -> None:
        if self.watchdog is not None and self.watchdog.poll() is None:
            self.watchdog.send_signal(signal.SIGTERM)
            try:
                self.watchdog.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.watchdog.kill()
                self.watchdog.wait(timeout=5)
        self.sim.stop()


def start_stage_host(
    workdir: Path,
    master_port: int,
    head_otlp_port: int | None,
    *,
    with_watchdog: bool = True,
    watchdog_config: dict[str, Any] = FAST,
    faults: tuple[str, ...] = (),
    plugin_env: Mapping[str, str] = SIM_ENV,
) -> StageHost:
    """A headless stage 1 registered with the head on `master_port`, exporting its spans
    to its own watchdog and, when `head_otlp_port` is given, to the head's; `plugin_env`
    sets the plugin (the tests' fast heartbeat by default)."""
    workdir.mkdir(parents=True, exist_ok=True)
    api_port, otlp_port = free_port(), free_port()
    env = {
        **plugin_env,
        "OMNI_WATCHDOG_HOST": STAGE_HOST,
        "OMNI_WATCHDOG_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_port}/v1/traces",
    }
    if head_otlp_port is not None:
        env["OMNI_WATCHDOG_HEAD_OTLP_ENDPOINT"] = f"http://127.0.0.1:{head_otlp_port}/v1/traces"
        env["OMNI_WATCHDOG_HEAD_OTLP_TOKEN"] = TOKEN
    sim = SimProcess.start(
        workdir,
        list(faults),
        "0.30",
        env=env,
        extra_args=[
            "--headless",
            "--stage-id",
            str(REMOTE_STAGE),
            "--omni-master-address",
            "127.0.0.1",
            "--omni-master-port",
            str(master_port),
        ],
    )
    watchdog = None
    if with_watchdog:
        config = merge_layers(
            watchdog_config,
            {
                "headless": True,
                "pid": sim.process.pid,
                "mode": "enforce",
                "host": STAGE_HOST,
                "listen": f"127.0.0.1:{api_port}",
                "state_dir": str(workdir / "watchdog"),
                "spans": {"otlp_listen": f"127.0.0.1:{otlp_port}"},
                "probes": {"gpu_backend": "sim"},
            },
        )
        config_path = workdir / "watchdog.yaml"
        config_path.write_text(yaml.safe_dump(config))
        log = (workdir / "watchdog.log").open("ab")
        watchdog = subprocess.Popen(
            [
                str(Path(sys.executable).with_name("omni-watchdog")),
                "run",
                "--config",
                str(config_path),
                "--log-level",
                "debug",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            # This host's simulated devices, not the head's.
            env={**os.environ, STATE_ENV: str(sim.state_dir)},
        )
    return StageHost(workdir, sim, watchdog, f"http://127.0.0.1:{api_port}")


@dataclass
class Head:
    watchdog: Watchdog
    sim: SimProcess

    @property
    def master_port(self) -> int:
        port: int = json.loads((self.sim.state_dir / MASTER_FILE).read_text())["port"]
        return port

    def processes_alive(self) -> bool:
        """Every process of the head's tree as the watchdog recorded it still runs."""
        return all(psutil.pid_exists(p.pid) for p in live_processes(self.watchdog))


@asynccontextmanager
async def head_with_remote_stage(
    workdir: Path, overrides: dict[str, Any] = FAST
) -> AsyncIterator[Head]:
    """The head's simulated server (stage 1 remote) and its watchdog, in enforce mode."""
    workdir.mkdir(parents=True, exist_ok=True)
    sim_state = workdir / "sim-state"
    # The head's watchdog reads this host's simulated devices from here.
    os.environ[STATE_ENV] = str(sim_state)
    port = free_port()
    config = demo_config(
        workdir,
        f"http://127.0.0.1:{port}",
        example_config("0.30"),
        "enforce",
        merge_layers(
            overrides,
            {"remote_stages": [REMOTE_STAGE], "otlp_token": TOKEN, "host": HEAD_HOST},
        ),
    )
    watchdog = await build_watchdog(config, clock=SystemClock())
    await watchdog.start()
    sim = SimProcess.start(
        workdir,
        [],
        "0.30",
        env={
            **SIM_ENV,
            "OMNI_WATCHDOG_HOST": HEAD_HOST,
            "OMNI_WATCHDOG_OTLP_ENDPOINT": f"http://127.0.0.1:{watchdog.otlp_port}/v1/traces",
            "OMNI_WATCHDOG_OTLP_TOKEN": TOKEN,
            "OMNI_WATCHDOG_ADMIN_TOKEN": config.admin_token,
        },
        port=port,
        extra_args=[
            "--omni-master-port",
            "0",
            "--remote-stage",
            str(REMOTE_STAGE),
            "--omni-heartbeat-timeout",
            str(EVICT_AFTER_S),
        ],
    )
    try:
        await wait_for(lambda: (sim.state_dir / MASTER_FILE).exists(), 30)
        yield Head(watchdog, sim)
    finally:
        await watchdog.stop()
        sim.stop()


async def head_health(head: Head) -> int:
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.get(head.sim.url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as answer,
        ):
            return answer.status
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return 0


async def chat(head: Head, timeout: float = 30.0) -> int:
    """The status of one chat request through the head's pipeline (0: no answer)."""
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                head.sim.url + "/v1/chat/completions",
                json=REPORT_REQUEST,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as answer,
        ):
            await answer.read()
            return answer.status
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return 0


async def stage_ready(head: Head, stage: StageHost) -> None:
    """The head serves again (the stage registered) and the stage's watchdog is warm and
    sees its stage well and its master linked; a timeout says which of these was missing."""
    seen: dict[str, Any] = {}

    async def ready() -> bool:
        seen["head /health"] = await head_health(head)
        try:
            status = await stage.status()
        except aiohttp.ClientError as error:
            seen["stage watchdog"] = repr(error)
            return False
        stages = {s["stage_id"]: s for s in status.get("stages") or ()}
        seen["stage watchdog"] = {
            "warmed_up": status["target"]["warmed_up"],
            "stage": stages.get(REMOTE_STAGE, {}).get("state"),
            "link": status.get("link"),
        }
        return (
            seen["head /health"] == 200
            and bool(status["target"]["warmed_up"])
            and stages.get(REMOTE_STAGE, {}).get("state") == "healthy"
            and bool((status.get("link") or {}).get("up"))
        )

    await wait_for(ready, 60, "the stage host ready", interval=POLL_INTERVAL, seen=lambda: seen)


@asynccontextmanager
async def running_stage_host(
    head: Head,
    workdir: Path,
    *,
    to_head: bool = True,
    with_watchdog: bool = True,
    watchdog_config: dict[str, Any] = FAST,
    plugin_env: Mapping[str, str] = SIM_ENV,
) -> AsyncIterator[StageHost]:
    """A stage host for `head`, registered and serving (its watchdog, when it has one,
    warm and linked); `to_head`: its spans go to the head's watchdog too. Ended on exit."""
    stage = start_stage_host(
        workdir,
        head.master_port,
        head.watchdog.otlp_port if to_head else None,
        with_watchdog=with_watchdog,
        watchdog_config=watchdog_config,
        plugin_env=plugin_env,
    )
    try:
        if with_watchdog:
            await stage_ready(head, stage)
        else:
            await wait_for(lambda: _serving(head), 60, "the head serving", interval=POLL_INTERVAL)
        await warmed_up(head.watchdog)
        yield stage
    finally:
        stage.stop()


async def _serving(head: Head) -> bool:
    return await head_health(head) == 200
