"""`omni-watchdog demo`: the report's hang on the simulated server, detected and cleaned up.

Starts the simulated vLLM-Omni server with the report's 3-stage config and a fault,
attaches a watchdog in enforce mode, sends the report's request, and prints the
timeline from the fault to the GPU memory coming back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from omni_watchdog.config import WatchdogConfig, load_config, merge_layers
from omni_watchdog.log import configure_logging
from omni_watchdog.sim.faults import FaultError, check_generation, parse_fault
from omni_watchdog.sim.launcher import SimProcess, example_config, free_port
from omni_watchdog.types import Incident, IncidentOutcome, ProcessStatus, StepOutcome

if TYPE_CHECKING:
    from omni_watchdog.app import Watchdog

REPORT_REQUEST: dict[str, Any] = {
    "model": "yujiepan/qwen2.5-omni-tiny-random",
    "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is vLLM?"},
    ],
    "max_tokens": 256,
    "temperature": 0.7,
    "stream": False,
}


async def wait_for(predicate: Callable[[], Any], timeout: float, interval: float = 0.1) -> Any:
    """Poll until `predicate` returns something truthy, or raise TimeoutError."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"condition not met within {timeout:g}s")
        await asyncio.sleep(interval)


def demo_config(
    workdir: Path,
    target: str,
    stage_config: Path,
    mode: str = "enforce",
    overrides: Mapping[str, Any] | None = None,
) -> WatchdogConfig:
    return load_config(
        environ={},
        overrides=merge_layers(
            {
                "target": target,
                "stage_config": str(stage_config),
                "mode": mode,
                "listen": "127.0.0.1:0",
                "state_dir": str(workdir / "watchdog"),
                "admin_token": "demo-token",
                "spans": {"otlp_listen": "127.0.0.1:0"},
                "probes": {"gpu_backend": "sim"},
            },
            overrides or {},
        ),
    )


def _line(offset: float | None, what: str, text: str) -> str:
    when = "        " if offset is None else f"{offset:+7.2f}s"
    return f"  {when}  {what:<10} {text}"


def timeline(incident: Incident, fault_time: float | None, fault: str) -> list[str]:
    """The incident as lines people read: fault, evidence, verdict, steps, release."""
    base = fault_time or incident.timeline.get("first_evidence") or incident.opened

    def at(wall: float | None) -> float | None:
        return None if wall is None else wall - base

    lines = [_line(0.0 if fault_time else None, "fault", f"{fault} injected and fired")]
    for verdict in incident.verdicts:
        first = min(verdict.evidence, key=lambda e: e.since)
        lines.append(
            _line(
                at(incident.timeline.get("first_evidence")),
                "evidence",
                f"{first.kind.value}: {first.detail}",
            )
        )
        kinds = ", ".join(sorted({e.kind.value for e in verdict.evidence}))
        lines.append(
            _line(
                at(incident.timeline.get("verdict")),
                "verdict",
                f"{verdict.describe()} ({kinds})",
            )
        )
    for step in incident.steps:
        lines.append(
            _line(
                at(step.started),
                step.step.value,
                f"{step.outcome.value} in {step.duration:.2f}s: {step.detail}",
            )
        )
    released = incident.timeline.get("released")
    if released is not None:
        lines.append(_line(at(released), "released", "GPU memory back to baseline"))
    lines.append(_line(None, "outcome", incident.outcome.value))
    lines.append(_line(None, "bundle", str(incident.bundle_dir)))
    return lines


def summary(incident: Incident, fault_time: float | None) -> dict[str, Any]:
    verdict_at = incident.timeline.get("verdict")
    released_at = incident.timeline.get("released")
    return {
        "outcome": incident.outcome.value,
        "incident_id": incident.incident_id,
        "fault_to_verdict_s": None
        if fault_time is None or verdict_at is None
        else round(verdict_at - fault_time, 3),
        "fault_to_released_s": None
        if fault_time is None or released_at is None
        else round(released_at - fault_time, 3),
        "steps": [
            {"name": s.step.value, "outcome": s.outcome.value, "duration": round(s.duration, 3)}
            for s in incident.steps
        ],
        "bundle_dir": incident.bundle_dir,
    }


@contextlib.asynccontextmanager
async def attached(
    workdir: Path,
    faults: list[str],
    generation: str = "0.11",
    mode: str = "enforce",
    overrides: Mapping[str, Any] | None = None,
    sim_args: list[str] | None = None,
    sim_env: Mapping[str, str] | None = None,
    stage_config: Path | None = None,
    port: int | None = None,
) -> AsyncIterator[tuple[Watchdog, SimProcess]]:
    """A watchdog attached to a simulated server this process started (on `port`, else on
    a free one); both end on exit."""
    from omni_watchdog.clock import SystemClock
    from omni_watchdog.factory import build_watchdog

    state_dir = workdir / "sim-state"
    # The watchdog's NVML stand-in reads the simulated devices from the same directory.
    os.environ["OMNI_WATCHDOG_SIM_STATE"] = str(state_dir)
    port = port or free_port()
    stage_config = stage_config or example_config(generation)
    config = demo_config(workdir, f"http://127.0.0.1:{port}", stage_config, mode, overrides)
    watchdog = await build_watchdog(config, clock=SystemClock())
    await watchdog.start()
    env = {
        "OMNI_WATCHDOG_OTLP_ENDPOINT": f"http://127.0.0.1:{watchdog.otlp_port}/v1/traces",
        "OMNI_WATCHDOG_ADMIN_TOKEN": config.admin_token,
        **(sim_env or {}),
    }
    server = SimProcess.start(
        workdir, faults, generation, stage_config, env=env, port=port, extra_args=sim_args
    )
    try:
        yield watchdog, server
    finally:
        await watchdog.stop()
        server.stop()


async def run_scenario(
    workdir: Path,
    faults: list[str],
    generation: str,
    mode: str = "enforce",
    say: Callable[[str], None] = print,
    timeout: float = 90.0,
    port: int | None = None,
) -> tuple[Incident | None, float | None]:
    """Sim + watchdog + the report's request; the first closed incident and the fault time.

    The faults are armed once warm-up is over, just before the report's request: armed at
    start, the watchdog's own canary could fire them while nothing is judged yet.
    """
    async with attached(workdir, [], generation, mode, port=port) as (watchdog, server):
        say(
            f"simulated vLLM-Omni {generation} server starting on {server.url}"
            f" (faults: {', '.join(faults)})"
        )
        await wait_for(lambda: watchdog.state.report and watchdog.state.report.warmed_up, 60)
        state = watchdog.state
        root = state.target.root
        live = [p for p in state.processes if p.status is not ProcessStatus.EXITED]
        say(
            f"watchdog attached to pid {root.pid if root else '?'}:"
            f" {len(live)} processes, mode {mode}"
        )
        await arm_faults(server.url, faults)
        say("sending the report's request (POST /v1/chat/completions)")
        request = asyncio.create_task(send_request(server.url))
        incident = await wait_for(lambda: closed_incident(watchdog), timeout)
        request.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await request
        return incident, server.fault_time()


async def arm_faults(url: str, faults: list[str]) -> None:
    """Arm faults on a running simulated server through its control endpoint."""
    async with aiohttp.ClientSession() as session:
        for text in faults:
            fault = parse_fault(text)
            async with session.post(url + "/sim/faults", json=fault.as_dict()) as response:
                if response.status != 200:
                    raise RuntimeError(f"cannot arm {text}: {await response.text()}")


def closed_incident(watchdog: Watchdog) -> Incident | None:
    """The first incident closed as of the watchdog's last evaluation."""
    incidents = watchdog.state.remediation.incidents
    return next((i for i in incidents if i.closed is not None), None)


async def send_request(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        with contextlib.suppress(Exception):
            async with session.post(
                url + "/v1/chat/completions",
                json=REPORT_REQUEST,
                timeout=aiohttp.ClientTimeout(total=120),
            ) as response:
                await response.read()


def run_demo(fault: str, generation: str, as_json: bool = False, port: int | None = None) -> int:
    try:
        check_generation(parse_fault(fault).kind, generation)
    except FaultError as error:
        print(f"omni-watchdog demo: --fault {fault}: {error}", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="omni-watchdog-demo-"))
    # The timeline is the demo's output; the watchdog's own JSON log goes beside the bundle.
    log_path = workdir / "watchdog.log"
    configure_logging("info", log_path.open("a", encoding="utf-8"))
    print("omni-watchdog demo: a stage error that hangs vLLM-Omni, detected and cleaned up\n")
    incident, fault_time = asyncio.run(run_scenario(workdir, [fault], generation, port=port))
    if incident is None:
        print("no incident was recorded", file=sys.stderr)
        return 1
    print("\ntimeline (seconds from the fault):")
    for line in timeline(incident, fault_time, fault):
        print(line)
    print(_line(None, "log", str(log_path)))
    released = incident.outcome in (
        IncidentOutcome.RECOVERED_BY_SHUTDOWN,
        IncidentOutcome.RECOVERED_BY_TERM,
        IncidentOutcome.RECOVERED_BY_KILL,
    ) and any(s.outcome is StepOutcome.OK for s in incident.steps if s.step.value == "verify")
    if as_json:
        print(json.dumps(summary(incident, fault_time)))
    return 0 if released else 1
