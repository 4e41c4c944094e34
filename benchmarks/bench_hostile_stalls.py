"""A stall judged under hostile load: impersonation, refused POSTs, readers.

For each load in turn, a simulated vLLM-Omni 0.30 server and an enforce-mode watchdog at
its defaults (in this process, as `omni-watchdog demo` runs them); once warm, a flood from
a process of its own starts, stage 0 stalls silently (its loop deadlocked, the process
asleep) and the report's request is sent. Measured: fault -> verdict, the `/metrics`
scrape times while the load runs (median, 95th percentile: this process's loop is the
watchdog's), the journal's size after, and what the receiver refused. Loads:
- none: the baseline;
- impersonation: heartbeats and successful stage spans in the stalled stage process's
  own name (pid, start and boot id read from /proc), every 0.3 s, with no token;
- token holder: the same, with the OTLP token the watchdog and the plugin are given, so
  the receiver takes them: what the watchdog reads for itself must outweigh them;
- refused POSTs: `POST /v1/pause` without the operator's token, 4 connections flat out;
- readers: `GET /v1/status`, `/v1/incidents` and `/metrics`, 8 connections flat out;
- reports: `GET /v1/incidents/<id>/report` of the unloaded run's incident (its journal
  and bundle carried over, as a restarted watchdog finds them), 16 connections flat out;
- mixed: all four at once for `--mixed-seconds` (30; the issue's figure took 600) before
  the fault, and idle connections held open on both listeners.

    python benchmarks/bench_hostile_stalls.py [--no-write]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from results import record

from omni_watchdog.config import ProbesConfig
from omni_watchdog.demo import arm_faults, attached, send_request, summary, wait_for
from omni_watchdog.log import configure_logging
from omni_watchdog.operator import UNAUTHENTICATED_OUTCOMES
from omni_watchdog.process_start import sender_attributes
from omni_watchdog.semconv import (
    HEARTBEAT_SPAN,
    PROCESS_PID,
    REQUEST_ID,
    STAGE_ID,
    STAGE_REPLICA,
    STAGE_REQUEST_SPAN,
)
from omni_watchdog.types import ProcessStatus, StageRef

SECTION = "Stalls under hostile load"
FLOODS = ("impersonation", "refused POSTs", "readers", "reports")
LOADS = ("none", *FLOODS, "token holder", "mixed")
OTLP_TOKEN = "bench-otlp-token"
IDLE_CONNECTIONS = 200
# A stall is judged within the unloaded run's time and this much more.
VERDICT_SLACK_S = 2.0
# Under the token holder's beats, the second kind of evidence is the watchdog's own canary:
# sent once no counter moved for its interval, failed at its deadline (the defaults).
CANARY_WAIT_S = ProbesConfig().canary_interval + ProbesConfig().canary_deadline
TARGET_SCRAPE_P95_MS = 50.0
TARGET_JOURNAL_BYTES = 1 << 20
SCRAPE_EVERY_S = 0.2
INCIDENT_TIMEOUT_S = 90.0
# How long a single flood runs before the fault: in full swing.
FLOOD_SECONDS = 2.0

# A flood from a process of its own: `threads` connections sending one request each in a
# loop, `pause` seconds apart, until SIGTERM; then it prints its answers' statuses as JSON.
FLOOD = r"""
import collections, http.client, json, os, signal, sys, threading, time
method, port, path, content_type, body_file, threads, pause, token = sys.argv[1:9]
body = open(body_file, "rb").read() if body_file != "-" else None
headers = {"Content-Type": content_type}
if token != "-":
    headers["Authorization"] = "Bearer " + token
paths = path.split(",")
answers = collections.Counter()
def run():
    connection, sent = None, 0
    while True:
        try:
            if connection is None:
                connection = http.client.HTTPConnection("127.0.0.1", int(port), timeout=10)
            connection.request(method, paths[sent % len(paths)], body, headers)
            response = connection.getresponse()
            response.read()
            answers[str(response.status)] += 1
            sent += 1
        except Exception:
            answers["no answer"] += 1
            connection = None
            time.sleep(0.05)
        if float(pause):
            time.sleep(float(pause))
def report(*_):
    print(json.dumps(dict(answers)), flush=True)
    os._exit(0)
signal.signal(signal.SIGTERM, report)
for _ in range(int(threads)):
    threading.Thread(target=run, daemon=True).start()
threading.Event().wait()
"""


@dataclass(frozen=True)
class Figures:
    load: str
    verdict_s: float | None
    scrape_p50_ms: float
    scrape_p95_ms: float
    scrape_max_ms: float
    journal_bytes: int
    refused: dict[str, int]
    actions_refused: int
    # The flood's answers by HTTP status.
    answers: dict[str, int]


def _value(key: str, value: object) -> KeyValue:
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    return KeyValue(key=key, value=AnyValue(string_value=str(value)))


def forged_body(pid: int) -> bytes:
    """A heartbeat and a successful stage span of stage 0, in process `pid`'s name."""
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    resource = {PROCESS_PID: pid, **sender_attributes(pid), STAGE_ID: 0, STAGE_REPLICA: 0}
    resource_spans.resource.attributes.extend(_value(k, v) for k, v in resource.items())
    spans = resource_spans.scope_spans.add()
    now = time.time_ns()
    for index, name in enumerate((HEARTBEAT_SPAN, STAGE_REQUEST_SPAN), start=1):
        span = spans.spans.add(
            name=name,
            trace_id=index.to_bytes(16, "big"),
            span_id=index.to_bytes(8, "big"),
            start_time_unix_nano=now,
            end_time_unix_nano=now,
        )
        if name == STAGE_REQUEST_SPAN:
            span.attributes.append(_value(REQUEST_ID, "forged"))
    return request.SerializeToString()


def start_floods(load: str, watchdog: Any, workdir: Path) -> list[subprocess.Popen[bytes]]:
    """The load's floods, started."""
    if load == "none":
        return []
    if load == "mixed":
        return [start_flood(flood, watchdog, workdir) for flood in FLOODS]
    return [start_flood(load, watchdog, workdir)]


def start_flood(load: str, watchdog: Any, workdir: Path) -> subprocess.Popen[bytes]:
    api, otlp = watchdog.api_port, watchdog.otlp_port
    token = "-"
    if load in ("impersonation", "token holder"):
        engine = next(
            p
            for p in watchdog.state.processes
            if p.stage == StageRef(0) and p.status is not ProcessStatus.EXITED
        )
        body = workdir / "forged.bin"
        body.write_bytes(forged_body(engine.pid))
        args = ["POST", otlp, "/v1/traces", "application/x-protobuf", body, 1, 0.3]
        token = OTLP_TOKEN if load == "token holder" else "-"
    elif load == "refused POSTs":
        body = workdir / "pause.json"
        body.write_text('{"seconds": 86400, "reason": "not yours"}')
        args = ["POST", api, "/v1/pause", "application/json", body, 4, 0]
    elif load == "readers":
        args = ["GET", api, "/v1/status,/v1/incidents,/metrics", "text/plain", "-", 8, 0]
    else:
        (earlier,) = watchdog.state.remediation.incidents
        report = f"/v1/incidents/{earlier.incident_id}/report"
        args = ["GET", api, report, "text/html", "-", 16, 0]
    return subprocess.Popen(
        [sys.executable, "-c", FLOOD, *map(str, args), token],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )


async def scrape_times(url: str, times: list[float], stop: asyncio.Event) -> None:
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            started = time.perf_counter()
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as reply:
                    await reply.read()
                    times.append((time.perf_counter() - started) * 1e3)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), SCRAPE_EVERY_S)


async def refused_actions(url: str) -> int:
    """The operator's actions refused for want of the token, from `/metrics`."""
    async with aiohttp.ClientSession() as session, session.get(url) as reply:
        text = await reply.text()
    wanted = tuple(f'outcome="{outcome}"' for outcome in UNAUTHENTICATED_OUTCOMES)
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        if line.startswith("omni_watchdog_operator_actions_total{")
        and any(label in line for label in wanted)
    )


async def stall_under(load: str, workdir: Path, flood_seconds: float) -> Figures:
    """The figures of one load, flooding `flood_seconds` before the fault."""
    token = load == "token holder"
    overrides = {"otlp_token": OTLP_TOKEN} if token else None
    sim_env = {"OMNI_WATCHDOG_OTLP_TOKEN": OTLP_TOKEN} if token else None
    async with attached(workdir, [], "0.30", "enforce", overrides, None, sim_env) as (
        watchdog,
        server,
    ):
        await wait_for(lambda: watchdog.state.report and watchdog.state.report.warmed_up, 60)
        floods = start_floods(load, watchdog, workdir)
        held = []
        if load == "mixed":
            for port in (watchdog.api_port, watchdog.otlp_port):
                for _ in range(IDLE_CONNECTIONS):
                    held.append(await asyncio.open_connection("127.0.0.1", port))
        times: list[float] = []
        stop = asyncio.Event()
        scraping = asyncio.create_task(
            scrape_times(f"http://127.0.0.1:{watchdog.api_port}/metrics", times, stop)
        )
        try:
            await asyncio.sleep(flood_seconds)  # the load in full swing before the fault
            earlier = {i.incident_id for i in watchdog.state.remediation.incidents}
            await arm_faults(server.url, ["0:silent-stall"])
            request = asyncio.create_task(send_request(server.url))
            incident = await wait_for(
                lambda: next(
                    (
                        i
                        for i in watchdog.state.remediation.incidents
                        if i.closed is not None and i.incident_id not in earlier
                    ),
                    None,
                ),
                INCIDENT_TIMEOUT_S,
            )
            request.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await request
        finally:
            stop.set()
            await scraping
            for _, writer in held:
                writer.close()
            answers: dict[str, int] = {}
            for flood in floods:
                flood.terminate()
                output, _ = flood.communicate(timeout=10)
                for status, count in json.loads(output or b"{}").items():
                    answers[status] = answers.get(status, 0) + count
        verdict = summary(incident, server.fault_time())["fault_to_verdict_s"]
        refused = {r: n for r, n in watchdog.state.receiver.spans_rejected.items() if n}
        actions_refused = await refused_actions(f"http://127.0.0.1:{watchdog.api_port}/metrics")
    journal = workdir / "watchdog" / "journal.jsonl"
    size = journal.stat().st_size if journal.exists() else 0
    ordered = sorted(times)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))] if ordered else 0.0
    median = statistics.median(times or [0.0])
    most = ordered[-1] if ordered else 0.0
    name = f"mixed ({flood_seconds:g} s)" if load == "mixed" else load
    return Figures(name, verdict, median, p95, most, size, refused, actions_refused, answers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument(
        "--mixed-seconds", type=float, default=30.0, help="how long the mixed flood runs"
    )
    args = parser.parse_args(argv)
    results = []
    history = Path(tempfile.mkdtemp(prefix="omni-bench-stalls-history-")) / "watchdog"
    for load in LOADS:
        with tempfile.TemporaryDirectory(prefix="omni-bench-stalls-") as workdir:
            state_dir = Path(workdir) / "watchdog"
            if load in ("reports", "mixed"):
                shutil.copytree(history, state_dir)
            # The watchdog's log would drown the figures; it goes with the run's directory.
            log = (Path(workdir) / "watchdog.log").open("a", encoding="utf-8")
            with log:
                configure_logging("info", log)
                seconds = args.mixed_seconds if load == "mixed" else FLOOD_SECONDS
                results.append(asyncio.run(stall_under(load, Path(workdir), seconds)))
            if load == "none":
                shutil.copytree(state_dir, history)
        found = results[-1]
        print(
            f"{found.load}: verdict {found.verdict_s} s, scrape median"
            f" {found.scrape_p50_ms:.1f} ms, p95 {found.scrape_p95_ms:.1f} ms, max"
            f" {found.scrape_max_ms:.1f} ms, journal {found.journal_bytes:,} B,"
            f" spans refused {found.refused}, actions refused {found.actions_refused:,},"
            f" the flood's answers {found.answers}"
        )
    baseline = results[0].verdict_s
    table = []
    ok = True
    for found in results:
        slack = VERDICT_SLACK_S + (CANARY_WAIT_S if found.load == "token holder" else 0.0)
        limit = None if baseline is None else baseline + slack
        judged = found.verdict_s is not None and (limit is None or found.verdict_s <= limit)
        checks = [
            (
                f"{found.load}: fault -> verdict",
                "none" if found.verdict_s is None else f"{found.verdict_s:.2f} s",
                "judged" if limit is None else f"<= {limit:.2f} s (unloaded + {slack:g})",
                judged,
            ),
            (
                f"{found.load}: scrape p95 (median, max)",
                f"{found.scrape_p95_ms:.1f} ms"
                f" ({found.scrape_p50_ms:.1f}, {found.scrape_max_ms:.0f})",
                f"<= {TARGET_SCRAPE_P95_MS:g} ms",
                found.scrape_p95_ms <= TARGET_SCRAPE_P95_MS,
            ),
            (
                f"{found.load}: journal",
                f"{found.journal_bytes:,} B",
                f"<= {TARGET_JOURNAL_BYTES:,} B",
                found.journal_bytes <= TARGET_JOURNAL_BYTES,
            ),
        ]
        if found.load != "none":
            checks.append(
                (
                    f"{found.load}: the flood's answers",
                    ", ".join(f"{status}: {n:,}" for status, n in sorted(found.answers.items())),
                    "every request answered",
                    bool(found.answers) and "no answer" not in found.answers,
                )
            )
        for figure, measured, target, passed in checks:
            table.append((figure, measured, target, "pass" if passed else "FAIL"))
            ok = ok and passed
    if not args.no_write:
        record(
            SECTION,
            table,
            note=(
                "A simulated vLLM-Omni 0.30 server and an enforce-mode watchdog at its "
                "defaults; after warm-up a flood from a process of its own, then stage 0 "
                "stalls silently under it (impersonation: heartbeats and stage spans in the "
                "stalled process's own name every 0.3 s, no token; token holder: the same "
                "with the OTLP token, so the receiver takes them; refused POSTs: "
                "`POST /v1/pause` without the token, 4 connections flat out; readers: "
                "status, incidents and /metrics, 8 connections flat out; reports: the HTML "
                "report of the unloaded run's incident, its journal and bundle carried over, "
                "16 connections flat out; mixed: all four at once, with "
                f"{IDLE_CONNECTIONS} idle connections on each listener, for the time its "
                "row names). Scrapes every "
                f"{SCRAPE_EVERY_S:g} s while it runs; "
                "`python benchmarks/bench_hostile_stalls.py`."
            ),
        )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
