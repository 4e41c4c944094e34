"""`omni-watchdog sim`: start the simulated vLLM-Omni server."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from omni_watchdog.sim.engine import DENOISE_STEP_S, SLOW_DENOISE_STEP_S
from omni_watchdog.sim.faults import (
    FAULTS_FILE,
    GENERATIONS,
    Fault,
    FaultError,
    FaultKind,
    check_fault,
    check_headless_fault,
    parse_fault,
)
from omni_watchdog.sim.nvml import STATE_ENV, write_devices
from omni_watchdog.sim.pipelines import (
    BUILT_IN_CONFIGS,
    PIPELINES,
    ExecutionType,
    PipelineError,
    execution_types,
)
from omni_watchdog.sim.wire import (
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    HEADLESS_FILE,
    MASTER_FILE,
    MASTER_HEARTBEAT_S,
)
from omni_watchdog.topology import TopologyError, load_topology, parse_topology
from omni_watchdog.types import Topology

if TYPE_CHECKING:
    from omni_watchdog.sim.server import SimSettings

DEFAULT_MODEL = "yujiepan/qwen2.5-omni-tiny-random"
DEFAULT_STAGE_CONFIG = "qwen2_5_omni_0.11.yaml"
SLOW_STARTUP_DEFAULT_S = 120.0
MAX_PORT = 65535
LISTEN_BACKLOG = 128


def default_stage_config() -> Path:
    """The report's 3-stage 0.11 config, shipped with the package."""
    return Path(str(resources.files("omni_watchdog") / "examples" / DEFAULT_STAGE_CONFIG))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The simulator's flags, for `omni-watchdog sim` and `python -m omni_watchdog.sim`."""
    parser.add_argument(
        "--stage-config", type=Path, default=None, help="stage config file (0.11 or 0.30 schema)"
    )
    parser.add_argument("--model-generation", choices=GENERATIONS, default="0.11")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="served model name")
    parser.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="[STAGE[.REPLICA]:]KIND",
        help="inject a fault (repeatable); kinds: " + ", ".join(k.value for k in FaultKind),
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help=f"simulated GPU state and fault events (default ${STATE_ENV}, else a temp dir)",
    )
    parser.add_argument("--token-delay", type=float, default=0.02, help="seconds per token")
    parser.add_argument(
        "--startup-seconds",
        type=float,
        default=None,
        help=f"start-up time (default 0; {SLOW_STARTUP_DEFAULT_S:g} with slow-startup)",
    )
    parser.add_argument(
        "--max-tokens-cap", type=int, default=8, help="most tokens per request per stage"
    )
    parser.add_argument("--gpus", type=int, default=1, help="simulated devices (24 GiB each)")
    parser.add_argument(
        "--pipeline",
        choices=sorted(PIPELINES),
        default=None,
        help="the pipeline the stages run, which gives each its execution type: "
        "qwen2_5_omni (thinker LLM_AR, talker LLM_AR, code2wav LLM_GENERATION: one forward "
        "per request) or image (text LLM_AR, dit DIFFUSION: a denoising loop per request, "
        "0.30 only; its own 2-stage config unless --stage-config is given); "
        "default: every stage LLM_AR, one token per engine step",
    )
    parser.add_argument(
        "--denoise-step-seconds",
        type=float,
        default=DENOISE_STEP_S,
        help="CPU work per denoising step of a diffusion stage (default %(default)g)",
    )
    parser.add_argument(
        "--slow-denoise-step-seconds",
        type=float,
        default=SLOW_DENOISE_STEP_S,
        help="CPU work per denoising step once denoise-slow fired (default %(default)g)",
    )
    hosts = parser.add_argument_group(
        "stages on other hosts (0.30)",
        "A head serves the API and lists the stages that run elsewhere (--remote-stage); a "
        "headless stage (--headless --stage-id N) runs that stage's replicas, registers them "
        "with the head's coordinator and heartbeats to it. A headless stage has no HTTP API: "
        "inject its faults at run time by appending lines like "
        f'{{"kind": "silent-stall", "replica": 0}} to {FAULTS_FILE} in its --state-dir; its '
        f"state is in {HEADLESS_FILE} there.",
    )
    hosts.add_argument(
        "--omni-master-port",
        type=int,
        default=None,
        metavar="PORT",
        help=f"head: the coordinator's port (0 picks one; {MASTER_FILE} in --state-dir says "
        "which); headless: the head's",
    )
    hosts.add_argument(
        "--omni-master-address",
        default=None,
        metavar="ADDRESS",
        help="head: the coordinator's address (default --host); headless: the head's",
    )
    hosts.add_argument(
        "--remote-stage",
        type=int,
        action="append",
        default=[],
        metavar="N",
        help="head: stage N runs headless on another host (repeatable)",
    )
    hosts.add_argument(
        "--omni-heartbeat-timeout",
        type=float,
        default=DEFAULT_HEARTBEAT_TIMEOUT_S,
        metavar="SECONDS",
        help="head: a remote replica silent this long is evicted (default %(default)g)",
    )
    hosts.add_argument(
        "--headless", action="store_true", help="run one stage for a head elsewhere, no API"
    )
    hosts.add_argument("--stage-id", type=int, default=None, help="headless: the stage to run")


class _Invalid(ValueError):
    """Flags the simulator cannot start with."""


def run(args: argparse.Namespace) -> int:
    """Start the server, or a headless stage, and serve until shut down; the exit code."""
    try:
        topology = _topology(args)
        types = execution_types(args.pipeline, ((s.stage_id, s.name) for s in topology.stages))
        faults = tuple(parse_fault(text) for text in args.fault)
        if args.gpus < 1 or args.max_tokens_cap < 1 or args.token_delay < 0:
            raise _Invalid("--gpus and --max-tokens-cap must be at least 1, --token-delay >= 0")
        if args.denoise_step_seconds < 0 or args.slow_denoise_step_seconds < 0:
            raise _Invalid("--denoise-step-seconds and --slow-denoise-step-seconds must be >= 0")
        if ExecutionType.DIFFUSION in types.values() and args.model_generation != "0.30":
            raise _Invalid(f"--pipeline {args.pipeline} needs --model-generation 0.30")
        if args.headless:
            _check_headless(args, topology, faults, types)
        else:
            _check_head(args, topology, faults, types)
    except (TopologyError, FaultError, PipelineError, _Invalid) as error:
        print(f"omni-watchdog sim: {error}", file=sys.stderr)
        return 2
    state_dir = Path(
        args.state_dir or os.environ.get(STATE_ENV) or tempfile.mkdtemp(prefix="omni-sim-")
    )
    state_dir.mkdir(parents=True, exist_ok=True)
    # Every child inherits it, and so does the NVML stand-in of anyone started from here.
    os.environ[STATE_ENV] = str(state_dir)
    write_devices(state_dir, args.gpus)
    if args.headless:
        return _run_headless(args, topology, faults, state_dir, types)
    return _run_head(args, topology, faults, state_dir, types)


def _topology(args: argparse.Namespace) -> Topology:
    """The stage config's topology; without one, the pipeline's own config or the report's."""
    if args.stage_config is None and args.pipeline in BUILT_IN_CONFIGS:
        return parse_topology(BUILT_IN_CONFIGS[args.pipeline], f"the {args.pipeline} pipeline")
    return load_topology(args.stage_config or default_stage_config())


def _diffusion(types: Mapping[int, ExecutionType]) -> set[int]:
    return {stage_id for stage_id, kind in types.items() if kind is ExecutionType.DIFFUSION}


def _check_head(
    args: argparse.Namespace,
    topology: Topology,
    faults: tuple[Fault, ...],
    types: Mapping[int, ExecutionType],
) -> None:
    replicas = {stage.stage_id: stage.replicas for stage in topology.stages}
    remote = set(args.remote_stage)
    if remote or args.omni_master_port is not None:
        if args.model_generation != "0.30":
            raise _Invalid("stages on other hosts need --model-generation 0.30")
        if args.omni_master_port is None:
            raise _Invalid("--remote-stage needs --omni-master-port")
        if not 0 <= args.omni_master_port <= MAX_PORT:
            raise _Invalid(f"--omni-master-port must be 0..{MAX_PORT}")
    if args.omni_heartbeat_timeout <= 0:
        raise _Invalid("--omni-heartbeat-timeout must be positive")
    unknown = sorted(remote - set(replicas))
    if unknown:
        raise _Invalid(f"--remote-stage {unknown[0]}: no stage {unknown[0]}")
    for fault in faults:
        check_fault(fault, args.model_generation, replicas, remote, _diffusion(types))


def _check_headless(
    args: argparse.Namespace,
    topology: Topology,
    faults: tuple[Fault, ...],
    types: Mapping[int, ExecutionType],
) -> None:
    if args.model_generation != "0.30":
        raise _Invalid("--headless needs --model-generation 0.30")
    if args.remote_stage:
        raise _Invalid("--remote-stage is for the head, not a headless stage")
    if args.omni_master_address is None or args.omni_master_port is None:
        raise _Invalid("--headless needs --omni-master-address and --omni-master-port")
    if not 0 < args.omni_master_port <= MAX_PORT:
        raise _Invalid(f"--omni-master-port must be 1..{MAX_PORT}")
    stage = next((s for s in topology.stages if s.stage_id == args.stage_id), None)
    if stage is None:
        raise _Invalid("--headless needs --stage-id, one of the config's stages")
    diffusion = stage.stage_id in _diffusion(types)
    for fault in faults:
        check_headless_fault(fault, stage.stage_id, stage.replicas, diffusion)


def _settings(
    args: argparse.Namespace,
    topology: Topology,
    faults: tuple[Fault, ...],
    state_dir: Path,
    port: int,
    types: Mapping[int, ExecutionType],
) -> SimSettings:
    from omni_watchdog.sim.server import SimSettings

    startup = args.startup_seconds
    if startup is None:
        slow = any(f.kind is FaultKind.SLOW_STARTUP for f in faults)
        startup = SLOW_STARTUP_DEFAULT_S if slow else 0.0
    return SimSettings(
        topology=topology,
        generation=args.model_generation,
        host=args.host,
        port=port,
        model=args.model,
        faults=faults,
        state_dir=state_dir,
        token_delay=args.token_delay,
        startup_seconds=startup,
        max_tokens_cap=args.max_tokens_cap,
        gpus=args.gpus,
        remote_stages=frozenset(args.remote_stage),
        heartbeat_timeout=args.omni_heartbeat_timeout,
        pipeline=args.pipeline,
        execution_types=dict(types),
        denoise_step_s=args.denoise_step_seconds,
        slow_denoise_step_s=args.slow_denoise_step_seconds,
    )


def _run_head(
    args: argparse.Namespace,
    topology: Topology,
    faults: tuple[Fault, ...],
    state_dir: Path,
    types: Mapping[int, ExecutionType],
) -> int:
    # Imported here so that `--help` and the stage processes stay light.
    from omni_watchdog.sim.server import (
        API_FILE,
        SimError,
        SimServer,
        write_listen_file,
    )

    logging.basicConfig(
        level=logging.INFO, format="(APIServer pid=%(process)d) %(levelname)s %(message)s"
    )
    master_host = args.omni_master_address or args.host
    try:
        listener = _listen(args.host, args.port)
        master = None
        if args.omni_master_port is not None:
            master = _listen(master_host, args.omni_master_port)
    except _Invalid as error:
        print(f"omni-watchdog sim: {error}", file=sys.stderr)
        return 2
    settings = _settings(args, topology, faults, state_dir, listener.getsockname()[1], types)
    try:
        server = SimServer(settings, listener, master)
    except SimError as error:
        print(f"omni-watchdog sim: {error}", file=sys.stderr)
        return 2
    write_listen_file(state_dir, API_FILE, args.host, settings.port)
    if master is not None:
        master_port = master.getsockname()[1]
        write_listen_file(state_dir, MASTER_FILE, master_host, master_port)
        logging.getLogger("omni_watchdog.sim").info(
            "omni master listening on %s:%d", master_host, master_port
        )
    return asyncio.run(server.serve())


def _listen(host: str, port: int) -> socket.socket:
    """Listen at once; nothing accepts until start-up is done, so clients wait, not fail."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as error:
        listener.close()
        raise _Invalid(f"cannot listen on {host}:{port}: {error}") from None
    listener.listen(LISTEN_BACKLOG)
    return listener


def _run_headless(
    args: argparse.Namespace,
    topology: Topology,
    faults: tuple[Fault, ...],
    state_dir: Path,
    types: Mapping[int, ExecutionType],
) -> int:
    from omni_watchdog.sim.headless import HeadlessStage
    from omni_watchdog.sim.server import SimError, stage_specs

    logging.basicConfig(
        level=logging.INFO, format="(HeadlessStage pid=%(process)d) %(levelname)s %(message)s"
    )
    # The stage has no API of its own: no port.
    settings = _settings(args, topology, faults, state_dir, 0, types)
    try:
        specs = [
            replace(spec, master_heartbeat_s=MASTER_HEARTBEAT_S)
            for spec in stage_specs(settings)
            if spec.stage_id == args.stage_id
        ]
    except SimError as error:
        print(f"omni-watchdog sim: {error}", file=sys.stderr)
        return 2
    stage = HeadlessStage(specs, args.omni_master_address, args.omni_master_port, state_dir)
    return asyncio.run(stage.serve())
