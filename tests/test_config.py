"""Config layers (file, environment, flags), durations, and errors that name file and field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from omni_watchdog.cli import build_parser, overrides_of
from omni_watchdog.config import ConfigError, describe_defaults, load_config, parse_duration
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
