"""`omni-watchdog run` as a user starts it, and re-attachment to a restarted server."""

from __future__ import annotations

import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from deadline import wait_for, wait_until
from e2e.harness import (
    SIM_ENV,
    WAITS_FOR_A_CRASH,
    all_healthy,
    attached,
    in_background,
    incident_done,
    run_scenario,
    warmed_up,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from ports import free_port

from omni_watchdog.cli import EXIT_CANNOT_START, EXIT_CONFIG
from omni_watchdog.config import merge_layers
from omni_watchdog.process_start import sender_attributes
from omni_watchdog.semconv import HEARTBEAT_SPAN, PROCESS_PID, STAGE_ID
from omni_watchdog.sim.launcher import SimProcess, example_config
from omni_watchdog.types import IncidentOutcome

pytestmark = pytest.mark.e2e


def get_json(url: str) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return json.loads(response.read())
    except OSError:
        return None


def test_run_command_attaches_and_stops_on_sigterm(tmp_path: Path) -> None:
    server = SimProcess.start(tmp_path, [], "0.11", port=free_port())
    api = free_port()
    watchdog = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "omni_watchdog.cli",
            "run",
            "--target",
            server.url,
            "--stage-config",
            str(example_config("0.11")),
            "--listen",
            f"127.0.0.1:{api}",
            "--otlp-listen",
            f"127.0.0.1:{free_port()}",
            "--mode",
            "observe",
            "--gpu-backend",
            "none",
            "--state-dir",
            str(tmp_path / "watchdog"),
            "--set",
            "detection.startup_grace=1s",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:

        def warm_status() -> Any:
            status = get_json(f"http://127.0.0.1:{api}/v1/status")
            return status if status and status["target"]["warmed_up"] else None

        status = wait_until(warm_status, 40, "/v1/status warmed up", 0.25)
        assert status["target"]["pid"] == server.process.pid
        assert [s["name"] for s in status["stages"]] == ["thinker", "talker", "code2wav"]
        assert status["probes"]["gpu"]["up"] is False  # no NVML: reported, the rest goes on
        watchdog.send_signal(signal.SIGTERM)
        assert watchdog.wait(timeout=15) == 0
        log = watchdog.stderr.read() if watchdog.stderr else ""
        events = [json.loads(line)["event"] for line in log.splitlines() if line.startswith("{")]
        assert "watchdog_started" in events and "attached" in events
    finally:
        if watchdog.poll() is None:
            watchdog.kill()
            watchdog.wait()
        server.stop()


# Nor a GPU: the memory the dead engine held, gone a second later, paired with the exit as
# well. Only the server's own 503 confirms the death then, so the ladder waits for its exit.
SAYS_IT_CRASHED = merge_layers(WAITS_FOR_A_CRASH, {"probes": {"gpu_backend": "none"}})


def test_a_crashed_server_is_recorded_and_its_successor_attached(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with attached(
            tmp_path, ["1:engine-dead-exit"], "0.11", "enforce", SAYS_IT_CRASHED, None, SIM_ENV
        ) as (watchdog, server):
            await warmed_up(watchdog)
            in_background(server.url)
            incident = await incident_done(watchdog)
            assert incident.outcome is IncidentOutcome.CRASHED
            first_pid = server.process.pid
            successor = SimProcess.start(
                tmp_path / "successor", [], "0.11", env=server.env, port=server.port
            )
            try:
                await wait_for(lambda: watchdog.state.target.generation == 2, 30)
                root = watchdog.state.target.root
                assert root is not None and root.pid == successor.process.pid != first_pid
                await warmed_up(watchdog, judged_after=time.monotonic())
                await all_healthy(watchdog, 20)
                assert len(watchdog.state.remediation.incidents) == 1
            finally:
                successor.stop()

    run_scenario(scenario())


def otlp_bodies(pid: int) -> tuple[bytes, bytes]:
    """One heartbeat of stage 0 from process `pid`, as OTLP protobuf and as OTLP JSON."""
    resource = {PROCESS_PID: pid, **sender_attributes(pid)}
    attributes = [
        {
            "key": key,
            "value": {"intValue": str(value)} if isinstance(value, int) else {"stringValue": value},
        }
        for key, value in resource.items()
    ]
    span: dict[str, Any] = {
        "traceId": "0af7651916cd43dd8448eb211c80319c",
        "spanId": "b7ad6b7169203331",
        "name": HEARTBEAT_SPAN,
        "attributes": [{"key": STAGE_ID, "value": {"intValue": "0"}}],
    }
    document = {
        "resourceSpans": [
            {"resource": {"attributes": attributes}, "scopeSpans": [{"spans": [span]}]}
        ]
    }
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    for key, value in resource.items():
        kv = resource_spans.resource.attributes.add(key=key)
        if isinstance(value, int):
            kv.value.int_value = value
        else:
            kv.value.string_value = value
    proto_span = resource_spans.scope_spans.add().spans.add(
        name=HEARTBEAT_SPAN,
        trace_id=bytes.fromhex(span["traceId"]),
        span_id=bytes.fromhex(span["spanId"]),
    )
    proto_span.attributes.add(key=STAGE_ID).value.int_value = 0
    return request.SerializeToString(), json.dumps(document).encode()


def post(url: str, body: bytes, headers: dict[str, str]) -> int:
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


def raw_status(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as connection:
        connection.sendall(request)
        return connection.makefile("rb").readline().strip()


def metric(text: str, series: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(series + " "))
    return float(line.rsplit(" ", 1)[1])


def test_run_serves_otlp_as_a_collector_does(tmp_path: Path) -> None:
    server = SimProcess.start(tmp_path, [], "0.30", port=free_port())
    api, otlp = free_port(), free_port()
    watchdog = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "omni_watchdog.cli",
            "run",
            *("--target", server.url, "--stage-config", str(example_config("0.30"))),
            *("--listen", f"127.0.0.1:{api}", "--otlp-listen", f"127.0.0.1:{otlp}"),
            *("--mode", "observe", "--gpu-backend", "none"),
            *("--state-dir", str(tmp_path / "watchdog")),
        ],
        stderr=subprocess.DEVNULL,
        env={**os.environ, "OMNI_WATCHDOG_OTLP_TOKEN": "s3cret"},
    )
    try:

        def attached_to_server() -> Any:
            status = get_json(f"http://127.0.0.1:{api}/v1/status")
            return status and status["target"]["pid"] == server.process.pid

        wait_until(attached_to_server, 40, "/v1/status attached to the server", 0.25)
        protobuf, otlp_json = otlp_bodies(server.process.pid)
        traces = f"http://127.0.0.1:{otlp}/v1/traces"
        token = {"Authorization": "Bearer s3cret"}
        gzipped = {"Content-Encoding": "gzip", **token}
        as_protobuf = {"Content-Type": "application/x-protobuf"}
        as_json = {"Content-Type": "application/json"}
        assert post(traces, gzip.compress(protobuf), {**as_protobuf, **gzipped}) == 200
        assert post(traces, gzip.compress(otlp_json), {**as_json, **gzipped}) == 200
        assert post(traces, protobuf, {**as_protobuf, **gzipped}) == 400  # not gzip at all
        assert (
            post(traces, gzip.compress(protobuf), {**as_protobuf, "Content-Encoding": "gzip"})
            == 401
        )
        assert post(traces, protobuf, {**as_protobuf, "Authorization": "Bearer nope"}) == 401
        malformed = raw_status(
            otlp,
            b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer \xff\xfe\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
        )
        assert malformed == b"HTTP/1.1 401 Unauthorized"
        expected = {
            "omni_watchdog_spans_received_total": 2,
            'omni_watchdog_spans_rejected_total{reason="decode_error"}': 1,
            'omni_watchdog_spans_rejected_total{reason="unauthorized"}': 3,
        }
        # /metrics shows the state of the last evaluation, a fraction of a second behind:
        # one may have counted the first exports and not yet the last refusals.

        def counted_as_expected() -> str | None:
            with urllib.request.urlopen(f"http://127.0.0.1:{api}/metrics", timeout=5) as response:
                text = response.read().decode()
            counted = {series: metric(text, series) for series in expected}
            return text if counted == expected else None

        text = wait_until(counted_as_expected, 5, f"/metrics counting {expected}")
        assert metric(text, 'omni_watchdog_internal_errors_total{loop="listener"}') == 0
        with urllib.request.urlopen(f"http://127.0.0.1:{api}/healthz", timeout=5) as response:
            assert response.status == 200
        watchdog.send_signal(signal.SIGTERM)
        assert watchdog.wait(timeout=15) == 0
    finally:
        if watchdog.poll() is None:
            watchdog.kill()
            watchdog.wait()
        server.stop()


def run_refused(*arguments: str) -> subprocess.CompletedProcess[str]:
    """`omni-watchdog run` with these arguments and no OMNI_WATCHDOG_* from this process,
    expected to end at once."""
    return subprocess.run(
        [sys.executable, "-m", "omni_watchdog.cli", "run", *arguments],
        capture_output=True,
        text=True,
        timeout=30,
        env={k: v for k, v in os.environ.items() if not k.startswith("OMNI_WATCHDOG_")},
    )


def test_a_receiver_off_loopback_without_a_token_refuses_to_start(tmp_path: Path) -> None:
    result = run_refused("--otlp-listen", f"0.0.0.0:{free_port()}", "--state-dir", str(tmp_path))
    assert result.returncode == EXIT_CONFIG
    assert result.stderr.count("\n") == 1 and "OMNI_WATCHDOG_OTLP_TOKEN" in result.stderr


def test_a_port_already_taken_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_refused(
            *("--listen", f"127.0.0.1:{port}", "--state-dir", str(tmp_path)),
            *("--otlp-listen", f"127.0.0.1:{free_port()}"),
        )
    assert result.returncode == EXIT_CANNOT_START
    (line,) = [line for line in result.stderr.splitlines() if not line.startswith("{")]
    assert line.startswith("omni-watchdog: cannot start:") and "Traceback" not in result.stderr
