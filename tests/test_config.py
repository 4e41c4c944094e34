"""Config layers (file, environment, flags), durations, and errors that name file and field."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import socket
import stat
import subprocess
import sys
import tempfile
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from omni_watchdog import cli
from omni_watchdog.cli import build_parser, main, overrides_of
from omni_watchdog.config import (
    ENV_PREFIX,
    ConfigError,
    WatchdogConfig,
    describe_defaults,
    load_config,
    merge_layers,
    parse_duration,
    prepare_state_dir,
    split_host_port,
)
from omni_watchdog.types import Mode


@pytest.mark.parametrize(
    ("text", "seconds"), [("30s", 30.0), ("500ms", 0.5), ("2m", 120.0), ("1h", 3600.0), (3, 3.0)]
)
def test_durations(text: str | int, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["fast", "-1s", "1d", True])
def test_bad_durations(text: object) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)  # type: ignore[arg-type]


def test_defaults_are_valid_and_documented() -> None:
    config = load_config(environ={})
    assert config.mode is Mode.DRY_RUN
    assert config.detection.heartbeat_timeout == 3.0
    rows = describe_defaults()
    assert all(doc for _, _, doc in rows)
    assert ("detection.confirm_timeout", "10s") in [(name, value) for name, value, _ in rows]


def test_file_then_environment_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "watchdog.yaml"
    path.write_text(
        "mode: observe\ndetection:\n  heartbeat_timeout: 5s\n  confirm_timeout: 20s\n"
        "ladder:\n  term_grace: 1s\n"
    )
    environ = {
        "OMNI_WATCHDOG_MODE": "enforce",
        "OMNI_WATCHDOG_LADDER_TERM_GRACE": "7s",
        "OMNI_WATCHDOG_SIM_STATE": "/ignored: the simulator's own variable",
    }
    flags = build_parser().parse_args(
        ["run", "--target", "http://127.0.0.1:9000", "--set", "ladder.term_grace=9s"]
    )
    config = load_config(path, environ, overrides_of(flags))
    assert config.mode is Mode.ENFORCE
    assert config.detection.heartbeat_timeout == 5.0
    assert config.ladder.term_grace == 9.0
    assert config.target == "http://127.0.0.1:9000"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("detection:\n  heartbeat_timeout: soon\n", "detection.heartbeat_timeout: expected"),
        ("detection:\n  heartbeat_tmeout: 3s\n", "detection.heartbeat_tmeout: unknown field"),
        ("mode: aggressive\n", "mode:"),
        ("ladder:\n  steps: [capture, pray]\n", "ladder.steps: unknown step 'pray'"),
        ("probes:\n  enabled: [spans, tarot]\n", "probes.enabled: unknown probe 'tarot'"),
        (
            "mode: enforce\nprobes:\n  enabled: [spans, metrics]\n",
            "probes.enabled: the verify step needs",
        ),
        ("detection:\n  health_failures: 2.5\n", "detection.health_failures: expected an integer"),
        ("- a list\n", "top level: expected a mapping"),
        ("target: [oops\n", "not valid YAML"),
    ],
)
def test_a_broken_file_names_the_file_and_the_field(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as raised:
        load_config(path, environ={})
    assert message in str(raised.value)
    assert "broken.yaml" in str(raised.value) or "configuration" in str(raised.value)


def test_a_bad_environment_variable_is_named() -> None:
    with pytest.raises(ConfigError, match="OMNI_WATCHDOG_DETECTION_STUCK_TIMEOUT"):
        load_config(environ={"OMNI_WATCHDOG_DETECTION_STUCK_TIMEOUT": "forever"})


def test_cross_field_checks() -> None:
    with pytest.raises(ConfigError, match="confirm_timeout"):
        load_config(environ={}, overrides={"detection": {"confirm_timeout": "1s"}})
    with pytest.raises(ConfigError, match="listen: expected HOST:PORT"):
        load_config(environ={}, overrides={"listen": "9464"})


def test_the_command_line_reports_a_broken_config(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("ladder:\n  term_grace: later\n")
    done = subprocess.run(
        [sys.executable, "-m", "omni_watchdog.cli", "config", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "broken.yaml: ladder.term_grace" in done.stderr


# ---- helpers ---------------------------------------------------------------------------


def numeric_fields(
    cls: type[Any] = WatchdogConfig, prefix: str = ""
) -> Iterator[tuple[str, dataclasses.Field[Any], Any]]:
    """(dotted name, field, type) of every int and float field, sections included."""
    hints = typing.get_type_hints(cls)
    for spec in dataclasses.fields(cls):
        kind = hints[spec.name]
        if dataclasses.is_dataclass(kind):
            yield from numeric_fields(kind, f"{prefix}{spec.name}.")  # type: ignore[arg-type]
        elif kind in (int, float):
            yield f"{prefix}{spec.name}", spec, kind


def layer(dotted: str, value: Any) -> dict[str, Any]:
    """{"a": {"b": value}} from "a.b"."""
    *sections, name = dotted.split(".")
    nested: dict[str, Any] = {name: value}
    for section in reversed(sections):
        nested = {section: nested}
    return nested


def env_name(dotted: str) -> str:
    return ENV_PREFIX + dotted.replace(".", "_").upper()


def set_flag(*assignments: str) -> dict[str, Any]:
    """The config layer of `omni-watchdog run --set A --set B ...`."""
    argv = ["run"]
    for assignment in assignments:
        argv.append(f"--set={assignment}")
    return overrides_of(build_parser().parse_args(argv))


def load_from(source: str, dotted: str, value: Any, tmp_path: Path) -> WatchdogConfig:
    """`dotted` = `value` given in a YAML file, an environment variable or a --set flag."""
    if source == "file":
        path = tmp_path / "watchdog.yaml"
        path.write_text(yaml.safe_dump(layer(dotted, value)))
        return load_config(path, environ={})
    if source == "env":
        return load_config(environ={env_name(dotted): value})
    return load_config(environ={}, overrides=set_flag(f"{dotted}={value}"))


NUMERIC = list(numeric_fields())
# Fields that a cross-field check ties together: moved as one for the range tests.
PARTNERS = {
    "detection.heartbeat_timeout": "detection.confirm_timeout",
    "detection.confirm_timeout": "detection.heartbeat_timeout",
}


# ---- ranges ----------------------------------------------------------------------------


RANGES = {
    "pid": (0, 4_194_304),
    "header_timeout": (0.1, 600.0),
    "max_connections": (1, 65535),
    "detection.heartbeat_timeout": (0.1, 86400.0),
    "detection.rhythm_multiplier": (1.0, 100.0),
    "detection.heartbeat_timeout_max": (0.1, 86400.0),
    "detection.progress_timeout": (0.1, 86400.0),
    "detection.stale_after": (0.1, 86400.0),
    "detection.health_failures": (1, 100),
    "detection.confirm_timeout": (0.1, 86400.0),
    "detection.stuck_timeout": (0.1, 86400.0),
    "detection.startup_grace": (0.1, 86400.0),
    "detection.startup_timeout": (1.0, 86400.0),
    "detection.overdue_floor": (0.1, 86400.0),
    "detection.overdue_multiplier": (1.0, 100.0),
    "detection.crash_window": (0.1, 86400.0),
    "detection.link_grace": (0.1, 86400.0),
    "detection.remote_grace": (1.0, 86400.0),
    "detection.work_timeout": (1.0, 86400.0),
    "probes.interval": (0.05, 3600.0),
    "probes.health_interval": (0.05, 3600.0),
    "probes.health_timeout": (0.1, 3600.0),
    "probes.metrics_interval": (0.05, 3600.0),
    "probes.metrics_timeout": (0.1, 3600.0),
    "probes.canary_interval": (1.0, 86400.0),
    "probes.canary_deadline": (0.1, 3600.0),
    "spans.max_body_bytes": (1024, 256 * 1024 * 1024),
    "spans.body_timeout": (0.1, 600.0),
    "spans.queue_size": (1, 1_000_000),
    "spans.ring_size": (1, 4096),
    "ladder.capture_timeout": (0.1, 3600.0),
    "ladder.self_exit_grace": (0.1, 3600.0),
    "ladder.admin_timeout": (0.1, 3600.0),
    "ladder.shutdown_grace": (0.1, 3600.0),
    "ladder.term_grace": (0.1, 3600.0),
    "ladder.kill_grace": (0.1, 3600.0),
    "ladder.release_timeout": (0.1, 3600.0),
    "ladder.teardown_timeout": (0.1, 3600.0),
    "ladder.budget_per_hour": (0, 1000),
    "ladder.records_per_hour": (0, 1000),
}


def test_every_number_has_the_documented_range_around_its_default() -> None:
    defaults = load_config(environ={})
    found = {}
    for dotted, spec, _ in NUMERIC:
        minimum, maximum = spec.metadata["minimum"], spec.metadata["maximum"]
        found[dotted] = (minimum, maximum)
        value: Any = defaults
        for part in dotted.split("."):
            value = getattr(value, part)
        assert minimum <= value <= maximum, dotted
    assert found == RANGES


@pytest.mark.parametrize(("dotted", "spec", "kind"), NUMERIC, ids=[n for n, _, _ in NUMERIC])
def test_each_bound_is_accepted_and_a_step_beyond_it_refused(
    dotted: str, spec: dataclasses.Field[Any], kind: type
) -> None:
    minimum, maximum = spec.metadata["minimum"], spec.metadata["maximum"]
    for bound in (minimum, maximum):
        overrides = layer(dotted, bound)
        if dotted in PARTNERS:
            overrides = merge_layers(overrides, layer(PARTNERS[dotted], bound))
        load_config(environ={}, overrides=overrides)
    below = minimum - 1 if kind is int else minimum / 2 if minimum else -0.5
    above = maximum + 1 if kind is int else maximum * 2
    with pytest.raises(ConfigError, match=f"^command line: {dotted}: must be at least "):
        load_config(environ={}, overrides=layer(dotted, below))
    with pytest.raises(ConfigError, match=f"^command line: {dotted}: must be at most "):
        load_config(environ={}, overrides=layer(dotted, above))


@pytest.mark.parametrize(
    ("assignment", "message"),
    [
        ("probes.interval=0s", "command line: probes.interval: must be at least 0.05s, got 0s"),
        (
            "probes.health_interval=10ms",
            "command line: probes.health_interval: must be at least 0.05s, got 0.01s",
        ),
        (
            "probes.metrics_interval=0",
            "command line: probes.metrics_interval: must be at least 0.05s, got 0s",
        ),
        ("ladder.term_grace=0s", "command line: ladder.term_grace: must be at least 0.1s, got 0s"),
        (
            "detection.confirm_timeout=25h",
            "command line: detection.confirm_timeout: must be at most 86400s, got 90000s",
        ),
        ("detection.health_failures=0", "detection.health_failures: must be at least 1, got 0"),
        (
            "detection.health_failures=101",
            "detection.health_failures: must be at most 100, got 101",
        ),
        (
            "detection.overdue_multiplier=0.5",
            "detection.overdue_multiplier: must be at least 1, got 0.5",
        ),
        ("spans.ring_size=-3", "command line: spans.ring_size: must be at least 1, got -3"),
        ("spans.ring_size=4097", "spans.ring_size: must be at most 4096, got 4097"),
        ("spans.queue_size=0", "spans.queue_size: must be at least 1, got 0"),
        ("spans.queue_size=1000001", "spans.queue_size: must be at most 1000000, got 1000001"),
        ("spans.max_body_bytes=1023", "spans.max_body_bytes: must be at least 1024, got 1023"),
        (
            "spans.max_body_bytes=268435457",
            "spans.max_body_bytes: must be at most 268435456, got 268435457",
        ),
        ("ladder.budget_per_hour=-1", "ladder.budget_per_hour: must be at least 0, got -1"),
        ("ladder.budget_per_hour=1001", "ladder.budget_per_hour: must be at most 1000, got 1001"),
        ("pid=-1", "command line: pid: must be at least 0, got -1"),
        ("header_timeout=11m", "header_timeout: must be at most 600s, got 660s"),
        ("max_connections=0", "max_connections: must be at least 1, got 0"),
        ("spans.body_timeout=0s", "spans.body_timeout: must be at least 0.1s, got 0s"),
        ("detection.startup_timeout=500ms", "startup_timeout: must be at least 1s, got 0.5s"),
    ],
)
def test_a_number_out_of_range_is_refused_with_its_bound(assignment: str, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load_config(environ={}, overrides=set_flag(assignment))
    assert message in str(raised.value)


def test_a_range_error_names_the_layer_the_value_came_from(tmp_path: Path) -> None:
    path = tmp_path / "watchdog.yaml"
    path.write_text("probes:\n  interval: 0s\n")
    with pytest.raises(ConfigError, match=r"watchdog\.yaml: probes\.interval: must be at least"):
        load_config(path, environ={})
    environ = {"OMNI_WATCHDOG_PROBES_INTERVAL": "0s"}
    with pytest.raises(
        ConfigError, match=r"^environment variable OMNI_WATCHDOG_PROBES_INTERVAL: probes\.interval"
    ):
        load_config(environ=environ)
    # A later layer may put right what an earlier one got wrong only if it is checked alone.
    config = load_config(environ={}, overrides=set_flag("probes.interval=0.05s"))
    assert config.probes.interval == 0.05


# ---- the new fields --------------------------------------------------------------------


def test_new_fields_have_their_defaults_and_variables() -> None:
    config = load_config(environ={})
    assert config.otlp_token == ""
    assert config.header_timeout == 10.0
    assert config.max_connections == 256
    assert config.spans.body_timeout == 30.0
    assert config.detection.startup_timeout == 120.0
    config = load_config(
        environ={
            "OMNI_WATCHDOG_OTLP_TOKEN": "s3cret",
            "OMNI_WATCHDOG_HEADER_TIMEOUT": "2s",
            "OMNI_WATCHDOG_MAX_CONNECTIONS": "8",
            "OMNI_WATCHDOG_SPANS_BODY_TIMEOUT": "500ms",
            "OMNI_WATCHDOG_DETECTION_STARTUP_TIMEOUT": "10m",
        }
    )
    assert config.otlp_token == "s3cret"
    assert config.header_timeout == 2.0
    assert config.max_connections == 8
    assert config.spans.body_timeout == 0.5
    assert config.detection.startup_timeout == 600.0
    documented = {name: doc for name, _, doc in describe_defaults()}
    assert "OMNI_WATCHDOG_OTLP_TOKEN" in documented["otlp_token"]
    assert "(408 after)" in documented["spans.body_timeout"]


# ---- the ladder's order ----------------------------------------------------------------


@pytest.mark.parametrize(
    "steps",
    [
        [],
        ["verify"],
        ["capture", "kill"],
        ["shutdown", "verify"],
        ["capture", "shutdown", "terminate", "kill", "verify"],
    ],
)
def test_ladder_steps_in_order_are_accepted(steps: list[str]) -> None:
    config = load_config(environ={}, overrides={"ladder": {"steps": steps}})
    assert config.ladder.steps == steps


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        (["kill", "terminate"], "got kill, terminate"),
        (["verify", "capture"], "got verify, capture"),
        (["capture", "capture"], "got capture, capture"),
        (["capture", "kill", "kill", "verify"], "got capture, kill, kill, verify"),
        ("kill,capture", "got kill, capture"),
    ],
)
def test_ladder_steps_out_of_order_name_the_expected_order(steps: Any, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load_config(environ={}, overrides={"ladder": {"steps": steps}})
    assert str(raised.value) == (
        "command line: ladder.steps: must keep the order capture, shutdown, terminate, kill,"
        f" verify (each at most once, any left out), {message}"
    )


def test_an_unknown_step_names_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="unknown step 'pray'; expected some of capture,"):
        load_config(environ={"OMNI_WATCHDOG_LADDER_STEPS": "capture,pray"})


# ---- the OTLP token --------------------------------------------------------------------


@pytest.mark.parametrize(
    "listen",
    ["127.0.0.1:4318", "127.8.9.10:0", "[::1]:4318", "localhost:4318", "LocalHost:4318"],
)
def test_a_loopback_receiver_needs_no_token(listen: str) -> None:
    config = load_config(environ={"OMNI_WATCHDOG_SPANS_OTLP_LISTEN": listen})
    assert config.otlp_token == ""


@pytest.mark.parametrize(
    "listen", ["0.0.0.0:4318", "[::]:4318", "10.0.0.5:4318", "example.com:4318", "[::2]:1"]
)
def test_a_receiver_beyond_loopback_needs_a_token(listen: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load_config(environ={"OMNI_WATCHDOG_SPANS_OTLP_LISTEN": listen})
    assert str(raised.value) == (
        f"configuration: otlp_token: required when spans.otlp_listen ({listen}) is not a"
        " loopback address; set OMNI_WATCHDOG_OTLP_TOKEN"
    )
    config = load_config(
        environ={"OMNI_WATCHDOG_SPANS_OTLP_LISTEN": listen, "OMNI_WATCHDOG_OTLP_TOKEN": "t"}
    )
    assert config.otlp_token == "t"


def test_remote_stages_need_the_token_and_come_from_env_or_flags() -> None:
    with pytest.raises(ConfigError) as raised:
        load_config(environ={"OMNI_WATCHDOG_REMOTE_STAGES": "1"})
    assert str(raised.value) == (
        "configuration: otlp_token: required with remote_stages; set OMNI_WATCHDOG_OTLP_TOKEN"
    )
    config = load_config(
        environ={"OMNI_WATCHDOG_REMOTE_STAGES": "1,2", "OMNI_WATCHDOG_OTLP_TOKEN": "t"}
    )
    assert config.remote_stages == [1, 2]
    args = build_parser().parse_args(["run", "--remote-stage", "3", "--remote-stage", "4"])
    config = load_config(environ={"OMNI_WATCHDOG_OTLP_TOKEN": "t"}, overrides=overrides_of(args))
    assert config.remote_stages == [3, 4]


@pytest.mark.parametrize(
    ("value", "problem"),
    [("1,1", "a stage is named twice"), ("-1", "expected stage ids of 0 or more")],
)
def test_bad_remote_stages_name_the_field(value: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=f"remote_stages: {problem}"):
        load_config(environ={"OMNI_WATCHDOG_REMOTE_STAGES": value, "OMNI_WATCHDOG_OTLP_TOKEN": "t"})


@pytest.mark.parametrize("variable", ["OTLP_TOKEN", "OPERATOR_TOKEN", "ADMIN_TOKEN"])
@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (" ", "a token of only spaces"),
        (" s3cret", "a token has spaces"),
        ("s3cret ", "a token has spaces"),
    ],
    ids=["only a space", "leading", "trailing"],
)
def test_a_token_with_spaces_at_its_ends_is_refused_without_showing_it(
    variable: str, value: str, problem: str
) -> None:
    """A token the config kept with its spaces matches no client's: every span or action
    would be refused, silently."""
    with pytest.raises(ConfigError, match=f"{variable.lower()}: {problem}") as raised:
        load_config(environ={f"OMNI_WATCHDOG_{variable}": value})
    assert "s3cret" not in str(raised.value)


def test_a_headless_stage_s_watchdog_has_no_remote_stages_of_its_own() -> None:
    args = build_parser().parse_args(["run", "--headless", "--remote-stage", "1"])
    with pytest.raises(ConfigError, match="only the head's watchdog has remote stages"):
        load_config(environ={"OMNI_WATCHDOG_OTLP_TOKEN": "t"}, overrides=overrides_of(args))
    with_config = build_parser().parse_args(["run", "--headless", "--stage-config", "s.yaml"])
    with pytest.raises(ConfigError, match="learns it from its process titles"):
        load_config(overrides=overrides_of(with_config))
    headless = load_config(overrides=overrides_of(build_parser().parse_args(["run", "--headless"])))
    assert headless.headless and headless.remote_stages == []
    assert load_config().headless is False


def test_the_host_defaults_to_the_machine_s_name() -> None:
    assert load_config().resolved_host() == socket.gethostname()
    named = load_config(environ={"OMNI_WATCHDOG_HOST": "gpu-node-a"})
    assert named.resolved_host() == "gpu-node-a"


# ---- host:port -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("127.0.0.1:4318", ("127.0.0.1", 4318)),
        ("[::1]:4318", ("::1", 4318)),
        ("[::]:0", ("::", 0)),
        ("localhost:0", ("localhost", 0)),
        ("0.0.0.0:65535", ("0.0.0.0", 65535)),
        ("watchdog.example-1.internal:9464", ("watchdog.example-1.internal", 9464)),
    ],
)
def test_host_port_splits(value: str, expected: tuple[str, int]) -> None:
    assert split_host_port(value, "listen") == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("9464", "expected HOST:PORT, got '9464'"),
        ("::1:4318", "an IPv6 address needs brackets, as in [::1]:4318; got '::1:4318'"),
        ("a:b:4318", "an IPv6 address needs brackets"),
        (":4318", "no host in ':4318'"),
        ("[]:4318", "expected an IPv6 address in the brackets of '[]:4318'"),
        ("[nothost]:80", "expected an IPv6 address in the brackets"),
        ("[::1]", "expected [IPV6]:PORT, got '[::1]'"),
        ("[::1]4318", "expected [IPV6]:PORT"),
        ("[::1]:", "expected a port from 0 to 65535"),
        ("ho st:80", "expected a host name or an address before the port"),
        ("host:", "expected a port from 0 to 65535"),
        ("host:65536", "expected a port from 0 to 65535"),
        ("host:-1", "expected a port from 0 to 65535"),
        ("host:80x", "expected a port from 0 to 65535"),
        ("host:\u0663", "expected a port from 0 to 65535"),
        ("host:000080", "expected a port from 0 to 65535"),
    ],
)
def test_bad_host_port_is_refused(value: str, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        split_host_port(value, "configuration: listen")
    assert str(raised.value).startswith("configuration: listen: ")
    assert message in str(raised.value)


@pytest.mark.parametrize(
    ("flag", "dotted"), [("--listen", "listen"), ("--otlp-listen", "spans.otlp_listen")]
)
def test_the_listen_flags_are_checked(flag: str, dotted: str) -> None:
    overrides = overrides_of(build_parser().parse_args(["run", flag, "::1:4318"]))
    with pytest.raises(ConfigError, match=f"^command line: {dotted}: an IPv6 address needs"):
        load_config(environ={}, overrides=overrides)
    overrides = overrides_of(build_parser().parse_args(["run", flag, "[::1]:0"]))
    load_config(environ={}, overrides=overrides)


# ---- every bad value: one line naming the field ----------------------------------------


@pytest.mark.parametrize(
    ("source", "dotted", "value", "message"),
    [
        ("file", "detection.heartbeat_timeout", {"a": 1}, "expected a duration like"),
        ("file", "detection.heartbeat_timeout", [3], "expected a duration like"),
        ("file", "detection.heartbeat_timeout", True, "expected a duration like"),
        ("file", "detection.heartbeat_timeout", float("nan"), "expected a finite duration"),
        ("file", "detection.stale_after", 10**400, "expected a finite duration"),
        ("file", "spans.ring_size", True, "expected an integer, got True"),
        ("file", "spans.ring_size", [1], "expected an integer, got [1]"),
        ("file", "spans.ring_size", 2.0, "expected an integer, got 2.0"),
        ("file", "spans.ring_size", 10**30, "must be at most 4096, got 1000000000000000000"),
        ("file", "pid", 10**400, "must be at most 4194304, got 1000000000000000"),
        ("file", "detection.overdue_multiplier", True, "expected a finite number, got True"),
        ("file", "detection.overdue_multiplier", float("nan"), "expected a finite number"),
        ("file", "detection.overdue_multiplier", float("inf"), "expected a finite number"),
        ("file", "detection.overdue_multiplier", 10**400, "expected a finite number"),
        ("file", "detection.overdue_multiplier", None, "expected a finite number, got None"),
        ("file", "target", {"a": 1}, "expected a string, got dict"),
        ("file", "target", None, "expected a string, got NoneType"),
        ("file", "admin_token", "a\nb", "unprintable character '\\n' at position 1"),
        ("file", "mode", ["observe"], "expected one of observe, dry-run, enforce"),
        ("file", "probes.enabled", {"spans": 1}, "expected a list, got {'spans': 1}"),
        ("file", "probes.enabled", ["spans", ["x"]], "item 2: expected a string, got list"),
        ("file", "ladder.steps", ["capture", 3], "unknown step '3'"),
        ("file", "probes.canary_body", [1], "expected a mapping, got [1]"),
        ("file", "probes.canary_body", {"a": float("nan")}, "not a JSON object"),
        ("file", "detection", 5, "detection: expected a mapping, got 5"),
        ("file", "probes", [], "probes: expected a mapping, got []"),
        ("env", "spans.ring_size", "-3", "must be at least 1, got -3"),
        ("env", "spans.ring_size", "1e3", "expected an integer, got '1e3'"),
        ("env", "spans.ring_size", "", "expected an integer, got ''"),
        ("env", "spans.ring_size", "9" * 5000, "expected an integer, got '999"),
        ("env", "pid", "99999999999999999999", "must be at most 4194304"),
        ("env", "probes.interval", "0", "must be at least 0.05s, got 0s"),
        ("env", "probes.interval", "1d", "expected a duration like"),
        ("env", "probes.interval", "9" * 400 + "s", "expected a finite duration"),
        ("env", "detection.overdue_multiplier", "nan", "expected a finite number, got 'nan'"),
        ("env", "detection.overdue_multiplier", "-inf", "expected a finite number"),
        ("env", "detection.overdue_multiplier", "true", "expected a finite number, got 'true'"),
        ("env", "probes.canary_body", "[oops", "not valid YAML: expected ',' or ']'"),
        ("env", "probes.canary_body", "", "expected a mapping, got None"),
        ("env", "probes.canary_body", "{a: 2001-01-01}", "not a JSON object"),
        ("env", "mode", "aggressive", "expected one of observe, dry-run, enforce"),
        ("env", "probes.gpu_backend", "cuda", "expected nvml, sim or none, got 'cuda'"),
        ("env", "probes.health_path", "health", "expected a path starting with '/'"),
        ("env", "ladder.admin_method", "PO ST", "expected an HTTP method"),
        ("env", "target", "ftp://x", "expected an http(s) URL"),
        ("env", "target", "http://x:99999", "Port out of range"),
        ("env", "target", "http://[::1", "Invalid IPv6 URL"),
        ("env", "target", "http://", "no host in 'http://'"),
        ("env", "ladder.admin_url", "localhost/shutdown", "expected an http(s) URL"),
        ("env", "spans.forward_endpoint", "http://:4318/v1/traces", "no host"),
        ("env", "otlp_export_endpoint", "grpc://x:4317", "expected an http(s) URL"),
        ("set", "spans.ring_size", "-3", "must be at least 1, got -3"),
        ("set", "ladder.budget_per_hour", "-5", "must be at least 0, got -5"),
        ("set", "detection.health_failures", "2.5", "expected an integer, got '2.5'"),
        ("set", "detection.overdue_multiplier", "5%", "expected a finite number"),
        ("set", "probes.canary_body", "{a: [", "not valid YAML"),
        ("set", "probes.enabled", "spans,tarot", "unknown probe 'tarot'"),
        ("set", "detection", "5", "detection: expected a mapping, got '5'"),
        ("set", "detection.heartbeat_timeout.x", "1", "expected a duration like"),
        ("set", "detection.heartbeat_tmeout", "1s", "detection.heartbeat_tmeout: unknown field"),
        ("set", "admin_token", "a\tb", "unprintable character '\\t' at position 1"),
    ],
)
def test_a_bad_value_is_one_line_naming_origin_and_field(
    tmp_path: Path, source: str, dotted: str, value: Any, message: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        load_from(source, dotted, value, tmp_path)
    text = str(raised.value)
    origin = {
        "file": str(tmp_path / "watchdog.yaml"),
        "env": f"environment variable {env_name(dotted)}",
        "set": "command line",
    }[source]
    field_name = dotted.removesuffix(".x")
    assert text.startswith(f"{origin}: {field_name}"), text
    assert message in text
    assert "\n" not in text and len(text) < 300


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"target: \xff\xfe\n", "not UTF-8 text: byte 0xff at offset 8"),
        (b"\xfe\xff\x00t", "not UTF-8 text"),
        (b"- a list\n", "top level: expected a mapping, got ['a list']"),
        (b"[]\n", "top level: expected a mapping, got []"),
        (b"0\n", "top level: expected a mapping, got 0"),
        (b"just text\n", "top level: expected a mapping, got 'just text'"),
        (b"1: 2\n", ": 1: unknown field"),
        (b"~: 2\n", ": None: unknown field"),
        (b'"a\\nb": 2\n', ": 'a\\nb': unknown field"),
        (b"target: [oops\n", "not valid YAML: expected ',' or ']'"),
        (b"a: 2001-13-45\n", "not valid YAML: month must be in 1..12"),
        (b"a: !!timestamp 99999-01-01\n", "not valid YAML"),
        (b"a: !!python/object:os.system x\n", "not valid YAML: could not determine a constructor"),
        (b"a: " + b"9" * 5000 + b"\n", "not valid YAML: Exceeds the limit"),
        (b"[" * 5000 + b"]" * 5000, "not valid YAML"),
        (b"? [a]\n: b\n", "not valid YAML: found unhashable key"),
    ],
)
def test_a_file_that_is_no_config_is_one_line(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "broken.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as raised:
        load_config(path, environ={})
    text = str(raised.value)
    assert text.startswith(f"{path}: ")
    assert message in text
    assert "\n" not in text


def test_an_empty_file_and_a_byte_order_mark_are_fine(tmp_path: Path) -> None:
    path = tmp_path / "watchdog.yaml"
    path.write_bytes(b"")
    assert load_config(path, environ={}) == WatchdogConfig()
    path.write_bytes("\ufeffmode: observe\n".encode())
    assert load_config(path, environ={}).mode is Mode.OBSERVE


def test_a_later_set_flag_wins_over_an_earlier_one() -> None:
    overrides = set_flag("detection=5", "detection.heartbeat_timeout=2s")
    assert load_config(environ={}, overrides=overrides).detection.heartbeat_timeout == 2.0
    overrides = set_flag("detection.heartbeat_timeout=2s", "detection.heartbeat_timeout.x=1")
    with pytest.raises(ConfigError, match=r"detection\.heartbeat_timeout: expected a duration"):
        load_config(environ={}, overrides=overrides)


@pytest.mark.parametrize("assignment", ["=5", "probes.=1", ".interval=1s", "probes..x=1", "x"])
def test_a_set_flag_without_a_field_is_refused(assignment: str) -> None:
    with pytest.raises(ConfigError, match=r"^command line: --set .*: expected FIELD=VALUE$"):
        set_flag(assignment)


def test_a_canary_body_is_a_json_object() -> None:
    config = load_config(
        environ={"OMNI_WATCHDOG_PROBES_CANARY_BODY": '{"model": "m", "max_tokens": 1}'}
    )
    assert config.probes.canary_body == {"model": "m", "max_tokens": 1}


# ---- the state directory ---------------------------------------------------------------


def state_config(path: Path, mode: str) -> WatchdogConfig:
    return load_config(environ={}, overrides={"state_dir": str(path), "mode": mode})


def test_the_state_dir_is_created_private_with_its_parents(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "state"
    assert prepare_state_dir(state_config(path, "enforce")) == ""
    for directory in (tmp_path / "a", tmp_path / "a" / "b", path):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert list(path.iterdir()) == []  # the probe file is gone


def test_an_existing_state_dir_keeps_its_mode(tmp_path: Path) -> None:
    path = tmp_path / "state"
    path.mkdir(mode=0o755)
    path.chmod(0o755)
    assert prepare_state_dir(state_config(path, "observe")) == ""
    assert stat.S_IMODE(path.stat().st_mode) == 0o755


@pytest.mark.parametrize("mode", ["observe", "dry-run", "enforce"])
def test_a_state_dir_that_cannot_be_created_is_fatal(tmp_path: Path, mode: str) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError) as raised:
        prepare_state_dir(state_config(tmp_path / "file" / "state", mode))
    assert str(raised.value) == (
        f"state_dir: {tmp_path / 'file' / 'state'} cannot be created (Not a directory)"
    )
    with pytest.raises(ConfigError, match="is not a directory"):
        prepare_state_dir(state_config(tmp_path / "file", mode))


def refuse_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    # Tests run as root, who may write anywhere: the probe file is refused instead.
    def refused(**_: Any) -> Any:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", refused)


def test_an_unwritable_state_dir_is_fatal_in_enforce_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refuse_writes(monkeypatch)
    with pytest.raises(ConfigError) as raised:
        prepare_state_dir(state_config(tmp_path, "enforce"))
    assert str(raised.value) == (
        f"state_dir: {tmp_path} is not writable (Permission denied); enforce mode needs it"
        " for the incident journal and the target lock"
    )


@pytest.mark.parametrize("mode", ["observe", "dry-run"])
def test_an_unwritable_state_dir_is_a_warning_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    refuse_writes(monkeypatch)
    warning = prepare_state_dir(state_config(tmp_path, mode))
    assert warning.startswith(f"state_dir: {tmp_path} is not writable (Permission denied); ")
    assert "\n" not in warning


# ---- the command line ------------------------------------------------------------------


@pytest.fixture
def quiet_cli(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No OMNI_WATCHDOG_* variable of this machine, and the package's logger put back."""
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)
    logger = logging.getLogger("omni_watchdog")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved


@pytest.mark.usefixtures("quiet_cli")
@pytest.mark.parametrize("command", ["run", "config"])
def test_main_reports_a_file_that_is_not_utf8_on_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    path = tmp_path / "watchdog.yaml"
    path.write_bytes(b"mode: \xc3\x28\n")
    assert main([command, "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == f"omni-watchdog: {path}: not UTF-8 text: byte 0xc3 at offset 6\n"


@pytest.mark.usefixtures("quiet_cli")
def test_main_reports_a_bad_set_flag_on_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--set", "spans.ring_size=-3"]) == 2
    err = capsys.readouterr().err
    assert err == "omni-watchdog: command line: spans.ring_size: must be at least 1, got -3\n"


@pytest.mark.usefixtures("quiet_cli")
def test_main_reports_a_bad_variable_on_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OMNI_WATCHDOG_PROBES_INTERVAL", "0s")
    assert main(["run"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "omni-watchdog: environment variable OMNI_WATCHDOG_PROBES_INTERVAL: probes.interval:"
        " must be at least 0.05s, got 0s\n"
    )


@pytest.mark.usefixtures("quiet_cli")
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--pid", "abc"], "command line: pid: expected an integer, got 'abc'"),
        (["--listen", "::1:9464"], "command line: listen: an IPv6 address needs brackets"),
        (["--set", "nothing"], "command line: --set 'nothing': expected FIELD=VALUE"),
        (["--set", "a.b=1", "--set", "a=2"], "command line: a: unknown field"),
        (["--state-dir", "/dev/null/state"], "state_dir: /dev/null/state cannot be created"),
    ],
)
def test_main_reports_other_bad_flags_on_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(["run", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"omni-watchdog: {message}")
    assert err.count("\n") == 1


@pytest.mark.usefixtures("quiet_cli")
def test_run_prints_a_state_dir_warning_and_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    refuse_writes(monkeypatch)
    started: list[WatchdogConfig] = []

    async def run_watchdog(config: WatchdogConfig) -> int:
        started.append(config)
        return 0

    monkeypatch.setattr(cli, "_run_watchdog", run_watchdog)
    assert main(["run", "--mode", "observe", "--state-dir", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert err.startswith(f"omni-watchdog: warning: state_dir: {tmp_path} is not writable")
    assert err.count("\n") == 1
    assert len(started) == 1


@pytest.mark.usefixtures("quiet_cli")
def test_run_exits_with_the_internal_error_code_on_a_bug_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async def run_watchdog(config: WatchdogConfig) -> int:
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli, "_run_watchdog", run_watchdog)
    assert main(["run", "--state-dir", str(tmp_path)]) == cli.EXIT_INTERNAL
    assert "omni-watchdog: internal error: RuntimeError('a bug')" in capsys.readouterr().err


@pytest.mark.usefixtures("quiet_cli")
def test_run_help_states_the_real_defaults(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "400")
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    defaults = WatchdogConfig()
    for value in (
        defaults.target,
        defaults.pid,
        defaults.listen,
        defaults.spans.otlp_listen,
        defaults.mode.value,
        defaults.probes.gpu_backend,
        defaults.resolved_state_dir(),
    ):
        assert f"(default {value})" in out


def test_the_listed_defaults_state_each_range() -> None:
    rows = {name: doc for name, _, doc in describe_defaults()}
    assert rows["probes.interval"].endswith("Range: 0.05s..3600s.")
    assert rows["spans.ring_size"].endswith("Range: 1..4096.")
    assert "Range" not in rows["target"]
