"""`omni-watchdog sim`: start the simulated vLLM-Omni server."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import tempfile
from importlib import resources
from pathlib import Path

from omni_watchdog.sim.faults import GENERATIONS, FaultError, FaultKind, check_fault, parse_fault
from omni_watchdog.sim.nvml import STATE_ENV, write_devices
from omni_watchdog.topology import TopologyError, load_topology

DEFAULT_MODEL = "yujiepan/qwen2.5-omni-tiny-random"
DEFAULT_STAGE_CONFIG = "qwen2_5_omni_0.11.yaml"
SLOW_STARTUP_DEFAULT_S = 120.0


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


def run(args: argparse.Namespace) -> int:
    """Start the server and serve until it is shut down; the process's exit code."""
    # Imported here so that `--help` and the stage processes stay light.
    from omni_watchdog.sim.server import (
        SimError,
        SimServer,
        SimSettings,
        bind_listener,
        write_api_file,
    )

    logging.basicConfig(
        level=logging.INFO, format="(APIServer pid=%(process)d) %(levelname)s %(message)s"
    )
    stage_config = args.stage_config or default_stage_config()
    try:
        topology = load_topology(stage_config)
        faults = tuple(parse_fault(text) for text in args.fault)
        replicas = {stage.stage_id: stage.replicas for stage in topology.stages}
        for fault in faults:
            check_fault(fault, args.model_generation, replicas)
        if args.gpus < 1 or args.max_tokens_cap < 1 or args.token_delay < 0:
            raise SimError("--gpus and --max-tokens-cap must be at least 1, --token-delay >= 0")
    except (TopologyError, FaultError, SimError) as error:
        print(f"omni-watchdog sim: {error}", file=sys.stderr)
        return 2
    startup = args.startup_seconds
    if startup is None:
        slow = any(f.kind is FaultKind.SLOW_STARTUP for f in faults)
        startup = SLOW_STARTUP_DEFAULT_S if slow else 0.0
    state_dir = Path(
        args.state_dir or os.environ.get(STATE_ENV) or tempfile.mkdtemp(prefix="omni-sim-")
    )
    state_dir.mkdir(parents=True, exist_ok=True)
    # Every child inherits it, and so does the NVML stand-in of anyone started from here.
    os.environ[STATE_ENV] = str(state_dir)
    write_devices(state_dir, args.gpus)
    try:
        listener = bind_listener(args.host, args.port)
    except OSError as error:
        print(
            f"omni-watchdog sim: cannot listen on {args.host}:{args.port}: {error}", file=sys.stderr
        )
        return 2
    settings = SimSettings(
        topology=topology,
        generation=args.model_generation,
        host=args.host,
        port=listener.getsockname()[1],
        model=args.model,
        faults=faults,
        state_dir=state_dir,
        token_delay=args.token_delay,
        startup_seconds=startup,
        max_tokens_cap=args.max_tokens_cap,
        gpus=args.gpus,
    )
    try:
        server = SimServer(settings, listener)
    except SimError as error:
        print(f"omni-watchdog sim: {error}", file=sys.stderr)
        return 2
    write_api_file(state_dir, args.host, settings.port)
    return asyncio.run(server.serve())
