"""Starting the simulated vLLM-Omni server as a process of its own, and ending it.

The demo, the benchmarks and the tests start the server this way: `python -m
omni_watchdog.sim` in a session of its own, with a state directory every one of its
processes carries in its environment, so that escaped children are found and ended too.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import psutil


def example_config(generation: str) -> Path:
    """The shipped stage config of a vLLM-Omni generation."""
    name = "qwen2_5_omni_0.11.yaml" if generation == "0.11" else "qwen2_5_omni_0.30.yaml"
    return Path(str(resources.files("omni_watchdog") / "examples" / name))


# Where the ports the kernel hands out by itself start, when /proc does not say.
EPHEMERAL_LOW = 32768


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range: a server started with it binds
    it minutes later, and an ephemeral port can be taken meanwhile by any outgoing
    connection on the machine (CI once lost the watchdog's OTLP port that way)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = EPHEMERAL_LOW
    chance = random.Random()
    for _ in range(64):
        port = chance.randrange(10000, max(10001, low))
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class SimProcess:
    """A simulated server this process started, in its own session and process group."""

    port: int
    state_dir: Path
    process: subprocess.Popen[bytes]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def start(
        cls,
        workdir: Path,
        faults: list[str],
        generation: str = "0.11",
        stage_config: Path | None = None,
        env: Mapping[str, str] | None = None,
        extra_args: list[str] | None = None,
        port: int | None = None,
    ) -> SimProcess:
        port = port or free_port()
        state_dir = workdir / "sim-state"
        state_dir.mkdir(parents=True, exist_ok=True)
        log_path = workdir / "sim.log"
        child_env = {**os.environ, **(env or {}), "OMNI_WATCHDOG_SIM_STATE": str(state_dir)}
        argv = [
            sys.executable,
            "-m",
            "omni_watchdog.sim",
            "--stage-config",
            str(stage_config or example_config(generation)),
            "--model-generation",
            generation,
            "--port",
            str(port),
            "--state-dir",
            str(state_dir),
            *[arg for fault in faults for arg in ("--fault", fault)],
            *(extra_args or []),
        ]
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=child_env, start_new_session=True
            )
        return cls(port, state_dir, process, log_path, child_env)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def events(self) -> list[dict[str, Any]]:
        path = self.state_dir / "events.jsonl"
        if not path.exists():
            return []
        events = []
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                events.append(json.loads(line))
        return events

    def fault_time(self) -> float | None:
        fired = [e["time"] for e in self.events() if e.get("event") == "fault_triggered"]
        return min(fired) if fired else None

    def leftover_pids(self) -> list[int]:
        """Live processes of this server, escaped ones included: they carry its state dir."""
        found = []
        for process in psutil.process_iter(["pid", "environ", "status"]):
            with contextlib.suppress(psutil.Error):
                environ = process.info["environ"] or {}
                if (
                    environ.get("OMNI_WATCHDOG_SIM_STATE") == str(self.state_dir)
                    and process.info["status"] != psutil.STATUS_ZOMBIE
                    and process.pid != os.getpid()
                ):
                    found.append(process.pid)
        return found

    def stop(self) -> None:
        """End whatever is left of the server this process started, escaped children too."""
        # The server runs in a session of its own, so its group holds only its processes.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        for pid in self.leftover_pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)
