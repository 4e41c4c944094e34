"""`omni-watchdog run` as a separate process, as the overhead and memory benchmarks use it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from omni_watchdog.demo import example_config


def start_watchdog(
    workdir: Path,
    target: str,
    api_port: int,
    otlp_port: int,
    settings: list[str],
    generation: str = "0.11",
) -> subprocess.Popen[bytes]:
    """An observe-mode watchdog without NVML; `settings` are `FIELD=VALUE` for `--set`."""
    command = Path(sys.executable).with_name("omni-watchdog")
    log = (workdir / "watchdog.log").open("ab")
    argv = [
        str(command),
        "run",
        "--target",
        target,
        "--mode",
        "observe",
        "--gpu-backend",
        "none",
        "--listen",
        f"127.0.0.1:{api_port}",
        "--otlp-listen",
        f"127.0.0.1:{otlp_port}",
        "--state-dir",
        str(workdir / "watchdog"),
        "--stage-config",
        str(example_config(generation)),
    ]
    for setting in settings:
        argv += ["--set", setting]
    return subprocess.Popen(
        argv,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={k: v for k, v in os.environ.items() if not k.startswith("OMNI_WATCHDOG_")},
    )
