"""Exit notices: a watched process's exit ends the tracker's rest at once.

Most tests stand a pipe in for each pidfd (writing to it is the exit), so that what is
watched and when it is noticed are exact. One test watches a real child this test
started, through a real pidfd, and kills it.
"""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
import sys

import pytest
from deadline import wait_for

from omni_watchdog.probes import exits
from omni_watchdog.probes.exits import ExitNotices
from omni_watchdog.process_start import start_time
from omni_watchdog.types import ProcessIdentity

STARTED = 1000.0


class Pipes:
    """pidfds as pipes: `exit(pid)` makes the pidfd of `pid` readable."""

    def __init__(self) -> None:
        self.write_ends: dict[int, int] = {}
        self.pid_of: dict[int, int] = {}
        self.closed: list[int] = []

    def open(self, pid: int) -> int:
        read_end, write_end = os.pipe()
        self.write_ends[pid] = write_end
        self.pid_of[read_end] = pid
        return read_end

    def close(self, fd: int) -> None:
        self.closed.append(self.pid_of.pop(fd))
        os.close(fd)

    def exit(self, pid: int) -> None:
        os.write(self.write_ends[pid], b"x")

    def close_all(self) -> None:
        for write_end in self.write_ends.values():
            os.close(write_end)


def identity(pid: int) -> ProcessIdentity:
    return ProcessIdentity(pid, STARTED)


def notices(pipes: Pipes, started: dict[int, float] | None = None) -> ExitNotices:
    def start_of(pid: int) -> float:
        return (started or {}).get(pid, STARTED)

    return ExitNotices(start_of, open_pidfd=pipes.open, close=pipes.close)


def test_an_exit_ends_the_rest_at_once_and_is_not_watched_again() -> None:
    async def scenario() -> tuple[bool, int, frozenset[ProcessIdentity]]:
        pipes = Pipes()
        watch = notices(pipes)
        watch.watch([identity(10), identity(11)])
        resting = asyncio.create_task(watch.rest(60))
        await asyncio.sleep(0)
        pipes.exit(11)
        done, _ = await asyncio.wait({resting}, timeout=10)
        # The next scan still lists it (a zombie): it is not watched again.
        watch.watch([identity(10), identity(11)])
        left = watch.watched
        watch.close()
        pipes.close_all()
        return bool(done), watch.noticed, left

    ended, noticed, left = asyncio.run(scenario())
    assert ended
    assert noticed == 1
    assert left == {identity(10)}


@pytest.mark.parametrize("scanned_since", [False, True], ids=["no scan since", "a scan since"])
def test_an_exit_between_rests_ends_the_next_rest_at_once_unless_a_scan_saw_it(
    scanned_since: bool,
) -> None:
    async def scenario() -> bool:
        pipes = Pipes()
        watch = notices(pipes)
        watch.watch([identity(10)])
        pipes.exit(10)
        # The loop reads the pidfd while no rest is running.
        await wait_for(lambda: watch.noticed, 10, "the exit noticed", 0.01)
        if scanned_since:
            watch.scanning()
        done, _ = await asyncio.wait({asyncio.create_task(watch.rest(60))}, timeout=0.5)
        for task in asyncio.all_tasks() - {asyncio.current_task()}:
            task.cancel()
        pipes.close_all()
        return bool(done)

    # A scan that began after the notice recorded the exit: the next rest is a whole one.
    assert asyncio.run(scenario()) is not scanned_since


def test_without_an_exit_the_rest_lasts_its_seconds() -> None:
    async def scenario() -> tuple[bool, int]:
        pipes = Pipes()
        watch = notices(pipes)
        watch.watch([identity(10)])
        done, _ = await asyncio.wait({asyncio.create_task(watch.rest(0.05))}, timeout=10)
        watch.close()
        pipes.close_all()
        return bool(done), watch.noticed

    assert asyncio.run(scenario()) == (True, 0)


def test_a_pid_now_held_by_another_process_is_not_watched() -> None:
    async def scenario() -> tuple[frozenset[ProcessIdentity], list[int]]:
        pipes = Pipes()
        watch = notices(pipes, started={10: STARTED + 5})
        watch.watch([identity(10), identity(11)])
        watched = watch.watched
        watch.close()
        pipes.close_all()
        return watched, pipes.closed

    watched, closed = asyncio.run(scenario())
    assert watched == {identity(11)}
    assert closed == [10, 11]


def test_a_process_no_longer_recorded_is_no_longer_watched() -> None:
    async def scenario() -> tuple[frozenset[ProcessIdentity], list[int]]:
        pipes = Pipes()
        watch = notices(pipes)
        watch.watch([identity(10), identity(11)])
        watch.watch([identity(11)])
        watched, closed = watch.watched, list(pipes.closed)
        watch.close()
        pipes.close_all()
        return watched, closed

    assert asyncio.run(scenario()) == (frozenset({identity(11)}), [10])


def test_beyond_the_cap_processes_are_left_to_the_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(exits, "MAX_WATCHED", 2)

    async def scenario() -> tuple[int, int]:
        pipes = Pipes()
        watch = notices(pipes)
        watch.watch([identity(pid) for pid in (10, 11, 12, 13)])
        counts = len(watch.watched), watch.over_cap
        watch.close()
        pipes.close_all()
        return counts

    assert asyncio.run(scenario()) == (2, 2)


@pytest.mark.parametrize(
    ("failure", "unavailable"),
    [
        (OSError(errno.ENOSYS, "Function not implemented"), "Function not implemented"),
        (PermissionError(errno.EPERM, "Operation not permitted"), "Operation not permitted"),
    ],
)
def test_without_pidfds_the_rest_is_a_plain_sleep(failure: OSError, unavailable: str) -> None:
    def refuse(pid: int) -> int:
        raise failure

    async def scenario() -> tuple[str | None, frozenset[ProcessIdentity], bool]:
        watch = ExitNotices(lambda pid: STARTED, open_pidfd=refuse)
        watch.watch([identity(10)])
        done, _ = await asyncio.wait({asyncio.create_task(watch.rest(0.05))}, timeout=10)
        return watch.unavailable, watch.watched, bool(done)

    reason, watched, rested = asyncio.run(scenario())
    assert reason is not None and unavailable in reason
    assert watched == frozenset()
    assert rested


def test_a_process_gone_before_its_pidfd_opened_is_left_to_the_scan() -> None:
    def gone(pid: int) -> int:
        raise ProcessLookupError(errno.ESRCH, "No such process")

    async def scenario() -> tuple[str | None, frozenset[ProcessIdentity]]:
        watch = ExitNotices(lambda pid: STARTED, open_pidfd=gone)
        watch.watch([identity(10)])
        return watch.unavailable, watch.watched

    assert asyncio.run(scenario()) == (None, frozenset())


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs os.pidfd_open (Linux)")
def test_the_kill_of_a_real_child_is_noticed_through_its_pidfd() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:

        async def scenario() -> tuple[bool, int]:
            watch = ExitNotices(start_time)
            watch.watch([ProcessIdentity(child.pid, start_time(child.pid))])
            assert len(watch.watched) == 1
            resting = asyncio.create_task(watch.rest(60))
            await asyncio.sleep(0)
            child.kill()
            done, _ = await asyncio.wait({resting}, timeout=10)
            return bool(done), watch.noticed

        assert asyncio.run(scenario()) == (True, 1)
    finally:
        child.kill()
        child.wait()
