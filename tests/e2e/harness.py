"""What the end-to-end tests share: fast settings and small waits on a watchdog."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import sys
import time
from collections.abc import AsyncIterator, Coroutine, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import explain
from deadline import wait_for
from ports import free_port

from omni_watchdog import demo
from omni_watchdog.app import Watchdog
from omni_watchdog.config import PROBES, DetectionConfig, load_config, merge_layers
from omni_watchdog.demo import closed_incident, send_request
from omni_watchdog.probes.processes import ProcessTracker
from omni_watchdog.sim.launcher import SimProcess
from omni_watchdog.types import (
    Incident,
    IncidentOutcome,
    ProcessInfo,
    ProcessStatus,
    StageRef,
    StageRequests,
    StageState,
    StepName,
    StepOutcome,
)

FAST: dict[str, Any] = {
    "detection": {
        "heartbeat_timeout": "2s",
        "progress_timeout": "3s",
        "health_failures": 2,
        "confirm_timeout": "6s",
        "stuck_timeout": "1.5s",
        "startup_grace": "1s",
        "stale_after": "2s",
    },
    "probes": {
        "interval": "0.25s",
        "health_interval": "0.5s",
        "health_timeout": "0.5s",
        "metrics_interval": "0.5s",
        "metrics_timeout": "1s",
        "canary_interval": "2s",
        "canary_deadline": "2s",
    },
    "ladder": {
        "capture_timeout": "3s",
        # Not shortened: the shutdown request goes out beside the capture's stack dumps,
        # and on two busy cores a real vLLM-Omni (and the simulator) have answered it later
        # than 0.5 s, the shutdown they then began showing in their logs. Only a server whose
        # API is hung makes a test wait this long.
        "admin_timeout": "5s",
        "shutdown_grace": "3s",
        "term_grace": "2s",
        "kill_grace": "2s",
        "release_timeout": "5s",
        "self_exit_grace": "5s",
    },
}
SIM_ENV = {"OMNI_WATCHDOG_HEARTBEAT_INTERVAL": "0.5"}
# A server that crashes by itself: vLLM takes about 3 s from its 503 to its exit, as does
# the simulator (its FATAL_EXIT_DELAY_S), and over 5 s once on two busy cores. A test of
# the crash waits long enough for it to happen, and sends no canary: answered 500 within
# 0.1 s of the engine's death, it paired with the exit into a verdict before a loaded
# watchdog read the 503, and the ladder, rightly not waiting on a server that had not said
# it is going, ended it with SIGTERM.
WAITS_FOR_A_CRASH = merge_layers(
    FAST,
    {
        "ladder": {"self_exit_grace": "15s"},
        # Not a long canary_interval: a canary goes out at once while no progress was seen.
        "probes": {"enabled": [p for p in PROBES if p != "canary"]},
    },
)
RECOVERED = {
    IncidentOutcome.RECOVERED_BY_SHUTDOWN,
    IncidentOutcome.RECOVERED_BY_TERM,
    IncidentOutcome.RECOVERED_BY_KILL,
}
# A shutdown request the server took, whether or not it was gone within the grace.
ACCEPTED = {StepOutcome.RECOVERED, StepOutcome.NOT_RECOVERED}


# A simulated server answers in milliseconds, but beside a real server starting on two
# cores its first healthy /health has taken over 30 s in CI.
WARM_UP_LIMIT = 90.0


async def warmed_up(watchdog: Watchdog, judged_after: float | None = None) -> None:
    """Warm, and the server's processes recorded where they can be (a fault may end one
    at once). `judged_after` (the watchdog's clock) asks for an evaluation made after that
    moment: after a re-attach, the report standing is the old server's, warm."""
    scans = any(probe.name == ProcessTracker.name for probe in watchdog.state.probes)
    try:
        await wait_for(
            lambda: (
                watchdog.state.report
                and (judged_after is None or watchdog.state.report.time > judged_after)
                and watchdog.state.report.warmed_up
                and (watchdog.state.target.generation > 0 or not scans)
            ),
            WARM_UP_LIMIT,
        )
    except AssertionError as error:
        report = watchdog.state.report
        raise AssertionError(
            f"not warm after {WARM_UP_LIMIT:g}s: judged {report is not None},"
            f" warm {report is not None and report.warmed_up},"
            f" process scans {watchdog.state.target.generation},"
            f" self-health {watchdog.state.self_health}"
        ) from error


async def judged_for(watchdog: Watchdog, seconds: float, slack: float = 60.0) -> None:
    """Wait until the watchdog has judged `seconds` of time it could see from now on: an
    evaluation made that much later, its own blind spells not counted, as the detector
    counts none of them against the server. Fails `slack` seconds after that was due."""
    since = time.monotonic()  # the watchdogs these tests attach run on the system clock
    blind_before = watchdog.state.self_health.blind_seconds

    def judged() -> float:
        state = watchdog.state
        blind = state.self_health.blind_seconds - blind_before
        return state.report.time - since - blind if state.report else 0.0

    try:
        await wait_for(lambda: judged() > seconds, seconds + slack)
    except AssertionError as error:
        raise AssertionError(
            f"the watchdog judged {judged():.1f}s of the {seconds:g}s wanted in"
            f" {seconds + slack:g}s; self-health {watchdog.state.self_health}"
        ) from error


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
) -> AsyncIterator[tuple[Watchdog, SimProcess]]:
    """`omni_watchdog.demo.attached`, the simulated server on a port of this test worker's;
    a failed test shows what the watchdog judged and the server's log."""
    async with demo.attached(
        workdir, faults, generation, mode, overrides, sim_args, sim_env, stage_config, free_port()
    ) as attachment:
        watchdog, server = attachment
        explain.witness_this_test("the watchdog", lambda: watchdog_account(watchdog))
        explain.witness_this_test(
            "the simulated server",
            lambda: server.log_path.read_text(errors="replace")[-3000:],
        )
        yield attachment


def state(watchdog: Watchdog, stage: StageRef) -> StageState | None:
    report = watchdog.state.report
    return next((s.state for s in report.statuses if s.stage == stage), None) if report else None


def run_scenario(scenario: Coroutine[Any, Any, Any], limit: float = 240.0) -> Any:
    """`asyncio.run(scenario)`, failing after `limit` seconds with where every task of the
    loop was waiting: a hang names its await, not only the thread that ran the loop."""

    async def bounded() -> Any:
        running = asyncio.ensure_future(scenario)
        done, _ = await asyncio.wait({running}, timeout=limit)
        if not done:
            stacks = io.StringIO()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.print_stack(file=stacks)
            message = f"scenario still running after {limit:g}s:\n{stacks.getvalue()}"
            # Also on stderr: a task that will not be cancelled holds `asyncio.run` past
            # this error, and pytest-timeout's report then shows only captured output.
            print(message, file=sys.stderr, flush=True)
            running.cancel()
            raise AssertionError(message)
        return running.result()

    return asyncio.run(bounded())


async def metrics(watchdog: Watchdog) -> str:
    """The body of the watchdog's /metrics, as Prometheus scrapes it."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{watchdog.api_port}/metrics") as response,
    ):
        return await response.text()


def worse_than_degraded(watchdog: Watchdog, stages: Any) -> list[str]:
    """Each of `stages` the last evaluation did not judge healthy or degraded, with its
    evidence: what a test that must never see one prints when it does."""
    report = watchdog.state.report
    statuses = {s.stage: s for s in report.statuses} if report else {}
    found = []
    for stage in stages:
        status = statuses.get(stage)
        if status is None:
            found.append(f"{stage}: not in the report")
        elif status.state not in (StageState.HEALTHY, StageState.DEGRADED):
            reasons = "; ".join(f"{e.kind.value}: {e.detail}" for e in status.evidence)
            found.append(f"{stage}: {status.state.value} ({reasons})")
    return found


async def all_healthy(watchdog: Watchdog, timeout: float) -> None:
    """Wait until the last evaluation judged every stage healthy; if it never does, say
    which stages were not, with their evidence, and how loaded the host was."""
    try:
        await wait_for(
            lambda: (
                (report := watchdog.state.report) is not None
                and all(s.state is StageState.HEALTHY for s in report.statuses)
            ),
            timeout,
        )
    except AssertionError as error:
        report = watchdog.state.report
        others = [
            f"{s.stage}: {s.state.value} ("
            + "; ".join(f"{e.kind.value}: {e.detail}" for e in s.evidence)
            + ")"
            for s in (report.statuses if report else ())
            if s.state is not StageState.HEALTHY
        ]
        load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
        raise AssertionError(
            f"not all healthy after {timeout:g}s: {others}; load {load};"
            f" self-health {watchdog.state.self_health}"
        ) from error


async def note_worse_than_degraded(
    watchdog: Watchdog, stages: Any, found: list[str], interval: float = 0.1
) -> None:
    """Until cancelled, add to `found` each new verdict worse than degraded, with when it
    came and how loaded the host was: a test that must never see one shows each it saw,
    not only those standing at the moments it looked."""
    seen: set[str] = set()
    while True:
        for line in worse_than_degraded(watchdog, stages):
            if line not in seen:
                seen.add(line)
                load = Path("/proc/loadavg").read_text().split()[:3]
                # Each process's CPU wait as last read: whether the starvation rule saw any.
                waits = {
                    f"{info.pid} {info.stage}": round(info.cpu_wait_seconds, 2)
                    for info in live_processes(watchdog)
                }
                found.append(
                    f"{line} [at {time.monotonic():.1f}, load {' '.join(load)}, waits {waits}]"
                )
        await asyncio.sleep(interval)


def watchdog_account(watchdog: Watchdog) -> str:
    """What a failed test prints of a watchdog: each stage's last state with its evidence,
    every incident with its verdicts and steps, and its own health."""
    report = watchdog.state.report
    spans = watchdog.state.receiver
    refused = {reason: n for reason, n in spans.spans_rejected.items() if n}
    topology = watchdog.state.topology
    lines = [
        f"self-health: {watchdog.state.self_health}",
        f"spans: {spans.spans_accepted} accepted, refused {refused or 'none'}, requests"
        f" { ({code: n for code, n in spans.requests.items() if n}) }",
        f"topology from {topology.source}: "
        + ", ".join(f"{s.stage_id}:{s.name}x{s.replicas}" for s in topology.stages),
    ]
    if report is None:
        lines.append("never judged")
    else:
        lines.append(f"last judged at {report.time:.1f} (warm {report.warmed_up}):")
        for status in report.statuses:
            evidence = "; ".join(f"{e.kind.value}: {e.detail}" for e in status.evidence)
            cause = status.cause
            doing = "" if cause is None else f", {cause.cause.value}: {cause.detail}"
            errors = f", {status.request_errors} request error(s)" if status.request_errors else ""
            lines.append(
                f"  {status.stage} {status.state.value}{doing}{errors}"
                + (f" ({evidence})" if evidence else "")
            )
    incidents = watchdog.state.remediation.incidents
    lines.append(f"{len(incidents)} incident(s)")
    lines += described(incidents)
    return "\n".join(lines)


def described(incidents: Any) -> list[str]:
    """What an incident the test never wanted was: its cause, its verdicts' evidence, its
    steps."""
    return [
        f"{incident.cause}; "
        + "; ".join(
            f"{v.stage} {v.state.value}: "
            + ", ".join(f"{e.kind.value} since {e.since:.1f}: {e.detail}" for e in v.evidence)
            for v in incident.verdicts
        )
        + "\n"
        + steps_of(incident)
        for incident in incidents
    ]


async def incident_done(watchdog: Watchdog, timeout: float = 40.0) -> Any:
    return await wait_for(lambda: closed_incident(watchdog), timeout)


def incident_by_id(watchdog: Watchdog, incident_id: str) -> Incident | None:
    """The incident as of the last evaluation; None before it was opened."""
    incidents = watchdog.state.remediation.incidents
    return next((i for i in incidents if i.incident_id == incident_id), None)


def held_back(watchdog: Watchdog, incident_id: str) -> bool:
    """Whether a maintenance pause holds the incident's remediation back."""
    incident = incident_by_id(watchdog, incident_id)
    return incident is not None and "held" in incident.timeline


def closed_by_id(watchdog: Watchdog, incident_id: str) -> Incident | None:
    """The incident, once it has closed; None before."""
    incident = incident_by_id(watchdog, incident_id)
    return incident if incident is not None and incident.closed is not None else None


async def incidents_now(watchdog: Watchdog, timeout: float = 10.0) -> tuple[Incident, ...]:
    """The incidents as of an evaluation made after this call. The state is published
    once per evaluation: read at once, it may predate what the test just did or saw, and
    a check that there is no incident could pass early."""
    asked = time.monotonic()  # the watchdogs these tests attach run on the system clock

    def evaluated_since() -> bool:
        last = watchdog.state.self_health.last_evaluation
        return last is not None and last > asked

    await wait_for(evaluated_since, timeout)
    return watchdog.state.remediation.incidents


def live_processes(watchdog: Watchdog) -> list[ProcessInfo]:
    """The server's processes as of the last evaluation, those that exited left out."""
    return [p for p in watchdog.state.processes if p.status is not ProcessStatus.EXITED]


def last_heartbeat(watchdog: Watchdog, stage: StageRef) -> float | None:
    """When the stage's last heartbeat landed, as of the last evaluation."""
    report = watchdog.state.report
    statuses = report.statuses if report is not None else ()
    return next((s.last_heartbeat for s in statuses if s.stage == stage), None)


def stage_requests(watchdog: Watchdog, stage_id: int) -> StageRequests:
    """The stage's waiting requests as of the last evaluation."""
    report = watchdog.state.report
    assert report is not None, "never judged"
    return report.requests[stage_id]


def detection_of(overrides: Mapping[str, Any]) -> DetectionConfig:
    """The detection settings a watchdog attached with `overrides` judges by."""
    return load_config(environ={}, overrides=overrides).detection


def steps_of(incident: Any) -> str:
    """An incident's outcome and each step in full, one a line: a failed assertion's message
    that pytest does not cut short, as it does the repr of the steps themselves."""
    return "\n".join(
        [f"outcome {incident.outcome.value if incident.outcome else None}"]
        + [
            f"{s.step.value} {s.outcome.value} after {s.duration:.1f}s: {s.detail}"
            for s in incident.steps
        ]
    )


def step(incident: Any, name: StepName) -> Any:
    return next((s for s in incident.steps if s.step is name), None)


def assert_released(incident: Any) -> None:
    verify = step(incident, StepName.VERIFY)
    assert verify is not None and verify.outcome is StepOutcome.OK, steps_of(incident)
    assert "back to baseline" in verify.detail


def in_background(url: str, count: int = 1) -> list[asyncio.Task[None]]:
    return [asyncio.get_running_loop().create_task(send_request(url)) for _ in range(count)]


async def with_fault(server: Any, fault: dict[str, Any]) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.post(server.url + "/sim/faults", json=fault) as response,
    ):
        assert response.status in (200, 202), await response.text()


OPERATOR_TOKEN = "on-call-token"


async def oncall(
    watchdog: Watchdog, *args: str, token: str | None = OPERATOR_TOKEN
) -> tuple[int, str, str]:
    """`omni-watchdog ARGS --watchdog <its API>` as on-call types it: exit code, stdout,
    stderr; the operator token in its environment unless `token` is None."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_WATCHDOG_")}
    if token is not None:
        environment["OMNI_WATCHDOG_OPERATOR_TOKEN"] = token
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "omni_watchdog.cli",
        *args,
        "--watchdog",
        f"http://127.0.0.1:{watchdog.api_port}",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=environment,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()
