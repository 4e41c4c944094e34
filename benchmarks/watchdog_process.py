"""`omni-watchdog run` as a separate process, and a plain server for it to watch, as the
overhead, memory and hostile-input benchmarks use them."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from omni_watchdog.process_start import sender_attributes
from omni_watchdog.semconv import PROCESS_PID
from omni_watchdog.sim.launcher import example_config


def start_plain_target(port: int) -> subprocess.Popen[bytes]:
    """A plain HTTP server on loopback: a target whose whole tree is one process."""
    return subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def target_resource(pid: int) -> list[KeyValue]:
    """The resource the instrument plugin would export from process `pid`: the watchdog
    takes spans as evidence only from the target's own processes."""
    resource = [KeyValue(key=PROCESS_PID, value=AnyValue(int_value=pid))]
    for key, value in sender_attributes(pid).items():
        if isinstance(value, int):
            resource.append(KeyValue(key=key, value=AnyValue(int_value=value)))
        else:
            resource.append(KeyValue(key=key, value=AnyValue(string_value=value)))
    return resource


async def wait_attached(
    session: aiohttp.ClientSession, api_url: str, pid: int, timeout: float, warm: bool = False
) -> None:
    """Until the watchdog's /v1/status shows it attached to `pid` (and, with `warm`, past
    its start-up grace)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            async with session.get(api_url + "/v1/status") as response:
                target = (await response.json())["target"] if response.status == 200 else {}
                if target.get("pid") == pid and (target.get("warmed_up") or not warm):
                    return
        except aiohttp.ClientError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the watchdog did not attach to pid {pid} within {timeout:g}s")
        await asyncio.sleep(0.2)


# The receiver token of a benchmark that posts spans in its target's name.
BENCH_TOKEN = "bench-token"
BENCH_AUTHORIZATION = {"Authorization": f"Bearer {BENCH_TOKEN}"}


def start_watchdog(
    workdir: Path,
    target: str,
    api_port: int,
    otlp_port: int,
    settings: list[str],
    generation: str | None = "0.11",
    otlp_token: str = "",
) -> subprocess.Popen[bytes]:
    """An observe-mode watchdog without NVML; `settings` are `FIELD=VALUE` for `--set`.
    With `generation` None it gets no stage config: a real server's plugin reports its
    topology. With `otlp_token` its receiver takes spans with that token, and from any
    process of this host that has it: a benchmark posting in its target's name needs it
    (without one, only the process a span names may send it)."""
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
    ]
    if generation is not None:
        argv += ["--stage-config", str(example_config(generation))]
    for setting in settings:
        argv += ["--set", setting]
    return subprocess.Popen(
        argv,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("OMNI_WATCHDOG_")},
            **({"OMNI_WATCHDOG_OTLP_TOKEN": otlp_token} if otlp_token else {}),
        },
    )
