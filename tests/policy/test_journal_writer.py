"""The journal is written off the judging loop: a disk that stalls never stalls the caller,
lines keep their order, and what waits for the disk is bounded."""

from __future__ import annotations

import threading
from pathlib import Path

from omni_watchdog.policy.incidents import IncidentJournal, SerialWriter, StateWriteErrors
from omni_watchdog.types import OperatorAction

WAIT_S = 10.0


class StalledDisk:
    """An append that waits until the test lets the disk go on, then keeps the line."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.going = threading.Event()
        self.lines: list[bytes] = []
        self.threads: set[str] = set()

    def append(self, _path: Path, data: bytes) -> None:
        self.entered.set()
        self.going.wait(WAIT_S)
        self.threads.add(threading.current_thread().name)
        self.lines.append(data)


def action(number: int) -> OperatorAction:
    return OperatorAction(
        time=float(number),
        action="pause",
        outcome="accepted",
        incident_id=None,
        detail=f"#{number}",
    )


def test_a_stalled_disk_never_holds_the_caller_and_lines_keep_their_order(
    tmp_path: Path,
) -> None:
    disk = StalledDisk()
    errors = StateWriteErrors()
    journal = IncidentJournal(tmp_path / "journal.jsonl", errors, disk.append, SerialWriter())
    for number in range(5):
        journal.record_action(action(number))  # returns while the disk is stalled
    assert disk.lines == []
    # The operator's actions are answered from memory meanwhile.
    assert [a.detail for a in journal.actions()] == [f"#{n}" for n in range(5)]
    disk.going.set()
    assert journal.close(WAIT_S)
    assert [b'"#%d"' % n in line for n, line in enumerate(disk.lines)] == [True] * 5
    assert disk.threads == {"omni-watchdog-writer"} and errors.total == 0


def test_lines_past_the_bound_are_dropped_and_counted(tmp_path: Path) -> None:
    disk = StalledDisk()
    errors = StateWriteErrors()
    writer = SerialWriter(max_pending=3)
    journal = IncidentJournal(tmp_path / "journal.jsonl", errors, disk.append, writer)
    journal.record_action(action(0))
    assert disk.entered.wait(WAIT_S)
    for number in range(1, 10):
        journal.record_action(action(number))
    # One is being written (held by the disk), three wait; the other six are refused.
    assert errors.total == 6 and "wait for the disk" in errors.last
    disk.going.set()
    assert journal.close(WAIT_S)
    assert len(disk.lines) == 4


def test_after_close_a_line_is_written_at_once(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    journal = IncidentJournal(path, StateWriteErrors(), writer=SerialWriter())
    journal.record_action(action(1))
    assert journal.close(WAIT_S)
    assert b'"#1"' in path.read_bytes()
    journal.record_action(action(2))
    assert b'"#2"' in path.read_bytes()
