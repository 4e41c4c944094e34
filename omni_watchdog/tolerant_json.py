"""Values out of JSON nobody vouches for: an incident bundle, another watchdog's answer.

Each reader takes whatever JSON value is there and gives the value of the type asked for,
or an empty one, never an exception: a huge integer, NaN, a string where a number was
meant or a number where a list was meant each read as absent, so that one odd field costs
only itself.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def number(value: object) -> float | None:
    """A finite number, or None: a bool is not one, nor an integer beyond any float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        as_float = float(value)
    except OverflowError:
        return None
    return as_float if math.isfinite(as_float) else None


def mapping(value: object) -> Mapping[str, Any]:
    """An object, or an empty one."""
    return value if isinstance(value, Mapping) else {}


def items(value: object) -> list[Any]:
    """The entries of a list (a string, a number or an object is not one), else none."""
    return list(value) if isinstance(value, (list, tuple)) else []


def mappings(value: object) -> list[Mapping[str, Any]]:
    """The objects of a list, whatever else it holds left out."""
    return [item for item in items(value) if isinstance(item, Mapping)]
