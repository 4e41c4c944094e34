"""Both listeners of `omni-watchdog run`, their whole surface, through the real process.

One simulated 0.30 server and one `run` (observe mode, its settings in a `--config` file,
the OTLP token among them) serve every test here. The simulated server exports its own
spans to the receiver with that token, so its stages stay judged on spans throughout.

Covered elsewhere end to end, and not repeated here:
- test_cli_run.py::test_run_serves_otlp_as_a_collector_does: gzip'd protobuf and gzip'd
  JSON accepted, a body sent as gzip that is not, and a token given in the environment
  (missing, wrong, undecodable header bytes);
- test_cli_run.py::test_run_command_attaches_and_stops_on_sigterm: attaching and SIGTERM;
- test_watchdog_api.py::test_status_target_health_and_incidents: /v1/target/health 503 on
  a stall and the detail of a real incident (no incident is opened here);
- test_hostile.py: forged spans and invented stages, /healthz 503 once judging stops.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from deadline import wait_for
from e2e.harness import FAST, SIM_ENV, run_scenario
from e2e.test_cli_run import metric
from google.protobuf import json_format
from google.rpc import status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from otlp_bodies import batch
from ports import free_port
from prometheus_client.parser import text_string_to_metric_families
from test_alerts import EXPORTER_FAMILIES, prometheus_tool

from omni_watchdog.config import PROBES, merge_layers
from omni_watchdog.process_start import sender_attributes
from omni_watchdog.sim.launcher import SimProcess, example_config

pytestmark = pytest.mark.e2e

GENERATION = "0.30"
# (stage_id, replica, name) of the example 0.30 pipeline.
SIMULATED_STAGES = [(0, 0, "thinker"), (1, 0, "talker"), (1, 1, "talker"), (2, 0, "code2wav")]
TOKEN = "listener-e2e-token"
# Short enough that an unfinished request head is cut off within the test.
HEADER_TIMEOUT = 2.0
MAX_CONNECTIONS = 16
MAX_BODY_BYTES = 256 * 1024
# Many more spans than the simulated server exports while a test runs, so that the
# received count can only reach its bound with every one of the test's exports in it.
SPANS_PER_EXPORT = 500
START_TIMEOUT = 60.0
WAIT_TIMEOUT = 10.0
REQUEST_TIMEOUT = 10.0
POLL_INTERVAL = 0.2
PROTOBUF = "application/x-protobuf"
JSON = "application/json"
# Enough malformed heads that a log written per request stands out from the rest.
MALFORMED_HEADS = 20


@dataclass(frozen=True)
class Running:
    """The started `omni-watchdog run` and the simulated server it watches."""

    process: subprocess.Popen[bytes]
    server: SimProcess
    api_port: int
    otlp_port: int
    log: Path

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    @property
    def traces(self) -> str:
        return f"http://127.0.0.1:{self.otlp_port}/v1/traces"

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def assert_alive(self) -> None:
        assert self.process.poll() is None, f"the watchdog exited:\n{self.log_tail()}"


@dataclass(frozen=True)
class Reply:
    status: int
    headers: Mapping[str, str]
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode()


async def call(
    method: str,
    url: str,
    body: bytes | AsyncIterator[bytes] | None = None,
    headers: Mapping[str, str] | None = None,
    decompress: bool = True,
) -> Reply:
    """One request on a connection of its own, closed after the answer."""
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT)
    async with (
        aiohttp.ClientSession(auto_decompress=decompress, timeout=timeout) as session,
        session.request(method, url, data=body, headers=headers) as response,
    ):
        return Reply(response.status, response.headers.copy(), await response.read())


async def scrape(running: Running) -> str:
    reply = await call("GET", running.api + "/metrics")
    assert reply.status == 200, reply.text
    return reply.text


async def scrape_until(running: Running, done: Callable[[str], bool]) -> str:
    """The first scrape `done` holds of, else the last one at the deadline (for the
    assertions that follow to show): /metrics may show the watchdog as of its last
    evaluation, a moment behind what was just sent."""
    deadline = time.monotonic() + WAIT_TIMEOUT
    while True:
        text = await scrape(running)
        if done(text) or time.monotonic() >= deadline:
            return text
        await asyncio.sleep(POLL_INTERVAL)


def declared_families(text: str) -> dict[str, str]:
    """Each family's name and type as its `# TYPE` line declares them."""
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE))


def parsed_families(text: str) -> set[str]:
    """The families a Prometheus parser reads out of `text`."""
    return {family.name for family in text_string_to_metric_families(text)}


def family_name(name: str) -> str:
    # The parser names a counter without its _total suffix.
    return name.removesuffix("_total")


def watchdog_config() -> dict[str, Any]:
    return merge_layers(
        FAST,
        {
            "otlp_token": TOKEN,
            "header_timeout": f"{HEADER_TIMEOUT:g}s",
            "max_connections": MAX_CONNECTIONS,
            "spans": {"max_body_bytes": MAX_BODY_BYTES},
        },
    )


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    workdir = tmp_path_factory.mktemp("listeners")
    api_port, otlp_port = free_port(), free_port()
    server = SimProcess.start(
        workdir,
        [],
        GENERATION,
        port=free_port(),
        env={
            "OMNI_WATCHDOG_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_port}/v1/traces",
            "OMNI_WATCHDOG_OTLP_TOKEN": TOKEN,
            **SIM_ENV,
        },
    )
    config = workdir / "watchdog.yaml"
    config.write_text(json.dumps(watchdog_config()))  # JSON is YAML
    # Only the config file speaks: none of this process's OMNI_WATCHDOG_* settings, bar
    # where the simulated GPUs are read from.
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_WATCHDOG_")}
    env["OMNI_WATCHDOG_SIM_STATE"] = str(server.state_dir)
    log = workdir / "watchdog.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "omni_watchdog.cli",
                "run",
                *("--config", str(config)),
                *("--target", server.url, "--stage-config", str(example_config(GENERATION))),
                *("--listen", f"127.0.0.1:{api_port}", "--otlp-listen", f"127.0.0.1:{otlp_port}"),
                *("--mode", "observe", "--gpu-backend", "sim"),
                *("--state-dir", str(workdir / "watchdog")),
            ],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=env,
        )
    started = Running(process, server, api_port, otlp_port, log)

    async def healthy() -> Reply | None:
        started.assert_alive()
        try:
            reply = await call("GET", started.api + "/v1/target/health")
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None  # not listening yet, or too busy starting to answer
        return reply if reply.status == 200 else None

    try:
        try:
            asyncio.run(
                wait_for(
                    healthy, START_TIMEOUT, "every simulated stage judged healthy", POLL_INTERVAL
                )
            )
        except AssertionError as error:
            raise AssertionError(f"{error}; the watchdog's log:\n{started.log_tail()}") from None
        yield started
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        server.stop()


# The API listener (`--listen`).


def test_every_api_route_answers_through_run(running: Running) -> None:
    async def scenario() -> None:
        healthz = await call("GET", running.api + "/healthz")
        assert (healthz.status, healthz.text) == (200, "ok\n")

        reply = await call("GET", running.api + "/v1/status")
        assert reply.status == 200 and reply.headers["Content-Type"].startswith(JSON)
        status = json.loads(reply.body)
        assert status["mode"] == "observe"
        assert status["target"]["pid"] == running.server.process.pid
        assert status["target"]["warmed_up"] is True
        assert status["topology"]["source"] == str(example_config(GENERATION))
        stages = status["stages"]
        assert [(s["stage_id"], s["replica"], s["name"]) for s in stages] == SIMULATED_STAGES
        assert all(s["state"] in ("healthy", "degraded") and s["pids"] for s in stages), stages
        probes = status["probes"]
        assert set(probes) == set(PROBES)
        # A canary that a busy machine makes late is a failed run of that probe: only
        # the others are sure to be up.
        assert all(p["up"] for name, p in probes.items() if name != "canary"), probes

        health = await call("GET", running.api + "/v1/target/health")
        assert (health.status, health.text) == (200, "every stage is healthy or degraded\n")

        incidents = await call("GET", running.api + "/v1/incidents")
        assert incidents.status == 200 and json.loads(incidents.body) == {"incidents": []}
        for tail in ("", "/stacks", "/report"):
            unknown = await call("GET", running.api + "/v1/incidents/no-such-incident" + tail)
            assert unknown.status == 404 and unknown.headers["Content-Type"].startswith(JSON)
            assert json.loads(unknown.body) == {"error": "no incident no-such-incident"}
        # No operator token was configured: every action is refused, and nothing changes.
        for action in ("remediate", "pause", "resume"):
            refused = await call("POST", running.api + "/v1/" + action, b"{}")
            assert refused.status == 403 and "OMNI_WATCHDOG_OPERATOR_TOKEN" in refused.text

        assert (await call("GET", running.api + "/v1/no-such-route")).status == 404
        assert (await call("POST", running.api + "/v1/status", b"{}")).status == 405

        metrics = await call("GET", running.api + "/metrics")
        assert metrics.status == 200
        assert metrics.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        # Every family of the exporter's contract, from the first scrape on.
        assert declared_families(metrics.text) == EXPORTER_FAMILIES
        assert parsed_families(metrics.text) == set(map(family_name, EXPORTER_FAMILIES))
        running.assert_alive()

    run_scenario(scenario())


def test_the_scraped_metrics_pass_promtool(running: Running) -> None:
    promtool = prometheus_tool("promtool")
    text = asyncio.run(scrape(running))
    checked = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_metrics_are_gzipped_for_a_scraper_that_asks(running: Running) -> None:
    async def scenario() -> Reply:
        return await call(
            "GET", running.api + "/metrics", headers={"Accept-Encoding": "gzip"}, decompress=False
        )

    reply = run_scenario(scenario())
    assert reply.status == 200
    assert reply.headers.get("Content-Encoding") == "gzip", dict(reply.headers)
    text = gzip.decompress(reply.body).decode()
    assert parsed_families(text) == set(map(family_name, EXPORTER_FAMILIES))


async def raw_exchange(port: int, request: bytes) -> bytes:
    """Everything the listener answers to `request` until it closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        # Reading to the end proves the listener closed the connection.
        return await asyncio.wait_for(reader.read(), WAIT_TIMEOUT)
    finally:
        writer.close()


BAD_HEADS = {
    "not HTTP": b"GARBAGE\r\n\r\n",
    "a header line without a colon": b"GET /healthz HTTP/1.1\r\nHost: x\r\nno colon\r\n\r\n",
    "a header line past aiohttp's limit": b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: "
    + b"a" * 20_000
    + b"\r\n\r\n",
    "too many header lines": b"GET /healthz HTTP/1.1\r\n" + b"X-Many: y\r\n" * 200 + b"\r\n",
}


def api_closed(text: str, reason: str) -> float:
    return metric(
        text, f'omni_watchdog_connections_closed_total{{listener="api",reason="{reason}"}}'
    )


def test_bad_request_heads_are_closed_and_the_api_serves_on(running: Running) -> None:
    async def scenario() -> None:
        before = await scrape(running)

        # A head never finished: cut off at the header deadline, unanswered, counted.
        started = time.monotonic()
        unfinished = await raw_exchange(running.api_port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        assert unfinished == b""
        assert time.monotonic() - started >= HEADER_TIMEOUT * 0.9

        # A malformed or oversized head: answered 400 and closed at once, as aiohttp does,
        # and counted as a bad request.
        for what, head in BAD_HEADS.items():
            answer = await raw_exchange(running.api_port, head)
            assert re.match(rb"HTTP/1\.[01] 400 ", answer), (what, answer[:200])

        # Idle connections up to the cap: a new client still gets its answer, and the
        # connection that made room for it is counted.
        idle = [
            await asyncio.open_connection("127.0.0.1", running.api_port)
            for _ in range(MAX_CONNECTIONS)
        ]
        try:
            served = await call("GET", running.api + "/healthz")
        finally:
            for _, writer in idle:
                writer.close()
        assert served.status == 200

        def closed_since(text: str, reason: str) -> float:
            return api_closed(text, reason) - api_closed(before, reason)

        after = await scrape_until(
            running,
            lambda text: (
                closed_since(text, "header_timeout") >= 1
                and closed_since(text, "over_cap") >= 1
                and closed_since(text, "bad_request") >= len(BAD_HEADS)
            ),
        )
        assert closed_since(after, "header_timeout") == 1
        assert closed_since(after, "bad_request") == len(BAD_HEADS)
        assert closed_since(after, "over_cap") >= 1
        assert metric(after, 'omni_watchdog_internal_errors_total{loop="listener"}') == 0
        assert (await call("GET", running.api + "/healthz")).status == 200
        running.assert_alive()

    run_scenario(scenario())


def test_a_burst_of_malformed_heads_does_not_flood_the_log(running: Running) -> None:
    async def burst() -> None:
        for port in (running.api_port, running.otlp_port):
            for _ in range(MALFORMED_HEADS // 2):
                answer = await raw_exchange(port, BAD_HEADS["a header line without a colon"])
                assert re.match(rb"HTTP/1\.[01] 400 ", answer), answer[:200]

    logged = running.log.stat().st_size
    asyncio.run(burst())
    running.assert_alive()
    with running.log.open("rb") as log:
        log.seek(logged)
        added = log.read().decode(errors="replace").splitlines()
    # Bounded: a rate-limited line or two at most, never one per request.
    assert len(added) < MALFORMED_HEADS, "\n".join(added[:40])


# The OTLP/HTTP receiver (`spans.otlp_listen`).


def as_otlp_json(body: bytes) -> bytes:
    """The protobuf export `body` as OTLP/JSON: protobuf's JSON mapping with hex ids."""
    document = json_format.MessageToDict(ExportTraceServiceRequest.FromString(body))
    for resource_spans in document["resourceSpans"]:
        for scope_spans in resource_spans["scopeSpans"]:
            for span in scope_spans["spans"]:
                for key in ("traceId", "spanId"):
                    span[key] = base64.b64decode(span[key]).hex()
    return json.dumps(document).encode()


async def oversized_stream() -> AsyncIterator[bytes]:
    """A body with no declared length (chunked) that passes the cap while it arrives."""
    chunk = bytes(64 * 1024)
    for _ in range(MAX_BODY_BYTES // len(chunk) + 1):
        yield chunk


def export_headers(
    media_type: str = PROTOBUF, encoding: str = "", token: str | None = TOKEN
) -> dict[str, str]:
    headers = {"Content-Type": media_type}
    if encoding:
        headers["Content-Encoding"] = encoding
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return headers


def error_message(reply: Reply) -> str:
    """The reason a refused export gives: an OTLP Status in the request's encoding."""
    media_type = reply.headers.get("Content-Type", "")
    if media_type.startswith(PROTOBUF):
        return str(status_pb2.Status.FromString(reply.body).message)
    if media_type.startswith(JSON):
        return str(json.loads(reply.body)["message"])
    return reply.text


def received(text: str) -> float:
    return metric(text, "omni_watchdog_spans_received_total")


def rejected(text: str, reason: str) -> float:
    return metric(text, f'omni_watchdog_spans_rejected_total{{reason="{reason}"}}')


@dataclass(frozen=True)
class Refusal:
    """An export the receiver must refuse: the answer, its reason, the counter it lands in."""

    what: str
    body: bytes | Callable[[], AsyncIterator[bytes]]
    headers: Mapping[str, str]
    status: int
    message: str
    counted_as: str


def refusals(protobuf: bytes) -> list[Refusal]:
    over_cap = f"over {MAX_BODY_BYTES} bytes"
    return [
        Refusal(
            "undecodable protobuf",
            b"\xff\xff\xff\xff",
            export_headers(),
            400,
            "undecodable protobuf body",
            "decode_error",
        ),
        Refusal(
            "undecodable JSON",
            b"{not json",
            export_headers(JSON),
            400,
            "undecodable JSON body",
            "decode_error",
        ),
        Refusal(
            "declared over the cap",
            bytes(MAX_BODY_BYTES + 1),
            export_headers(),
            413,
            over_cap,
            "too_large",
        ),
        Refusal(
            "streamed over the cap", oversized_stream, export_headers(), 413, over_cap, "too_large"
        ),
        Refusal(
            "over the cap once inflated",
            gzip.compress(bytes(MAX_BODY_BYTES + 1)),
            export_headers(encoding="gzip"),
            413,
            "once decompressed",
            "too_large",
        ),
        Refusal(
            "an unsupported media type",
            protobuf,
            export_headers("text/plain"),
            415,
            "unsupported content type",
            "unsupported_media_type",
        ),
        Refusal(
            "an unsupported encoding",
            protobuf,
            export_headers(encoding="br"),
            415,
            "unsupported content encoding",
            "unsupported_media_type",
        ),
        Refusal(
            "no token",
            protobuf,
            export_headers(token=None),
            401,
            "bearer token",
            "unauthorized",
        ),
        Refusal(
            "a wrong token",
            protobuf,
            export_headers(token="not-" + TOKEN),
            401,
            "bearer token",
            "unauthorized",
        ),
    ]


def test_every_otlp_answer_through_run(running: Running) -> None:
    pid = running.server.process.pid
    sender = {"process.pid": pid, **sender_attributes(pid)}
    protobuf = batch(sender, [("listener.e2e.export", {})] * SPANS_PER_EXPORT)
    traces = running.traces
    refused = refusals(protobuf)
    expected_rejections = Counter(refusal.counted_as for refusal in refused)

    async def scenario() -> None:
        before = await scrape(running)

        accepted = {
            "protobuf": await call("POST", traces, protobuf, export_headers()),
            "gzip'd protobuf": await call(
                "POST", traces, gzip.compress(protobuf), export_headers(encoding="gzip")
            ),
            "JSON": await call("POST", traces, as_otlp_json(protobuf), export_headers(JSON)),
        }
        for what, reply in accepted.items():
            assert reply.status == 200, (what, reply.status, reply.body[:200])
        # A whole success: no partial_success telling the exporter some spans were dropped.
        answer = ExportTraceServiceResponse.FromString(accepted["protobuf"].body)
        assert not answer.HasField("partial_success")
        assert json.loads(accepted["JSON"].body) == {}

        for refusal in refused:
            body = refusal.body if isinstance(refusal.body, bytes) else refusal.body()
            reply = await call("POST", traces, body, refusal.headers)
            assert reply.status == refusal.status, (refusal.what, reply.status, reply.body[:200])
            assert refusal.message in error_message(reply), (refusal.what, error_message(reply))

        # Only POST /v1/traces is served: another signal's exporter pointed here, or a GET.
        otlp = f"http://127.0.0.1:{running.otlp_port}"
        metrics_export = await call("POST", otlp + "/v1/metrics", protobuf, export_headers())
        assert metrics_export.status == 404
        assert (await call("GET", traces)).status == 405

        def received_since(text: str) -> float:
            return received(text) - received(before)

        def rejected_since(text: str) -> dict[str, float]:
            return {
                reason: rejected(text, reason) - rejected(before, reason)
                for reason in expected_rejections
            }

        after = await scrape_until(
            running,
            lambda text: (
                received_since(text) >= len(accepted) * SPANS_PER_EXPORT
                and rejected_since(text) == expected_rejections
            ),
        )
        assert received_since(after) >= len(accepted) * SPANS_PER_EXPORT
        assert rejected_since(after) == expected_rejections
        assert metric(after, 'omni_watchdog_internal_errors_total{loop="listener"}') == 0

        # The simulated server's own exports, with the token, are still taken in...
        async def more_received() -> float | None:
            now = received(await scrape(running))
            return now if now > received(after) else None

        await wait_for(
            more_received, WAIT_TIMEOUT, "the simulated server's spans received", POLL_INTERVAL
        )
        # ...and none of the above made a stage look anything but live.
        health = await call("GET", running.api + "/v1/target/health")
        assert health.status == 200, health.text
        running.assert_alive()

    run_scenario(scenario())
