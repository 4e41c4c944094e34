"""Random YAML, environment and `--set` values: a config or a ConfigError, nothing else."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omni_watchdog.cli import build_parser, overrides_of
from omni_watchdog.config import ENV_PREFIX, ConfigError, WatchdogConfig, load_config

FUZZ = settings(
    max_examples=100,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


def field_names(cls: type[Any] = WatchdogConfig) -> dict[str, Any]:
    """Each field's name, with a dict of the same for a section and None for a value."""
    hints = typing.get_type_hints(cls)
    return {
        spec.name: field_names(hints[spec.name])
        if dataclasses.is_dataclass(hints[spec.name])
        else None
        for spec in dataclasses.fields(cls)
    }


FIELDS = field_names()
DOTTED = sorted(
    [f"{name}.{sub}" for name, section in FIELDS.items() if section for sub in section]
    + [name for name, section in FIELDS.items() if not section]
)
VARIABLES = [ENV_PREFIX + name.replace(".", "_").upper() for name in DOTTED]
# Values near the edges of what fields take, beside the random ones.
TRICKY = [
    "0",
    "0s",
    "-1",
    "1e400",
    "nan",
    "inf",
    "-inf",
    "1d",
    "500ms",
    "25h",
    "true",
    "",
    "[::1]:0",
    "::1:4318",
    "0.0.0.0:4318",
    ":0",
    "http://[::1",
    "http://x:99999",
    "capture,kill",
    "kill,capture",
    "spans,tarot",
    "{a: [",
    "{a: 1}",
    "[1, 2]",
    "a\nb",
    "9" * 5000,
    "observe",
    "enforce",
    "/health",
    "\x00",
]
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(10**400), max_value=10**400),
    st.floats(),
    st.text(max_size=20),
    st.sampled_from(TRICKY),
)
VALUES = st.recursive(
    SCALARS,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(max_size=8) | st.sampled_from(DOTTED), children, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def documents(draw: st.DrawFn) -> dict[Any, Any]:
    """A mapping shaped like a config file, with random keys and values mixed in."""
    document: dict[Any, Any] = {}
    for name in draw(st.lists(st.sampled_from(sorted(FIELDS)) | st.text(max_size=8), max_size=6)):
        section = FIELDS.get(name)
        if section and draw(st.booleans()):
            keys = st.sampled_from(sorted(section)) | st.text(max_size=8)
            document[name] = draw(st.dictionaries(keys, VALUES, max_size=4))
        else:
            document[name] = draw(VALUES)
    return document


def config_or_error(load: typing.Callable[[], WatchdogConfig]) -> None:
    try:
        assert isinstance(load(), WatchdogConfig)
    except ConfigError as error:
        assert "\n" not in str(error), str(error)


@FUZZ
@given(document=documents())
def test_random_yaml_documents(tmp_path: Path, document: dict[Any, Any]) -> None:
    path = tmp_path / "watchdog.yaml"
    path.write_text(yaml.safe_dump(document, allow_unicode=True))
    config_or_error(lambda: load_config(path, environ={}))


@FUZZ
@given(content=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_random_file_contents(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "watchdog.yaml"
    path.write_bytes(content)
    config_or_error(lambda: load_config(path, environ={}))


@FUZZ
@given(
    environ=st.dictionaries(
        st.sampled_from(VARIABLES) | st.text(max_size=12).map(ENV_PREFIX.__add__),
        st.text(max_size=30) | st.sampled_from(TRICKY),
        max_size=5,
    )
)
def test_random_environment_values(environ: dict[str, str]) -> None:
    config_or_error(lambda: load_config(environ=environ))


@FUZZ
@given(
    assignments=st.lists(
        st.tuples(
            st.sampled_from(DOTTED) | st.text(max_size=12),
            st.text(max_size=30) | st.sampled_from(TRICKY),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_random_set_flags(assignments: list[tuple[str, str]]) -> None:
    argv = ["run", *(f"--set={name}={value}" for name, value in assignments)]

    def load() -> WatchdogConfig:
        return load_config(environ={}, overrides=overrides_of(build_parser().parse_args(argv)))

    config_or_error(load)
