"""The watchdog's records as plain JSON values: the journals, the API and the bundles
write them alike."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any


def to_jsonable(value: Any) -> Any:
    """Dataclasses, enums and tuples as plain JSON values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    return value
