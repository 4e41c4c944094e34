"""The capture step: stacks of every recorded process, spans, GPU, /health and /metrics."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from omni_watchdog.http_body import read_at_most
from omni_watchdog.policy.actuators import Actuators
from omni_watchdog.policy.incidents import BundleWriter
from omni_watchdog.types import (
    Clock,
    Incident,
    ProcessInfo,
    StepName,
    StepOutcome,
    StepResult,
    TargetSnapshot,
)

# A copy of py-spy that carries CAP_SYS_PTRACE as a file capability (the container image
# ships one), for reading processes of another user or under Yama's ptrace_scope 1.
PTRACE_PY_SPY = "py-spy-ptrace"
# The most of one of the target's pages kept in a bundle (its /metrics, /health): what a
# post-mortem needs is at the top, and a server's answer must not fill the state disk.
MAX_CAPTURED_BODY = 2 * 2**20
_CAP_SYS_PTRACE = 19


def ptrace_in_bounding_set(status_path: Path = Path("/proc/self/status")) -> bool:
    """Whether CAP_SYS_PTRACE is in this process's capability bounding set."""
    try:
        for line in status_path.read_text().splitlines():
            if line.startswith("CapBnd:"):
                return bool(int(line.split()[1], 16) >> _CAP_SYS_PTRACE & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def find_py_spy(ptrace_allowed: Callable[[], bool] = ptrace_in_bounding_set) -> str | None:
    """The py-spy to run, beside this Python (a virtual environment) or on PATH.

    The capability-carrying copy only where the bounding set holds CAP_SYS_PTRACE: elsewhere
    the kernel refuses to start a program whose file capabilities it cannot grant, while
    plain py-spy still reads processes of its own user.
    """
    names = (PTRACE_PY_SPY, "py-spy") if ptrace_allowed() else ("py-spy",)
    for name in names:
        beside = Path(sys.executable).parent / name
        if beside.exists() and os.access(beside, os.X_OK):
            return str(beside)
        on_path = shutil.which(name)
        if on_path is not None:
            return on_path
    return None


class Capturer:
    """Collects what the post-mortem needs into the incident's bundle, within a bound."""

    def __init__(
        self,
        actuators: Actuators,
        session: aiohttp.ClientSession,
        bundles: BundleWriter,
        clock: Clock,
        timeout: float,
        target_url: str,
        health_path: str,
        metrics_path: str,
        spans: Callable[[], Any],
        gpu: Callable[[], Any],
        alive: Callable[[ProcessInfo], bool],
        py_spy: str | None,
    ) -> None:
        self._actuators = actuators
        self._session = session
        self._bundles = bundles
        self._clock = clock
        self._timeout = timeout
        self._target_url = target_url.rstrip("/")
        self._health_path = health_path
        self._metrics_path = metrics_path
        self._spans = spans
        self._gpu = gpu
        self._alive = alive
        self._py_spy = py_spy

    async def __call__(self, incident: Incident, snapshot: TargetSnapshot) -> StepResult:
        started, begun = self._clock.wall(), self._clock.monotonic()
        bundle = incident.incident_id
        live = [p for p in snapshot.processes if self._alive(p)]
        self._bundles.write_json(bundle, "processes.json", snapshot.processes)
        self._bundles.write_json(bundle, "spans.json", self._spans())
        self._bundles.write_json(bundle, "gpu.json", self._gpu())
        stacks, health, metrics = await asyncio.gather(
            asyncio.gather(*(self._stack(bundle, p) for p in live)),
            self._fetch(bundle, self._health_path, "health.txt"),
            self._fetch(bundle, self._metrics_path, "metrics.txt"),
        )
        captured = sum(stacks)
        detail = (
            f"stacks of {captured}/{len(live)} live processes"
            f"{'' if self._py_spy else ' (py-spy not installed)'}; /health: {health};"
            f" /metrics: {metrics}; bundle {self._bundles.directory(bundle)}"
        )
        outcome = StepOutcome.OK if captured == len(live) else StepOutcome.FAILED
        duration = self._clock.monotonic() - begun
        pids = tuple(p.pid for p in live)
        return StepResult(StepName.CAPTURE, outcome, started, duration, detail, pids)

    async def _stack(self, bundle: str, process: ProcessInfo) -> bool:
        if self._py_spy is None:
            return False
        argv = [self._py_spy, "dump", "--pid", str(process.pid)]
        code, output = await self._actuators.run_bounded(argv, self._timeout)
        header = (
            f"# pid {process.pid} {process.title} ({process.role.value}, stage {process.stage})\n"
        )
        self._bundles.write_text(bundle, f"stacks/{process.pid}.txt", header + output)
        return code == 0

    async def _fetch(self, bundle: str, path: str, name: str) -> str:
        url = self._target_url + path
        try:
            async with self._session.get(
                url, timeout=aiohttp.ClientTimeout(total=min(self._timeout, 2.0))
            ) as response:
                body, more = await read_at_most(response, MAX_CAPTURED_BODY)
                text = body.decode("utf-8", "replace")
                if more:
                    text += f"\n[cut at {MAX_CAPTURED_BODY // 2**20} MiB: the server sent more]\n"
                self._bundles.write_text(bundle, name, f"HTTP {response.status}\n{text}")
                return str(response.status)
        except asyncio.TimeoutError:
            self._bundles.write_text(bundle, name, "timeout\n")
            return "timeout"
        except aiohttp.ClientError as error:
            self._bundles.write_text(bundle, name, f"error: {error}\n")
            return "unreachable"
