"""The on-call commands: `status`, `incidents`, `remediate`, `pause`, `resume`, `report`.

Each is a client of a running watchdog's HTTP API (the `--listen` address of
`omni-watchdog run`), so it works from wherever that address is reachable: the watchdog's
own container, a debug pod, an operator's shell through a port-forward. The address is
`--watchdog URL`, else `OMNI_WATCHDOG_URL`, else the API's default, 127.0.0.1:9464. The
mutating commands (`remediate`, `pause`, `resume`) send `OMNI_WATCHDOG_OPERATOR_TOKEN` as
a bearer token; the read commands send nothing.

Exit codes:
    0    done
    1    the watchdog refused or the action failed (HTTP 4xx/5xx, its reason on stderr),
         or a remediation was not confirmed at the prompt
    2    usage error: a bad duration, URL or incident id, or `remediate` off a terminal
         without --yes
    3    the watchdog cannot be reached (connection refused, timeout)
    130  interrupted (Ctrl+C); `status --watch`, which runs until Ctrl+C, exits 0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TextIO
from urllib.parse import urlsplit

import aiohttp

from omni_watchdog.config import parse_duration
from omni_watchdog.http_body import read_at_most

# The watchdog's own bound on one pause, checked here too so that a typo such as
# `--for 30h` is a usage error before anything is sent.
from omni_watchdog.policy.maintenance import MAX_PAUSE_SECONDS
from omni_watchdog.tolerant_json import items, mapping, number
from omni_watchdog.types import PIPELINE, StageRef, StepName

DEFAULT_URL = "http://127.0.0.1:9464"
URL_VARIABLE = "OMNI_WATCHDOG_URL"
TOKEN_VARIABLE = "OMNI_WATCHDOG_OPERATOR_TOKEN"
DEFAULT_TIMEOUT = 5.0
DEFAULT_WATCH_INTERVAL = 2.0
COMMANDS = ("status", "incidents", "remediate", "pause", "resume", "report")
# The commands that change what the watchdog does: only they send the operator token.
MUTATING_COMMANDS = ("remediate", "pause", "resume")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_INTERRUPTED = 130

# The most of an answer read: a watchdog's JSON is kilobytes, its largest report a few
# megabytes; a server that sends more is not one (measured: 3.5 GB read in 5.7 s).
MAX_JSON_BYTES = 16 * 2**20
MAX_REPORT_BYTES = 64 * 2**20

# Frames shown per thread of a process's stack dump: the innermost ones say where it waits.
STACK_FRAMES = 8
# The evidence and cause columns are cut to what the terminal leaves them, but not below
# this: a column of a few characters says nothing.
MIN_FLEXIBLE_WIDTH = 16
PIDS_SHOWN = 3

_MIB = 1024 * 1024
_CLEAR_SCREEN = "\x1b[H\x1b[2J"
_RESET = "\x1b[0m"
_GREEN, _YELLOW, _RED, _DIM = "32", "33", "31", "2"
_STATE_COLOURS = {
    "healthy": _GREEN,
    "degraded": _YELLOW,
    "stalled": _RED,
    "dead": _RED,
    "starting": _DIM,
    "unknown": _DIM,
}
# Incident ids are made by the watchdog (`20250101T120000Z-0a1b2c`); anything else would be
# spliced into the request path, so it is refused before it is sent.
_INCIDENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_CONFIRMED = ("y", "yes")


@dataclass(frozen=True)
class Console:
    """Where a command's input and output go; `system()` is the real terminal."""

    out: TextIO
    err: TextIO
    environ: Mapping[str, str]
    stdout_is_terminal: bool = False
    stdin_is_terminal: bool = False
    ask: Callable[[str], str] = input
    columns: int = 120
    wall: Callable[[], float] = time.time
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep

    @classmethod
    def system(cls) -> Console:
        return cls(
            out=sys.stdout,
            err=sys.stderr,
            environ=os.environ,
            stdout_is_terminal=sys.stdout.isatty(),
            stdin_is_terminal=sys.stdin.isatty(),
            columns=shutil.get_terminal_size((120, 24)).columns,
        )

    @property
    def colour(self) -> bool:
        # https://no-color.org: any non-empty NO_COLOR turns colours off.
        return self.stdout_is_terminal and not self.environ.get("NO_COLOR")

    def say(self, line: str = "") -> None:
        self.out.write(line + "\n")


class _Failed(Exception):
    """The watchdog refused, or the action failed: exit 1."""


class _Refused(_Failed):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"HTTP {status}: {reason}" if reason else f"HTTP {status}")
        self.status = status


class _Usage(Exception):
    """The command line asks for something that cannot be done: exit 2."""


class _Unreachable(Exception):
    """No answer from the watchdog: exit 3."""


# The parser


def _seconds(text: str) -> float:
    try:
        seconds = parse_duration(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"expected more than 0 seconds, got {text!r}")
    return seconds


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the on-call commands to `omni-watchdog`'s subcommands; `run_command` runs one."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--watchdog",
        metavar="URL",
        help=(
            "the watchdog's API address, as `omni-watchdog run --listen` serves it"
            f" (default ${URL_VARIABLE}, else {DEFAULT_URL})"
        ),
    )
    common.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=_seconds,
        default=DEFAULT_TIMEOUT,
        help=f"how long to wait for each answer (default {DEFAULT_TIMEOUT:g})",
    )

    def add(name: str, summary: str) -> argparse.ArgumentParser:
        parser = commands.add_parser(name, parents=[common], help=summary, description=summary)
        parser.set_defaults(oncall_command=name)
        return parser

    status = add("status", "the target and every stage, as the running watchdog judges them")
    status.add_argument(
        "--watch",
        nargs="?",
        const=DEFAULT_WATCH_INTERVAL,
        type=_seconds,
        metavar="SECONDS",
        help=f"refresh every SECONDS (default {DEFAULT_WATCH_INTERVAL:g}) until Ctrl+C",
    )
    status.add_argument("--json", action="store_true", help="print /v1/status as JSON")

    incidents = add("incidents", "the incidents, or one incident with its top stack frames")
    incidents.add_argument("incident", nargs="?", metavar="ID", help="the incident to show")
    incidents.add_argument("--json", action="store_true", help="print the API's JSON")

    remediate = add("remediate", "run the remediation ladder now (asks first on a terminal)")
    remediate.add_argument(
        "--incident",
        metavar="ID",
        help="approve the plan of this dry-run or observe incident (default: a new"
        " incident on the server attached now)",
    )
    remediate.add_argument(
        "--from",
        dest="from_step",
        choices=[step.value for step in StepName],
        help="the first acting step; the capture always runs (default: the whole ladder)",
    )
    remediate.add_argument("--yes", action="store_true", help="do not ask for confirmation")

    pause = add("pause", "hold the watchdog's actions for a while; detection goes on")
    pause.add_argument(
        "--for",
        dest="duration",
        required=True,
        metavar="DURATION",
        help=f"how long, e.g. 90s, 30m, 2h (at most {MAX_PAUSE_SECONDS / 3600:g}h)",
    )
    pause.add_argument("--reason", required=True, metavar="TEXT", help="why, for the journal")

    add("resume", "end the pause in force")

    report = add("report", "save an incident's self-contained HTML report")
    report.add_argument("incident", metavar="ID", help="the incident")
    report.add_argument(
        "--html", required=True, metavar="FILE", help="where to write it; - for stdout"
    )


def run_command(args: argparse.Namespace, console: Console | None = None) -> int:
    """Run the on-call command `args` names (one `add_commands` added); the exit code."""
    console = Console.system() if console is None else console
    command: str = args.oncall_command
    try:
        return asyncio.run(_run(command, args, console))
    except KeyboardInterrupt:
        # Ctrl+C is how a watch ends; anywhere else it cuts a command short.
        return EXIT_OK if command == "status" and args.watch else EXIT_INTERRUPTED
    except _Usage as error:
        console.err.write(f"omni-watchdog {command}: {error}\n")
        return EXIT_USAGE
    except _Unreachable as error:
        console.err.write(f"omni-watchdog {command}: {error}\n")
        return EXIT_UNREACHABLE
    except _Failed as error:
        console.err.write(f"omni-watchdog {command}: {error}\n")
        return EXIT_FAILED
    except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as error:
        # An answer of the wrong shape, from a server that is not the watchdog or one of
        # another version: one line, never a traceback.
        what = _clean(f"{type(error).__name__}: {error}")[:200]
        console.err.write(f"omni-watchdog {command}: an answer this command cannot read ({what})\n")
        return EXIT_FAILED


async def _run(command: str, args: argparse.Namespace, console: Console) -> int:
    if args.watchdog:
        base_url = _base_url(args.watchdog, "--watchdog")
    else:
        base_url = _base_url(console.environ.get(URL_VARIABLE) or DEFAULT_URL, URL_VARIABLE)
    token = ""
    if command in MUTATING_COMMANDS:
        token = console.environ.get(TOKEN_VARIABLE, "").strip()
        if not (token.isascii() and token.isprintable()):
            raise _Usage(f"{TOKEN_VARIABLE} holds characters an HTTP header cannot carry")
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        client = WatchdogClient(session, base_url, token, args.timeout)
        return await _HANDLERS[command](client, args, console)


def _base_url(text: str, source: str) -> str:
    text = text.strip()
    # `run --listen` takes HOST:PORT; the same value works here.
    if "://" not in text:
        text = "http://" + text
    try:
        parts = urlsplit(text)
        _ = parts.port  # parsing the port is the check: it raises on a bad one
    except ValueError as error:
        raise _Usage(f"{source} {text!r}: {error}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _Usage(f"{source} {text!r}: expected http://HOST:PORT")
    if parts.query or parts.fragment:
        raise _Usage(f"{source} {text!r}: expected no query or fragment")
    return text.rstrip("/")


def _incident_path(incident_id: str, tail: str = "") -> str:
    if not _INCIDENT_ID.fullmatch(incident_id):
        raise _Usage(f"{incident_id!r} is not an incident id (see `omni-watchdog incidents`)")
    return f"/v1/incidents/{incident_id}{tail}"


# The API


class WatchdogClient:
    """The calls the on-call commands make on one watchdog's API."""

    def __init__(
        self, session: aiohttp.ClientSession, base_url: str, token: str, timeout: float
    ) -> None:
        self.base_url = base_url
        self._session = session
        self._token = token
        self._timeout = timeout

    async def get_json(self, path: str) -> Any:
        return self._json(path, await self._call("GET", path))

    async def get_bytes(self, path: str) -> bytes:
        return await self._call("GET", path, accept="text/html", limit=MAX_REPORT_BYTES)

    async def post_json(self, path: str, body: Mapping[str, Any] | None = None) -> Any:
        return self._json(path, await self._call("POST", path, body))

    async def _call(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        accept: str = "application/json",
        limit: int = MAX_JSON_BYTES,
    ) -> bytes:
        headers = {"Accept": accept}
        # Only the mutating routes check the token: the read ones never get to see it.
        if method == "POST" and self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        url = self.base_url + path
        try:
            # A redirect would carry the token somewhere the operator did not name.
            async with self._session.request(
                method,
                url,
                json=None if method == "GET" else dict(body or {}),
                headers=headers,
                allow_redirects=False,
            ) as response:
                data, more = await read_at_most(response, limit)
                status = response.status
                phrase = _clean(response.reason or "")
        except asyncio.TimeoutError:
            raise self._unreachable(method, path, f"no answer within {self._timeout:g}s") from None
        except aiohttp.ClientConnectorError as error:
            refused = isinstance(error.os_error, ConnectionRefusedError)
            why = "connection refused" if refused else error.os_error.strerror or str(error)
            raise self._unreachable(method, path, why) from None
        except aiohttp.ServerDisconnectedError:
            why = "the connection closed before an answer"
            raise self._unreachable(method, path, why) from None
        except aiohttp.ClientConnectionError as error:
            raise self._unreachable(method, path, str(error) or type(error).__name__) from None
        except aiohttp.ClientError as error:
            raise _Failed(f"{method} {url}: {_clean(str(error)) or type(error).__name__}") from None
        if more:
            raise _Failed(
                f"{method} {url}: an answer over {limit // 2**20} MiB, not read:"
                " no watchdog sends one; is that its API address?"
            )
        if not 200 <= status < 300:
            reason = _error_reason(data) or phrase
            if status == 401 and not self._token:
                reason = f"{reason} ({TOKEN_VARIABLE} is not set)".lstrip()
            raise _Refused(status, reason)
        return data

    def _unreachable(self, method: str, path: str, why: str) -> _Unreachable:
        return _Unreachable(
            f"cannot reach the watchdog at {self.base_url} ({method} {path}: {why});"
            " `omni-watchdog run` must be running there: point --watchdog or"
            f" {URL_VARIABLE} at its --listen address"
        )

    def _json(self, path: str, data: bytes) -> Any:
        try:
            return json.loads(data)
        except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
            raise _Failed(
                f"{self.base_url}{path} did not answer JSON: is that the watchdog's API address?"
            ) from None


def _error_reason(data: bytes) -> str:
    """The `error` of a JSON error body; else its first line (aiohttp's own pages)."""
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return _clean(body["error"])
    text = data.decode("utf-8", "replace").strip()
    return _clean(text.splitlines()[0])[:200] if text else ""


# The commands


async def _status(client: WatchdogClient, args: argparse.Namespace, console: Console) -> int:
    if args.watch is None:
        for line in _status_view(await client.get_json("/v1/status"), args.json, console):
            console.say(line)
        return EXIT_OK
    while True:
        try:
            lines = _status_view(await client.get_json("/v1/status"), args.json, console)
        except (_Failed, _Unreachable) as error:
            # A watchdog being restarted comes back: keep watching for it.
            lines = [str(error)]
        # The screen is cleared only once the new view is there: no blank screen while an
        # answer is slow to come.
        if console.stdout_is_terminal:
            console.out.write(_CLEAR_SCREEN)
        for line in [f"every {args.watch:g}s, Ctrl+C to stop", *lines]:
            console.say(line)
        if not console.stdout_is_terminal:
            console.say()
        console.out.flush()
        await console.sleep(args.watch)


def _status_view(status: Any, as_json: bool, console: Console) -> list[str]:
    if as_json:
        return [json.dumps(status, indent=2, sort_keys=True)]
    if not isinstance(status, dict):
        raise _Failed("/v1/status did not answer a JSON object")
    now = number(status.get("now"))
    return _status_lines(status, console, console.wall() if now is None else now)


def _status_lines(status: Mapping[str, Any], console: Console, now: float) -> list[str]:
    target = mapping(status.get("target"))
    pid = target.get("pid")
    up = "up" if target.get("alive") else "down"
    incident = status.get("incident")
    lines = [
        _field("target", f"{_text(target.get('url'))}  pid {_text(pid)}  {up}"),
        _field(
            "mode",
            f"{_text(status.get('mode'))}"
            f"  remediation budget left {_text(status.get('remediation_budget_remaining'))}",
        ),
    ]
    pause = status.get("pause")
    if isinstance(pause, dict):
        until = number(pause.get("until"))
        left = None if until is None else until - now
        lines.append(
            _field(
                "paused",
                f"until {_utc(until)} ({_age(left)} left): {_text(pause.get('reason'))}",
            )
        )
    link = status.get("link")
    if isinstance(link, dict):
        state = "up" if link.get("up") else "DOWN"
        since = number(link.get("since"))
        lines.append(
            _field(
                "master",
                f"{_text(link.get('address'))}:{_text(link.get('port'))}  {state}"
                f" for {_age(None if since is None else now - since)}: {_text(link.get('detail'))}",
            )
        )
    lines.append(_field("incident", "none" if incident is None else _text(incident)))
    pipeline = status.get("pipeline")
    if isinstance(pipeline, dict):
        # The target fails and no stage's own readings answer for it: said once, here,
        # rather than as every stage's state.
        since = number(pipeline.get("since"))
        evidence = [mapping(e) for e in items(pipeline.get("evidence"))]
        lines.append(
            _field(
                "target",
                f"{_text(pipeline.get('state'))}, stage unknown,"
                f" for {_age(None if since is None else now - since)}: {_why(None, evidence)}",
            )
        )
    lines.append("")
    stages = [mapping(stage) for stage in items(status.get("stages"))]
    if not stages:
        lines.append("no stage judged yet")
        return lines
    rows: list[list[_Cell | str]] = []
    for stage in stages:
        state = _text(stage.get("state"))
        since = number(stage.get("since"))
        evidence = [mapping(e) for e in items(stage.get("evidence"))]
        pids = [_text(p) for p in items(stage.get("pids"))]
        shown_pids = ",".join(pids[:PIDS_SHOWN]) + (
            f" +{len(pids) - PIDS_SHOWN}" if len(pids) > PIDS_SHOWN else ""
        )
        gpu = number(stage.get("gpu_memory_bytes"))
        rows.append(
            [
                _text(stage.get("stage_id")),
                _text(stage.get("replica")),
                _text(stage.get("name")),
                _Cell(state, _STATE_COLOURS.get(state, "")),
                _age(None if since is None else now - since),
                _why(stage.get("cause"), evidence),
                shown_pids or "-",
                "-" if gpu is None else f"{gpu / _MIB:.0f}",
                _heartbeat_age(number(stage.get("heartbeat_age_seconds"))),
            ]
        )
    columns: tuple[_Column, ...] = (
        _Column("STAGE", right=True),
        _Column("REPLICA", right=True),
        _Column("NAME"),
        _Column("STATE"),
        _Column("SINCE", right=True),
        _Column("EVIDENCE", flexible=True),
        _Column("PIDS"),
        _Column("GPU MiB", right=True),
        _Column("HEARTBEAT", right=True),
    )
    if any(stage.get("remote") for stage in stages):
        # Stages on several hosts: a remote one is its own host's watchdog's to act on, so
        # the table says where to go. On one host the column would only repeat its name.
        columns = (*columns[:3], _Column("HOST"), *columns[3:])
        for row, stage in zip(rows, stages, strict=True):
            row.insert(3, _text(stage.get("host")) + (" (remote)" if stage.get("remote") else ""))
    lines.extend(_table(columns, rows, console.columns, console.colour))
    lines.extend(_stage_notes(stages))
    return lines


def _stage_notes(stages: list[Mapping[str, Any]]) -> list[str]:
    """Under the table: each request a diffusion stage is denoising, at its step and pace,
    and the requests a stage failed (request errors, not a stopped stage)."""
    notes: list[str] = []
    for stage in stages:
        name = f"stage {_text(stage.get('stage_id'))}.{_text(stage.get('replica'))}"
        name += f" ({_text(stage.get('name'))})"
        pace = number(stage.get("seconds_per_step"))
        for request in items(stage.get("denoising")):
            request = mapping(request)
            steps = number(request.get("steps"))
            in_step = number(request.get("step_seconds"))
            notes.append(
                f"{name} denoising {_text(request.get('request_id'))}:"
                f" step {_text(request.get('step'))}/{'?' if steps is None else f'{steps:.0f}'},"
                f" {'?' if pace is None else f'{pace:.2f}'}s a step,"
                f" {_age(in_step)} into this one"
            )
        errors = number(stage.get("request_errors"))
        if errors:
            notes.append(f"{name} failed {errors:.0f} request(s) (request errors, not acted on)")
    return ["", *notes] if notes else []


def _why(cause: Any, evidence: list[Mapping[str, Any]]) -> str:
    """What a stage's row says of it: what it is doing while silent, else its first
    evidence."""
    if isinstance(cause, dict):
        seconds = number(cause.get("seconds"))
        return f"{_text(cause.get('cause'))} {_age(seconds)}: {_text(cause.get('detail'))}"
    return _text(evidence[0].get("detail")) if evidence else "-"


def _cause_text(cause: dict[str, Any]) -> str:
    working = "advancing" if cause.get("working") else "not advancing"
    return f"{_text(cause.get('cause'))} ({working}): {_text(cause.get('detail'))}"


async def _incidents(client: WatchdogClient, args: argparse.Namespace, console: Console) -> int:
    if args.incident is None:
        listing = await client.get_json("/v1/incidents")
        if args.json:
            console.say(json.dumps(listing, indent=2, sort_keys=True))
            return EXIT_OK
        incidents = [mapping(i) for i in items(mapping(listing).get("incidents"))]
        if not incidents:
            console.say("no incidents")
            return EXIT_OK
        for line in _incident_table(incidents, console):
            console.say(line)
        return EXIT_OK
    path = _incident_path(args.incident)
    incident = await client.get_json(path)
    if args.json:
        console.say(json.dumps(incident, indent=2, sort_keys=True))
        return EXIT_OK
    try:
        stacks = mapping(await client.get_json(path + "/stacks")).get("stacks")
        stacks, stacks_error = (stacks if isinstance(stacks, list) else []), ""
    except (_Failed, _Unreachable) as error:
        # The incident itself came back; its stacks are a part of it worth losing alone.
        stacks, stacks_error = [], str(error)
    for line in _incident_lines(mapping(incident), stacks, stacks_error):
        console.say(line)
    return EXIT_OK


def _incident_table(incidents: Sequence[Mapping[str, Any]], console: Console) -> list[str]:
    rows = []
    for incident in incidents:
        steps = " ".join(
            f"{_text(s.get('step'))}:{_text(s.get('outcome'))}"
            for s in (mapping(s) for s in items(incident.get("steps")))
        )
        opened = number(incident.get("opened"))
        rows.append(
            [
                _text(incident.get("incident_id")),
                _utc(opened, zone=False),
                _text(incident.get("mode")),
                _text(incident.get("outcome")),
                steps or "-",
                _text(incident.get("cause")),
            ]
        )
    columns = (
        _Column("ID"),
        _Column("OPENED (UTC)"),
        _Column("MODE"),
        _Column("OUTCOME"),
        _Column("STEPS", flexible=True),
        _Column("CAUSE", flexible=True),
    )
    return _table(columns, rows, console.columns, console.colour)


def _incident_lines(
    incident: Mapping[str, Any], stacks: Sequence[Any], stacks_error: str
) -> list[str]:
    opened = number(incident.get("opened"))
    closed = number(incident.get("closed"))

    def offset(wall: float | None) -> str:
        return "" if wall is None or opened is None else f"{wall - opened:+.2f}s"

    outcome = _text(incident.get("outcome"))
    if incident.get("crashed"):
        outcome += " (the server crashed)"
    files = incident.get("files")
    bundle = _text(incident.get("bundle_dir"))
    if isinstance(files, list):
        bundle += f" ({len(files)} files)"
    lines = [
        _field("incident", _text(incident.get("incident_id"))),
        _field("cause", _text(incident.get("cause"))),
        _field("target", _text(incident.get("target"))),
        _field("mode", _text(incident.get("mode"))),
        _field("outcome", outcome),
        _field("opened", _utc(opened)),
        _field("closed", "still open" if closed is None else f"{_utc(closed)} ({offset(closed)})"),
        _field("bundle", bundle),
    ]
    timeline = sorted(
        (wall, _clean(str(name)))
        for name, value in mapping(incident.get("timeline")).items()
        if (wall := number(value)) is not None
    )
    if timeline:
        lines += ["", "timeline (seconds from opened):"]
        marks = [(offset(wall), name) for wall, name in timeline]
        width = max(len(mark) for mark, _ in marks)
        lines += [f"  {mark:>{width}}  {name}" for mark, name in marks]

    verdicts = [mapping(v) for v in items(incident.get("verdicts"))]
    if verdicts:
        lines += ["", "verdicts:"]
        # Verdict times are the watchdog's monotonic seconds, and the incident read that
        # clock as it opened; an older watchdog's incident did not, and shows none.
        opened_monotonic = number(incident.get("opened_monotonic"))
        for verdict in verdicts:
            stage = mapping(verdict.get("stage"))
            when = ""
            verdict_time = number(verdict.get("time"))
            if opened_monotonic is not None and verdict_time is not None:
                when = f"  at {verdict_time - opened_monotonic:+.2f}s"
            stage_id = stage.get("stage_id")
            if isinstance(stage_id, int) and StageRef(stage_id).whole_pipeline:
                subject = f"target ({PIPELINE}, stage unknown)"
            else:
                subject = f"stage {_text(stage_id)}.{_text(stage.get('replica'))}"
            lines.append(f"  {subject}  {_text(verdict.get('state'))}{when}")
            cause = verdict.get("cause")
            if isinstance(cause, dict):
                lines.append(f"      cause {_cause_text(cause)}")
            for evidence in (mapping(e) for e in items(verdict.get("evidence"))):
                kind, detail = _text(evidence.get("kind")), _text(evidence.get("detail"))
                lines.append(f"      {kind}: {detail}")

    steps = [mapping(s) for s in items(incident.get("steps"))]
    if steps:
        lines += ["", "steps:"]
        starts = [offset(number(s.get("started"))) for s in steps]
        start_width = max(len(start) for start in starts)
        name_width = max(len(_text(s.get("step"))) for s in steps)
        for step, start in zip(steps, starts, strict=True):
            duration = number(step.get("duration"))
            took = "" if duration is None else f" in {duration:.2f}s"
            detail = _text(step.get("detail"), empty="")
            lines.append(
                f"  {start:>{start_width}}  {_text(step.get('step')):<{name_width}}"
                f"  {_text(step.get('outcome'))}{took}{': ' + detail if detail else ''}"
            )

    lines += ["", "top stack frames:"]
    if stacks_error:
        lines.append(f"  not available: {stacks_error}")
    elif not stacks:
        lines.append("  none captured")
    for stack in (mapping(s) for s in stacks):
        where = _text(stack.get("role"))
        if stack.get("stage") is not None:
            where += f", stage {_text(stack.get('stage'))}"
        lines.append(f"  pid {_text(stack.get('pid'))}  {_text(stack.get('title'))}  ({where})")
        frames = top_frames(str(stack.get("text") or ""))
        lines += [f"    {frame}" for frame in frames] if frames else ["    (empty)"]
    return lines


def top_frames(text: str, limit: int = STACK_FRAMES) -> list[str]:
    """Each thread's header and its first `limit` frames, of a `py-spy dump` output.

    py-spy prints a process header, then per thread a `Thread <id> (<state>): "<name>"`
    line and one indented `function (file:line)` line per frame, innermost first; with
    --locals, deeper-indented argument and variable lines follow a frame. Text in no such
    shape (an error of py-spy, another tool) is shown by its first `limit` lines.
    """
    lines = [_clean(line, keep_indent=True) for line in text.splitlines()]
    if not any(line.startswith("Thread ") for line in lines):
        return [line for line in lines if line.strip()][:limit]
    shown: list[str] = []
    in_thread = False
    indent: int | None = None
    frames = 0

    def more() -> None:
        if frames > limit:
            shown.append(f"{' ' * (indent or 4)}... {frames - limit} more frames")

    for line in lines:
        if line.startswith("Thread "):
            more()
            shown.append(line)
            in_thread, indent, frames = True, None, 0
            continue
        depth = len(line) - len(line.lstrip())
        if not in_thread or not line.strip():
            continue
        if depth == 0:
            # Something after the threads (a py-spy warning): the thread has ended.
            more()
            in_thread, frames = False, 0
            continue
        indent = depth if indent is None else indent
        if depth != indent:
            continue
        frames += 1
        if frames <= limit:
            shown.append(line)
    more()
    return shown


async def _remediate(client: WatchdogClient, args: argparse.Namespace, console: Console) -> int:
    if args.incident is not None:
        _incident_path(args.incident)  # checks the id before anything is asked or sent
    if not args.yes:
        if not (console.stdin_is_terminal and console.stdout_is_terminal):
            raise _Usage("not on a terminal, nobody to ask: pass --yes to run the ladder")
        status = mapping(await client.get_json("/v1/status"))
        url = _text(mapping(status.get("target")).get("url"))
        question = f"Run the ladder now on {url} (mode {_text(status.get('mode'))})? [y/N] "
        try:
            answer = console.ask(question)
        except (EOFError, KeyboardInterrupt):
            answer = ""
            console.say()
        if answer.strip().lower() not in _CONFIRMED:
            raise _Failed("not confirmed; nothing was done")
    started = mapping(
        await client.post_json("/v1/remediate", {"incident": args.incident, "from": args.from_step})
    )
    incident_id = _text(started.get("incident_id"))
    steps = " ".join(_text(step) for step in items(started.get("steps")))
    console.say(f"ladder started: incident {incident_id} (mode {_text(started.get('mode'))})")
    console.say(f"planned steps: {steps or 'none'}")
    console.say(f"follow it with: omni-watchdog incidents {incident_id}")
    return EXIT_OK


def pause_seconds(text: str) -> float:
    """Seconds of a `pause --for` duration; ValueError unless more than 0 and at most 24h."""
    seconds = parse_duration(text)
    if not 0 < seconds <= MAX_PAUSE_SECONDS:
        raise ValueError(
            f"a pause lasts more than 0s and at most {MAX_PAUSE_SECONDS / 3600:g}h, got {text!r}"
        )
    return seconds


async def _pause(client: WatchdogClient, args: argparse.Namespace, console: Console) -> int:
    try:
        seconds = pause_seconds(args.duration)
    except ValueError as error:
        raise _Usage(f"--for: {error}") from None
    reason = args.reason.strip()
    if not reason:
        raise _Usage("--reason: say why, for whoever finds the watchdog paused")
    answer = mapping(await client.post_json("/v1/pause", {"seconds": seconds, "reason": reason}))
    pause = mapping(answer.get("pause"))
    until, since = number(pause.get("until")), number(pause.get("since"))
    length = seconds if until is None or since is None else until - since
    console.say(f"paused until {_utc(until)} (for {_age(length)}): {_text(pause.get('reason'))}")
    console.say("detection and alerts go on; remediation waits for the end or `resume`")
    return EXIT_OK


async def _resume(client: WatchdogClient, args: argparse.Namespace, console: Console) -> int:
    await client.post_json("/v1/resume")
    console.say("resumed")
    return EXIT_OK


async def _report(client: WatchdogClient, args: argparse.Namespace, console: Console) -> int:
    page = await client.get_bytes(_incident_path(args.incident, "/report"))
    if args.html == "-":
        # To a terminal, perhaps: the page's text as it prints, never a raw escape.
        lines = page.decode("utf-8", "replace").splitlines()
        console.out.write("".join(_clean(line, keep_indent=True) + "\n" for line in lines))
        return EXIT_OK
    try:
        with open(args.html, "wb") as file:
            file.write(page)
    except OSError as error:
        raise _Failed(f"cannot write {args.html}: {error.strerror or error}") from None
    console.say(f"wrote {args.html} ({len(page)} bytes)")
    return EXIT_OK


_HANDLERS: dict[str, Callable[[WatchdogClient, argparse.Namespace, Console], Awaitable[int]]] = {
    "status": _status,
    "incidents": _incidents,
    "remediate": _remediate,
    "pause": _pause,
    "resume": _resume,
    "report": _report,
}


# Text


class _Cell(NamedTuple):
    text: str
    colour: str = ""  # an SGR code, shown only where colours are on


class _Column(NamedTuple):
    title: str
    right: bool = False  # numbers line up on the right
    flexible: bool = False  # cut to the room the other columns leave


def _table(
    columns: Sequence[_Column],
    rows: Sequence[Sequence[_Cell | str]],
    width: int,
    colour: bool,
) -> list[str]:
    """Rows under their titles, each column as wide as its widest cell, two spaces apart."""
    cells = [[cell if isinstance(cell, _Cell) else _Cell(cell) for cell in row] for row in rows]
    widths = [
        max([len(column.title)] + [len(row[i].text) for row in cells])
        for i, column in enumerate(columns)
    ]
    flexible = [i for i, column in enumerate(columns) if column.flexible]
    room = (
        width - 2 * (len(columns) - 1) - sum(w for i, w in enumerate(widths) if i not in flexible)
    )
    # Narrowest first: what a short column does not need goes to the wider ones.
    for count, i in enumerate(sorted(flexible, key=lambda i: widths[i])):
        widths[i] = min(widths[i], max(room // (len(flexible) - count), MIN_FLEXIBLE_WIDTH))
        room -= widths[i]

    def line(row: Sequence[_Cell]) -> str:
        parts = []
        for column, cell, cell_width in zip(columns, row, widths, strict=True):
            text = _cut(cell.text, cell_width)
            padding = " " * (cell_width - len(text))
            if colour and cell.colour:
                text = f"\x1b[{cell.colour}m{text}{_RESET}"
            parts.append(padding + text if column.right else text + padding)
        return "  ".join(parts).rstrip()

    titles = [_Cell(column.title) for column in columns]
    return [line(titles)] + [line(row) for row in cells]


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 3, 0)] + "..."


def _field(name: str, value: str) -> str:
    return f"{name:<9} {value}"


def _clean(text: str, keep_indent: bool = False) -> str:
    """`text` safe to print: the watchdog relays the server's error texts and process
    titles, and an escape sequence in one must not reach the operator's terminal."""
    cleaned = "".join(c if c.isprintable() else " " for c in text.replace("\t", "    "))
    if keep_indent:
        return cleaned.rstrip()
    return " ".join(cleaned.split())


def _text(value: Any, empty: str = "-") -> str:
    if value is None or value == "":
        return empty
    return _clean(value if isinstance(value, str) else json.dumps(value))


def _utc(wall: float | None, zone: bool = True) -> str:
    if wall is None:
        return "-"
    try:
        shown = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(wall))
    except (OverflowError, OSError, ValueError):
        return "-"
    return shown + " UTC" if zone else shown


def _age(seconds: float | None) -> str:
    """12s, 3m04s, 2h05m, 3d04h; a time ahead of `now` (another host's clock) counts 0."""
    if seconds is None:
        return "-"
    whole = int(max(seconds, 0.0))
    if whole < 60:
        return f"{whole}s"
    minutes, rest = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes}m{rest:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def _heartbeat_age(seconds: float | None) -> str:
    # Heartbeats come every fraction of a second: a tenth tells fresh from slipping.
    if seconds is not None and seconds < 10:
        return f"{max(seconds, 0.0):.1f}s"
    return _age(seconds)
