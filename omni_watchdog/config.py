"""One typed configuration: defaults, then a YAML file, then `OMNI_WATCHDOG_*`, then flags.

Durations are written like "30s", "500ms" or "2m". Every number has an inclusive range.
Every error names where the bad value came from (the file, the variable or the flag) and
the dotted field, on one line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import ipaddress
import json
import math
import os
import re
import socket
import tempfile
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import yaml

from omni_watchdog.types import Mode, SilenceCause, StepName

ENV_PREFIX = "OMNI_WATCHDOG_"
GPU_BACKENDS = ("nvml", "sim", "none")
PROBES = ("spans", "metrics", "health", "canary", "processes", "gpu", "activity")
LADDER_STEPS = tuple(step.value for step in StepName)

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
_MINUTE = 60.0
_HOUR = 3600.0
_DAY = 86_400.0
# Linux's PID_MAX_LIMIT: no pid is larger.
_PID_MAX = 4_194_304
_HOST_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_SHOWN_CHARS = 80


class ConfigError(ValueError):
    """A configuration value that cannot be used, with where it came from."""


def _shown(value: Any) -> str:
    """`value` as an error message shows it: quoted, escaped onto one line, cut short."""
    try:
        text = repr(value)
    except ValueError:  # an integer of more digits than Python turns into text
        return "a number too long to show"
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def parse_duration(text: str | float | int) -> float:
    """Seconds from "30s", "500ms", "2m", "1h" or a bare number of seconds."""
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise ValueError(f"expected a duration like '30s' or '500ms', got {_shown(text)}")
    if isinstance(text, str):
        match = _DURATION.match(text)
        if not match:
            raise ValueError(f"expected a duration like '30s' or '500ms', got {_shown(text)}")
        seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    else:
        try:
            seconds = float(text)
        except OverflowError:
            seconds = math.inf
    if seconds < 0:
        raise ValueError(f"a duration cannot be negative, got {_shown(text)}")
    if not math.isfinite(seconds):
        raise ValueError(f"expected a finite duration, got {_shown(text)}")
    return seconds


def split_host_port(value: str, where: str) -> tuple[str, int]:
    """("127.0.0.1", 4318) from "127.0.0.1:4318", ("::1", 4318) from "[::1]:4318"."""
    try:
        return _host_port(value)
    except ValueError as error:
        raise ConfigError(f"{where}: {error}") from None


def _host_port(value: str) -> tuple[str, int]:
    if value.startswith("["):
        host, bracket, rest = value[1:].partition("]")
        if not bracket or not rest.startswith(":"):
            raise ValueError(f"expected [IPV6]:PORT, got {_shown(value)}")
        port = rest[1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(
                f"expected an IPv6 address in the brackets of {_shown(value)}"
            ) from None
    else:
        host, colon, port = value.rpartition(":")
        if not colon:
            raise ValueError(f"expected HOST:PORT, got {_shown(value)}")
        if ":" in host:
            raise ValueError(
                f"an IPv6 address needs brackets, as in [::1]:4318; got {_shown(value)}"
            )
        if not host:
            raise ValueError(
                f"no host in {_shown(value)}: use 127.0.0.1 for loopback or 0.0.0.0 for every"
                " address"
            )
        if not _HOST_NAME.fullmatch(host):
            raise ValueError(
                f"expected a host name or an address before the port, got {_shown(value)}"
            )
    if not (port.isascii() and port.isdigit() and len(port) <= 5 and int(port) <= 65535):
        raise ValueError(f"expected a port from 0 to 65535 after the host, got {_shown(value)}")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """Whether `host` (as `split_host_port` returns it) is reachable only from this host."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_url(value: str) -> None:
    if not value.startswith(("http://", "https://")):
        raise ValueError(f"expected an http(s) URL, got {_shown(value)}")
    try:
        parsed = urlsplit(value)
        # The port is parsed when read: one out of range fails here, not at the first request.
        host, _ = parsed.hostname, parsed.port
    except ValueError as error:
        raise ValueError(f"{error} in {_shown(value)}") from None
    if not host:
        raise ValueError(f"no host in {_shown(value)}")


def _check_optional_url(value: str) -> None:
    if value:
        _check_url(value)


def _check_token(value: str) -> None:
    # The value is never shown: it is a secret, or one mistyped.
    if value and not value.strip():
        raise ValueError("a token of only spaces: every request would be refused")
    if value != value.strip():
        raise ValueError("a token has spaces at its ends: the one a client sends has none")


def _check_path(value: str) -> None:
    if not value.startswith("/"):
        raise ValueError(f"expected a path starting with '/', got {_shown(value)}")


def _check_method(value: str) -> None:
    if not (value.isascii() and value.isalpha()):
        raise ValueError(f"expected an HTTP method such as POST, got {_shown(value)}")


def _check_gpu_backend(value: str) -> None:
    if value not in GPU_BACKENDS:
        raise ValueError(
            f"expected {', '.join(GPU_BACKENDS[:-1])} or {GPU_BACKENDS[-1]}, got {_shown(value)}"
        )


def _check_probes(names: list[str]) -> None:
    for name in names:
        if name not in PROBES:
            raise ValueError(f"unknown probe {_shown(name)}; expected some of {', '.join(PROBES)}")


def _check_stage_ids(ids: list[int]) -> None:
    if any(stage_id < 0 for stage_id in ids):
        raise ValueError(f"expected stage ids of 0 or more, got {ids}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"a stage is named twice in {ids}")


def _check_steps(names: list[str]) -> None:
    for name in names:
        if name not in LADDER_STEPS:
            raise ValueError(
                f"unknown step {_shown(name)}; expected some of {', '.join(LADDER_STEPS)}"
            )
    places = [LADDER_STEPS.index(name) for name in names]
    if places != sorted(set(places)):
        raise ValueError(
            f"must keep the order {', '.join(LADDER_STEPS)} (each at most once, any left out),"
            f" got {', '.join(names)}"
        )


# The causes of a silence that can be work advancing, each of which may have its own bound.
WORKING_CAUSES = (
    SilenceCause.COMPILING,
    SilenceCause.WAITING_ON_CHILD,
    SilenceCause.LOADING,
    SilenceCause.COMPUTING,
)


def _check_work_timeouts(bounds: dict[str, Any]) -> None:
    names = {cause.value for cause in WORKING_CAUSES}
    for name, bound in bounds.items():
        if name not in names:
            raise ValueError(
                f"unknown cause {_shown(name)}; expected some of {', '.join(sorted(names))}"
            )
        seconds = parse_duration(bound)
        if seconds < 1.0:
            raise ValueError(f"{name}: must be at least 1s, got {seconds:g}s")


def _duration(default: float, doc: str, *, minimum: float, maximum: float = _DAY) -> Any:
    metadata = {"duration": True, "doc": doc, "minimum": minimum, "maximum": maximum}
    return field(default=default, metadata=metadata)


def _setting(
    default: Any,
    doc: str,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    check: Callable[[Any], object] | None = None,
) -> Any:
    metadata = {"doc": doc, "minimum": minimum, "maximum": maximum, "check": check}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class DetectionConfig:
    """Thresholds of the stall rules (docs/design.md, Detection)."""

    heartbeat_timeout: float = _duration(
        3.0,
        "No loop heartbeat from a stage for this long is evidence (3 missed 1 s beats).",
        minimum=0.1,
    )
    rhythm_multiplier: float = _setting(
        2.0,
        "A stage whose loop beats slower than once a second (long steps block it) is not"
        " silent before this many times the rolling p99 of its healthy beat gaps, when"
        " that is longer than heartbeat_timeout.",
        minimum=1.0,
        maximum=100.0,
    )
    heartbeat_timeout_max: float = _duration(
        30.0,
        "The most a stage's learned rhythm may stretch its heartbeat timeout to.",
        minimum=0.1,
    )
    progress_timeout: float = _duration(
        3.0,
        "Requests running on a stage and its progress counters flat for this long.",
        minimum=0.1,
    )
    stale_after: float = _duration(
        3.0, "Metrics not refreshed for this long are unknown, never 'flat'.", minimum=0.1
    )
    health_failures: int = _setting(
        3,
        "Consecutive failed /health calls (503, timeout, refused) before it is evidence.",
        minimum=1,
        maximum=100,
    )
    confirm_timeout: float = _duration(
        10.0,
        "A single kind of evidence held this long confirms a verdict on its own (a stage"
        " starved of CPU: not counting its time waiting for one).",
        minimum=0.1,
    )
    stuck_timeout: float = _duration(
        2.0,
        "A process stopped (T) or in D state this long, or without CPU progress.",
        minimum=0.1,
    )
    startup_grace: float = _duration(
        5.0, "Nothing is judged until the first healthy /health plus this grace.", minimum=0.1
    )
    startup_timeout: float = _duration(
        120.0,
        "A server that has not answered a healthy /health this long after the watchdog"
        " attached is judged anyway; a recorded stage process that exits ends the wait at"
        " once. Raise it for models that take longer than this to load.",
        minimum=1.0,
    )
    overdue_floor: float = _duration(
        10.0,
        "The smallest deadline for a stage's span after the request reached it.",
        minimum=0.1,
    )
    overdue_multiplier: float = _setting(
        4.0,
        "Deadline = max(floor, multiplier x rolling p99 of the stage's durations).",
        minimum=1.0,
        maximum=100.0,
    )
    crash_window: float = _duration(
        30.0,
        "Unhealthy signs this long before the server exits make the exit a crash.",
        minimum=0.1,
    )
    link_grace: float = _duration(
        10.0,
        "A headless stage whose link to its master (reachable, and the stage connected to"
        " it) has been down this long is orphaned: its own watchdog ends it.",
        minimum=0.1,
    )
    work_timeout: float = _duration(
        600.0,
        "A silent stage whose work visibly advances (a compile, a child process building"
        " for it, a step whose stacks move, weights loading) is not stalled before this;"
        " work that stops advancing is judged at once.",
        minimum=1.0,
    )
    work_timeouts: dict[str, Any] = _setting(
        {},
        'Per cause, a bound other than work_timeout, e.g. {"compiling": "30m"};'
        f" causes: {', '.join(c.value for c in WORKING_CAUSES)}.",
        check=_check_work_timeouts,
    )
    remote_grace: float = _duration(
        120.0,
        "The head's /health failing this long while only remote stages are unwell (none"
        " of its own) restarts the head: longer than the stage host needs to restart its"
        " stage and register it again.",
        minimum=1.0,
    )

    def work_budget(self, cause: SilenceCause) -> float:
        """How long work of `cause` that advances may keep its stage silent."""
        bound = self.work_timeouts.get(cause.value)
        return self.work_timeout if bound is None else parse_duration(bound)


@dataclass(frozen=True)
class ProbesConfig:
    """How often and how patiently each probe looks."""

    # A period under 50 ms turns a probe into a busy loop.
    interval: float = _duration(
        0.5, "Period of the process and GPU probes.", minimum=0.05, maximum=_HOUR
    )
    health_interval: float = _duration(
        1.0, "Period of the /health probe.", minimum=0.05, maximum=_HOUR
    )
    health_timeout: float = _duration(
        1.0, "A /health call slower than this is a timeout.", minimum=0.1, maximum=_HOUR
    )
    health_path: str = _setting(
        "/health", "Path of the server's health endpoint.", check=_check_path
    )
    metrics_interval: float = _duration(
        1.0, "Period of the /metrics scrape.", minimum=0.05, maximum=_HOUR
    )
    metrics_timeout: float = _duration(
        2.0, "A /metrics scrape slower than this fails.", minimum=0.1, maximum=_HOUR
    )
    metrics_path: str = _setting(
        "/metrics", "Path of the server's metrics endpoint.", check=_check_path
    )
    # A canary is a real request to the model: more than one a second is load, not a probe.
    canary_interval: float = _duration(
        3.0, "Send a canary after this long without organic progress.", minimum=1.0
    )
    canary_deadline: float = _duration(
        5.0, "A canary that takes longer than this failed.", minimum=0.1, maximum=_HOUR
    )
    canary_path: str = _setting(
        "/v1/chat/completions", "Path the canary request is sent to.", check=_check_path
    )
    canary_body: dict[str, Any] = _setting(
        {}, "JSON body of the canary; empty means one text token to the served model."
    )
    gpu_backend: str = _setting(
        "nvml", "nvml (real pynvml), sim (the simulator's), or none.", check=_check_gpu_backend
    )
    enabled: list[str] = _setting(list(PROBES), "Probes to run.", check=_check_probes)


@dataclass(frozen=True)
class SpansConfig:
    """The OTLP/HTTP receiver."""

    otlp_listen: str = _setting(
        "127.0.0.1:4318", "HOST:PORT of the OTLP/HTTP receiver.", check=_host_port
    )
    max_body_bytes: int = _setting(
        16 * 1024 * 1024,
        "Largest request body, compressed or not (413 above).",
        minimum=1024,
        maximum=256 * 1024 * 1024,
    )
    body_timeout: float = _duration(
        30.0,
        "An export's body must arrive within this long (408 after).",
        minimum=0.1,
        maximum=10 * _MINUTE,
    )
    queue_size: int = _setting(
        10_000,
        "Decoded batches waiting for the detector; 503 with Retry-After when full.",
        minimum=1,
        maximum=1_000_000,
    )
    ring_size: int = _setting(
        256, "Spans kept per stage for the detector and bundles.", minimum=1, maximum=4096
    )
    forward_endpoint: str = _setting(
        "",
        "Upstream OTLP/HTTP traces URL that receives a copy of everything; empty: none.",
        check=_check_optional_url,
    )


@dataclass(frozen=True)
class LadderConfig:
    """The remediation ladder (docs/design.md, Remediation ladder)."""

    steps: list[str] = _setting(
        list(LADDER_STEPS),
        "Steps, in this order; any may be left out.",
        check=_check_steps,
    )
    capture_timeout: float = _duration(
        5.0, "Bound on capturing stacks and snapshots.", minimum=0.1, maximum=_HOUR
    )
    self_exit_grace: float = _duration(
        5.0,
        "When the server itself answers 503, wait this long for it to exit on its own"
        " (vLLM exits about 3 s after its engine dies) before asking it to; not for a"
        " vLLM-Omni 0.30 server, which never does.",
        minimum=0.1,
        maximum=_HOUR,
    )
    admin_url: str = _setting(
        "",
        "Shutdown endpoint; empty means the target URL + /admin/shutdown.",
        check=_check_optional_url,
    )
    admin_method: str = _setting(
        "POST", "HTTP method of the shutdown endpoint.", check=_check_method
    )
    admin_timeout: float = _duration(
        1.0, "The shutdown request itself must answer this fast.", minimum=0.1, maximum=_HOUR
    )
    shutdown_grace: float = _duration(
        5.0,
        "After an accepted shutdown request, wait this long for the tree to exit.",
        minimum=0.1,
        maximum=_HOUR,
    )
    term_grace: float = _duration(
        3.0, "After SIGTERM, wait this long before SIGKILL.", minimum=0.1, maximum=_HOUR
    )
    kill_grace: float = _duration(
        2.0, "After SIGKILL, wait this long for exits.", minimum=0.1, maximum=_HOUR
    )
    release_timeout: float = _duration(
        10.0,
        "GPU memory must be back to baseline this long after the kill.",
        minimum=0.1,
        maximum=_HOUR,
    )
    teardown_timeout: float = _duration(
        120.0,
        "A survivor that SIGKILL reached and that is on its way out at the end of"
        " release_timeout (the signal pending or its exit begun, not in uninterruptible"
        " sleep) is waited for while its exit advances (runnable, gaining CPU time, losing"
        " threads or memory: it frees a large address space on a busy core), up to this"
        " much longer. One that stops advancing for 5 s is called unkillable at once.",
        minimum=0.1,
        maximum=_HOUR,
    )
    budget_per_hour: int = _setting(
        3, "Enforced incidents allowed per rolling hour.", minimum=0, maximum=1000
    )
    records_per_hour: int = _setting(
        30,
        "Incidents that act on nothing (observe, dry-run, budget or lock missing) recorded"
        " per rolling hour, each with its captured bundle; past it a verdict is counted and"
        " logged once, not recorded.",
        minimum=0,
        maximum=1000,
    )


@dataclass(frozen=True)
class WatchdogConfig:
    """Everything `omni-watchdog run` needs."""

    target: str = _setting(
        "http://127.0.0.1:8000", "Base URL of the served model.", check=_check_url
    )
    pid: int = _setting(
        0,
        "The server's pid; 0 finds the process listening on the port.",
        minimum=0,
        maximum=_PID_MAX,
    )
    stage_config: str = _setting("", "vLLM-Omni stage config file (0.11 or 0.30 schema).")
    headless: bool = _setting(
        False,
        "The target is a vLLM-Omni 0.30 headless stage server on this host (--headless):"
        " found by pid or by its command line, it has no HTTP API and is judged from its"
        " processes, spans, GPU memory and its link to the master.",
    )
    remote_stages: list[int] = _setting(
        [],
        "Stage ids that run on other hosts (headless stages): judged from their spans and"
        " the server's /health, never signalled; their spans need the OTLP token.",
        check=_check_stage_ids,
    )
    host: str = _setting(
        "", "This host's name on every stage series; empty: the machine's hostname."
    )
    listen: str = _setting(
        "127.0.0.1:9464", "HOST:PORT of the watchdog's own HTTP API.", check=_host_port
    )
    mode: Mode = _setting(Mode.DRY_RUN, "observe, dry-run or enforce.")
    state_dir: str = _setting(
        "", "Incident journal, bundles and lock; empty means ~/.local/state/omni-watchdog."
    )
    admin_token: str = _setting("", "Bearer token for the shutdown endpoint.", check=_check_token)
    otlp_token: str = _setting(
        "",
        "Bearer token the OTLP receiver requires of every export (OMNI_WATCHDOG_OTLP_TOKEN);"
        " required when spans.otlp_listen is not a loopback address.",
        check=_check_token,
    )
    operator_token: str = _setting(
        "",
        "Bearer token of the operator's actions (remediate, pause, resume) on the API"
        " (OMNI_WATCHDOG_OPERATOR_TOKEN); empty refuses every action.",
        check=_check_token,
    )
    otlp_export_endpoint: str = _setting(
        "",
        "OTLP/HTTP traces URL for the watchdog's own incident spans; empty: none.",
        check=_check_optional_url,
    )
    header_timeout: float = _duration(
        10.0,
        "A client of either listener must send a whole request head this long after"
        " connecting or after its previous response; idle kept-alive connections are"
        " closed then too.",
        minimum=0.1,
        maximum=10 * _MINUTE,
    )
    max_connections: int = _setting(
        256,
        "Open connections each listener accepts; more are closed at once and counted.",
        minimum=1,
        maximum=65535,
    )
    detection: DetectionConfig = field(default_factory=DetectionConfig)
    probes: ProbesConfig = field(default_factory=ProbesConfig)
    spans: SpansConfig = field(default_factory=SpansConfig)
    ladder: LadderConfig = field(default_factory=LadderConfig)

    def resolved_host(self) -> str:
        return self.host or socket.gethostname()

    def resolved_state_dir(self) -> Path:
        if self.state_dir:
            return Path(self.state_dir)
        return Path.home() / ".local" / "state" / "omni-watchdog"

    def resolved_admin_url(self) -> str:
        return self.ladder.admin_url or self.target.rstrip("/") + "/admin/shutdown"


Section = TypeVar("Section")


def _field_type(owner: type[Any], name: str) -> Any:
    return typing.get_type_hints(owner)[name]


def _integer(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise ValueError(f"expected an integer, got {_shown(value)}")


def _number(value: Any) -> float:
    number = math.nan
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        with contextlib.suppress(ValueError, OverflowError):
            number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"expected a finite number, got {_shown(value)}")
    return number


def _string(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"expected a string, got {type(value).__name__}")
    text = str(value)
    for place, character in enumerate(text):
        if not character.isprintable():
            # Shows only the character: the value may be a token.
            raise ValueError(f"unprintable character {character!r} at position {place}")
    return text


def _yaml(text: str) -> Any:
    """The document in `text`; ValueError, on one line, for anything PyYAML cannot load."""
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = error.problem or error.context or "malformed"
        raise ValueError(f"not valid YAML: {problem}{where}") from None
    except Exception as error:
        # PyYAML's constructors raise ValueError, AttributeError or RecursionError on some
        # malformed scalars and nesting: every one of them is a document it cannot load.
        reason = " ".join(str(error).split()) or type(error).__name__
        raise ValueError(f"not valid YAML: {reason}") from None


def _json_object(value: Any) -> dict[str, Any]:
    if isinstance(value, str):
        value = _yaml(value)
    if not isinstance(value, Mapping):
        raise ValueError(f"expected a mapping, got {_shown(value)}")
    try:
        # The body is sent as JSON: dates, binary and NaN are refused here, not per request.
        loaded: dict[str, Any] = json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError, RecursionError) as error:
        raise ValueError(f"not a JSON object: {error}") from None
    return loaded


def _value(value: Any, kind: Any, is_duration: bool) -> Any:
    """`value` as a `kind`; a ValueError says what is wrong with it."""
    if is_duration:
        return parse_duration(value)
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        choices = [member.value for member in kind]
        if value not in choices:
            raise ValueError(f"expected one of {', '.join(map(str, choices))}, got {_shown(value)}")
        return kind(value)
    if kind is bool:
        if isinstance(value, str):
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {_shown(value)}")
        return value
    if kind is int:
        return _integer(value)
    if kind is float:
        return _number(value)
    if kind is str:
        return _string(value)
    origin = typing.get_origin(kind)
    if origin is list:
        if isinstance(value, str):
            value = [item.strip() for item in value.split(",") if item.strip()]
        if not isinstance(value, list):
            raise ValueError(f"expected a list, got {_shown(value)}")
        (item_kind,) = typing.get_args(kind)
        items = []
        for place, item in enumerate(value, 1):
            try:
                items.append(_value(item, item_kind, False))
            except ValueError as error:
                raise ValueError(f"item {place}: {error}") from None
        return items
    if origin is dict:
        return _json_object(value)
    raise TypeError(f"unsupported config type {kind!r}")


def _amount(value: int | float, is_duration: bool) -> str:
    if isinstance(value, float):
        return f"{value:g}s" if is_duration else f"{value:g}"
    return _shown(value)


def _convert(value: Any, kind: Any, metadata: Mapping[str, Any], where: str) -> Any:
    is_duration = bool(metadata.get("duration"))
    try:
        converted = _value(value, kind, is_duration)
        minimum, maximum = metadata.get("minimum"), metadata.get("maximum")
        if minimum is not None and converted < minimum:
            raise ValueError(
                f"must be at least {_amount(minimum, is_duration)},"
                f" got {_amount(converted, is_duration)}"
            )
        if maximum is not None and converted > maximum:
            raise ValueError(
                f"must be at most {_amount(maximum, is_duration)},"
                f" got {_amount(converted, is_duration)}"
            )
        check = metadata.get("check")
        if check is not None:
            check(converted)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{where}: {error}") from None
    return converted


def _name(key: Any) -> str:
    """A field name as given, for an error message on one line."""
    return key if isinstance(key, str) and key.isidentifier() else _shown(key)


def _build(cls: type[Section], values: Any, origin: str, prefix: str) -> Section:
    if not isinstance(values, Mapping):
        section = prefix.rstrip(".") or "top level"
        raise ConfigError(f"{origin}: {section}: expected a mapping, got {_shown(values)}")
    known = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    for name in values:
        if name not in known:
            raise ConfigError(f"{origin}: {prefix}{_name(name)}: unknown field")
    converted: dict[str, Any] = {}
    for name, value in values.items():
        kind = _field_type(cls, name)
        if dataclasses.is_dataclass(kind):
            converted[name] = _build(kind, value, origin, f"{prefix}{name}.")  # type: ignore[arg-type]
        else:
            where = f"{origin}: {prefix}{name}"
            converted[name] = _convert(value, kind, known[name].metadata, where)
    return cls(**converted)


def merge_layers(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """`override` on top of `base`, section by section."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = merge_layers(dict(merged[key]), value)
        else:
            merged[key] = value
    return merged


def _env_layer(environ: Mapping[str, str]) -> list[tuple[str, dict[str, Any]]]:
    """`OMNI_WATCHDOG_MODE` sets `mode`; `OMNI_WATCHDOG_LADDER_TERM_GRACE` sets a section field.

    Variables that name no field are left alone: the plugin and the simulator read
    their own `OMNI_WATCHDOG_*` variables from the same environment.
    """
    layers: list[tuple[str, dict[str, Any]]] = []
    top = {f.name: f for f in dataclasses.fields(WatchdogConfig)}
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX):
            continue
        key = name[len(ENV_PREFIX) :].lower()
        if key in top and not dataclasses.is_dataclass(_field_type(WatchdogConfig, key)):
            layers.append((f"environment variable {name}", {key: environ[name]}))
            continue
        for section_name in top:
            section = _field_type(WatchdogConfig, section_name)
            if not dataclasses.is_dataclass(section) or not key.startswith(section_name + "_"):
                continue
            sub = key[len(section_name) + 1 :]
            if sub in {f.name for f in dataclasses.fields(section)}:
                layer = {section_name: {sub: environ[name]}}
                layers.append((f"environment variable {name}", layer))
    return layers


def _file_layer(file_path: Path) -> Mapping[str, Any]:
    try:
        data = file_path.read_bytes()
    except OSError as error:
        raise ConfigError(f"{file_path}: cannot read: {error.strerror or error}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{file_path}: not UTF-8 text: byte 0x{data[error.start]:02x} at offset {error.start}"
        ) from None
    try:
        loaded = _yaml(text)
    except ValueError as error:
        raise ConfigError(f"{file_path}: {error}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, Mapping):
        raise ConfigError(f"{file_path}: top level: expected a mapping, got {_shown(loaded)}")
    return loaded


def load_config(
    path: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> WatchdogConfig:
    """Defaults, then the YAML file at `path`, then the environment, then `overrides`."""
    layers: list[tuple[str, Mapping[str, Any]]] = []
    if path:
        layers.append((str(path), _file_layer(Path(path))))
    layers.extend(_env_layer(os.environ if environ is None else environ))
    if overrides:
        layers.append(("command line", overrides))
    merged: dict[str, Any] = {}
    for origin, layer in layers:
        # Validate each layer alone so an error names the layer it came from.
        _build(WatchdogConfig, merge_layers(merged, layer), origin, "")
        merged = merge_layers(merged, layer)
    config = _build(WatchdogConfig, merged, "configuration", "")
    _validate(config)
    return config


def _validate(config: WatchdogConfig) -> None:
    """The checks that involve more than one field, on the merged configuration."""
    if config.remote_stages and not config.otlp_token:
        # A remote stage's spans come from processes this host cannot check: only the
        # token tells them from anyone's.
        raise ConfigError(
            f"configuration: otlp_token: required with remote_stages; set {ENV_PREFIX}OTLP_TOKEN"
        )
    if config.headless and config.stage_config:
        raise ConfigError(
            "configuration: stage_config: a headless stage server runs the one stage its"
            " command line names; its watchdog learns it from its process titles"
        )
    if config.headless and config.remote_stages:
        raise ConfigError(
            "configuration: remote_stages: a headless stage server runs one stage; only"
            " the head's watchdog has remote stages"
        )
    sees_exit = set(config.probes.enabled) & {"processes", "health"}
    if config.mode is Mode.ENFORCE and "verify" in config.ladder.steps and not sees_exit:
        # With neither, nothing can tell whether the server went: verify would always fail.
        raise ConfigError(
            "configuration: probes.enabled: the verify step needs 'processes' or, without "
            "the server's PID namespace, 'health'"
        )
    if config.detection.confirm_timeout < config.detection.heartbeat_timeout:
        raise ConfigError(
            "configuration: detection.confirm_timeout: must not be shorter than "
            "detection.heartbeat_timeout"
        )
    host, _ = split_host_port(config.spans.otlp_listen, "configuration: spans.otlp_listen")
    if not is_loopback(host) and not config.otlp_token:
        # Anyone who reaches the receiver could feed the detector spans that end in a kill.
        raise ConfigError(
            "configuration: otlp_token: required when spans.otlp_listen"
            f" ({config.spans.otlp_listen}) is not a loopback address;"
            f" set {ENV_PREFIX}OTLP_TOKEN"
        )


def prepare_state_dir(config: WatchdogConfig) -> str:
    """Create the state directory (mode 0700); "" when it is writable, else a warning.

    Outside enforce mode a directory that exists but cannot be written is only warned of.
    """
    path = config.resolved_state_dir()
    try:
        missing = [directory for directory in (path, *path.parents) if not directory.exists()]
        for directory in reversed(missing):
            directory.mkdir(mode=0o700, exist_ok=True)
    except (OSError, ValueError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        raise ConfigError(f"state_dir: {path} cannot be created ({reason})") from None
    if not path.is_dir():
        raise ConfigError(f"state_dir: {path} is not a directory")
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-probe-"):
            pass
    except OSError as error:
        problem = f"state_dir: {path} is not writable ({error.strerror or error})"
        if config.mode is Mode.ENFORCE:
            raise ConfigError(
                f"{problem}; enforce mode needs it for the incident journal and the target lock"
            ) from None
        return f"{problem}; incidents cannot be journaled there"
    return ""


def describe_defaults() -> list[tuple[str, str, str]]:
    """(dotted name, default, documentation) for every field, for `config --defaults`."""
    rows: list[tuple[str, str, str]] = []

    def walk(cls: type[Any], instance: Any, prefix: str) -> None:
        for spec in dataclasses.fields(cls):
            value = getattr(instance, spec.name)
            if dataclasses.is_dataclass(value):
                walk(type(value), value, f"{prefix}{spec.name}.")
                continue
            shown = value.value if isinstance(value, enum.Enum) else value
            unit = "s" if spec.metadata.get("duration") else ""
            if unit:
                shown = f"{value:g}s"
            doc = spec.metadata.get("doc", "")
            bounds = [spec.metadata.get("minimum"), spec.metadata.get("maximum")]
            if bounds != [None, None]:
                low, high = ("" if bound is None else f"{bound:g}{unit}" for bound in bounds)
                doc += f" Range: {low}..{high}."
            rows.append((f"{prefix}{spec.name}", str(shown), doc))

    walk(WatchdogConfig, WatchdogConfig(), "")
    return rows
