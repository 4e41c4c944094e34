"""The on-call commands against a real HTTP server that answers as the watchdog's API does.

The server runs on its own event loop in a thread, since each command runs its own
`asyncio.run`; it serves canned answers (a three-stage pipeline with its talker stalled,
one open incident, a pause in force) and records every request it gets.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import re
import signal
import socket
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
from aiohttp import web

from omni_watchdog.oncall import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    MAX_JSON_BYTES,
    TOKEN_VARIABLE,
    URL_VARIABLE,
    Console,
    add_commands,
    pause_seconds,
    run_command,
    top_frames,
)
from omni_watchdog.types import StepName

NOW = 1_767_225_600.0  # 2026-01-01 00:00:00 UTC: the watchdog's clock as it answers
T = TypeVar("T")
TOKEN = "operator-test-token"
OPEN_ID = "20251231T235950Z-0a1b2c"
CLOSED_ID = "20251231T235000Z-9f8e7d"
TARGET_URL = "http://127.0.0.1:8091"
GIB = 1024**3
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
REPORT_PAGE = b"<!doctype html><html><body><h1>incident</h1>\xe2\x9c\x93</body></html>\n"
LADDER = [step.value for step in StepName]


def evidence(kind: str, since: float, detail: str) -> dict[str, Any]:
    return {"kind": kind, "since": since, "detail": detail}


def stage(
    stage_id: int,
    name: str,
    state: str,
    since: float | None,
    evidence: list[dict[str, Any]],
    pids: list[int],
    gpu_bytes: int,
    heartbeat_age: float | None,
) -> dict[str, Any]:
    return {
        "stage_id": stage_id,
        "replica": 0,
        "name": name,
        "state": state,
        "since": since,
        "evidence": evidence,
        "pids": pids,
        "gpu_memory_bytes": gpu_bytes,
        "heartbeat_age_seconds": heartbeat_age,
        "last_progress": since,
        "in_flight": 1,
        "overdue": 0,
    }


def status_answer() -> dict[str, Any]:
    """/v1/status of a watched 3-stage Qwen2.5-Omni whose talker stopped heartbeating."""
    stages = [
        stage(0, "thinker", "healthy", NOW - 754, [], [4101], 20 * GIB, 0.4),
        stage(
            1,
            "talker",
            "stalled",
            NOW - 12,
            [
                evidence("heartbeat_lost", NOW - 14, "no heartbeat for 14.0s (timeout 10s)"),
                evidence("span_overdue", NOW - 13, "request r-17 overdue by 9.1s"),
            ],
            [4301, 4302, 4303, 4304],
            30 * GIB,
            14.2,
        ),
        stage(2, "code2wav", "starting", None, [], [], 0, None),
    ]
    topology_stages = [
        {
            "stage_id": stage_id,
            "name": name,
            "replicas": 1,
            "devices": [stage_id],
            "gpu_memory_utilization": 0.8,
            "upstream": [] if stage_id == 0 else [stage_id - 1],
            "downstream": [] if stage_id == 2 else [stage_id + 1],
            "final_output": stage_id == 2,
        }
        for stage_id, name in enumerate(("thinker", "talker", "code2wav"))
    ]
    return {
        "mode": "enforce",
        "target": {
            "url": TARGET_URL,
            "pid": 4000,
            "alive": True,
            "generation": 1,
            "warmed_up": True,
            "health": {"outcome": "timeout", "detail": "no answer in 2s"},
        },
        "topology": {"source": "stage config", "stages": topology_stages},
        "stages": stages,
        "processes": [
            {
                "pid": 4000,
                "ppid": 1,
                "pgid": 4000,
                "sid": 4000,
                "title": "vllm serve",
                "role": "api",
                "stage": None,
                "status": "sleeping",
                "orphaned": False,
                "gpu_memory_bytes": 0,
            }
        ],
        "probes": {
            "health": {"up": True, "errors_total": 0, "last_error": "", "duration_seconds": 2.0}
        },
        "gpu": None,
        "incident": OPEN_ID,
        "remediation_budget_remaining": 2,
        "lock": {"held": True, "conflict": "", "path": "/state/target.lock"},
        "watchdog": {
            "evaluation_age_seconds": 0.1,
            "internal_errors": {},
            "state_write_errors": 0,
            "last_state_write_error": "",
        },
        "pause": {"until": NOW + 1800, "reason": "driver upgrade", "since": NOW - 60},
        "now": NOW,
    }


def incident_summaries() -> dict[str, Any]:
    return {
        "incidents": [
            {
                "incident_id": CLOSED_ID,
                "mode": "enforce",
                "opened": NOW - 600,
                "closed": NOW - 591.5,
                "cause": "stage 1.0 (talker) dead: process_exit, heartbeat_lost, gpu_held",
                "outcome": "recovered_by_kill",
                "steps": [
                    {"step": "capture", "outcome": "ok", "duration": 2.09},
                    {"step": "shutdown", "outcome": "timeout", "duration": 1.0},
                    {"step": "terminate", "outcome": "not_recovered", "duration": 3.03},
                    {"step": "kill", "outcome": "recovered", "duration": 0.02},
                    {"step": "verify", "outcome": "ok", "duration": 0.01},
                ],
                "bundle_dir": f"/state/incidents/{CLOSED_ID}",
            },
            {
                "incident_id": OPEN_ID,
                "mode": "enforce",
                "opened": NOW - 10,
                "closed": None,
                "cause": "stage 1.0 (talker) stalled: heartbeat_lost, span_overdue",
                "outcome": "open",
                "steps": [],
                "bundle_dir": f"/state/incidents/{OPEN_ID}",
            },
        ]
    }


def closed_incident() -> dict[str, Any]:
    """The full incident as `to_jsonable(Incident)` makes it, with its bundle's files."""
    opened = NOW - 600
    ref = {"stage_id": 1, "replica": 0}
    # Verdict and evidence times are the watchdog's monotonic seconds, not wall times.
    return {
        "incident_id": CLOSED_ID,
        "target": TARGET_URL,
        "mode": "enforce",
        "opened": opened,
        "cause": "stage 1.0 (talker) dead: process_exit, heartbeat_lost, gpu_held",
        "verdicts": [
            {
                "stage": ref,
                "state": "dead",
                "time": 5001.0,
                "evidence": [
                    {
                        "kind": "process_exit",
                        "stage": ref,
                        "since": 4999.0,
                        "detail": "engine pid 4305 (VLLM::EngineCore) exited",
                    },
                    {
                        "kind": "heartbeat_lost",
                        "stage": ref,
                        "since": 4998.5,
                        "detail": "no heartbeat for 2.5s",
                    },
                ],
            },
            {
                "stage": {"stage_id": 2, "replica": 0},
                "state": "stalled",
                "time": 5001.5,
                "evidence": [
                    {
                        "kind": "progress_flat",
                        "stage": {"stage_id": 2, "replica": 0},
                        "since": 4990.0,
                        "detail": "no progress for 11.0s with 1 request in flight",
                    }
                ],
                "cause": {
                    "cause": "spinning",
                    "since": 4995.0,
                    "working": False,
                    "detail": "pid 4401: thread 4401 at 100% CPU in the same frames 3 samples"
                    " running: forward (/models/tiny.py:12)",
                },
            },
        ],
        "steps": [
            {
                "step": "capture",
                "outcome": "ok",
                "started": opened,
                "duration": 2.09,
                "detail": "stacks of 2/2 live processes",
                "targets": [4301, 4000],
            },
            {
                "step": "shutdown",
                "outcome": "timeout",
                "started": opened + 2.1,
                "duration": 1.0,
                "detail": "no answer from http://127.0.0.1:8091/admin/shutdown in 1s",
                "targets": [],
            },
            {
                "step": "kill",
                "outcome": "recovered",
                "started": opened + 3.1,
                "duration": 0.02,
                "detail": "",
                "targets": [4000],
            },
        ],
        "outcome": "recovered_by_kill",
        "closed": opened + 8.5,
        "bundle_dir": f"/state/incidents/{CLOSED_ID}",
        "timeline": {
            "opened": opened,
            "first_evidence": opened - 2.04,
            "verdict": opened - 0.01,
            "released": opened + 8.48,
            "closed": opened + 8.5,
        },
        "crashed": False,
        # The monotonic clock as the incident opened: its first verdict came 0.01 s before.
        "opened_monotonic": 5001.01,
        "files": ["incident.json", "stacks/4301.txt", "stacks/4000.txt", "gpu.json"],
    }


# py-spy dump of a stage process: the main thread is 10 frames deep and was dumped with
# --locals (deeper-indented lines after a frame); a second thread waits in a queue.
STAGE_STACK = """\
# pid 4301 VLLM::stage-1 (stage, stage 1.0)
Process 4301: VLLM::stage-1
Python v3.12.3 (/usr/bin/python3.12)

Thread 4301 (idle): "MainThread"
    wait (threading.py:355)
        Arguments:
            self: <Condition at 0x7f0c>
            timeout: None
    get (queue.py:171)
    frame_3 (engine.py:30)
    frame_4 (engine.py:40)
    frame_5 (engine.py:50)
    frame_6 (engine.py:60)
    frame_7 (engine.py:70)
    frame_8 (engine.py:80)
    frame_9 (engine.py:90)
    main (stage.py:100)
Thread 4320 (active): "output_thread"
    recv (socket.py:12)
    run (zmq_loop.py:44)
"""
# py-spy could not read the process: no thread in it, so its first lines are shown.
DENIED_STACK = "\n".join(f"line {n}: Error: Permission Denied" for n in range(1, 11))


def stacks_answer() -> dict[str, Any]:
    return {
        "stacks": [
            {
                "pid": 4301,
                "title": "VLLM::stage-1",
                "stage": "1.0",
                "role": "stage",
                "text": STAGE_STACK,
            },
            {
                "pid": 4000,
                "title": "vllm serve",
                "stage": None,
                "role": "api",
                "text": DENIED_STACK,
            },
        ]
    }


@dataclass(frozen=True)
class Received:
    method: str
    path: str
    headers: Mapping[str, str]
    body: Any


@dataclass
class FakeWatchdog:
    """The watchdog's API contract, over canned answers; `token` "" turns actions off."""

    url: str = ""
    token: str = TOKEN
    status: dict[str, Any] = field(default_factory=status_answer)
    conflict: str = ""  # when set, /v1/remediate answers 409 with it
    incident: dict[str, Any] = field(default_factory=closed_incident)  # CLOSED_ID's answer
    stacks: bool = True  # False: a watchdog without the /stacks route
    requests: list[Received] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._record])
        app.router.add_get("/v1/status", self._status)
        app.router.add_get("/v1/incidents", self._incidents)
        app.router.add_get("/v1/incidents/{incident_id}", self._incident)
        app.router.add_get("/v1/incidents/{incident_id}/stacks", self._stacks)
        app.router.add_get("/v1/incidents/{incident_id}/report", self._report)
        app.router.add_post("/v1/remediate", self._remediate)
        app.router.add_post("/v1/pause", self._pause)
        app.router.add_post("/v1/resume", self._resume)
        return app

    def sent(self, method: str) -> list[Received]:
        return [r for r in self.requests if r.method == method]

    @web.middleware
    async def _record(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        raw = await request.read()
        self.requests.append(
            Received(
                request.method,
                request.path,
                dict(request.headers),
                json.loads(raw) if raw else None,
            )
        )
        return await handler(request)

    async def _status(self, _: web.Request) -> web.Response:
        return web.json_response(self.status)

    async def _incidents(self, _: web.Request) -> web.Response:
        return web.json_response(incident_summaries())

    def _known(self, request: web.Request) -> bool:
        return request.match_info["incident_id"] == CLOSED_ID

    async def _incident(self, request: web.Request) -> web.Response:
        if not self._known(request):
            return error(404, "no such incident")
        return web.json_response(self.incident)

    async def _stacks(self, request: web.Request) -> web.Response:
        if not self.stacks:
            raise web.HTTPNotFound()
        if not self._known(request):
            return error(404, "no such incident")
        return web.json_response(stacks_answer())

    async def _report(self, request: web.Request) -> web.Response:
        if not self._known(request):
            return error(404, "no such incident")
        return web.Response(body=REPORT_PAGE, content_type="text/html", charset="utf-8")

    def _refusal(self, request: web.Request) -> web.Response | None:
        if not self.token:
            return error(
                403,
                "operator actions are off: start the watchdog with OMNI_WATCHDOG_OPERATOR_TOKEN",
            )
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return error(401, "missing or wrong operator token")
        return None

    async def _remediate(self, request: web.Request) -> web.Response:
        refused = self._refusal(request)
        if refused is not None:
            return refused
        if self.conflict:
            return error(409, self.conflict)
        first = (await request.json()).get("from")
        steps = LADDER[LADDER.index(first) :] if first else LADDER
        return web.json_response(
            {"incident_id": OPEN_ID, "mode": "enforce", "steps": steps}, status=202
        )

    async def _pause(self, request: web.Request) -> web.Response:
        refused = self._refusal(request)
        if refused is not None:
            return refused
        body = await request.json()
        pause = {"since": NOW, "until": NOW + body["seconds"], "reason": body["reason"]}
        return web.json_response({"pause": pause})

    async def _resume(self, request: web.Request) -> web.Response:
        return self._refusal(request) or web.json_response({"pause": None})


def error(status: int, reason: str) -> web.Response:
    return web.json_response({"error": reason}, status=status)


class LoopInAThread:
    """Servers on free loopback ports, run by an event loop of their own in a thread (the
    command under test runs its own loop); each is closed at the end."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._runners: list[web.AppRunner] = []
        self._raw: list[asyncio.AbstractServer] = []

    def app(self, app: web.Application) -> str:
        """Serve `app`; its base URL."""
        runner = web.AppRunner(app)
        self._runners.append(runner)

        async def start() -> str:
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            host, port = runner.addresses[0][:2]
            return f"http://{host}:{port}"

        return self._run(start())

    def raw(self, answer: bytes) -> str:
        """A server that answers every request with `answer` as it is, as no HTTP library
        would let one; its base URL."""

        async def answer_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(answer)
            await writer.drain()
            writer.close()

        async def start() -> str:
            server = await asyncio.start_server(answer_once, "127.0.0.1", 0)
            self._raw.append(server)
            host, port = server.sockets[0].getsockname()[:2]
            return f"http://{host}:{port}"

        return self._run(start())

    def close(self) -> None:
        async def close_raw() -> None:
            # On the servers' own loop: closed from this thread, a server raced the loop
            # finishing its last connection (`_wakeup` on waiters already cleared).
            for server in self._raw:
                server.close()

        self._run(close_raw())
        for runner in self._runners:
            self._run(runner.cleanup())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def _run(self, work: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(work, self._loop).result(timeout=10)


@pytest.fixture
def served() -> Iterator[LoopInAThread]:
    servers = LoopInAThread()
    try:
        yield servers
    finally:
        servers.close()


@pytest.fixture
def watchdog(served: LoopInAThread) -> FakeWatchdog:
    """The fake API on a free loopback port, served from its own loop in a thread."""
    fake = FakeWatchdog()
    fake.url = served.app(fake.app())
    return fake


@dataclass
class Outcome:
    code: int
    out: str
    err: str
    prompts: list[str]

    @property
    def lines(self) -> list[str]:
        return self.out.splitlines()


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="omni-watchdog")
    commands = parser.add_subparsers(dest="command", required=True)
    add_commands(commands)
    return parser.parse_args(argv)


def invoke(
    argv: Sequence[str],
    *,
    watchdog: FakeWatchdog | None = None,
    environ: Mapping[str, str] | None = None,
    terminal: bool = False,
    answer: str | BaseException = "y",
    columns: int = 200,
    wall: float = NOW,
    sleep: Callable[[float], Awaitable[None]] | None = None,
) -> Outcome:
    """Run one command as `omni-watchdog` would, pointed at `watchdog`, with the operator
    token in the environment unless `environ` says otherwise."""
    out, err = io.StringIO(), io.StringIO()
    prompts: list[str] = []

    def ask(prompt: str) -> str:
        prompts.append(prompt)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    async def no_sleep(_: float) -> None:
        raise AssertionError("only a watch waits")

    console = Console(
        out=out,
        err=err,
        environ={TOKEN_VARIABLE: TOKEN} if environ is None else environ,
        stdout_is_terminal=terminal,
        stdin_is_terminal=terminal,
        ask=ask,
        columns=columns,
        wall=lambda: wall,
        sleep=sleep or no_sleep,
    )
    where = ["--watchdog", watchdog.url] if watchdog else []
    code = run_command(parse([*argv, *where]), console)
    return Outcome(code, out.getvalue(), err.getvalue(), prompts)


def cells(line: str) -> list[str]:
    """A table row's cells: columns are two or more spaces apart, and no cell holds two."""
    return re.split(r"\s{2,}", ANSI.sub("", line).strip())


def closed_port() -> int:
    """A loopback port nothing listens on: bound once for a free number, then closed."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


# status


def test_status_shows_the_header_and_one_row_per_stage(watchdog: FakeWatchdog) -> None:
    result = invoke(["status"], watchdog=watchdog)

    assert result.code == EXIT_OK, result.err
    assert result.lines[:5] == [
        f"target    {TARGET_URL}  pid 4000  up",
        "mode      enforce  remediation budget left 2",
        "paused    until 2026-01-01 00:30:00 UTC (30m00s left): driver upgrade",
        f"incident  {OPEN_ID}",
        "",
    ]
    table = result.lines[5:]
    assert cells(table[0]) == [
        "STAGE",
        "REPLICA",
        "NAME",
        "STATE",
        "SINCE",
        "EVIDENCE",
        "PIDS",
        "GPU MiB",
        "HEARTBEAT",
    ]
    assert [cells(row) for row in table[1:]] == [
        ["0", "0", "thinker", "healthy", "12m34s", "-", "4101", "20480", "0.4s"],
        [
            "1",
            "0",
            "talker",
            "stalled",
            "12s",
            "no heartbeat for 14.0s (timeout 10s)",
            "4301,4302,4303 +1",
            "30720",
            "14s",
        ],
        ["2", "0", "code2wav", "starting", "-", "-", "-", "0", "-"],
    ]
    # Widths come from the content: every column starts where its title does.
    starts = [table[0].index(title) for title in ("NAME", "STATE", "EVIDENCE", "PIDS")]
    for row in table[1:]:
        assert all(row[start - 2 : start] == "  " and row[start] != " " for start in starts)
    assert "\x1b" not in result.out
    assert [(r.method, r.path) for r in watchdog.requests] == [("GET", "/v1/status")]
    # Reading sends no token.
    assert "Authorization" not in watchdog.requests[0].headers


def test_status_without_a_pause_or_an_incident(watchdog: FakeWatchdog) -> None:
    watchdog.status.update(pause=None, incident=None)
    result = invoke(["status"], watchdog=watchdog)
    assert result.lines[:3] == [
        f"target    {TARGET_URL}  pid 4000  up",
        "mode      enforce  remediation budget left 2",
        "incident  none",
    ]


def test_status_ages_use_the_local_clock_when_the_watchdog_sends_no_time(
    watchdog: FakeWatchdog,
) -> None:
    del watchdog.status["now"]
    result = invoke(["status"], watchdog=watchdog, wall=NOW + 60)
    rows = {cells(row)[2]: cells(row) for row in result.lines[6:]}
    assert rows["thinker"][4] == "13m34s"
    assert rows["talker"][4] == "1m12s"
    assert "(29m00s left)" in result.lines[2]


def test_status_colours_states_only_on_a_terminal(watchdog: FakeWatchdog) -> None:
    plain = invoke(["status"], watchdog=watchdog)
    coloured = invoke(["status"], watchdog=watchdog, terminal=True)

    assert "\x1b[32mhealthy\x1b[0m" in coloured.out
    assert "\x1b[31mstalled\x1b[0m" in coloured.out
    assert "\x1b[2mstarting\x1b[0m" in coloured.out
    # Colour codes take no room: without them the terminal's table is the plain one.
    assert ANSI.sub("", coloured.out) == plain.out


@pytest.mark.parametrize("no_color", ["1", "true"])
def test_status_respects_no_color(watchdog: FakeWatchdog, no_color: str) -> None:
    environ = {TOKEN_VARIABLE: TOKEN, "NO_COLOR": no_color}
    result = invoke(["status"], watchdog=watchdog, terminal=True, environ=environ)
    assert result.code == EXIT_OK
    assert "\x1b" not in result.out


def test_status_cuts_the_evidence_to_the_terminal_width(watchdog: FakeWatchdog) -> None:
    result = invoke(["status"], watchdog=watchdog, columns=100)
    table = result.lines[5:]
    assert max(len(line) for line in table) <= 100
    talker = cells(table[2])
    assert talker[5].endswith("...")
    assert "no heartbeat for 14.0s (timeout 10s)".startswith(talker[5][:-3])
    # The other cells are whole.
    assert talker[6:] == ["4301,4302,4303 +1", "30720", "14s"]


def test_status_json_prints_the_answer_as_received(watchdog: FakeWatchdog) -> None:
    result = invoke(["status", "--json"], watchdog=watchdog, terminal=True)
    assert result.code == EXIT_OK
    assert json.loads(result.out) == status_answer()
    assert result.out == json.dumps(status_answer(), indent=2, sort_keys=True) + "\n"


def test_status_watch_refreshes_until_ctrl_c(watchdog: FakeWatchdog) -> None:
    waits: list[float] = []

    async def interrupt_on_the_second_wait(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 2:
            # Ctrl+C as the terminal sends it; asyncio.run turns it into KeyboardInterrupt
            # (cancelling this wait), or Python raises it here where asyncio has no handler.
            signal.raise_signal(signal.SIGINT)
            await asyncio.Event().wait()

    # As on a terminal: Python's own SIGINT handler, which asyncio.run replaces with one
    # that cancels the command. A test run started in the background by a shell without
    # job control inherits SIGINT ignored, and Python keeps it so: the Ctrl+C was then
    # lost and the watch waited 300 s.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        result = invoke(
            ["status", "--watch", "5"],
            watchdog=watchdog,
            terminal=True,
            sleep=interrupt_on_the_second_wait,
        )
    finally:
        signal.signal(signal.SIGINT, inherited)

    assert result.code == EXIT_OK
    assert waits == [5.0, 5.0]
    assert result.out.count("\x1b[H\x1b[2J") == 2
    assert result.out.count("every 5s, Ctrl+C to stop") == 2
    assert [r.path for r in watchdog.requests] == ["/v1/status", "/v1/status"]


def test_status_watch_keeps_watching_a_watchdog_that_went_away() -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    waits: list[float] = []

    async def stop(seconds: float) -> None:
        waits.append(seconds)
        raise KeyboardInterrupt

    result = invoke(["status", "--watch", "--watchdog", url], sleep=stop)
    assert result.code == EXIT_OK
    assert waits == [2.0]
    assert f"cannot reach the watchdog at {url}" in result.out


def test_status_watch_interval_must_be_positive() -> None:
    with pytest.raises(SystemExit) as stopped:
        parse(["status", "--watch", "0"])
    assert stopped.value.code == EXIT_USAGE


# incidents


def test_incidents_lists_every_incident(watchdog: FakeWatchdog) -> None:
    result = invoke(["incidents"], watchdog=watchdog, columns=300)

    assert result.code == EXIT_OK, result.err
    assert cells(result.lines[0]) == ["ID", "OPENED (UTC)", "MODE", "OUTCOME", "STEPS", "CAUSE"]
    assert [cells(line) for line in result.lines[1:]] == [
        [
            CLOSED_ID,
            "2025-12-31 23:50:00",
            "enforce",
            "recovered_by_kill",
            "capture:ok shutdown:timeout terminate:not_recovered kill:recovered verify:ok",
            "stage 1.0 (talker) dead: process_exit, heartbeat_lost, gpu_held",
        ],
        [
            OPEN_ID,
            "2025-12-31 23:59:50",
            "enforce",
            "open",
            "-",
            "stage 1.0 (talker) stalled: heartbeat_lost, span_overdue",
        ],
    ]


def test_incidents_share_a_narrow_terminal_between_steps_and_cause(
    watchdog: FakeWatchdog,
) -> None:
    result = invoke(["incidents"], watchdog=watchdog, columns=120)

    assert max(len(line) for line in result.lines) <= 120
    steps, cause = cells(result.lines[1])[4:]
    assert steps.endswith("...") and cause.endswith("...")
    assert abs(len(steps) - len(cause)) <= 1
    # A cell that fits is left whole.
    assert cells(result.lines[2])[4] == "-"


def test_incidents_json(watchdog: FakeWatchdog) -> None:
    listing = invoke(["incidents", "--json"], watchdog=watchdog)
    one = invoke(["incidents", CLOSED_ID, "--json"], watchdog=watchdog)
    assert json.loads(listing.out) == incident_summaries()
    assert json.loads(one.out) == closed_incident()
    assert [r.path for r in watchdog.requests] == ["/v1/incidents", f"/v1/incidents/{CLOSED_ID}"]


def test_one_incident_with_its_timeline_verdicts_steps_and_stacks(
    watchdog: FakeWatchdog,
) -> None:
    result = invoke(["incidents", CLOSED_ID], watchdog=watchdog)

    assert result.code == EXIT_OK, result.err
    assert result.out == (
        f"incident  {CLOSED_ID}\n"
        "cause     stage 1.0 (talker) dead: process_exit, heartbeat_lost, gpu_held\n"
        f"target    {TARGET_URL}\n"
        "mode      enforce\n"
        "outcome   recovered_by_kill\n"
        "opened    2025-12-31 23:50:00 UTC\n"
        "closed    2025-12-31 23:50:08 UTC (+8.50s)\n"
        f"bundle    /state/incidents/{CLOSED_ID} (4 files)\n"
        "\n"
        "timeline (seconds from opened):\n"
        "  -2.04s  first_evidence\n"
        "  -0.01s  verdict\n"
        "  +0.00s  opened\n"
        "  +8.48s  released\n"
        "  +8.50s  closed\n"
        "\n"
        "verdicts:\n"
        "  stage 1.0  dead  at -0.01s\n"
        "      process_exit: engine pid 4305 (VLLM::EngineCore) exited\n"
        "      heartbeat_lost: no heartbeat for 2.5s\n"
        "  stage 2.0  stalled  at +0.49s\n"
        "      cause spinning (not advancing): pid 4401: thread 4401 at 100% CPU in the same"
        " frames 3 samples running: forward (/models/tiny.py:12)\n"
        "      progress_flat: no progress for 11.0s with 1 request in flight\n"
        "\n"
        "steps:\n"
        "  +0.00s  capture   ok in 2.09s: stacks of 2/2 live processes\n"
        "  +2.10s  shutdown  timeout in 1.00s: no answer from"
        " http://127.0.0.1:8091/admin/shutdown in 1s\n"
        "  +3.10s  kill      recovered in 0.02s\n"
        "\n"
        "top stack frames:\n"
        "  pid 4301  VLLM::stage-1  (stage, stage 1.0)\n"
        '    Thread 4301 (idle): "MainThread"\n'
        "        wait (threading.py:355)\n"
        "        get (queue.py:171)\n"
        "        frame_3 (engine.py:30)\n"
        "        frame_4 (engine.py:40)\n"
        "        frame_5 (engine.py:50)\n"
        "        frame_6 (engine.py:60)\n"
        "        frame_7 (engine.py:70)\n"
        "        frame_8 (engine.py:80)\n"
        "        ... 2 more frames\n"
        '    Thread 4320 (active): "output_thread"\n'
        "        recv (socket.py:12)\n"
        "        run (zmq_loop.py:44)\n"
        "  pid 4000  vllm serve  (api)\n"
        + "".join(f"    line {n}: Error: Permission Denied\n" for n in range(1, 9))
    )
    assert [r.path for r in watchdog.requests] == [
        f"/v1/incidents/{CLOSED_ID}",
        f"/v1/incidents/{CLOSED_ID}/stacks",
    ]


@pytest.mark.parametrize(
    "odd", [10**400, float("nan"), "yesterday", True, [1.0]], ids=lambda odd: repr(odd)[:24]
)
def test_an_odd_number_in_an_incident_costs_only_its_own_field(
    watchdog: FakeWatchdog, odd: Any
) -> None:
    """The same tolerant reading as the HTML report's: an integer beyond any float, NaN or
    a value of the wrong type in any time is shown as unknown, and the rest as it is."""
    incident = closed_incident()
    incident.update(opened=odd, closed=odd, opened_monotonic=odd)
    incident["timeline"]["verdict"] = odd
    incident["verdicts"][1]["time"] = odd
    incident["steps"][1].update(started=odd, duration=odd)
    watchdog.incident = incident
    result = invoke(["incidents", CLOSED_ID], watchdog=watchdog)

    assert result.code == EXIT_OK, result.err
    assert "opened    -" in result.lines and "closed    still open" in result.lines
    assert "  stage 1.0  dead" in result.lines and "  stage 2.0  stalled" in result.lines
    # No opening, no offsets; the step whose duration is odd shows none.
    shutdown = "    shutdown  timeout: no answer from http://127.0.0.1:8091/admin/shutdown in 1s"
    assert shutdown in result.lines


def test_an_incident_from_a_watchdog_that_did_not_read_its_monotonic_clock(
    watchdog: FakeWatchdog,
) -> None:
    """Its verdicts have no time from the opening, rather than one guessed from the
    timeline's; the timeline itself is wall-clock times and shown as ever."""
    del watchdog.incident["opened_monotonic"]
    result = invoke(["incidents", CLOSED_ID], watchdog=watchdog)

    assert result.code == EXIT_OK, result.err
    assert "  stage 1.0  dead" in result.lines and "  stage 2.0  stalled" in result.lines
    assert "  -0.01s  verdict" in result.lines


def test_an_incident_without_stacks_is_shown_all_the_same(watchdog: FakeWatchdog) -> None:
    watchdog.stacks = False
    result = invoke(["incidents", CLOSED_ID], watchdog=watchdog)

    assert result.code == EXIT_OK, result.err
    assert result.lines[-2:] == ["top stack frames:", "  not available: HTTP 404: 404: Not Found"]
    assert result.lines[0] == f"incident  {CLOSED_ID}"


def test_top_frames_of_a_dump_without_threads_and_of_nothing() -> None:
    assert top_frames("") == []
    assert top_frames("Error: Failed to find python version from target process") == [
        "Error: Failed to find python version from target process"
    ]
    # Escape sequences in a dump never reach the terminal.
    assert top_frames('Thread 1 (idle): "x\x1b[2J"\n    f (a.py:1)\n') == [
        'Thread 1 (idle): "x [2J"',
        "    f (a.py:1)",
    ]


def test_an_unknown_incident_prints_the_watchdogs_reason(watchdog: FakeWatchdog) -> None:
    result = invoke(["incidents", "20200101T000000Z-000000"], watchdog=watchdog)
    assert result.code == EXIT_FAILED
    assert result.out == ""
    assert result.err == "omni-watchdog incidents: HTTP 404: no such incident\n"


def test_an_incident_id_that_is_no_id_is_not_sent(watchdog: FakeWatchdog) -> None:
    result = invoke(["incidents", "../status"], watchdog=watchdog)
    assert result.code == EXIT_USAGE
    assert "not an incident id" in result.err
    assert watchdog.requests == []


# remediate


def test_remediate_with_yes_sends_the_token_and_the_body(watchdog: FakeWatchdog) -> None:
    result = invoke(
        ["remediate", "--incident", OPEN_ID, "--from", "shutdown", "--yes"], watchdog=watchdog
    )

    assert result.code == EXIT_OK, result.err
    assert result.prompts == []
    (post,) = watchdog.requests
    assert (post.method, post.path) == ("POST", "/v1/remediate")
    assert post.headers["Authorization"] == f"Bearer {TOKEN}"
    assert post.body == {"incident": OPEN_ID, "from": "shutdown"}
    assert result.lines == [
        f"ladder started: incident {OPEN_ID} (mode enforce)",
        "planned steps: shutdown terminate kill verify",
        f"follow it with: omni-watchdog incidents {OPEN_ID}",
    ]


@pytest.mark.parametrize("answer", ["y", "Y", " yes ", "YES"])
def test_remediate_asks_on_a_terminal_and_goes_on_yes(watchdog: FakeWatchdog, answer: str) -> None:
    result = invoke(["remediate"], watchdog=watchdog, terminal=True, answer=answer)

    assert result.code == EXIT_OK, result.err
    assert result.prompts == [f"Run the ladder now on {TARGET_URL} (mode enforce)? [y/N] "]
    assert [(r.method, r.path) for r in watchdog.requests] == [
        ("GET", "/v1/status"),
        ("POST", "/v1/remediate"),
    ]
    assert watchdog.requests[1].body == {"incident": None, "from": None}
    assert "planned steps: capture shutdown terminate kill verify" in result.lines


@pytest.mark.parametrize("answer", ["n", "", "no", "yep", EOFError(), KeyboardInterrupt()])
def test_remediate_declined_at_the_prompt_sends_nothing(
    watchdog: FakeWatchdog, answer: str | BaseException
) -> None:
    result = invoke(["remediate"], watchdog=watchdog, terminal=True, answer=answer)

    assert result.code == EXIT_FAILED
    assert "not confirmed" in result.err
    assert watchdog.sent("POST") == []


def test_remediate_off_a_terminal_needs_yes(watchdog: FakeWatchdog) -> None:
    result = invoke(["remediate"], watchdog=watchdog, terminal=False)

    assert result.code == EXIT_USAGE
    assert "--yes" in result.err
    assert result.prompts == []
    assert watchdog.requests == []


def test_remediate_from_must_be_a_ladder_step() -> None:
    with pytest.raises(SystemExit) as stopped:
        parse(["remediate", "--from", "reboot"])
    assert stopped.value.code == EXIT_USAGE


@pytest.mark.parametrize(
    ("server_token", "environ", "conflict", "expected"),
    [
        (
            TOKEN,
            {TOKEN_VARIABLE: "wrong-token"},
            "",
            "HTTP 401: missing or wrong operator token",
        ),
        (
            TOKEN,
            {},
            "",
            f"HTTP 401: missing or wrong operator token ({TOKEN_VARIABLE} is not set)",
        ),
        (
            "",
            {TOKEN_VARIABLE: TOKEN},
            "",
            "HTTP 403: operator actions are off:"
            " start the watchdog with OMNI_WATCHDOG_OPERATOR_TOKEN",
        ),
        (TOKEN, {TOKEN_VARIABLE: TOKEN}, "a ladder is already running", "HTTP 409: a ladder"),
    ],
)
def test_refusals_print_the_watchdogs_reason(
    watchdog: FakeWatchdog,
    server_token: str,
    environ: dict[str, str],
    conflict: str,
    expected: str,
) -> None:
    watchdog.token, watchdog.conflict = server_token, conflict
    result = invoke(["remediate", "--yes"], watchdog=watchdog, environ=environ)

    assert result.code == EXIT_FAILED
    assert result.out == ""
    assert result.err.startswith(f"omni-watchdog remediate: {expected}")
    (post,) = watchdog.requests
    if TOKEN_VARIABLE in environ:
        assert post.headers["Authorization"] == f"Bearer {environ[TOKEN_VARIABLE]}"
    else:
        assert "Authorization" not in post.headers


# pause and resume


def test_pause_sends_seconds_and_reason_and_prints_the_end(watchdog: FakeWatchdog) -> None:
    result = invoke(["pause", "--for", "30m", "--reason", " driver upgrade "], watchdog=watchdog)

    assert result.code == EXIT_OK, result.err
    (post,) = watchdog.requests
    assert (post.method, post.path) == ("POST", "/v1/pause")
    assert post.headers["Authorization"] == f"Bearer {TOKEN}"
    assert post.body == {"seconds": 1800.0, "reason": "driver upgrade"}
    assert result.lines[0] == "paused until 2026-01-01 00:30:00 UTC (for 30m00s): driver upgrade"


@pytest.mark.parametrize(
    ("text", "seconds"), [("90s", 90.0), ("30m", 1800.0), ("2h", 7200.0), ("24h", 86400.0)]
)
def test_pause_durations(text: str, seconds: float) -> None:
    assert pause_seconds(text) == seconds


@pytest.mark.parametrize("text", ["0s", "0", "-5m", "86401s", "25h", "soon", ""])
def test_pause_rejects_durations_out_of_bounds(watchdog: FakeWatchdog, text: str) -> None:
    result = invoke(["pause", f"--for={text}", "--reason", "x"], watchdog=watchdog)

    assert result.code == EXIT_USAGE
    assert result.err.startswith("omni-watchdog pause: --for:")
    assert watchdog.requests == []


def test_pause_needs_a_reason(watchdog: FakeWatchdog) -> None:
    result = invoke(["pause", "--for", "1h", "--reason", "  "], watchdog=watchdog)
    assert result.code == EXIT_USAGE
    assert watchdog.requests == []


def test_resume(watchdog: FakeWatchdog) -> None:
    result = invoke(["resume"], watchdog=watchdog)

    assert result.code == EXIT_OK, result.err
    assert result.out == "resumed\n"
    (post,) = watchdog.requests
    assert (post.method, post.path) == ("POST", "/v1/resume")
    assert post.headers["Authorization"] == f"Bearer {TOKEN}"


# report


def test_report_writes_the_page_to_a_file(watchdog: FakeWatchdog, tmp_path: Path) -> None:
    page = tmp_path / "incident.html"
    result = invoke(["report", CLOSED_ID, "--html", str(page)], watchdog=watchdog)

    assert result.code == EXIT_OK, result.err
    assert page.read_bytes() == REPORT_PAGE
    assert result.out == f"wrote {page} ({len(REPORT_PAGE)} bytes)\n"
    assert [r.path for r in watchdog.requests] == [f"/v1/incidents/{CLOSED_ID}/report"]


def test_report_to_stdout(watchdog: FakeWatchdog) -> None:
    result = invoke(["report", CLOSED_ID, "--html", "-"], watchdog=watchdog)
    assert result.code == EXIT_OK
    assert result.out == REPORT_PAGE.decode()


def test_report_of_an_unknown_incident_writes_nothing(
    watchdog: FakeWatchdog, tmp_path: Path
) -> None:
    page = tmp_path / "incident.html"
    result = invoke(["report", OPEN_ID, "--html", str(page)], watchdog=watchdog)

    assert result.code == EXIT_FAILED
    assert result.err == "omni-watchdog report: HTTP 404: no such incident\n"
    assert not page.exists()


def test_report_into_a_missing_directory(watchdog: FakeWatchdog, tmp_path: Path) -> None:
    page = tmp_path / "missing" / "incident.html"
    result = invoke(["report", CLOSED_ID, "--html", str(page)], watchdog=watchdog)
    assert result.code == EXIT_FAILED
    assert f"cannot write {page}" in result.err


# where the watchdog is


@pytest.mark.parametrize("command", [["status"], ["incidents"], ["resume"], ["remediate", "--yes"]])
def test_an_unreachable_watchdog_exits_3_naming_the_url(command: list[str]) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    result = invoke([*command, "--watchdog", url])

    assert result.code == EXIT_UNREACHABLE
    assert result.out == ""
    assert f"cannot reach the watchdog at {url}" in result.err
    assert "connection refused" in result.err
    assert "`omni-watchdog run` must be running there" in result.err


def test_a_watchdog_that_does_not_answer_times_out() -> None:
    # A listening socket nobody accepts from: the connection is made, no answer comes.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        result = invoke(["status", "--watchdog", url, "--timeout", "0.2"])

    assert result.code == EXIT_UNREACHABLE
    assert f"cannot reach the watchdog at {url} (GET /v1/status: no answer within 0.2s)" in (
        result.err
    )


def test_the_address_comes_from_the_environment(watchdog: FakeWatchdog) -> None:
    host_port = watchdog.url.removeprefix("http://")
    result = invoke(["resume"], environ={URL_VARIABLE: host_port, TOKEN_VARIABLE: TOKEN})
    assert result.code == EXIT_OK, result.err
    assert [r.path for r in watchdog.requests] == ["/v1/resume"]

    # --watchdog wins over the environment.
    elsewhere = f"http://127.0.0.1:{closed_port()}"
    result = invoke(["status", "--watchdog", watchdog.url + "/"], environ={URL_VARIABLE: elsewhere})
    assert result.code == EXIT_OK, result.err


def test_the_default_address_is_the_apis_default() -> None:
    parser = argparse.ArgumentParser(prog="omni-watchdog")
    commands = parser.add_subparsers(dest="command", required=True)
    add_commands(commands)
    args = parser.parse_args(["status"])
    assert (args.watchdog, args.timeout) == (None, 5.0)
    help_text = commands.choices["status"].format_help()
    assert "http://127.0.0.1:9464" in help_text
    assert URL_VARIABLE in help_text


@pytest.mark.parametrize("url", ["ftp://127.0.0.1:9464", "http://", "http://host:port"])
def test_a_bad_address_is_a_usage_error(url: str) -> None:
    result = invoke(["status", "--watchdog", url])
    assert result.code == EXIT_USAGE
    assert result.err.startswith(f"omni-watchdog status: --watchdog {url!r}:")

    result = invoke(["status"], environ={URL_VARIABLE: url})
    assert result.code == EXIT_USAGE
    assert result.err.startswith(f"omni-watchdog status: {URL_VARIABLE} {url!r}:")


def test_status_says_where_each_stage_runs_when_one_is_remote(watchdog: FakeWatchdog) -> None:
    watchdog.status["stages"][0]["host"] = "gpu-a"
    watchdog.status["stages"][1].update(host="gpu-b", remote=True)
    watchdog.status["link"] = None
    result = invoke(["status"], watchdog=watchdog, columns=200)
    table = result.lines[5:]
    assert cells(table[0])[:5] == ["STAGE", "REPLICA", "NAME", "HOST", "STATE"]
    assert cells(table[1])[3] == "gpu-a"
    assert cells(table[2])[3:5] == ["gpu-b (remote)", "stalled"]


def test_status_of_a_headless_stage_shows_its_master_link(watchdog: FakeWatchdog) -> None:
    watchdog.status["link"] = {
        "address": "head.svc",
        "port": 29500,
        "up": False,
        "since": NOW - 12,
        "detail": "master head.svc:29500 refused the connection",
    }
    result = invoke(["status"], watchdog=watchdog)
    assert (
        "master    head.svc:29500  DOWN for 12s: master head.svc:29500 refused the connection"
        in result.lines
    )


def test_status_says_what_a_silent_stage_is_doing(watchdog: FakeWatchdog) -> None:
    watchdog.status["stages"][1].update(
        state="degraded",
        cause={
            "cause": "compiling",
            "since": None,
            "seconds": 42.0,
            "working": True,
            "detail": "g++ pid 123 at 98% CPU",
        },
    )
    result = invoke(["status"], watchdog=watchdog, columns=200)
    table = result.lines[5:]
    assert cells(table[2])[3:6] == ["degraded", "12s", "compiling 42s: g++ pid 123 at 98% CPU"]


def test_status_shows_diffusion_progress_and_request_errors_under_the_table(
    watchdog: FakeWatchdog,
) -> None:
    dit = stage(1, "dit", "healthy", NOW - 60, [], [4301], 0, 0.2)
    dit.update(
        denoising=[
            {"request_id": "img-7", "step": 37, "steps": 50, "step_seconds": 0.2},
            {"request_id": "img-8", "step": 3, "steps": None, "step_seconds": 1.5},
        ],
        seconds_per_step=0.35,
        request_errors=2,
    )
    watchdog.status["stages"] = [dit]
    result = invoke(["status"], watchdog=watchdog)
    assert result.code == EXIT_OK, result.err
    assert result.lines[-4:] == [
        "",
        "stage 1.0 (dit) denoising img-7: step 37/50, 0.35s a step, 0s into this one",
        "stage 1.0 (dit) denoising img-8: step 3/?, 0.35s a step, 1s into this one",
        "stage 1.0 (dit) failed 2 request(s) (request errors, not acted on)",
    ]


# a server that is not the watchdog

HOSTILE_STREAM_CHUNK = b"x" * 2**20


async def _endless(request: web.Request) -> web.StreamResponse:
    """Megabytes for as long as the client reads, and at most well past any bound."""
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    await response.prepare(request)
    for _ in range(MAX_JSON_BYTES // len(HOSTILE_STREAM_CHUNK) * 4):
        await response.write(HOSTILE_STREAM_CHUNK)
    return response


def _answer(status: int, body: bytes, reason: str | None = None) -> Any:
    async def handler(_: web.Request) -> web.Response:
        return web.Response(
            status=status, body=body, reason=reason, content_type="application/json"
        )

    return handler


@pytest.fixture
def hostile(served: LoopInAThread) -> Callable[[Any], str]:
    """Serves one handler at every path, or raw bytes, on a free loopback port; its URL."""

    def serve(handler: Callable[..., Any] | bytes) -> str:
        if isinstance(handler, bytes):
            return served.raw(handler)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler)
        return served.app(app)

    return serve


@pytest.mark.parametrize(
    ("handler", "said"),
    [
        (_endless, "an answer over 16 MiB, not read"),
        (_answer(200, b"[" * 1500 + b"]" * 1500), "did not answer JSON"),
        (_answer(200, b"[1, 2]"), "did not answer a JSON object"),
        (
            b"HTTP/1.1 502 Bad \x1b]0;owned\x07 \xe2\x80\xaegateway\r\nContent-Length: 0\r\n\r\n",
            "HTTP 502",
        ),
    ],
    ids=["endless body", "nested deep", "not an object", "escapes in its reason"],
)
def test_a_server_that_is_not_the_watchdog_gets_one_clean_line_and_a_failure(
    hostile: Callable[[Any], str], handler: Any, said: str
) -> None:
    url = hostile(handler)
    out, err = io.StringIO(), io.StringIO()
    console = Console(
        out=out,
        err=err,
        environ={},
        stdout_is_terminal=True,
        stdin_is_terminal=False,
        ask=lambda prompt: "n",
        columns=120,
        wall=lambda: NOW,
        sleep=asyncio.sleep,
    )
    code = run_command(parse(["status", "--watchdog", url]), console)
    assert code == EXIT_FAILED, (out.getvalue(), err.getvalue())
    message = err.getvalue()
    assert len(message.splitlines()) == 1 and said in message, message
    assert all(c.isprintable() for c in message.rstrip("\n")), message


def test_fields_of_the_wrong_type_are_shown_unknown(hostile: Callable[[Any], str]) -> None:
    """A watchdog of another version, or not one: every field it got wrong is a dash."""
    status = {"stages": [1, {"stage_id": [], "pids": 7, "evidence": "x"}], "target": 5}
    url = hostile(_answer(200, json.dumps({**status, "pause": [], "incident": {}}).encode()))
    result = invoke(["status", "--watchdog", url])
    assert result.code == EXIT_OK, result.err
    assert result.lines[0].startswith("target    -  pid -  down"), result.lines


def test_a_report_to_the_terminal_prints_no_escape(hostile: Callable[[Any], str]) -> None:
    page = "<html>\x1b[2J\x1b]0;owned\x07<pre>\n  kept \u202eindent\n</pre></html>".encode()

    async def report(_: web.Request) -> web.Response:
        return web.Response(body=page, content_type="text/html")

    url = hostile(report)
    result = invoke(["report", CLOSED_ID, "--html", "-", "--watchdog", url])
    assert result.code == EXIT_OK, result.err
    assert not any(c in result.out for c in "\x1b\x07\u202e"), repr(result.out)
    assert "\n  kept  indent\n" in result.out, repr(result.out)
