"""The watchdog's account of itself: its probes' health, its own errors, and whether its
event loop runs when it should.

All are written by the loops and read into each `WatchdogState`; a failure is logged
once per distinct reason and always counted, so a loop that fails at every turn neither
floods the log nor goes unseen.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from omni_watchdog.log import log_event
from omni_watchdog.types import Clock, ProbeHealth

logger = logging.getLogger("omni_watchdog.app")

INTERNAL_ERROR_LOOPS = ("evaluate", "ingest", "ladder", "listener")
# Distinct internal errors logged with their traceback; repeats are only counted.
_LOGGED_ERRORS_LIMIT = 256
# The sight loop looks this often. A look more than LATE_ALLOWED after it was due means the
# loop could not run: scheduling jitter is milliseconds; a process starved of CPU by the
# server it watches, measured on two cores, stops for tenths of seconds up to 3 s.
SIGHT_EVERY = 0.1
LATE_ALLOWED = 0.1
# While the server is at rest the loop looks this often: a blind spell shorter than
# SIGHT_AT_REST + LATE_ALLOWED then goes unseen, which no heartbeat timeout (seconds)
# feels, and the loop wakes a fifth as often. Rest ends on the first news.
SIGHT_AT_REST = 0.5
# A spell this long is logged, at most once per LOG_BLIND_EVERY with the count between.
LOGGED_BLIND_SPELL = 1.0
LOG_BLIND_EVERY = 60.0


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


class LoopSight:
    """Whether the watchdog's event loop runs when it should.

    The sight loop looks every `period` (`SIGHT_EVERY`, or `SIGHT_AT_REST` while the server
    is at rest), and so does every probe result before it is taken in. A look that comes
    more than `LATE_ALLOWED` after the one due next means nothing ran in between: the
    spell is handed to `on_blind` (the detector, which then does not count it as the
    server's silence) and counted for `/metrics`.
    """

    def __init__(self, clock: Clock, on_blind: Callable[[float, float], None]) -> None:
        self._clock = clock
        self._on_blind = on_blind
        self._last_look: float | None = None
        self.period = SIGHT_EVERY
        # The period when the last look was made: the loop's next look was due after it,
        # even if the period has shortened since.
        self._period_at_last_look = SIGHT_EVERY
        self._last_logged: float | None = None
        self._unlogged = 0
        self.blind_seconds = 0.0
        self.blind_spells = 0

    def pace(self, period: float) -> None:
        """Look every `period` from the next look on."""
        self.period = period

    def look(self) -> None:
        now = self._clock.monotonic()
        last, self._last_look = self._last_look, now
        period, self._period_at_last_look = self._period_at_last_look, self.period
        if last is None or now - last <= period + LATE_ALLOWED:
            return
        # The loop was due to run one period after the last look; blind from then on.
        start = last + period
        self.blind_seconds += now - start
        self.blind_spells += 1
        self._on_blind(start, now)
        if now - start >= LOGGED_BLIND_SPELL:
            self._log(now, now - start)

    def _log(self, now: float, seconds: float) -> None:
        if self._last_logged is not None and now - self._last_logged < LOG_BLIND_EVERY:
            self._unlogged += 1
            return
        log_event(
            logger,
            "watchdog_blind",
            logging.WARNING,
            seconds=round(seconds, 2),
            long_spells_unlogged=self._unlogged,
            hint="the watchdog's own loop could not run: give it CPU of its own",
        )
        self._last_logged = now
        self._unlogged = 0
