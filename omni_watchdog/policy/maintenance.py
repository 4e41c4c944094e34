"""Maintenance windows: an operator holds the watchdog's actions for a while.

Detection, alerts and the API go on; an incident opens as usual and captures its
evidence, then waits before its first acting step until the window ends (by its clock or
by `resume`). The window is journaled, so a watchdog restarted inside it keeps it.
"""

from __future__ import annotations

import asyncio
import contextlib

from omni_watchdog.types import Clock, MaintenancePause

# The longest window one `pause` may open: a forgotten pause must not disarm the
# watchdog for good.
MAX_PAUSE_SECONDS = 24 * 3600.0
MAX_REASON_CHARS = 500


class MaintenanceWindow:
    """Whether actions are held now, and a way to wait until they are not."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._pause: MaintenancePause | None = None
        self._changed = asyncio.Event()

    def current(self) -> MaintenancePause | None:
        """The pause in force now; one whose end has passed is over."""
        pause = self._pause
        if pause is not None and self._clock.wall() >= pause.until:
            self._pause = None
            return None
        return pause

    def pause(self, seconds: float, reason: str) -> MaintenancePause:
        """Hold actions for `seconds` from now; a new pause replaces the one in force."""
        if not 0 < seconds <= MAX_PAUSE_SECONDS:
            raise ValueError(f"a pause lasts more than 0 s and at most {MAX_PAUSE_SECONDS:g} s")
        reason = reason.strip()
        if not reason or len(reason) > MAX_REASON_CHARS:
            raise ValueError(f"a pause needs a reason of 1 to {MAX_REASON_CHARS} characters")
        now = self._clock.wall()
        self._pause = MaintenancePause(since=now, until=now + seconds, reason=reason)
        self._notify()
        return self._pause

    def resume(self) -> MaintenancePause | None:
        """End the pause in force now; returns it, or None when there was none."""
        ended = self.current()
        self._pause = None
        self._notify()
        return ended

    def restore(self, pause: MaintenancePause) -> None:
        """Keep a journaled pause that has not ended yet (a restarted watchdog)."""
        if pause.until > self._clock.wall():
            self._pause = pause
            self._notify()

    async def wait_until_over(self) -> None:
        """Return once no pause is in force: at its end or at `resume`."""
        while (pause := self.current()) is not None:
            self._changed.clear()
            remaining = max(0.0, pause.until - self._clock.wall())
            # A wall-clock step or a new pause is picked up within a second.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(remaining, 1.0))

    def _notify(self) -> None:
        self._changed.set()
