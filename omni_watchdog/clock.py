"""The clocks: the system's, and a fake one that tests move by hand."""

from __future__ import annotations

import asyncio
import time


class SystemClock:
    """The real clock."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()


class FakeClock:
    """A clock that only moves when told to, for table tests of the detector and policy."""

    def __init__(self, start: float = 1000.0, wall_offset: float = 1_700_000_000.0) -> None:
        self._now = start
        self._wall_offset = wall_offset

    def monotonic(self) -> float:
        return self._now

    def wall(self) -> float:
        return self._now + self._wall_offset

    def advance(self, seconds: float) -> float:
        self._now += seconds
        return self._now

    def set(self, now: float) -> None:
        self._now = now

    async def sleep(self, seconds: float) -> None:
        """Stands in for asyncio.sleep: time passes at once, other tasks still get a turn."""
        self.advance(seconds)
        await asyncio.sleep(0)
