"""The watchdog must never be the outage: forged spans, invented stages, a bad disk, a
planted lock, a server broken before the watchdog came, all against the simulated server."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import stat
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from deadline import wait_for
from e2e.forgery import forge, outsider, traces_url
from e2e.harness import (
    ACCEPTED,
    FAST,
    RECOVERED,
    SIM_ENV,
    attached,
    detection_of,
    in_background,
    incident_done,
    incidents_now,
    judged_for,
    live_processes,
    metrics,
    run_scenario,
    stage_requests,
    step,
    steps_of,
    warmed_up,
    with_fault,
)
from ports import free_port

from omni_watchdog.app import Watchdog
from omni_watchdog.clock import SystemClock
from omni_watchdog.config import merge_layers
from omni_watchdog.demo import demo_config
from omni_watchdog.detector import Detector
from omni_watchdog.exporters.views import target_health
from omni_watchdog.factory import build_watchdog
from omni_watchdog.policy.incidents import TargetLock, lock_dir_for
from omni_watchdog.process_start import sender_attributes, start_time
from omni_watchdog.semconv import (
    PROCESS_PID,
)
from omni_watchdog.sim.launcher import SimProcess, example_config
from omni_watchdog.types import (
    IncidentOutcome,
    Mode,
    ProcessIdentity,
    SilenceCause,
    StageRef,
    StageState,
    StepName,
)

pytestmark = pytest.mark.e2e
S0, S1 = StageRef(0), StageRef(1)


def refused_more(watchdog: Watchdog, before: Mapping[str, int]) -> bool:
    """Whether the receiver has refused more spans since `before` for both reasons a forger
    gets: a sender outside the target's tree, and a stage it does not have."""
    now = watchdog.state.receiver.spans_rejected
    reasons = ("unknown_sender", "unknown_stage")
    return all(now.get(reason, 0) > before.get(reason, 0) for reason in reasons)


async def metrics_series(watchdog: Watchdog) -> int:
    text = await metrics(watchdog)
    return sum(1 for line in text.splitlines() if line and not line.startswith("#"))


def test_forged_spans_and_invented_stages_do_not_harm_a_healthy_server(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with attached(tmp_path, [], "0.30", "enforce", FAST, None, SIM_ENV) as (
            watchdog,
            _,
        ):
            await warmed_up(watchdog)
            series = await metrics_series(watchdog)
            refused_before = watchdog.state.receiver.spans_rejected
            stop = asyncio.Event()
            # Heartbeats and admissions that would each make a stage look stalled if
            # believed: for stages the server has, and for 500 it does not.
            forgers = [
                asyncio.create_task(forge(traces_url(watchdog), outsider(), [0, 1], stop)),
                asyncio.create_task(
                    forge(traces_url(watchdog), outsider(), list(range(7, 507)), stop)
                ),
            ]
            # Both forgers' spans have reached the receiver once it refuses both kinds.
            try:
                await wait_for(lambda: refused_more(watchdog, refused_before), 30)
            except AssertionError as error:
                raise AssertionError(
                    f"forgeries not refused: {watchdog.state.receiver.spans_rejected}"
                ) from error
            refused_from = watchdog.state.receiver.spans_rejected
            # A believed admission is owed a span by stage 0, overdue after its deadline
            # (the overdue floor at least) and judged once that stood confirm_timeout.
            confirm = detection_of(FAST).confirm_timeout
            await judged_for(watchdog, stage_requests(watchdog, 0).deadline + confirm)
            stop.set()
            assert min(await asyncio.gather(*forgers)) > 10
            assert await incidents_now(watchdog) == ()
            assert target_health(watchdog.state)[0] == 200
            # Forged all along, not only at first.
            assert refused_more(watchdog, refused_from), watchdog.state.receiver.spans_rejected
            # The canary's own request may still be on its way through: only it counts.
            await wait_for(lambda: stage_requests(watchdog, 0).in_flight == 0, 10)
            assert await metrics_series(watchdog) == series

    run_scenario(scenario())


OTLP_TOKEN = "the-otlp-token"


@pytest.mark.parametrize(
    ("fault", "forger"),
    [
        # A stage loop that deadlocks, heartbeats forged from outside the tree.
        ("silent-stall", "outsider"),
        # An engine stopped by SIGSTOP, heartbeats and spans forged in its own name (pid
        # and start read from /proc): the stopped process outweighs them.
        ("frozen-engine", "the stage's own process"),
        # A stage loop asleep in a deadlock, heartbeats and successful stage spans forged
        # in its own name and in the API server's: the connection they come on is not
        # theirs.
        ("silent-stall", "the stage's own process and the API server's"),
        # The same, forged by a holder of the OTLP token, whose spans the receiver takes:
        # the stage's step counters, flat while requests wait at it, and the failing
        # canary outweigh them, and the verdict names what its process is doing.
        ("silent-stall", "a holder of the OTLP token"),
    ],
)
def test_forged_spans_do_not_hide_a_stall(tmp_path: Path, fault: str, forger: str) -> None:
    token = OTLP_TOKEN if forger == "a holder of the OTLP token" else ""
    overrides = merge_layers(FAST, {"otlp_token": token}) if token else FAST
    sim_env = {**SIM_ENV, "OMNI_WATCHDOG_OTLP_TOKEN": token} if token else SIM_ENV

    async def scenario() -> None:
        async with attached(tmp_path, [], "0.30", "enforce", overrides, None, sim_env) as (
            watchdog,
            server,
        ):
            await warmed_up(watchdog)
            engine = next(p for p in live_processes(watchdog) if p.stage == S0).pid
            claimed = {
                "outsider": [],
                "the stage's own process": [engine],
                "the stage's own process and the API server's": [engine, server.process.pid],
                "a holder of the OTLP token": [engine, server.process.pid],
            }[forger]
            senders: list[dict[str, object]] = [
                {PROCESS_PID: pid, **sender_attributes(pid)} for pid in claimed
            ]
            refused_before = dict(watchdog.state.receiver.spans_rejected)
            stop = asyncio.Event()
            url = traces_url(watchdog)
            forging = [
                asyncio.create_task(forge(url, sender, [0], stop, token))
                for sender in senders or [outsider()]
            ]
            await asyncio.sleep(1)
            await with_fault(server, {"kind": fault, "stage": 0})
            in_background(server.url)
            try:
                incident = await incident_done(watchdog, 60)
            finally:
                stop.set()
                taken = await asyncio.gather(*forging)
            (verdict,) = incident.verdicts
            assert (verdict.stage, verdict.state) == (S0, StageState.STALLED), incident.cause
            refused = watchdog.state.receiver.spans_rejected
            if token:
                # Taken all along, and outweighed.
                assert min(taken) > 10 and refused == refused_before, (taken, refused)
                assert verdict.cause is not None, incident.cause
                assert verdict.cause.cause is SilenceCause.LOCK_OR_QUEUE_WAIT, verdict.cause
            elif forger != "outsider":
                # Refused for what they are, not only outweighed.
                assert refused["unproven_sender"] > refused_before["unproven_sender"], refused
            assert incident.outcome in (
                IncidentOutcome.RECOVERED_BY_SHUTDOWN,
                IncidentOutcome.RECOVERED_BY_TERM,
                IncidentOutcome.RECOVERED_BY_KILL,
            ), incident.steps

    run_scenario(scenario())


@contextlib.asynccontextmanager
async def server_and_watchdog(
    workdir: Path,
    faults: list[str],
    overrides: Mapping[str, Any],
    before_watchdog: Any = None,
    generation: str = "0.30",
) -> AsyncIterator[tuple[Watchdog, SimProcess]]:
    """A server started first, then a watchdog attached to it in enforce mode;
    `before_watchdog(server)` runs in between."""
    otlp_port = free_port()
    os.environ["OMNI_WATCHDOG_SIM_STATE"] = str(workdir / "sim-state")
    server = SimProcess.start(
        workdir,
        faults,
        generation,
        port=free_port(),
        env={
            "OMNI_WATCHDOG_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_port}/v1/traces",
            "OMNI_WATCHDOG_ADMIN_TOKEN": "demo-token",
            **SIM_ENV,
        },
    )
    try:
        await wait_for(lambda: server_answers(server), 60)
        if before_watchdog is not None:
            await before_watchdog(server)
        watchdog = await watchdog_for(workdir, server, otlp_port, generation, overrides)
        try:
            yield watchdog, server
        finally:
            await watchdog.stop()
    finally:
        server.stop()


async def watchdog_for(
    workdir: Path, server: SimProcess, otlp_port: int, generation: str, overrides: Mapping[str, Any]
) -> Watchdog:
    """A started enforce-mode watchdog on `server`, its state in `workdir`."""
    layers = merge_layers(FAST, {"spans": {"otlp_listen": f"127.0.0.1:{otlp_port}"}})
    config = demo_config(
        workdir, server.url, example_config(generation), "enforce", merge_layers(layers, overrides)
    )
    watchdog = await build_watchdog(config, clock=SystemClock())
    await watchdog.start()
    return watchdog


def server_answers(server: SimProcess) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(server.url + "/health", timeout=1):
            return True
    except OSError as error:
        return getattr(error, "code", None) == 503


def test_a_server_broken_before_the_watchdog_came_gets_its_incident(tmp_path: Path) -> None:
    async def break_stage_one(server: SimProcess) -> None:
        in_background(server.url)
        # Stage 0's only replica dies on the request; the server stays up answering 503 for
        # good, and /health never answers 200 to the watchdog.
        await wait_for(lambda: server.fault_time(), 30)

    async def scenario() -> None:
        async with server_and_watchdog(
            tmp_path,
            ["0:stage-dead-503"],
            {"detection": {"startup_timeout": "5s"}},
            break_stage_one,
        ) as (watchdog, _):
            incident = await incident_done(watchdog, 60)
            assert watchdog.state.report is not None
            assert [v.stage for v in incident.verdicts] == [S0], incident.cause
            # The admin endpoint took the request. A loaded machine can stretch the
            # server's exit past the shutdown grace; the terminate step then ends it.
            shutdown = step(incident, StepName.SHUTDOWN)
            assert shutdown is not None and shutdown.outcome in ACCEPTED, steps_of(incident)
            assert incident.outcome in RECOVERED, steps_of(incident)

    run_scenario(scenario())


def full_device(path: Path) -> None:
    """A node at `path` that answers every write with ENOSPC, as /dev/full does."""
    os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 7))
    with pytest.raises(OSError) as raised, path.open("ab") as handle:
        handle.write(b"x")
        handle.flush()
    assert raised.value.errno == errno.ENOSPC


def test_a_full_disk_never_holds_the_ladder_back(tmp_path: Path) -> None:
    state = tmp_path / "watchdog"
    state.mkdir(mode=0o700)
    full_device(state / "journal.jsonl")

    async def scenario() -> None:
        async with attached(tmp_path, ["1:stage-dead-503"], "0.30", "enforce", FAST) as (
            watchdog,
            server,
        ):
            await warmed_up(watchdog)
            in_background(server.url)
            incident = await incident_done(watchdog, 60)
            shutdown = step(incident, StepName.SHUTDOWN)
            assert shutdown is not None and shutdown.outcome in ACCEPTED, steps_of(incident)
            assert incident.outcome in RECOVERED, steps_of(incident)
            # The state after the incident closed carries every failed write.
            health = await wait_for(
                lambda: (
                    watchdog.state.self_health
                    if watchdog.state.remediation.open_incident is None
                    and watchdog.state.self_health.state_write_errors >= len(incident.steps)
                    else None
                ),
                15,
            )
            assert "No space left" in health.last_state_write_error
            url = f"http://127.0.0.1:{watchdog.api_port}"
            # The shutdown request was taken; a server slow to go on busy cores is then
            # terminated, the outcome either way counted.
            outcome = incident.outcome.value
            recovered = f'omni_watchdog_incidents_total{{outcome="{outcome}"}} 1'

            # The exporter counts a closed incident at the next evaluation (every 0.25 s).
            async def counted() -> bool:
                return recovered in await metrics(watchdog)

            await wait_for(counted, 15)
            async with aiohttp.ClientSession() as session:
                async with session.get(url + "/metrics") as response:
                    text = await response.text()
                async with session.get(url + f"/v1/incidents/{incident.incident_id}") as reply:
                    shown = await reply.json()
            written = next(
                line
                for line in text.splitlines()
                if line.startswith("omni_watchdog_state_write_errors_total ")
            )
            assert float(written.split()[1]) >= len(incident.steps)
            assert recovered in text
            assert shown["outcome"] == outcome
            # The bundle still went to disk, readable by its owner only.
            bundle = Path(incident.bundle_dir)
            assert stat.S_IMODE(bundle.stat().st_mode) == 0o700
            files = [p for p in bundle.rglob("*") if p.is_file()]
            assert files and {stat.S_IMODE(p.stat().st_mode) for p in files} == {0o600}

    run_scenario(scenario())


def test_a_symlink_planted_at_the_lock_path_is_never_followed(tmp_path: Path) -> None:
    victim = tmp_path / "precious.txt"
    victim.write_text("precious\n")

    async def plant(server: SimProcess) -> None:
        root = ProcessIdentity(server.process.pid, start_time(server.process.pid))
        lock_dir = lock_dir_for(tmp_path / "watchdog", os.environ)
        lock_dir.mkdir(parents=True, mode=0o700, exist_ok=True)
        TargetLock(lock_dir).path_for(root).symlink_to(victim)

    async def scenario() -> None:
        async with server_and_watchdog(tmp_path, [], {}, plant) as (watchdog, server):
            await warmed_up(watchdog)
            status = watchdog.state.remediation.lock
            assert not status.held and "symbolic link" in status.conflict
            url = f"http://127.0.0.1:{watchdog.api_port}"
            async with aiohttp.ClientSession() as session:
                async with session.get(url + "/metrics") as response:
                    assert "omni_watchdog_target_lock_conflict 1" in await response.text()
                async with session.get(url + "/v1/status") as response:
                    assert "symbolic link" in (await response.json())["lock"]["conflict"]
            await with_fault(server, {"kind": "stage-dead-503", "stage": 1})
            in_background(server.url)
            incident = await incident_done(watchdog, 60)
            # Standing by: the incident is observed, nothing is signalled.
            assert incident.mode is Mode.OBSERVE and "symbolic link" in incident.cause
        assert victim.read_text() == "precious\n"

    run_scenario(scenario())


async def healthz(watchdog: Watchdog) -> int:
    url = f"http://127.0.0.1:{watchdog.api_port}/healthz"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status


def evaluation_age(watchdog: Watchdog) -> float:
    last = watchdog.state.self_health.last_evaluation
    # The watchdogs here run on the system clock.
    return float("inf") if last is None else time.monotonic() - last


def test_loops_survive_their_errors_and_healthz_tells_when_judging_stops(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario() -> None:
        async with attached(tmp_path, [], "0.30", "observe", FAST, None, SIM_ENV) as (
            watchdog,
            _,
        ):
            await warmed_up(watchdog)
            # The class, not the watchdog's detector: the only one in this process.
            evaluate, observe = Detector.evaluate, Detector.observe
            left = [3]

            def flaky_evaluate(detector: Detector, now: float) -> Any:
                if left[0] > 0:
                    left[0] -= 1
                    raise RuntimeError("a bug in judging")
                return evaluate(detector, now)

            def broken_observe(detector: Detector, observations: Any) -> None:
                raise ValueError("a bug in taking observations")

            monkeypatch.setattr(Detector, "evaluate", flaky_evaluate)
            monkeypatch.setattr(Detector, "observe", broken_observe)
            await wait_for(
                lambda: (
                    watchdog.state.self_health.internal_errors["evaluate"] == 3
                    and watchdog.state.self_health.internal_errors["ingest"] >= 3
                ),
                10,
            )
            monkeypatch.setattr(Detector, "observe", observe)
            judged = watchdog.state.self_health.last_evaluation or 0.0
            # Every loop went on: judging resumes, and the watchdog says it is fine.
            await wait_for(lambda: (watchdog.state.self_health.last_evaluation or 0.0) > judged, 5)
            assert await healthz(watchdog) == 200

            def stuck(detector: Detector, now: float) -> Any:
                raise RuntimeError("judging is broken for good")

            monkeypatch.setattr(Detector, "evaluate", stuck)
            await wait_for(lambda: evaluation_age(watchdog) > 5.5, 10)
            assert await healthz(watchdog) == 503
            url = f"http://127.0.0.1:{watchdog.api_port}/metrics"
            async with aiohttp.ClientSession() as session, session.get(url) as response:
                text = await response.text()
            age = next(
                line
                for line in text.splitlines()
                if line.startswith("omni_watchdog_evaluation_age")
            )
            assert float(age.split()[1]) > 5

    with caplog.at_level("ERROR", logger="omni_watchdog.app"):
        run_scenario(scenario())
    logged = [r for r in caplog.records if r.getMessage() == "internal_error"]
    # Each distinct error once, with its traceback; repeats are only counted.
    errors = [r.__dict__["fields"]["error"] for r in logged]
    assert errors.count("RuntimeError('a bug in judging')") == 1
    assert all(r.exc_info for r in logged)


def test_a_restarted_watchdog_resumes_on_the_journals_processes_and_gpu(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with server_and_watchdog(tmp_path, ["1:engine-dead-hang"], {}, None, "0.11") as (
            first,
            server,
        ):
            await warmed_up(first)
            in_background(server.url)
            # The report's hang: the shutdown request goes unanswered, and the first
            # watchdog is stopped before the ladder reaches terminate.
            opened = await wait_for(
                lambda: next(
                    (i for i in first.state.remediation.incidents if len(i.steps) >= 2), None
                ),
                40,
            )
            await first.stop()
            otlp_port = first.otlp_port
            assert otlp_port is not None
            second = await watchdog_for(tmp_path, server, otlp_port, "0.11", {})
            try:
                incident = await wait_for(
                    lambda: next(
                        (
                            i
                            for i in second.state.remediation.incidents
                            if i.incident_id == opened.incident_id and i.closed
                        ),
                        None,
                    ),
                    40,
                )
            finally:
                await second.stop()
        steps = {s.step.value: s for s in incident.steps}
        assert [s.step.value for s in incident.steps] == [
            "capture",
            "shutdown",
            "terminate",
            "kill",
            "verify",
        ], incident.steps
        assert not [s.detail for s in incident.steps if "not a recorded process" in s.detail]
        assert f"process group {server.process.pid} sent" in steps["terminate"].detail
        assert "back to baseline" in steps["verify"].detail, steps["verify"].detail
        assert incident.outcome is IncidentOutcome.RECOVERED_BY_KILL

    run_scenario(scenario())
