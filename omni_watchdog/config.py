"""One typed configuration: defaults, then a YAML file, then `OMNI_WATCHDOG_*`, then flags.

Durations are written like "30s", "500ms" or "2m". Every error names where the bad value
came from (the file, the variable or the flag) and the dotted field.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from omni_watchdog.types import Mode

ENV_PREFIX = "OMNI_WATCHDOG_"

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


class ConfigError(ValueError):
    """A configuration value that cannot be used, with where it came from."""


def parse_duration(text: str | float | int) -> float:
    """Seconds from "30s", "500ms", "2m", "1h" or a bare number of seconds."""
    if isinstance(text, bool):
        raise ValueError(f"expected a duration like '30s', got {text!r}")
    if isinstance(text, (int, float)):
        if text < 0:
            raise ValueError(f"a duration cannot be negative, got {text!r}")
        return float(text)
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"expected a duration like '30s' or '500ms', got {text!r}")
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]


def _duration(default: float, doc: str) -> Any:
    return field(default=default, metadata={"duration": True, "doc": doc})


def _setting(default: Any, doc: str) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class DetectionConfig:
    """Thresholds of the stall rules (DESIGN.md section 4)."""

    heartbeat_timeout: float = _duration(
        3.0, "No loop heartbeat from a stage for this long is evidence (3 missed 1 s beats)."
    )
    progress_timeout: float = _duration(
        4.0, "Requests running on a stage and its progress counters flat for this long."
    )
    stale_after: float = _duration(
        3.0, "Metrics not refreshed for this long are unknown, never 'flat'."
    )
    health_failures: int = _setting(
        3, "Consecutive failed /health calls (503, timeout, refused) before it is evidence."
    )
    confirm_timeout: float = _duration(
        10.0, "A single kind of evidence held this long confirms a verdict on its own."
    )
    stuck_timeout: float = _duration(
        2.0, "A process stopped (T) or in D state this long, or without CPU progress."
    )
    startup_grace: float = _duration(
        5.0, "Nothing is judged until the first healthy /health plus this grace."
    )
    overdue_floor: float = _duration(
        10.0, "The smallest deadline for a stage's span after the request reached it."
    )
    overdue_multiplier: float = _setting(
        4.0, "Deadline = max(floor, multiplier x rolling p99 of the stage's durations)."
    )
    gpu_idle_utilization: float = _setting(
        0.05, "Utilization at or under this counts as idle for gpu_held evidence."
    )
    crash_window: float = _duration(
        30.0, "Unhealthy signs this long before the server exits make the exit a crash."
    )


@dataclass(frozen=True)
class ProbesConfig:
    """How often and how patiently each probe looks."""

    interval: float = _duration(0.5, "Period of the process and GPU probes.")
    health_interval: float = _duration(1.0, "Period of the /health probe.")
    health_timeout: float = _duration(1.0, "A /health call slower than this is a timeout.")
    health_path: str = _setting("/health", "Path of the server's health endpoint.")
    metrics_interval: float = _duration(1.0, "Period of the /metrics scrape.")
    metrics_timeout: float = _duration(2.0, "A /metrics scrape slower than this fails.")
    metrics_path: str = _setting("/metrics", "Path of the server's metrics endpoint.")
    canary_interval: float = _duration(
        3.0, "Send a canary after this long without organic progress."
    )
    canary_deadline: float = _duration(5.0, "A canary that takes longer than this failed.")
    canary_path: str = _setting("/v1/chat/completions", "Path the canary request is sent to.")
    canary_body: dict[str, Any] = _setting(
        {}, "JSON body of the canary; empty means one text token to the served model."
    )
    gpu_backend: str = _setting("nvml", "nvml (real pynvml), sim (the simulator's), or none.")
    enabled: list[str] = _setting(
        ["spans", "metrics", "health", "canary", "processes", "gpu"], "Probes to run."
    )


@dataclass(frozen=True)
class SpansConfig:
    """The OTLP/HTTP receiver."""

    otlp_listen: str = _setting("127.0.0.1:4318", "HOST:PORT of the OTLP/HTTP receiver.")
    max_body_bytes: int = _setting(
        16 * 1024 * 1024, "Largest request body, compressed or not (413 above)."
    )
    queue_size: int = _setting(
        10_000, "Decoded batches waiting for the detector; 503 with Retry-After when full."
    )
    ring_size: int = _setting(256, "Spans kept per stage for the detector and bundles.")
    forward_endpoint: str = _setting(
        "", "Upstream OTLP/HTTP traces URL that receives a copy of everything; empty: none."
    )


@dataclass(frozen=True)
class LadderConfig:
    """The remediation ladder (DESIGN.md section 5)."""

    steps: list[str] = _setting(
        ["capture", "shutdown", "terminate", "kill", "verify"], "Steps, in order."
    )
    capture_timeout: float = _duration(5.0, "Bound on capturing stacks and snapshots.")
    self_exit_grace: float = _duration(
        5.0,
        "When the server itself answers 503, wait this long for it to exit on its own"
        " (vLLM exits about 3 s after its engine dies) before asking it to.",
    )
    admin_url: str = _setting(
        "", "Shutdown endpoint; empty means the target URL + /admin/shutdown."
    )
    admin_method: str = _setting("POST", "HTTP method of the shutdown endpoint.")
    admin_timeout: float = _duration(1.0, "The shutdown request itself must answer this fast.")
    shutdown_grace: float = _duration(
        5.0, "After an accepted shutdown request, wait this long for the tree to exit."
    )
    term_grace: float = _duration(3.0, "After SIGTERM, wait this long before SIGKILL.")
    kill_grace: float = _duration(2.0, "After SIGKILL, wait this long for exits.")
    release_timeout: float = _duration(
        10.0, "GPU memory must be back to baseline this long after the kill."
    )
    budget_per_hour: int = _setting(3, "Enforced incidents allowed per rolling hour.")


@dataclass(frozen=True)
class WatchdogConfig:
    """Everything `omni-watchdog run` needs."""

    target: str = _setting("http://127.0.0.1:8000", "Base URL of the served model.")
    pid: int = _setting(0, "The server's pid; 0 finds the process listening on the port.")
    stage_config: str = _setting("", "vLLM-Omni stage config file (0.11 or 0.30 schema).")
    listen: str = _setting("127.0.0.1:9464", "HOST:PORT of the watchdog's own HTTP API.")
    mode: Mode = _setting(Mode.DRY_RUN, "observe, dry-run or enforce.")
    state_dir: str = _setting(
        "", "Incident journal, bundles and lock; empty means ~/.local/state/omni-watchdog."
    )
    admin_token: str = _setting("", "Bearer token for the shutdown endpoint.")
    otlp_export_endpoint: str = _setting(
        "", "OTLP/HTTP traces URL for the watchdog's own incident spans; empty: none."
    )
    detection: DetectionConfig = field(default_factory=DetectionConfig)
    probes: ProbesConfig = field(default_factory=ProbesConfig)
    spans: SpansConfig = field(default_factory=SpansConfig)
    ladder: LadderConfig = field(default_factory=LadderConfig)

    def resolved_state_dir(self) -> Path:
        if self.state_dir:
            return Path(self.state_dir)
        return Path.home() / ".local" / "state" / "omni-watchdog"

    def resolved_admin_url(self) -> str:
        return self.ladder.admin_url or self.target.rstrip("/") + "/admin/shutdown"


Section = TypeVar("Section")


def _field_type(owner: type[Any], name: str) -> Any:
    return typing.get_type_hints(owner)[name]


def _convert(value: Any, kind: Any, is_duration: bool, where: str) -> Any:
    try:
        if is_duration:
            return parse_duration(value)
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            return kind(value)
        if kind is bool:
            if isinstance(value, str):
                if value.lower() in ("1", "true", "yes", "on"):
                    return True
                if value.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError(f"expected true or false, got {value!r}")
            if not isinstance(value, bool):
                raise ValueError(f"expected true or false, got {value!r}")
            return value
        if kind is int:
            if isinstance(value, (bool, float)):
                raise ValueError(f"expected an integer, got {value!r}")
            return int(value)
        if kind is float:
            if isinstance(value, bool):
                raise ValueError(f"expected a number, got {value!r}")
            return float(value)
        if kind is str:
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise ValueError(f"expected a string, got {value!r}")
            return str(value)
        origin = typing.get_origin(kind)
        if origin is list:
            if isinstance(value, str):
                value = [item.strip() for item in value.split(",") if item.strip()]
            if not isinstance(value, list):
                raise ValueError(f"expected a list, got {value!r}")
            (item_kind,) = typing.get_args(kind)
            return [_convert(item, item_kind, False, where) for item in value]
        if origin is dict:
            if isinstance(value, str):
                value = yaml.safe_load(value)
            if not isinstance(value, dict):
                raise ValueError(f"expected a mapping, got {value!r}")
            return dict(value)
        if origin in (typing.Union, types.UnionType):
            raise TypeError(f"unsupported config type {kind!r}")
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{where}: {error}") from None
    raise ConfigError(f"{where}: unsupported config type {kind!r}")


def _build(cls: type[Section], values: Mapping[str, Any], origin: str, prefix: str) -> Section:
    if not isinstance(values, Mapping):
        raise ConfigError(f"{origin}: {prefix or 'top level'}: expected a mapping")
    known = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"{origin}: {prefix}{unknown[0]}: unknown field")
    converted: dict[str, Any] = {}
    for name, value in values.items():
        spec = known[name]
        kind = _field_type(cls, name)
        where = f"{origin}: {prefix}{name}"
        if dataclasses.is_dataclass(kind):
            converted[name] = _build(kind, value, origin, f"{prefix}{name}.")  # type: ignore[arg-type]
        else:
            converted[name] = _convert(value, kind, bool(spec.metadata.get("duration")), where)
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


def load_config(
    path: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> WatchdogConfig:
    """Defaults, then the YAML file at `path`, then the environment, then `overrides`."""
    layers: list[tuple[str, Mapping[str, Any]]] = []
    if path:
        file_path = Path(path)
        try:
            loaded = yaml.safe_load(file_path.read_text()) or {}
        except OSError as error:
            raise ConfigError(f"{file_path}: cannot read: {error.strerror}") from None
        except yaml.YAMLError as error:
            raise ConfigError(f"{file_path}: not valid YAML: {error}") from None
        if not isinstance(loaded, Mapping):
            raise ConfigError(f"{file_path}: top level: expected a mapping")
        layers.append((str(file_path), loaded))
    layers.extend(_env_layer(os.environ if environ is None else environ))
    if overrides:
        layers.append(("command line", overrides))
    config = WatchdogConfig()
    merged: dict[str, Any] = {}
    for origin, layer in layers:
        # Validate each layer alone so an error names the layer it came from.
        _build(WatchdogConfig, merge_layers(merged, layer), origin, "")
        merged = merge_layers(merged, layer)
    config = _build(WatchdogConfig, merged, "configuration", "")
    _validate(config)
    return config


def _validate(config: WatchdogConfig) -> None:
    from omni_watchdog.types import StepName

    for name in config.ladder.steps:
        if name not in {step.value for step in StepName}:
            raise ConfigError(f"configuration: ladder.steps: unknown step {name!r}")
    known_probes = {"spans", "metrics", "health", "canary", "processes", "gpu"}
    for name in config.probes.enabled:
        if name not in known_probes:
            raise ConfigError(f"configuration: probes.enabled: unknown probe {name!r}")
    if config.probes.gpu_backend not in ("nvml", "sim", "none"):
        raise ConfigError(
            "configuration: probes.gpu_backend: expected nvml, sim or none, "
            f"got {config.probes.gpu_backend!r}"
        )
    sees_exit = set(config.probes.enabled) & {"processes", "health"}
    if config.mode is Mode.ENFORCE and "verify" in config.ladder.steps and not sees_exit:
        # With neither, nothing can tell whether the server went: verify would always fail.
        raise ConfigError(
            "configuration: probes.enabled: the verify step needs 'processes' or, without "
            "the server's PID namespace, 'health'"
        )
    if config.detection.health_failures < 1:
        raise ConfigError("configuration: detection.health_failures: must be at least 1")
    if config.detection.confirm_timeout < config.detection.heartbeat_timeout:
        raise ConfigError(
            "configuration: detection.confirm_timeout: must not be shorter than "
            "detection.heartbeat_timeout"
        )
    if not config.target.startswith(("http://", "https://")):
        raise ConfigError(f"configuration: target: expected an http(s) URL, got {config.target!r}")
    for name, value in (("listen", config.listen), ("spans.otlp_listen", config.spans.otlp_listen)):
        split_host_port(value, f"configuration: {name}")


def split_host_port(value: str, where: str) -> tuple[str, int]:
    """("127.0.0.1", 4318) from "127.0.0.1:4318", with an error naming `where`."""
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{where}: expected HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


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
            if spec.metadata.get("duration"):
                shown = f"{value:g}s"
            rows.append((f"{prefix}{spec.name}", str(shown), spec.metadata.get("doc", "")))

    walk(WatchdogConfig, WatchdogConfig(), "")
    return rows
