"""The watchdog's account of itself: its probes' health and its own errors.

Both are written by the loops and read into each `WatchdogState`; a failure is logged
once per distinct reason and always counted, so a loop that fails at every turn neither
floods the log nor goes unseen.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from omni_watchdog.log import log_event
from omni_watchdog.types import ProbeHealth

logger = logging.getLogger("omni_watchdog.app")

INTERNAL_ERROR_LOOPS = ("evaluate", "ingest", "ladder", "listener")
# Distinct internal errors logged with their traceback; repeats are only counted.
_LOGGED_ERRORS_LIMIT = 256


class InternalErrors:
    """Exceptions of the watchdog's own code, per loop; the loop goes on after each."""

    def __init__(self) -> None:
        self._counts = dict.fromkeys(INTERNAL_ERROR_LOOPS, 0)
        self._logged: set[tuple[str, str, str]] = set()

    def record(self, loop: str, error: Exception) -> None:
        """Count the error; log it with its traceback the first time it is seen."""
        self.count(loop)
        key = (loop, type(error).__name__, str(error)[:200])
        if key in self._logged or len(self._logged) >= _LOGGED_ERRORS_LIMIT:
            return
        self._logged.add(key)
        log_event(
            logger, "internal_error", logging.ERROR, exc_info=error, loop=loop, error=repr(error)
        )

    def count(self, loop: str) -> None:
        self._counts[loop] = self._counts.get(loop, 0) + 1

    def counts(self) -> dict[str, int]:
        return dict(self._counts)


class ProbeBoard:
    """How each probe is doing: up after a run that succeeded, down with its reason."""

    def __init__(self, names: Iterable[str]) -> None:
        self._health = {name: ProbeHealth(name) for name in names}

    def succeeded(self, name: str, duration: float) -> None:
        self._health[name] = ProbeHealth(name, True, self._get(name).errors_total, "", duration)

    def failed(self, name: str, reason: str, duration: float | None = None) -> None:
        """A run failed; logged when the probe was up or its reason changed."""
        health = self._get(name)
        if health.up or health.last_error != reason:
            log_event(logger, "probe_failed", logging.WARNING, probe=name, reason=reason)
        self._health[name] = ProbeHealth(
            name,
            False,
            health.errors_total + 1,
            reason,
            health.last_duration if duration is None else duration,
        )

    def snapshot(self) -> tuple[ProbeHealth, ...]:
        return tuple(self._health[name] for name in sorted(self._health))

    def _get(self, name: str) -> ProbeHealth:
        return self._health.get(name) or ProbeHealth(name)
