"""Reads of incident bundles run a few at a time off the loop; past a bound they are 503."""

from __future__ import annotations

import asyncio
import functools
import threading

import pytest
from aiohttp import web

from omni_watchdog.exporters.api import BundleReads

WAIT_S = 10.0


def test_reads_run_two_at_a_time_and_past_the_bound_are_refused() -> None:
    released = threading.Event()
    running: list[int] = []
    most = [0]
    lock = threading.Lock()

    def read(number: int) -> int:
        with lock:
            running.append(number)
            most[0] = max(most[0], len(running))
        released.wait(WAIT_S)
        with lock:
            running.remove(number)
        return number

    async def scenario() -> list[int]:
        reads = BundleReads(at_once=2, waiting=4)
        held = [asyncio.create_task(reads.run(functools.partial(read, n))) for n in range(4)]
        await asyncio.sleep(0)  # each has taken its place
        with pytest.raises(web.HTTPServiceUnavailable) as refused:
            await reads.run(lambda: read(99))
        assert refused.value.headers["Retry-After"] == "1"
        assert reads.refused == 1
        released.set()
        done = await asyncio.wait_for(asyncio.gather(*held), WAIT_S)
        # Room again once they are done.
        assert await reads.run(lambda: 7) == 7
        return done

    assert asyncio.run(scenario()) == [0, 1, 2, 3]
    assert most[0] == 2
