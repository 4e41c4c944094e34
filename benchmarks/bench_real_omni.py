"""Real vLLM-Omni 0.30 on CPU: fault -> verdict and -> tree gone; the plugin's overhead.

The overhead is measured on the real vLLM-Omni and on the real plain vLLM.

Faults: each run starts a fresh three-stage server (thinker -> talker -> code2wav), sends
its first requests, attaches a watchdog in enforce mode at the default settings (the
plugin's heartbeat too), makes one fault and measures from the fault to the stage's
verdict (the detector's STALLED or DEAD, at the time the detector set it) and to the
moment no process of the server's tree is left. Each verdict is shown beside its floor.

First requests: every vLLM-Omni start is asked "ping" (one token), then a normal chat; a
start counts as answered when both are 200, /health stays 200 and no stage worker died.
The harness deploy file runs float32 because bfloat16 kernels killed a stage worker on
its first forward now and then; `--bf16-starts` extra starts with the same file in
bfloat16 show whether that still happens.

Overhead: two servers side by side, one loading the plugin and exporting to a watchdog
(observe mode, span receiver only), the other with every plugin but this one; rounds of
the same load alternate between them, the order flipping every round, and the figure is
the median of the per-round throughput ratios. The vLLM-Omni pair, then the plain vLLM
pair: never all four at once (memory).

Soak: one server under load for `--soak-seconds` with a watchdog in enforce mode at the
real-server tests' settings: stage 1 a quarter of a second slower each forward, two
clients back to back, a burst of six more every minute, and one client that abandons each
request after 0.2 to 3 s. Every incident would be a false remediation.

Legit work: stage 1's forward compiles (a real torch.compile), waits on a JIT build in a
child, or computes for 20 s, each longer than every shipped timeout, with a watchdog in
enforce mode at the shipped thresholds: each incident would be a false remediation. With
`--busy-loops N`, N processes spin on the CPUs beside the server all the while (a loaded
host, where a compiler waits its turn for a CPU), and the figures go to a section of
their own.

    python benchmarks/bench_real_omni.py [--runs 20] [--fault block --fault spin ...]
        [--bf16-starts 3] [--rounds 8] [--soak-seconds 600] [--legit-runs 5]
        [--busy-loops 2] [--only faults|overhead|bf16|soak|legit]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import aiohttp
import pytest

# The tests' helpers for the real servers import each other as the test runner puts them
# on the path: `tests/` itself.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_detection import p95, spread
from bench_overhead import spans_received, wait_healthy
from e2e.harness import FAST, worse_than_degraded
from real_omni.server import (
    DEPLOY_FILE,
    MODEL_ARCHITECTURE,
    OMNI_PYTHON,
    OMNI_STAMP,
    OTLP_TOKEN,
    READY_TIMEOUT,
    STAGE_NAMES,
    STAGES,
    engine_of,
    omni_environment,
    start_omni_server,
    watched,
)
from real_vllm.client import answer, chat, chat_body, health_status
from real_vllm.server import READY_TIMEOUT as VLLM_READY_TIMEOUT
from real_vllm.server import VLLM_PYTHON, VLLM_STAMP, VllmServer, make_tiny_model
from results import record, recorded_rows
from watchdog_process import start_watchdog

from omni_watchdog.config import WatchdogConfig
from omni_watchdog.demo import closed_incident, wait_for
from omni_watchdog.instrument.telemetry import DEFAULT_HEARTBEAT_INTERVAL_S, HEARTBEAT_INTERVAL_ENV
from omni_watchdog.sim.launcher import free_port
from omni_watchdog.types import (
    EvidenceKind,
    Incident,
    SilenceCause,
    StageRef,
    StageState,
    StepName,
)

FAULTS_SECTION = "Real vLLM-Omni: detection and release"
STARTS_SECTION = "Real vLLM-Omni: first requests after start"
OVERHEAD_SECTION = "Real servers: plugin overhead"
SOAK_SECTION = "Real vLLM-Omni: never-wrong soak"
LEGIT_SECTION = "Real vLLM-Omni: legit work is never remediated"
LOADED_LEGIT_SECTION = "Real vLLM-Omni: legit work on a loaded host is never remediated"
# Stage 1's forward, armed once per run, each longer than every shipped timeout: what it
# does, and the cause the watchdog should name while it lasts.
LEGIT_WORK = (
    ("compile", "real torch.compiles of new functions", SilenceCause.COMPILING),
    ("jit:20", "a 20 s wait on a child at full CPU (a JIT build)", SilenceCause.WAITING_ON_CHILD),
    ("slow-step:20", "20 s of tensor work in one forward", SilenceCause.COMPUTING),
)
LEGIT_LIMIT_S = 300.0
SOAK_BURST = 6
SOAK_BURST_EVERY = 60.0
TREE_GONE_TARGET_S = 15.0
OVERHEAD_TARGET = 0.99
JUDGED = (StageState.STALLED, StageState.DEAD)
# The rungs that end processes; capture only reads.
ACTING = (StepName.SHUTDOWN, StepName.TERMINATE, StepName.KILL)
# Every plugin of the vLLM-Omni environment but omni-watchdog's: vLLM-Omni's own models,
# the harness (its general plugin registers the pipeline, its platform plugin of the same
# name makes the CPU platform) and vLLM's LoRA resolvers.
OMNI_PLUGINS_BUT_OURS = (
    "vllm_omni_register_models,omni_cpu_harness,lora_filesystem_resolver,lora_hf_hub_resolver"
)
# The plain vLLM environment has no other plugin worth loading: an empty list loads none.
VLLM_PLUGINS_BUT_OURS = ""
WORKER_DIED = "died unexpectedly"
# The faults are measured at what a user gets: every threshold, interval and grace the
# tests shorten is put back to its default, and the plugin beats at its default rate. Only
# what this machine needs stays: no GPU probe, and the receiver's token.
DEFAULTS = WatchdogConfig()
AT_DEFAULTS = {
    section: {key: getattr(getattr(DEFAULTS, section), key) for key in settings}
    for section, settings in FAST.items()
}
DEFAULT_HEARTBEAT = {HEARTBEAT_INTERVAL_ENV: str(DEFAULT_HEARTBEAT_INTERVAL_S)}
DTYPE_LINE = "dtype: float32"
ARCHITECTURE_ARGS = ("--architecture", MODEL_ARCHITECTURE)


@dataclass(frozen=True)
class Fault:
    """A fault and its verdict's target: the simulated server's (docs/design.md, Performance
    targets), a death's at the median and a stall's at the 95th percentile."""

    word: str  # a harness fault word, or "kill" for SIGKILL of the stage's engine core
    label: str
    stage_id: int
    expected: StageState
    verdict_target_s: float

    @property
    def verdict_at_p95(self) -> bool:
        return self.expected is StageState.STALLED


FAULTS = (
    Fault("block", "blocked forward in stage 1", 1, StageState.STALLED, 4.0),
    Fault("spin", "forward spinning in one frame in stage 1", 1, StageState.STALLED, 15.0),
    Fault("raise", "forward raising in stage 2", 2, StageState.DEAD, 1.5),
    Fault("kill", "SIGKILL of stage 1's engine core", 1, StageState.DEAD, 1.5),
)


@dataclass(frozen=True)
class StartCheck:
    """How one server answered its first requests after ready."""

    ping: int | None
    chat: int | None
    health: int | None
    worker_died: bool

    @property
    def answered(self) -> bool:
        return self.ping == 200 and self.chat == 200 and self.health == 200 and not self.worker_died

    def describe(self) -> str:
        died = ", a stage worker died" if self.worker_died else ""
        return f"ping {self.ping}, chat {self.chat}, /health {self.health}{died}"


@dataclass
class FaultRun:
    to_verdict_s: float | None = None  # the first STALLED or DEAD: the ladder starts there
    to_gone_s: float | None = None
    state_seen: StageState | None = None
    # DEAD, counted only when it came before the ladder's first shutdown or signal: a stage
    # that the remediation itself ended is dead by then whatever the fault was.
    to_dead_s: float | None = None
    dead_only_after_ladder: bool = False
    # No stage process had exited when the ladder first acted: its death may be the
    # ladder's doing, so fault -> dead is not measured in this run (the first verdict is).
    exit_after_ladder: bool = False
    outcome: str = "not started"
    steps: str = ""  # the incident's steps, each with its outcome and duration
    floor_s: float | None = None  # what the verdict cannot beat: see `floor_of`


@dataclass
class Tally:
    """Every vLLM-Omni start of this run: (dtype, answered its first requests)."""

    starts: list[tuple[str, bool]] = field(default_factory=list)

    def count(self, dtype: str) -> tuple[int, int]:
        mine = [answered for kind, answered in self.starts if kind == dtype]
        return sum(mine), len(mine)


class StartFailed(Exception):
    """A server that never became ready, or did not answer its first requests."""


def interrupt_on_sigterm(signum: int, frame: FrameType | None) -> None:
    # A terminated benchmark unwinds like Ctrl+C, through every `finally` that stops a server.
    raise KeyboardInterrupt


def make_models(workdir: Path, need_vllm: bool) -> tuple[Path, Path | None]:
    """The tiny random models: the harness architecture for vLLM-Omni, plain for vLLM."""
    omni_model = make_tiny_model(
        OMNI_PYTHON, workdir / "omni-tiny-model", omni_environment(), *ARCHITECTURE_ARGS
    )
    if not need_vllm:
        return omni_model, None
    return omni_model, make_tiny_model(VLLM_PYTHON, workdir / "tiny-model", {})


@contextlib.contextmanager
def stopped_at_exit(servers: list[VllmServer]) -> Iterator[list[VllmServer]]:
    """Every server put in the list is killed, with its whole tree, however the block ends."""
    try:
        yield servers
    finally:
        for server in servers:
            server.stop()
            # A killed process can take a moment to be reaped; one still there after
            # that has escaped.
            deadline = time.monotonic() + 10.0
            while server.leftovers() and time.monotonic() < deadline:
                time.sleep(0.2)
            if server.leftovers():
                print(f"processes left after stop: {server.leftovers()}", file=sys.stderr)


async def ready(server: VllmServer, timeout: float) -> None:
    # The helper fails the way a test fails; here that is a start that failed.
    try:
        await server.wait_ready(timeout)
    except pytest.fail.Exception as failure:
        raise StartFailed(str(failure)[-1500:]) from None


async def ping(session: aiohttp.ClientSession, url: str) -> int | None:
    body = {**chat_body(1), "messages": [{"role": "user", "content": "ping"}]}
    try:
        async with session.post(
            url + "/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=60)
        ) as response:
            await response.read()
            return response.status
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None


async def chat_status(session: aiohttp.ClientSession, url: str) -> int | None:
    try:
        return await chat(session, url)
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None


async def first_requests(server: VllmServer) -> StartCheck:
    """A "ping" for one token, a normal chat, then /health once a dead worker would show."""
    async with aiohttp.ClientSession() as session:
        pinged = await ping(session, server.url)
        chatted = await chat_status(session, server.url)
        # A stage whose worker died is evicted within a second or so: /health turns 503.
        await asyncio.sleep(2.0)
        health = await health_status(session, server)
    died = WORKER_DIED in server.log_path.read_text(errors="replace")
    return StartCheck(pinged, chatted, health, died)


def stage_status(watchdog: Any, stage: StageRef) -> Any:
    report = watchdog.state.report
    return next((s for s in report.statuses if s.stage == stage), None) if report else None


async def verdict_and_gone(
    watchdog: Any,
    server: VllmServer,
    stage: StageRef,
    fault_at: float,
    timeout: float,
) -> tuple[FaultRun, float | None]:
    """From `fault_at` (monotonic): until the stage is judged and the server's tree is gone.

    The detector stamps each state with the watchdog's monotonic clock, the same as this
    process's; its report comes every quarter second, so the verdict time is the
    detector's own, not the poll's. A server that ends before the verdict still counts
    for the tree. Also returns when the stage was first DEAD (monotonic), if it was."""
    run = FaultRun(outcome="no incident")
    dead_since: float | None = None
    deadline = fault_at + timeout
    polls = 0
    while time.monotonic() < deadline and (
        run.to_verdict_s is None or run.to_gone_s is None or dead_since is None
    ):
        if polls % 5 == 0:
            # A process the tree starts after the fault belongs to it too; walking the
            # whole process table is dearer than checking the known ones, so less often.
            server.tree()
        polls += 1
        status = stage_status(watchdog, stage)
        if run.to_verdict_s is None and status is not None and status.state in JUDGED:
            run.to_verdict_s, run.state_seen = status.since - fault_at, status.state
        if dead_since is None and status is not None and status.state is StageState.DEAD:
            dead_since = status.since
        if run.to_gone_s is None and not server.leftovers():
            run.to_gone_s = time.monotonic() - fault_at
            # A server that ended before any verdict gets a few seconds for one, no more.
            deadline = min(deadline, time.monotonic() + 10.0)
        await asyncio.sleep(0.1)
    return run, dead_since


async def fault_scenario(server: VllmServer, faults: Any, fault: Fault, workdir: Path) -> FaultRun:
    stage = StageRef(fault.stage_id)
    async with (
        watched(server, workdir, overrides=AT_DEFAULTS) as watchdog,
        aiohttp.ClientSession() as session,
    ):
        server.tree()  # every process of the tree, remembered for the tree-gone check
        background: list[asyncio.Task[int | None]] = []
        engine = engine_of(server, fault.stage_id) if fault.word == "kill" else None
        # The ladder's steps carry wall-clock times; the detector's states monotonic ones.
        wall_minus_monotonic = time.time() - time.monotonic()
        fault_at = time.monotonic()
        if engine is not None:
            server.signal(engine, signal.SIGKILL)
        else:
            faults.arm(fault.stage_id, fault.word)
            background.append(asyncio.create_task(chat_status(session, server.url)))
        run, dead_since = await verdict_and_gone(watchdog, server, stage, fault_at, 60.0)
        acted_at: float | None = None
        with contextlib.suppress(TimeoutError):
            incident = await wait_for(lambda: closed_incident(watchdog), 30.0)
            run.outcome = incident.outcome.value
            run.steps = ", ".join(
                f"{s.step.value} {s.outcome.value} {s.duration:.2f} s" for s in incident.steps
            )
            run.floor_s = floor_of(fault, incident, fault_at)
            acted_at = next(
                (s.started - wall_minus_monotonic for s in incident.steps if s.step in ACTING),
                None,
            )
        if dead_since is not None and (acted_at is None or dead_since <= acted_at):
            run.to_dead_s = dead_since - fault_at
        elif dead_since is not None:
            run.dead_only_after_ladder = True
            run.exit_after_ladder = acted_at is not None and (
                run.floor_s is None or fault_at + run.floor_s > acted_at
            )
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
    return run


def floor_of(fault: Fault, incident: Incident, fault_at: float) -> float | None:
    """A death's floor is its exit notice (fault -> the exit's evidence, monotonic like
    `fault_at`: the watchdog runs in this process); a stall's the heartbeat timeout."""
    if fault.expected is StageState.STALLED:
        return float(AT_DEFAULTS["detection"]["heartbeat_timeout"])
    exits = [
        e.since
        for v in incident.verdicts
        for e in v.evidence
        if e.kind is EvidenceKind.PROCESS_EXIT
    ]
    return min(exits) - fault_at if exits else None


def measure_fault(fault: Fault, model: Path, workdir: Path, tally: Tally) -> FaultRun:
    with stopped_at_exit([]) as servers:
        server, faults = start_omni_server(model, workdir, DEFAULT_HEARTBEAT)
        servers.append(server)

        async def scenario() -> FaultRun:
            await ready(server, READY_TIMEOUT)
            check = await first_requests(server)
            tally.starts.append(("float32", check.answered))
            if not check.answered:
                return FaultRun(outcome=f"first requests failed ({check.describe()})")
            return await fault_scenario(server, faults, fault, workdir)

        try:
            return asyncio.run(scenario())
        except StartFailed as failure:
            tally.starts.append(("float32", False))
            print(f"  start failed: {failure}", file=sys.stderr)
            return FaultRun(outcome="not ready")
        except Exception:
            # One broken run must not cost the others; it shows in the outcomes.
            traceback.print_exc()
            return FaultRun(outcome="error")


def in_seconds(value: float | None, otherwise: str = "-") -> str:
    return otherwise if value is None else f"{value:.2f} s"


def seconds(values: list[float]) -> str:
    return spread(values) if values else "-"


def within(
    values: list[float], runs: int, target: float, missing: str = "measured", at_p95: bool = False
) -> str:
    if len(values) < runs:
        return f"FAIL (not {missing} in every run)"
    measured = p95(values) if at_p95 else statistics.median(values)
    return "pass" if measured <= target else "FAIL"


def beside_floor(verdicts: list[float], floors: list[float], floor_is: str) -> str:
    if not verdicts or not floors:
        return ""
    floor, median = statistics.median(floors), statistics.median(verdicts)
    ratio = f"{median / floor:.1f}" if floor > 0 else "-"
    return (
        f"; floor ({floor_is}) {floor:.2f} s: median - floor {median - floor:.2f} s,"
        f" median / floor {ratio}"
    )


def fault_rows(fault: Fault, runs: list[FaultRun]) -> list[tuple[str, str, str, str]]:
    verdicts = [r.to_verdict_s for r in runs if r.to_verdict_s is not None]
    floors = [r.floor_s for r in runs if r.floor_s is not None]
    gones = [r.to_gone_s for r in runs if r.to_gone_s is not None]
    states = sorted({r.state_seen.value for r in runs if r.state_seen is not None})
    outcomes = sorted({r.outcome for r in runs})
    label = f"{fault.label}, {len(runs)} runs, outcomes {outcomes}"
    at = "at p95" if fault.verdict_at_p95 else "median"
    target = f"<= {fault.verdict_target_s:g} s ({at})"
    floor_is = "the heartbeat timeout" if fault.verdict_at_p95 else "the exit notice"
    rows = [
        (
            f"{label}: fault -> first verdict ({'/'.join(states) or 'none'})",
            seconds(verdicts) + beside_floor(verdicts, floors, floor_is),
            target,
            within(verdicts, len(runs), fault.verdict_target_s, at_p95=fault.verdict_at_p95),
        )
    ]
    if fault.expected is StageState.DEAD:
        deads = [r.to_dead_s for r in runs if r.to_dead_s is not None]
        late = sum(r.dead_only_after_ladder and not r.exit_after_ladder for r in runs)
        unmeasured = sum(r.exit_after_ladder for r in runs)
        shown = seconds(deads)
        if late:
            shown += f"; dead only once the ladder acted in {late} of {len(runs)} runs"
        if unmeasured:
            shown += (
                f"; in {unmeasured} of {len(runs)} runs no stage process had exited when the"
                " ladder acted on the first verdict: not measured there"
            )
        rows.append(
            (
                f"{label}: fault -> dead, before the ladder acts",
                shown,
                target,
                within(
                    deads, len(runs) - unmeasured, fault.verdict_target_s, "dead before the ladder"
                ),
            )
        )
    rows.append(
        (
            f"{label}: fault -> tree gone",
            seconds(gones),
            f"<= {TREE_GONE_TARGET_S:g} s",
            within(gones, len(runs), TREE_GONE_TARGET_S),
        )
    )
    return rows


def run_faults(
    chosen: list[Fault], runs: int, model: Path, workdir: Path, tally: Tally
) -> list[tuple[str, str, str, str]]:
    """Each fault's rows, recorded as soon as it is measured; the rows of the faults not
    chosen stay as they were."""
    rows: list[tuple[str, str, str, str]] = []
    for fault in chosen:
        measured = []
        for index in range(runs):
            run = measure_fault(fault, model, workdir / f"{fault.word}-{index + 1}", tally)
            measured.append(run)
            dead = "only once the ladder acted" if run.dead_only_after_ladder else "-"
            if run.exit_after_ladder:
                dead += " (no stage process had exited before it)"
            print(
                f"{fault.label} run {index + 1}: first verdict {in_seconds(run.to_verdict_s)}"
                f" ({run.state_seen.value if run.state_seen else '-'}),"
                f" dead {in_seconds(run.to_dead_s, dead)}, exit notice {in_seconds(run.floor_s)},"
                f" tree gone {in_seconds(run.to_gone_s)}, {run.outcome} ({run.steps})",
                flush=True,
            )
        rows += fault_rows(fault, measured)
        record(FAULTS_SECTION, with_other_faults(rows), faults_note())
    return rows


def with_other_faults(rows: list[tuple[str, str, str, str]]) -> list[tuple[str, str, str, str]]:
    """`rows`, and the recorded rows of every fault they do not measure, in FAULTS' order."""
    recorded = recorded_rows(FAULTS_SECTION)
    merged: list[tuple[str, str, str, str]] = []
    for fault in FAULTS:
        mine = [row for row in rows if row[0].startswith(f"{fault.label}, ")]
        merged += mine or [row for row in recorded if row[0].startswith(f"{fault.label}, ")]
    return merged


def faults_note() -> str:
    detection, probes, ladder = (AT_DEFAULTS[name] for name in ("detection", "probes", "ladder"))
    return (
        f"The real vLLM-Omni 0.30 on CPU (the tests' harness: {' -> '.join(STAGE_NAMES)}, a "
        "tiny random Llama, float32), a fresh server per run; after its first requests a "
        "watchdog attaches in enforce mode at the default settings (plugin heartbeat every "
        f"{DEFAULT_HEARTBEAT_INTERVAL_S:g} s, heartbeat_timeout "
        f"{detection['heartbeat_timeout']:g} s, progress_timeout "
        f"{detection['progress_timeout']:g} s, stuck_timeout {detection['stuck_timeout']:g} s, "
        f"confirm_timeout {detection['confirm_timeout']:g} s, probes every "
        f"{probes['interval']:g} s, /health every {probes['health_interval']:g} s, canary "
        f"every {probes['canary_interval']:g} s, shutdown_grace {ladder['shutdown_grace']:g} "
        f"s, term_grace {ladder['term_grace']:g} s; no GPU probe on this machine). The fault "
        "time is when the fault was armed and the one request that meets it sent, or the "
        "SIGKILL sent; the first verdict is the detector's first STALLED or DEAD for the "
        "stage (the ladder starts there), dead its first DEAD if that came before the "
        "ladder's first shutdown or signal; tree gone: no process of the server's tree left. "
        "The verdicts' targets are the simulated server's. Each verdict is shown beside its "
        "floor: a death's exit notice (fault -> the exit's evidence, in the same run), a "
        "stall's heartbeat timeout. Medians and 95th percentiles with min - max; "
        "`python benchmarks/bench_real_omni.py --only faults --runs 20`."
    )


def bf16_deploy_file(directory: Path) -> Path:
    """The harness deploy file, word for word, but for bfloat16."""
    text = DEPLOY_FILE.read_text()
    assert DTYPE_LINE in text, f"{DEPLOY_FILE.name} no longer says {DTYPE_LINE!r}"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "deploy-bf16.yaml"
    path.write_text(text.replace(DTYPE_LINE, "dtype: bfloat16"))
    return path


def run_bf16_starts(starts: int, model: Path, workdir: Path, tally: Tally) -> None:
    deploy = bf16_deploy_file(workdir)
    for index in range(starts):
        with stopped_at_exit([]) as servers:
            server, _ = start_omni_server(model, workdir / f"start-{index + 1}", deploy_file=deploy)
            servers.append(server)

            async def scenario(server: VllmServer = server) -> StartCheck:
                await ready(server, READY_TIMEOUT)
                return await first_requests(server)

            try:
                check = asyncio.run(scenario())
            except StartFailed as failure:
                print(f"bfloat16 start {index + 1}: not ready: {failure}", flush=True)
                tally.starts.append(("bfloat16", False))
                continue
            except Exception:
                # Not the server's answer but this benchmark's failure: not counted.
                traceback.print_exc()
                continue
            tally.starts.append(("bfloat16", check.answered))
            print(f"bfloat16 start {index + 1}: {check.describe()}", flush=True)


def start_rows(tally: Tally) -> list[tuple[str, str, str, str]]:
    rows = []
    for dtype, source in (
        ("float32", "the harness deploy file"),
        ("bfloat16", "the same file in bfloat16"),
    ):
        answered, starts = tally.count(dtype)
        if starts:
            rows.append(
                (
                    f"{dtype} ({source}): starts that answered their first requests",
                    f"{answered} of {starts}",
                    "information",
                    "-",
                )
            )
    return rows


@dataclass(frozen=True)
class Pair:
    """One kind of server, started twice: with the plugin and without."""

    name: str
    requests: int
    with_env: Mapping[str, str]
    without_env: Mapping[str, str]
    receiver_settings: tuple[str, ...]
    omni: bool


# One request to a server: its HTTP status.
Send = Callable[[aiohttp.ClientSession, str], Awaitable[int]]


async def load(
    session: aiohttp.ClientSession, url: str, requests: int, in_flight: int, send: Send = chat
) -> float:
    """Requests per second for `requests` requests (chat completions unless `send` says
    otherwise), `in_flight` at a time."""
    remaining = iter(range(requests))

    async def worker() -> None:
        for _ in remaining:
            status = await send(session, url)
            if status != 200:
                raise RuntimeError(f"{url}: HTTP {status}")

    begun = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    return requests / (time.perf_counter() - begun)


@dataclass
class OverheadFigures:
    with_plugin: list[float]
    without: list[float]
    spans_with: float
    spans_without: float

    @property
    def ratios(self) -> list[float]:
        return [w / b for w, b in zip(self.with_plugin, self.without, strict=True)]


async def alternate(
    instrumented: VllmServer,
    bare: VllmServer,
    api_urls: tuple[str, str],
    rounds: int,
    requests: int,
    in_flight: int,
    send: Send = chat,
) -> OverheadFigures:
    figures = OverheadFigures([], [], 0.0, 0.0)
    connector = aiohttp.TCPConnector(limit=in_flight * 2)
    async with aiohttp.ClientSession(connector=connector) as session:
        for api_url in api_urls:
            await wait_healthy(session, api_url + "/healthz", 60)
        for server in (instrumented, bare):  # warm both: connections, stage queues, exporters
            await load(session, server.url, max(in_flight, requests // 4), in_flight, send)
        for index in range(rounds):
            order = [(instrumented, figures.with_plugin), (bare, figures.without)]
            for server, measured in order if index % 2 == 0 else reversed(order):
                measured.append(await load(session, server.url, requests, in_flight, send))
            # The load average tells a round that something else on the machine disturbed.
            print(
                f"  round {index + 1}: with {figures.with_plugin[-1]:.2f}/s,"
                f" without {figures.without[-1]:.2f}/s, load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
        # Let the plugin's exporters flush their last batches.
        await asyncio.sleep(2.0)
        figures.spans_with = await spans_received(session, api_urls[0])
        figures.spans_without = await spans_received(session, api_urls[1])
    return figures


def start_pair_server(pair: Pair, model: Path, workdir: Path, env: Mapping[str, str]) -> VllmServer:
    if pair.omni:
        server, _ = start_omni_server(model, workdir, env)
        return server
    return VllmServer.start(model, workdir, env)


def measure_pair(
    pair: Pair, model: Path, workdir: Path, rounds: int, in_flight: int, tally: Tally
) -> OverheadFigures:
    receivers: list[subprocess.Popen[bytes]] = []
    with stopped_at_exit([]) as servers:
        try:
            api_urls = []
            for name, env in (("with", pair.with_env), ("without", pair.without_env)):
                server = start_pair_server(pair, model, workdir / name, env)
                servers.append(server)
                # Both get a receiver on their OTLP port, so that the one difference between
                # them is the plugin: only its spans reach the receiver of the first.
                api_port = free_port()
                receivers.append(
                    start_watchdog(
                        workdir / name,
                        server.url,
                        api_port,
                        server.otlp_port,
                        ["probes.enabled=spans", *pair.receiver_settings],
                        generation=None,
                    )
                )
                api_urls.append(f"http://127.0.0.1:{api_port}")

                # One after the other: two starts at once on a small machine fight for
                # memory at their peak.
                async def started(server: VllmServer = server) -> StartCheck:
                    await ready(server, READY_TIMEOUT if pair.omni else VLLM_READY_TIMEOUT)
                    return await first_requests(server)

                try:
                    check = asyncio.run(started())
                except StartFailed:
                    if pair.omni:
                        tally.starts.append(("float32", False))
                    raise
                if pair.omni:
                    tally.starts.append(("float32", check.answered))
                if not check.answered:
                    raise StartFailed(f"{pair.name} {name}: {check.describe()}")
            return asyncio.run(
                alternate(
                    servers[0],
                    servers[1],
                    (api_urls[0], api_urls[1]),
                    rounds,
                    pair.requests,
                    in_flight,
                )
            )
        finally:
            for receiver in receivers:
                receiver.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    receiver.wait(timeout=10)


def overhead_rows(pair: Pair, figures: OverheadFigures) -> list[tuple[str, str, str, str]]:
    ratios = figures.ratios
    ratio = statistics.median(ratios)
    return [
        (
            f"{pair.name}: throughput ratio, with / without the plugin",
            f"{ratio:.3f}",
            f">= {OVERHEAD_TARGET}",
            "pass" if ratio >= OVERHEAD_TARGET else "FAIL",
        ),
        (
            f"{pair.name}: requests/s with / without the plugin",
            f"{statistics.median(figures.with_plugin):.2f} / "
            f"{statistics.median(figures.without):.2f}",
            "information",
            "-",
        ),
        (
            f"{pair.name}: lowest / highest round ratio",
            f"{min(ratios):.3f} / {max(ratios):.3f}",
            "information",
            "-",
        ),
        (
            f"{pair.name}: spans received, with / without the plugin",
            f"{figures.spans_with:,.0f} / {figures.spans_without:,.0f}",
            "information",
            "-",
        ),
    ]


def pairs(args: argparse.Namespace) -> list[Pair]:
    heartbeat = {HEARTBEAT_INTERVAL_ENV: f"{args.heartbeat:g}"}
    return [
        Pair(
            "vLLM-Omni 0.30",
            args.omni_requests,
            heartbeat,
            {**heartbeat, "VLLM_PLUGINS": OMNI_PLUGINS_BUT_OURS},
            (f"otlp_token={OTLP_TOKEN}",),
            omni=True,
        ),
        Pair(
            "vLLM 0.32",
            args.vllm_requests,
            heartbeat,
            {**heartbeat, "VLLM_PLUGINS": VLLM_PLUGINS_BUT_OURS},
            (),
            omni=False,
        ),
    ]


def run_overhead(
    args: argparse.Namespace, omni_model: Path, vllm_model: Path, workdir: Path, tally: Tally
) -> list[tuple[str, str, str, str]]:
    rows: list[tuple[str, str, str, str]] = []
    for pair in pairs(args):
        model = omni_model if pair.omni else vllm_model
        try:
            figures = measure_pair(
                pair, model, workdir / pair.name.split()[0], args.rounds, args.in_flight, tally
            )
        except Exception:
            # The other pair is still worth measuring; this one shows as not measured.
            traceback.print_exc()
            rows.append((f"{pair.name}: throughput ratio", "-", f">= {OVERHEAD_TARGET}", "FAIL"))
            continue
        if figures.spans_with <= figures.spans_without or (pair.omni and figures.spans_without):
            # Only the plugin's spans make the difference (plain vLLM exports its own to
            # both receivers): without it, the ratio would compare two equal servers.
            print(
                f"{pair.name}: spans with / without the plugin "
                f"{figures.spans_with:,.0f} / {figures.spans_without:,.0f}",
                file=sys.stderr,
            )
            rows.append((f"{pair.name}: throughput ratio", "-", f">= {OVERHEAD_TARGET}", "FAIL"))
            continue
        ratios = figures.ratios
        print(
            f"{pair.name}: ratio {statistics.median(ratios):.3f}"
            f" (rounds {', '.join(f'{r:.3f}' for r in ratios)}),"
            f" spans {figures.spans_with:,.0f} / {figures.spans_without:,.0f}",
            flush=True,
        )
        rows += overhead_rows(pair, figures)
    return rows


def overhead_note(args: argparse.Namespace) -> str:
    return (
        "Two real servers side by side, one with the omni-watchdog plugin (heartbeat every "
        f"{args.heartbeat:g} s) exporting to a watchdog in observe mode (span receiver only), "
        "one with `VLLM_PLUGINS` naming every other plugin (vLLM-Omni: its models, the "
        "harness, the LoRA resolvers; plain vLLM: none), each with a receiver of its own; "
        f"{args.rounds} alternating rounds of chat requests (8 tokens, {args.in_flight} in "
        f"flight; vLLM-Omni {args.omni_requests} a round, vLLM {args.vllm_requests}), the "
        "order flipping every round; median of the per-round ratios. The vLLM-Omni pair, "
        "then the plain pair; `python benchmarks/bench_real_omni.py --only overhead`."
    )


@dataclass
class SoakSeen:
    answers: list[int] = field(default_factory=list)
    abandoned: int = 0
    bursts: int = 0
    worse: list[str] = field(default_factory=list)
    incidents: int = 0


async def soak_scenario(server: VllmServer, faults: Any, seconds: float, workdir: Path) -> SoakSeen:
    seen = SoakSeen()
    chance = random.Random(0)
    async with watched(server, workdir) as watchdog, aiohttp.ClientSession() as session:

        async def impatient() -> None:
            try:
                await asyncio.wait_for(answer(session, server.url, 16), chance.uniform(0.2, 3.0))
            except asyncio.TimeoutError:
                seen.abandoned += 1
            except aiohttp.ClientError as error:
                print(f"  impatient request failed: {error}", file=sys.stderr)

        async def statuses(*tokens: int) -> list[int]:
            answers = await asyncio.gather(
                *(answer(session, server.url, n) for n in tokens), return_exceptions=True
            )
            return [a[0] if isinstance(a, tuple) else 0 for a in answers]

        faults.arm(1, "slow:0.25")
        try:
            begun = time.monotonic()
            next_burst = begun + SOAK_BURST_EVERY
            while time.monotonic() - begun < seconds:
                tokens = [16, 4]
                if time.monotonic() >= next_burst:
                    tokens += [8] * SOAK_BURST
                    seen.bursts += 1
                    next_burst += SOAK_BURST_EVERY
                answered, _ = await asyncio.gather(statuses(*tokens), impatient())
                seen.answers += answered
                seen.worse += worse_than_degraded(watchdog, STAGES)
        finally:
            faults.disarm(1)
        seen.incidents = len(watchdog.state.remediation.incidents)
    return seen


def run_soak(
    seconds: float, model: Path, workdir: Path, tally: Tally
) -> list[tuple[str, str, str, str]]:
    with stopped_at_exit([]) as servers:
        server, faults = start_omni_server(model, workdir)
        servers.append(server)

        async def scenario() -> SoakSeen | None:
            await ready(server, READY_TIMEOUT)
            check = await first_requests(server)
            tally.starts.append(("float32", check.answered))
            if not check.answered:
                print(f"  first requests failed ({check.describe()})", file=sys.stderr)
                return None
            return await soak_scenario(server, faults, seconds, workdir)

        seen = asyncio.run(scenario())
    label = f"{seconds:g} s, stage 1 slower, bursts, abandoned requests"
    if seen is None:
        return [(f"{label}: incidents opened", "-", "0", "FAIL (not measured)")]
    ok = sum(1 for status in seen.answers if status == 200)
    print(f"soak: {seen.incidents} incidents; worse than degraded: {seen.worse[:5]}", flush=True)
    return [
        (
            f"{label}: incidents opened (each a remediation)",
            str(seen.incidents),
            "0",
            "pass" if seen.incidents == 0 else "FAIL",
        ),
        (
            f"{label}: evaluations that judged a stage worse than degraded",
            str(len(seen.worse)),
            "0",
            "pass" if not seen.worse else "FAIL",
        ),
        (
            f"{label}: requests answered 200 / all / abandoned by their client / bursts",
            f"{ok:,} / {len(seen.answers):,} / {seen.abandoned:,} / {seen.bursts}",
            "information",
            "-",
        ),
    ]


@dataclass
class LegitRun:
    """One run of one kind of legit work on a server that should be left alone."""

    status: int | None = None
    seconds: float = 0.0
    worse: list[str] = field(default_factory=list)
    causes: set[str] = field(default_factory=set)
    incidents: int = 0


async def legit_run(watchdog: Any, server: VllmServer, faults: Any, word: str) -> LegitRun:
    run = LegitRun()
    talker = StageRef(1)

    async def watch() -> None:
        while True:
            run.worse += worse_than_degraded(watchdog, STAGES)
            status = stage_status(watchdog, talker)
            if status is not None and status.cause is not None:
                run.causes.add(status.cause.cause.value)
            await asyncio.sleep(0.25)

    async with aiohttp.ClientSession() as session:
        watcher = asyncio.create_task(watch())
        faults.arm(talker.stage_id, word)
        begun = time.monotonic()
        try:
            run.status, _ = await answer(session, server.url, timeout=LEGIT_LIMIT_S)
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            print(f"  {word}: the request failed: {error!r}", file=sys.stderr)
        finally:
            run.seconds = time.monotonic() - begun
            faults.disarm(talker.stage_id)
            watcher.cancel()
    run.incidents = len(watchdog.state.remediation.incidents)
    return run


@contextlib.contextmanager
def busy_loops(count: int) -> Iterator[None]:
    """`count` processes of this benchmark's own spinning on the CPUs while it lasts."""
    spinning = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for process in spinning:
            process.kill()
            process.wait()


def run_legit_work(
    runs: int, model: Path, workdir: Path, tally: Tally, busy: int = 0
) -> list[tuple[str, str, str, str]]:
    """Every kind of legit work `runs` times on one server, a watchdog in enforce mode at
    the shipped thresholds, `busy` loops spinning beside them: each incident would be a
    false remediation, and ends the server (a new one is started for the runs left)."""
    measured: dict[str, list[LegitRun]] = {word: [] for word, _, _ in LEGIT_WORK}
    plan = [word for _ in range(runs) for word, _, _ in LEGIT_WORK]
    while plan:
        with stopped_at_exit([]) as servers, busy_loops(busy):
            server, faults = start_omni_server(model, workdir / f"server-{len(plan)}")
            servers.append(server)

            async def scenario(server: VllmServer = server, faults: Any = faults) -> None:
                await ready(server, READY_TIMEOUT)
                check = await first_requests(server)
                tally.starts.append(("float32", check.answered))
                if not check.answered:
                    raise StartFailed(check.describe())
                watchdog_dir = workdir / f"watchdog-{len(plan)}"
                watchdog_dir.mkdir(parents=True)
                async with watched(server, watchdog_dir, overrides=AT_DEFAULTS) as dog:
                    while plan:
                        word = plan.pop(0)
                        run = await legit_run(dog, server, faults, word)
                        measured[word].append(run)
                        print(
                            f"{word}: {run.status} after {run.seconds:.1f} s, causes"
                            f" {sorted(run.causes)}, incidents {run.incidents},"
                            f" worse than degraded {run.worse[:3]}",
                            flush=True,
                        )
                        if run.incidents:
                            return  # the server was ended: the next runs get a new one

            try:
                asyncio.run(scenario())
            except StartFailed as failure:
                print(f"  start failed: {failure}", file=sys.stderr)
                return [("legit work", "-", "0 false remediations", "FAIL (no server)")]
    rows = []
    for word, label, cause in LEGIT_WORK:
        done = measured[word]
        remediated = sum(1 for r in done if r.incidents)
        named = sum(1 for r in done if cause.value in r.causes)
        answered = sum(1 for r in done if r.status == 200)
        took = spread([r.seconds for r in done]) if done else "-"
        rows += [
            (
                f"{label}, {len(done)} runs: false remediations",
                str(remediated),
                "0",
                "pass" if remediated == 0 and done else "FAIL",
            ),
            (
                f"{label}: runs never judged worse than degraded / answered 200 / named"
                f" {cause.value} while it lasted; request time",
                f"{sum(1 for r in done if not r.worse)} / {answered} / {named} of"
                f" {len(done)}; {took}",
                f"{len(done)} / {len(done)} / {len(done)}",
                "pass"
                if done
                and all(not r.worse and r.status == 200 for r in done)
                and named == len(done)
                else "FAIL",
            ),
        ]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["faults", "overhead", "bf16", "soak", "legit"])
    parser.add_argument("--legit-runs", type=int, default=5, help="runs of each legit work")
    parser.add_argument(
        "--busy-loops", type=int, default=0, help="processes spinning beside the legit work"
    )
    parser.add_argument("--soak-seconds", type=float, default=600.0)
    parser.add_argument(
        "--runs", type=int, default=20, help="fresh servers per fault (about 2 min each)"
    )
    parser.add_argument(
        "--fault",
        action="append",
        choices=[f.word for f in FAULTS],
        help="measure only this fault (repeatable)",
    )
    parser.add_argument("--bf16-starts", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=8, help="overhead rounds per server")
    parser.add_argument("--omni-requests", type=int, default=64, help="requests per round")
    parser.add_argument("--vllm-requests", type=int, default=256, help="requests per round")
    parser.add_argument("--in-flight", type=int, default=4)
    parser.add_argument("--heartbeat", type=float, default=1.0, help="plugin heartbeat, s")
    args = parser.parse_args(argv)
    parts = {args.only} if args.only else {"faults", "bf16", "overhead", "soak", "legit"}
    if not OMNI_STAMP.exists() or ("overhead" in parts and not VLLM_STAMP.exists()):
        print("skipped: the real vLLM-Omni and vLLM environments are missing (make tools)")
        return 0
    signal.signal(signal.SIGTERM, interrupt_on_sigterm)
    # The servers' plugin and this process's watchdogs must not pick up outside settings.
    for name in [name for name in os.environ if name.startswith("OMNI_WATCHDOG_")]:
        del os.environ[name]
    begun = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="omni-bench-real-"))
    tally = Tally()
    failed = False
    omni_model, vllm_model = make_models(workdir, "overhead" in parts)
    if "faults" in parts:
        chosen = [f for f in FAULTS if not args.fault or f.word in args.fault]
        rows = run_faults(chosen, args.runs, omni_model, workdir / "faults", tally)
        failed = failed or any(row[3].startswith("FAIL") for row in rows)
        print("\n".join(" | ".join(row) for row in rows), flush=True)
    if "legit" in parts:
        busy = args.busy_loops
        rows = run_legit_work(args.legit_runs, omni_model, workdir / "legit", tally, busy)
        failed = failed or any(row[3].startswith("FAIL") for row in rows)
        loaded = (
            f" {busy} processes spinning on the CPUs beside the server and the watchdog"
            " throughout (`--busy-loops`), so a compiler waits its turn for a CPU;"
            if busy
            else ""
        )
        record(
            LOADED_LEGIT_SECTION if busy else LEGIT_SECTION,
            rows,
            "The real vLLM-Omni 0.30 (CPU harness), a watchdog in enforce mode at the shipped"
            " thresholds; stage 1's forward, armed for one request each run: a real"
            " torch.compile on a fresh Inductor cache (g++ in child processes), a 20 s wait on"
            " a child at full CPU, 20 s of tensor work. One server for every run while none"
            f" is remediated;{loaded} each stage's state and stage 1's cause read every"
            " 0.25 s; `python benchmarks/bench_real_omni.py --only legit"
            f"{f' --busy-loops {busy}' if busy else ''}`.",
        )
        print("\n".join(" | ".join(row) for row in rows), flush=True)
    if "soak" in parts:
        rows = run_soak(args.soak_seconds, omni_model, workdir / "soak", tally)
        failed = failed or any(row[3].startswith("FAIL") for row in rows)
        record(
            SOAK_SECTION,
            rows,
            "The real vLLM-Omni 0.30 (CPU harness) under load with a watchdog in enforce mode"
            " at the real-server tests' settings; the talker a quarter of a second slower each"
            " forward, a 16- and a 4-token request back to back, 6 more every minute, and one"
            " request each round abandoned after 0.2 - 3 s; every stage's state read after"
            " each round; `python benchmarks/bench_real_omni.py --only soak`.",
        )
        print("\n".join(" | ".join(row) for row in rows), flush=True)
    if "bf16" in parts:
        run_bf16_starts(args.bf16_starts, omni_model, workdir / "bf16", tally)
    if "overhead" in parts:
        assert vllm_model is not None
        rows = run_overhead(args, omni_model, vllm_model, workdir / "overhead", tally)
        failed = failed or any(row[3].startswith("FAIL") for row in rows)
        record(OVERHEAD_SECTION, rows, overhead_note(args))
        print("\n".join(" | ".join(row) for row in rows), flush=True)
    rows = start_rows(tally)
    # The count is over every start of a whole run: a partial one leaves it as it was.
    if rows and args.only is None:
        record(
            STARTS_SECTION,
            rows,
            "Every vLLM-Omni start of `python benchmarks/bench_real_omni.py`: once ready, "
            '"ping" for one token, then a chat of 8; answered when both are 200, /health '
            'is still 200 two seconds later and the log has no "died unexpectedly" of a '
            "stage worker. bfloat16: `--bf16-starts` extra starts, the harness deploy file "
            "with only its dtype changed.",
        )
        print("\n".join(" | ".join(row) for row in rows), flush=True)
    print(f"took {(time.monotonic() - begun) / 60:.1f} min", flush=True)
    if failed or not all(answered for _, answered in tally.starts):
        print(f"the servers' and watchdogs' logs: {workdir}", file=sys.stderr)
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
