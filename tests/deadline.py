"""Waiting, in tests, for a condition to hold: poll it until it does or a deadline passes.

Every test that waits on another process, thread or task waits through here, so that a
wait that runs out fails alike everywhere: an AssertionError that says what was awaited
and the last value seen, which is most of what a failure in CI has to tell.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

T = TypeVar("T")

# Cheap enough for conditions read in this process; pass a longer interval where a look
# costs the watched server something (an HTTP request, a scrape).
INTERVAL = 0.1


def wait_until(
    probe: Callable[[], T | None],
    timeout: float,
    what: str = "",
    interval: float = INTERVAL,
    seen: Callable[[], object] | None = None,
) -> T:
    """Call `probe` until it returns something truthy, and return that. After `timeout`
    seconds raise AssertionError naming `what` (else the probe), the last value and, when
    given, what `seen()` shows then."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(_not_met(probe, what, timeout, value, seen))
        time.sleep(interval)


def holds_for(
    probe: Callable[[], object],
    seconds: float,
    what: str = "",
    interval: float = INTERVAL,
    seen: Callable[[], object] | None = None,
) -> None:
    """The other side of a wait: `probe` stays truthy, looked at every `interval`, for
    `seconds`; the first look it fails raises AssertionError as `wait_until` does."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = probe()
        if not value:
            raise AssertionError(_broken(probe, what, seconds, value, seen))
        time.sleep(interval)


@overload
async def wait_for(
    probe: Callable[[], Awaitable[T | None]],
    timeout: float,
    what: str = "",
    interval: float = INTERVAL,
    seen: Callable[[], object] | None = None,
) -> T: ...


@overload
async def wait_for(
    probe: Callable[[], T | None],
    timeout: float,
    what: str = "",
    interval: float = INTERVAL,
    seen: Callable[[], object] | None = None,
) -> T: ...


async def wait_for(
    probe: Callable[[], Any],
    timeout: float,
    what: str = "",
    interval: float = INTERVAL,
    seen: Callable[[], object] | None = None,
) -> Any:
    """`wait_until` on the event loop, which runs on between looks; `probe` may be a
    coroutine function."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(_not_met(probe, what, timeout, value, seen))
        await asyncio.sleep(interval)


def _not_met(
    probe: Callable[[], object],
    what: str,
    timeout: float,
    last: object,
    seen: Callable[[], object] | None,
) -> str:
    return f"{what or _named(probe)}: not within {timeout:g}s; last value {last!r}{_shown(seen)}"


def _broken(
    probe: Callable[[], object],
    what: str,
    seconds: float,
    value: object,
    seen: Callable[[], object] | None,
) -> str:
    return f"{what or _named(probe)}: broke within {seconds:g}s, value {value!r}{_shown(seen)}"


def _named(probe: Callable[[], object]) -> str:
    """A probe without a `what` is named by where its code is: most are lambdas."""
    code = getattr(probe, "__code__", None)
    where = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
    return f"{getattr(probe, '__qualname__', repr(probe))}{where}"


def _shown(seen: Callable[[], object] | None) -> str:
    return "" if seen is None else f"; seen: {seen()}"
