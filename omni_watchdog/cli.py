"""`omni-watchdog`: run the watchdog, the on-call commands, the simulated server, or the
demo.

`run` exits with:
    0  stopped by SIGINT or SIGTERM
    2  configuration error (the message names the file and the field), a state
       directory that cannot be made, or a bad command line
    3  cannot start: a listener cannot bind its address
    4  internal error: an exception of the watchdog's own, logged with its traceback
The on-call commands' codes are in `oncall.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any

from omni_watchdog import __version__, oncall
from omni_watchdog.config import (
    GPU_BACKENDS,
    ConfigError,
    WatchdogConfig,
    describe_defaults,
    load_config,
    prepare_state_dir,
)
from omni_watchdog.log import configure_logging, log_event
from omni_watchdog.topology import TopologyError
from omni_watchdog.types import Mode

EXIT_STOPPED = 0
EXIT_CONFIG = 2
EXIT_CANNOT_START = 3
EXIT_INTERNAL = 4

logger = logging.getLogger("omni_watchdog.app")


def _set_override(overrides: dict[str, Any], dotted: str, value: Any) -> None:
    *sections, name = dotted.split(".")
    level = overrides
    for section in sections:
        # A later flag wins, also over an earlier value given to a whole section.
        if not isinstance(level.get(section), dict):
            level[section] = {}
        level = level[section]
    level[name] = value


def overrides_of(args: argparse.Namespace) -> dict[str, Any]:
    """The flags given on the command line, as a config layer."""
    overrides: dict[str, Any] = {}
    flags = {
        "target": "target",
        "pid": "pid",
        "stage_config": "stage_config",
        "listen": "listen",
        "otlp_listen": "spans.otlp_listen",
        "mode": "mode",
        "gpu_backend": "probes.gpu_backend",
        "state_dir": "state_dir",
        "host": "host",
    }
    for attribute, dotted in flags.items():
        value = getattr(args, attribute, None)
        if value is not None:
            _set_override(overrides, dotted, value)
    if getattr(args, "headless", False):
        overrides["headless"] = True
    if getattr(args, "remote_stage", None):
        overrides["remote_stages"] = list(args.remote_stage)
    for assignment in args.set or ():
        dotted, sep, value = assignment.partition("=")
        if not sep or not all(dotted.strip().split(".")):
            raise ConfigError(f"command line: --set {assignment!r}: expected FIELD=VALUE")
        _set_override(overrides, dotted.strip(), value)
    return overrides


def _default(value: object) -> str:
    # argparse expands % in help texts.
    return f"(default {value})".replace("%", "%%")


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = WatchdogConfig()
    parser.add_argument("--target", help=f"base URL of the server {_default(defaults.target)}")
    parser.add_argument(
        "--pid",
        help=f"the server's pid; 0 finds it by the target's port {_default(defaults.pid)}",
    )
    parser.add_argument("--stage-config", help="vLLM-Omni stage config (0.11 or 0.30 schema)")
    parser.add_argument(
        "--headless",
        action="store_true",
        default=None,
        help="watch a vLLM-Omni 0.30 headless stage server on this host (found by --pid or"
        " by its --headless command line); it has no HTTP API",
    )
    parser.add_argument(
        "--remote-stage",
        action="append",
        type=int,
        metavar="STAGE",
        help="a stage that runs on another host: judged from its spans, never signalled"
        " (repeatable; needs the OTLP token)",
    )
    parser.add_argument("--host", help="this host's name on the stage series (default: hostname)")
    parser.add_argument(
        "--listen", help=f"HOST:PORT of the watchdog API {_default(defaults.listen)}"
    )
    parser.add_argument(
        "--otlp-listen",
        help=f"HOST:PORT of the OTLP receiver {_default(defaults.spans.otlp_listen)}",
    )
    parser.add_argument(
        "--mode",
        choices=[mode.value for mode in Mode],
        help=f"how far to go {_default(defaults.mode.value)}",
    )
    parser.add_argument(
        "--gpu-backend",
        choices=GPU_BACKENDS,
        help=f"where GPU readings come from {_default(defaults.probes.gpu_backend)}",
    )
    parser.add_argument(
        "--state-dir",
        help=f"incident journal and bundles {_default(defaults.resolved_state_dir())}",
    )
    parser.add_argument("--config", help="YAML config file")
    parser.add_argument(
        "--set",
        action="append",
        metavar="FIELD=VALUE",
        help="any config field, e.g. --set detection.heartbeat_timeout=2s (repeatable)",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        type=str.lower,
        choices=["debug", "info", "warning", "error", "critical"],
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omni-watchdog",
        description="Trace, detect and clean up stalled vLLM / vLLM-Omni stages.",
    )
    parser.add_argument("--version", action="version", version=f"omni-watchdog {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="attach to a server and watch it")
    _add_run_arguments(run)
    oncall.add_commands(commands)

    from omni_watchdog.sim.cli import add_arguments as add_sim_arguments

    sim = commands.add_parser("sim", help="run the simulated vLLM-Omni server")
    add_sim_arguments(sim)

    demo = commands.add_parser("demo", help="the report's hang, detected and cleaned up")
    demo.add_argument("--json", action="store_true", help="end with one JSON summary line")
    demo.add_argument("--fault", default="1:engine-dead-hang", help="[STAGE:]KIND to inject")
    demo.add_argument("--model-generation", default="0.11", choices=["0.11", "0.30"])
    demo.add_argument("--port", type=int, help="the simulated server's port (default: a free one)")

    config = commands.add_parser("config", help="check a config, or list every default")
    config.add_argument("--config", help="YAML config file to check")
    config.add_argument("--defaults", action="store_true", help="print every field and default")
    return parser


async def _run_watchdog(config: WatchdogConfig) -> int:
    from omni_watchdog.clock import SystemClock
    from omni_watchdog.factory import build_watchdog

    watchdog = await build_watchdog(config, clock=SystemClock())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        await watchdog.start()
    except OSError as error:
        # A port in use or an address this host does not have: one line, not a traceback.
        await watchdog.stop()
        print(f"omni-watchdog: cannot start: {error}", file=sys.stderr)
        return EXIT_CANNOT_START
    await watchdog.run_until(stop)
    return EXIT_STOPPED


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "run":
            return _run(args)
        if args.command in oncall.COMMANDS:
            return oncall.run_command(args)
        if args.command == "sim":
            from omni_watchdog.sim.cli import run as run_sim

            return run_sim(args)
        if args.command == "demo":
            from omni_watchdog.demo import run_demo

            return run_demo(args.fault, args.model_generation, as_json=args.json, port=args.port)
        if args.config:
            load_config(args.config, environ={})
            print(f"{args.config}: ok")
        if args.defaults or not args.config:
            for name, default, doc in describe_defaults():
                print(f"{name} = {default}\n    {doc}")
        return 0
    except (ConfigError, TopologyError) as error:
        print(f"omni-watchdog: {error}", file=sys.stderr)
        return EXIT_CONFIG


def _run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    config = load_config(args.config, overrides=overrides_of(args))
    warning = prepare_state_dir(config)
    if warning:
        print(f"omni-watchdog: warning: {warning}", file=sys.stderr)
    try:
        return asyncio.run(_run_watchdog(config))
    except (ConfigError, TopologyError):
        raise
    except Exception as error:
        # A supervisor restarts on this code; the traceback is what to file.
        log_event(logger, "internal_error", logging.CRITICAL, exc_info=error, loop="run")
        print(f"omni-watchdog: internal error: {error!r}", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
