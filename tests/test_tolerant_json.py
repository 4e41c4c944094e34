"""Reading untrusted JSON: each reader gives its type or an empty value, never raises."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from omni_watchdog.tolerant_json import items, mapping, mappings, number

HUGE = 10**400  # an integer beyond any float


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, 0.0),
        (-3, -3.0),
        (2.5, 2.5),
        (1_796_343_429.75, 1_796_343_429.75),
        (2**1023, float(2**1023)),
        (HUGE, None),
        (-HUGE, None),
        (float("nan"), None),
        (float("inf"), None),
        (float("-inf"), None),
        (True, None),
        (False, None),
        (None, None),
        ("12", None),
        ([1], None),
        ({"a": 1}, None),
    ],
    ids=lambda value: repr(value)[:24],
)
def test_number(value: Any, expected: float | None) -> None:
    read = number(value)
    assert read == expected
    assert read is None or (isinstance(read, float) and math.isfinite(read))


def test_numbers_as_json_parses_them() -> None:
    # What `json.loads` makes of a huge integer, NaN and an overflowing exponent.
    parsed = json.loads(f"[{HUGE}, NaN, Infinity, 1e400, -1e400, 7]")
    assert [number(value) for value in parsed] == [None, None, None, None, None, 7.0]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"a": 1}, {"a": 1}),
        ({}, {}),
        ([("a", 1)], {}),
        ("a", {}),
        (None, {}),
        (HUGE, {}),
    ],
    ids=lambda value: repr(value)[:24],
)
def test_mapping(value: Any, expected: dict[str, Any]) -> None:
    assert mapping(value) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ([1, "a", None], [1, "a", None]),
        ((1, 2), [1, 2]),
        ([], []),
        ("abc", []),
        ({"a": 1}, []),
        (HUGE, []),
        (None, []),
    ],
    ids=lambda value: repr(value)[:24],
)
def test_items(value: Any, expected: list[Any]) -> None:
    assert items(value) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ([{"a": 1}, 1, "x", None, [], {"b": HUGE}], [{"a": 1}, {"b": HUGE}]),
        ([], []),
        ({"a": 1}, []),
        ("[{}]", []),
    ],
    ids=lambda value: repr(value)[:24],
)
def test_mappings(value: Any, expected: list[dict[str, Any]]) -> None:
    assert mappings(value) == expected
