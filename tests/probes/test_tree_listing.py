"""A scan lists the whole process table only when a process was born since the last
listing: otherwise it reads the tree it knows, and records what a listing would.

Listing the table reads every process of the host (psutil's children() reads each
/proc/<pid>/stat to find parents), which is most of an idle scan's cost. A fork is the
only way into a tree, and every fork moves the kernel's last pid, so while that stands
the known processes are all there is to read.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys

import pytest
from fakes import FakePsutil

from omni_watchdog.clock import FakeClock
from omni_watchdog.probes.processes import RELIST_EVERY, ProcessTracker
from omni_watchdog.process_start import last_pid
from omni_watchdog.types import ProcessStatus, Stage, Topology

ONE_STAGE = Topology((Stage(0, "thinker"),))
OWN_PID = 50


def tracker_over(
    table: FakePsutil, clock: FakeClock, *, births: bool = True, last_pid_fails: bool = False
) -> ProcessTracker:
    def failing() -> int:
        raise OSError("no ns_last_pid on this kernel")

    reader = failing if last_pid_fails else table.last_pid
    return ProcessTracker(
        table,
        clock,
        own_pid=OWN_PID,
        target_port=None,
        pid=100,
        topology=ONE_STAGE,
        process_groups=lambda pid: (100, 100),
        start_time=table.start_time,
        start_time_of_ticks=float,
        last_pid=reader if births else None,
    )


def scan(tracker: ProcessTracker) -> None:
    asyncio.run(tracker.collect())


def tree_of(tracker: ProcessTracker) -> dict[int, bool]:
    """Each recorded process, and whether it is still in the tree (not orphaned)."""
    return {info.pid: not info.orphaned for info in tracker.recorded()}


def server() -> FakePsutil:
    table = FakePsutil()
    table.add(100, 1, "vllm serve --omni")
    table.add(110, 100, "VLLM::StageEngineCoreProc_stage0_replica0_DP0")
    table.add(111, 110, "VLLM::Worker_TP0")
    table.add(OWN_PID, 100, "omni-watchdog run")
    return table


def test_without_a_birth_the_known_tree_is_read_and_the_table_not_listed() -> None:
    table, clock = server(), FakeClock()
    tracker = tracker_over(table, clock)
    scan(tracker)
    assert table.listings == 1
    table.table[111].state = "disk-sleep"
    for _ in range(5):
        clock.advance(1.0)
        scan(tracker)
    assert table.listings == 1
    assert tree_of(tracker) == {100: True, 110: True, 111: True}
    statuses = {info.pid: info.status for info in tracker.recorded()}
    assert statuses[111] is ProcessStatus.DISK_SLEEP


def test_a_birth_lists_the_table_and_the_new_child_is_recorded() -> None:
    table, clock = server(), FakeClock()
    tracker = tracker_over(table, clock)
    scan(tracker)
    table.add(112, 110, "python -c compile")
    clock.advance(1.0)
    scan(tracker)
    assert table.listings == 2
    assert tree_of(tracker)[112]


def test_an_exit_and_an_orphan_leave_the_tree_without_a_listing() -> None:
    table, clock = server(), FakeClock()
    tracker = tracker_over(table, clock)
    scan(tracker)
    # The stage exits and the kernel hands its worker to init: no birth.
    del table.table[110]
    table.table[111].parent = 1
    clock.advance(1.0)
    scan(tracker)
    assert table.listings == 1
    statuses = {info.pid: info.status for info in tracker.recorded()}
    assert statuses[110] is ProcessStatus.EXITED
    assert tree_of(tracker)[111] is False


def test_the_table_is_listed_again_after_a_while_whatever_the_count_says() -> None:
    """A kernel whose count stands when it should not hides a child for RELIST_EVERY at most."""
    table, clock = server(), FakeClock()
    tracker = tracker_over(table, clock)
    scan(tracker)
    table.add(112, 110, "python -c compile")
    table.births -= 1  # a count that did not move
    clock.advance(RELIST_EVERY - 0.5)
    scan(tracker)
    assert 112 not in tree_of(tracker)
    clock.advance(0.5)
    scan(tracker)
    assert table.listings == 2
    assert tree_of(tracker)[112]


@pytest.mark.parametrize(("births", "fails"), [(False, False), (True, True)])
def test_without_a_readable_count_every_scan_lists_the_table(births: bool, fails: bool) -> None:
    table, clock = server(), FakeClock()
    tracker = tracker_over(table, clock, births=births, last_pid_fails=fails)
    for _ in range(3):
        scan(tracker)
        clock.advance(1.0)
    assert table.listings == 3


def test_the_known_tree_records_what_a_listing_would_through_births_exits_and_orphans() -> None:
    """Two trackers over one table, one that lists at every scan; 400 random changes."""
    rng = random.Random(7)
    table, clock = server(), FakeClock()
    knowing, listing = tracker_over(table, clock), tracker_over(table, clock, births=False)
    next_pid, knowing_listings = 200, 0
    for _ in range(400):
        alive = [pid for pid in table.table if pid not in (100, OWN_PID)]
        change = rng.choice(("birth", "exit", "zombie", "nothing", "nothing"))
        if change == "birth":
            parent = rng.choice([100, *alive])
            table.add(next_pid, parent, "python -c work")
            next_pid += 1
        elif change == "exit" and alive:
            gone = rng.choice(alive)
            del table.table[gone]
            for orphan in table.table.values():
                if orphan.parent == gone:
                    orphan.parent = 1
        elif change == "zombie" and alive:
            table.table[rng.choice(alive)].state = FakePsutil.STATUS_ZOMBIE
        clock.advance(rng.choice((0.25, 1.0, 2.0)))
        listed_before = table.listings
        scan(knowing)
        knowing_listings += table.listings - listed_before
        scan(listing)
        assert tree_of(knowing) == tree_of(listing)
    assert next_pid > 250
    assert knowing_listings < 400 - 100


def test_this_kernels_last_pid_moves_on_at_a_fork() -> None:
    try:
        before = last_pid()
    except OSError:
        pytest.skip("this kernel does not tell the last pid (no /proc/sys/kernel/ns_last_pid)")
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    after = last_pid()
    assert after != before
    assert int(child.stdout) != before
