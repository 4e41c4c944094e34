"""What a failed end-to-end test prints beside its assertion, so that CI's log alone says
why: the log tail and process table of each server it used, each watchdog's last verdicts
with their evidence and its incidents, the host's load.

A fixture or helper that starts a server or a watchdog registers a witness here; the hook
in `tests/conftest.py` asks every witness of the test for its account when the test fails,
and forgets the test's own witnesses once it has ended. A witness that cannot give its
account says so instead: an explanation never hides the failure it explains.

CI shows the head and the tail of a long log, and a second failure's report falls between:
the run ends with a brief of each failure (its assertion's first lines, each witness's
first line and its incidents), so that the tail alone says what each failed on.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil

# A witness: a title and what it has to say, read when a test has failed.
Witness = tuple[str, Callable[[], str]]

# Witnesses that live as long as a fixture (a server shared by a module's tests), and those
# of the test now running (its watchdogs), forgotten when it ends.
_lasting: dict[int, Witness] = {}
_of_this_test: list[Witness] = []


@contextlib.contextmanager
def witnessed(title: str, account: Callable[[], str]) -> Iterator[None]:
    """`account` explains any test that fails while this context is open."""
    key = id(account)
    _lasting[key] = (title, account)
    try:
        yield
    finally:
        _lasting.pop(key, None)


def witness_this_test(title: str, account: Callable[[], str]) -> None:
    """`account` explains the test now running if it fails, even after its context ended:
    a watchdog stopped at the end of a scenario still knows what it judged."""
    _of_this_test.append((title, account))


def accounts() -> list[tuple[str, str]]:
    """Every witness's title and account, for a test that failed, and the host's beside
    them (a test with no witness started nothing that the host's load could explain)."""
    witnesses = [*_lasting.values(), *_of_this_test]
    if not witnesses:
        return []
    found = []
    for title, account in [*witnesses, ("the host", host_account)]:
        try:
            text = account()
        except Exception as error:  # an explanation must never replace the failure
            text = f"(no account: {type(error).__name__}: {error})"
        found.append((title, text))
    return found


def test_ended() -> None:
    _of_this_test.clear()


# What a brief keeps of a failure: its assertion's first lines and characters, and of each
# witness's account the lines after its count of incidents.
BRIEF_CRASH_LINES = 4
BRIEF_CRASH_CHARS = 600
BRIEF_INCIDENT_LINES = 4
# Lines of an account a brief keeps wherever they are: what the receiver took and refused.
BRIEF_KEPT = ("spans:",)


def brief(nodeid: str, when: str, crash: str, sections: list[tuple[str, str]]) -> str:
    """A failure in a few lines: where, its assertion, each witness's first line (a root
    running or exited, a watchdog's health), its spans, and the incidents it counted."""
    message = "\n".join(crash.splitlines()[:BRIEF_CRASH_LINES])[:BRIEF_CRASH_CHARS]
    lines = [f"-- {nodeid} ({when}):", *(f"   {line}" for line in message.splitlines())]
    for title, text in sections:
        told = text.splitlines()
        if not told:
            continue
        lines.append(f"   {title}: {told[0][:200]}")
        lines += [f"     {line[:300]}" for line in told[1:] if line.startswith(BRIEF_KEPT)]
        counted = next((i for i, line in enumerate(told) if line.endswith("incident(s)")), None)
        if counted is not None:
            lines += [
                f"     {line[:300]}" for line in told[counted : counted + 1 + BRIEF_INCIDENT_LINES]
            ]
    return "\n".join(lines)


def host_account() -> str:
    """The host's load and its busiest processes: a failure on a starved machine says so."""
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    busiest = sorted(
        psutil.process_iter(["pid", "name", "cpu_times", "status"]),
        key=lambda p: -sum(p.info["cpu_times"][:2]) if p.info["cpu_times"] else 0.0,
    )[:15]
    rows = [
        f"  {p.info['pid']:>7} {p.info['status'] or '?':<9}"
        f" cpu {sum(p.info['cpu_times'][:2]) if p.info['cpu_times'] else 0.0:8.1f}s"
        f" {p.info['name']}"
        for p in busiest
    ]
    return f"load average {load}; the busiest processes by CPU time:\n" + "\n".join(rows)


def process_table(pids: dict[int, float], start_of: Callable[[int], float]) -> str:
    """Each recorded process, by pid and start, as it is now: alive (its state, parent,
    group, CPU time and title), a zombie, or gone."""
    rows = []
    for pid in sorted(pids):
        try:
            process = psutil.Process(pid)
            if start_of(pid) != pids[pid]:
                rows.append(f"  {pid:>7} gone (pid reused)")
                continue
            with process.oneshot():
                times = process.cpu_times()
                rows.append(
                    f"  {pid:>7} {process.status():<9} ppid {process.ppid():>7}"
                    f" pgid {os.getpgid(pid):>7} cpu {times.user + times.system:7.1f}s"
                    f" {' '.join(process.cmdline())[:100] or process.name()}"
                )
        except (psutil.Error, OSError):
            rows.append(f"  {pid:>7} gone")
    return "\n".join(rows) or "  (no process recorded)"
