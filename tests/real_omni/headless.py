"""vLLM-Omni 0.30's distributed mode, on one machine: a head and headless stages.

The head is `vllm serve MODEL --omni --stage-id 0 --omni-master-address A
--omni-master-port P`: it runs stage 0 itself, serves the API, and binds the master's
registration socket on P plus the coordinator (a forked child with the head's command
line) that collects the replicas' heartbeats. Every other stage of the pipeline is then
remote: the head waits for it to register. Each is `vllm serve MODEL --omni --stage-id N
--headless --omni-master-address A --omni-master-port P`, a process tree of its own (as on
another host), with the same import shim, plugins and deploy file as the head.

What 0.30 does, measured here (the head's heartbeat timeout 5 s):

- a headless replica registers once, over a short-lived connection to P; afterwards its
  engine core holds three TCP connections to the head's address: the coordinator
  (heartbeats every 5 s) and the head-owned input and output sockets. Nothing holds P,
  and the headless root process holds no connection at all;
- the master numbers replicas itself: a stage started again comes up as `replica1`,
  `replica2`, ... in its title;
- the head evicts a replica whose engine core dies or stops (503 within about 2.5 s, the
  request in flight fails with "stage replica disappeared", later ones at once with
  "Stage-N has no live replica"); it then closes its sockets to that replica, whose engine
  core keeps only the coordinator connection. An evicted replica is never taken back, even
  when it resumes: the head stays at 503 until a new headless stage of that id registers,
  and then answers 200 again with no restart of the head;
- a headless stage whose engine core dies exits by itself (the tree in about 6 s);
- a headless stage outlives its head for good: nothing in it watches the master.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil
from deadline import wait_for
from ports import free_port
from real_omni.server import (
    DEPLOY_FILE,
    FAULTS_DIR,
    FAULTS_ENV,
    OTLP_TOKEN,
    STAGE_NAMES,
    Faults,
    omni_environment,
    omni_serve,
)
from real_vllm.server import MODEL_NAME, StartedTree, VllmServer, launch

MASTER_ADDRESS = "127.0.0.1"
# The head's own stage; every other stage of the pipeline is remote.
HEAD_STAGE = 0
# Short, so that a stopped replica is evicted within seconds; 0.30's default is 30 s.
HEARTBEAT_TIMEOUT = 5.0
# The head, then two headless stages, each starting its engine and worker on two cores.
READY_TIMEOUT = 420.0
HEADLESS_ENGINE_TITLE = "VLLM::StageEngineCoreProc_stage{stage}_replica"


@dataclass(kw_only=True)
class HeadlessStage(StartedTree):
    """`vllm serve --omni --stage-id N --headless`, in a session and process group of its
    own, as it would be on another host."""

    stage_id: int

    @property
    def pid(self) -> int:
        return self.process.pid

    def engine(self) -> psutil.Process:
        """The stage's engine core (`VLLM::StageEngineCoreProc_stage<N>_replica<R>_DP0`,
        R given by the master)."""
        return self.titled(HEADLESS_ENGINE_TITLE.format(stage=self.stage_id))

    def master_connections(self, address: str = MASTER_ADDRESS) -> dict[int, list[int]]:
        """Per process of the tree, the head's ports it holds an established TCP
        connection to."""
        held: dict[int, list[int]] = {}
        for process in self.tree():
            with contextlib.suppress(psutil.Error):
                ports = sorted(
                    c.raddr.port
                    for c in process.net_connections(kind="tcp")
                    if c.raddr and c.raddr.ip == address and c.status == psutil.CONN_ESTABLISHED
                )
                if ports:
                    held[process.pid] = ports
        return held

    def alive(self) -> bool:
        return self.process.poll() is None


@dataclass
class Deployment:
    """A head and its headless stages; ready only after `wait_ready`."""

    head: VllmServer
    faults: Faults
    model: Path
    workdir: Path
    master_port: int
    deploy_file: Path
    env: Mapping[str, str]
    # What each stage's processes get beyond `env`, by stage id (its own watchdog's
    # receiver, its host name).
    stage_env: Mapping[int, Mapping[str, str]] = field(default_factory=dict)
    stages: dict[int, HeadlessStage] = field(default_factory=dict)
    # Every headless stage ever started here, replaced ones included, for the clean-up.
    started: list[HeadlessStage] = field(default_factory=list)

    def start_stage(self, stage_id: int) -> HeadlessStage:
        """Start (or start again) the headless stage `stage_id`; it registers with the
        head by itself, as the next replica of that stage."""
        stage = start_headless(
            self.model,
            self.workdir / f"stage-{stage_id}-{len(self.started)}",
            stage_id,
            self.master_port,
            self.faults,
            {
                # Its spans go to the head's watchdog too, which takes them with the token.
                "OMNI_WATCHDOG_HEAD_OTLP_ENDPOINT": f"http://127.0.0.1:{self.head.otlp_port}",
                "OMNI_WATCHDOG_HEAD_OTLP_TOKEN": OTLP_TOKEN,
                **self.env,
                **self.stage_env.get(stage_id, {}),
            },
            self.deploy_file,
        )
        self.stages[stage_id] = stage
        self.started.append(stage)
        return stage

    async def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        """Until the head's /health answers 200; fails at once, with the log, if the head
        or a headless stage exits."""

        def logs() -> str:
            tails = "\n".join(
                f"-- stage {stage.stage_id}:\n{stage.log_tail(1500)}"
                for stage in self.stages.values()
            )
            return f"\n{self.head.log_tail()}\n{tails}"

        async with aiohttp.ClientSession() as session:

            async def healthy() -> bool:
                if self.head.process.poll() is not None:
                    self.head.exited("the head")
                for stage in self.stages.values():
                    if not stage.alive():
                        stage.exited(f"headless stage {stage.stage_id}")
                    stage.tree()
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with session.get(
                        self.head.url + "/health", timeout=aiohttp.ClientTimeout(total=2)
                    ) as response:
                        if response.status == 200:
                            self.head.tree()
                            return True
                return False

            await wait_for(healthy, timeout, "the head's /health answering 200", 0.5, seen=logs)

    def stop(self) -> None:
        for stage in self.started:
            stage.stop()
        self.head.stop()

    def account(self) -> str:
        """What a failed test prints of the head and of every headless stage started."""
        parts = [f"-- the head:\n{self.head.account()}"]
        parts += [f"-- headless stage {s.stage_id}:\n{s.account()}" for s in self.started]
        return "\n".join(parts)


def start_head(
    model: Path,
    workdir: Path,
    master_port: int,
    faults: Faults,
    env: Mapping[str, str] | None = None,
    deploy_file: Path = DEPLOY_FILE,
    heartbeat_timeout: float = HEARTBEAT_TIMEOUT,
) -> VllmServer:
    """The head: the API, stage 0, the master on `master_port` and the coordinator."""
    port, otlp_port = free_port(), free_port()
    argv = omni_serve(
        model,
        deploy_file,
        "--served-model-name",
        MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--stage-id",
        str(HEAD_STAGE),
        "--omni-master-address",
        MASTER_ADDRESS,
        "--omni-master-port",
        str(master_port),
        "--omni-heartbeat-timeout",
        f"{heartbeat_timeout:g}",
    )
    return VllmServer.spawn(argv, workdir, port, otlp_port, _stage_environment(faults, env))


def start_headless(
    model: Path,
    workdir: Path,
    stage_id: int,
    master_port: int,
    faults: Faults,
    env: Mapping[str, str] | None = None,
    deploy_file: Path = DEPLOY_FILE,
) -> HeadlessStage:
    """One headless stage registering with the master on `master_port`."""
    argv = omni_serve(
        model,
        deploy_file,
        "--stage-id",
        str(stage_id),
        "--headless",
        "--omni-master-address",
        MASTER_ADDRESS,
        "--omni-master-port",
        str(master_port),
    )
    process, log_path, scratch = launch(argv, workdir, _stage_environment(faults, env))
    return HeadlessStage(stage_id=stage_id, process=process, log_path=log_path, scratch=scratch)


def start_deployment(
    model: Path,
    workdir: Path,
    env: Mapping[str, str] | None = None,
    deploy_file: Path = DEPLOY_FILE,
    heartbeat_timeout: float = HEARTBEAT_TIMEOUT,
    remote_stages: Sequence[int] = tuple(range(1, len(STAGE_NAMES))),
    stage_env: Mapping[int, Mapping[str, str]] | None = None,
) -> Deployment:
    """The head, then a headless stage for each remote stage; ready after `wait_ready`.

    Every stage but the head's own must be started, or the head waits for it
    (`--stage-init-timeout`, 300 s) and never answers."""
    faults = Faults(workdir / FAULTS_DIR)
    faults.directory.mkdir(parents=True, exist_ok=True)
    master_port = free_port()
    head = start_head(
        model, workdir / "head", master_port, faults, env, deploy_file, heartbeat_timeout
    )
    deployment = Deployment(
        head, faults, model, workdir, master_port, deploy_file, env or {}, stage_env or {}
    )
    try:
        for stage_id in remote_stages:
            deployment.start_stage(stage_id)
    except BaseException:
        deployment.stop()
        raise
    return deployment


def _stage_environment(faults: Faults, env: Mapping[str, str] | None) -> dict[str, str]:
    return omni_environment(
        {
            FAULTS_ENV: str(faults.directory),
            "OMNI_WATCHDOG_OTLP_TOKEN": OTLP_TOKEN,
            **(env or {}),
        }
    )
