"""Process start times: read from /proc, against the boot time first read."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from omni_watchdog import process_start


def stat_line(pid: int, command: str, starttime_ticks: int) -> str:
    # Fields after the command: state, ppid, pgrp, session, tty, tpgid, flags, minflt,
    # cminflt, majflt, cmajflt, utime, stime, cutime, cstime, priority, nice, threads,
    # itrealvalue, starttime, vsize, ...
    after = ["S", "1", pid, pid, "0", "-1", "4194560"] + ["0"] * 8 + ["20", "0", "1", "0"]
    return f"{pid} ({command}) " + " ".join(map(str, [*after, starttime_ticks, 1000, 12])) + "\n"


def test_the_start_is_read_past_a_command_name_with_spaces_and_parentheses(
    tmp_path: Path,
) -> None:
    (tmp_path / "4242").mkdir()
    command = "VLLM::Worker) (x 1 2"
    ticks = 123_456
    (tmp_path / "4242" / "stat").write_text(stat_line(4242, command, ticks))
    started = process_start.seconds_after_boot(4242, tmp_path)
    assert started == ticks / process_start.CLOCK_TICKS


def test_a_pid_that_is_gone_is_no_such_process(tmp_path: Path) -> None:
    with pytest.raises(psutil.NoSuchProcess):
        process_start.seconds_after_boot(4243, tmp_path)


def test_the_start_is_psutils_create_time_less_the_boot_time() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=-1)
    try:
        for pid in (child.pid, os.getpid()):
            after_boot = psutil.Process(pid).create_time() - psutil.boot_time()
            assert process_start.seconds_after_boot(pid) == pytest.approx(after_boot, abs=1e-6)
    finally:
        child.kill()
        child.wait(5)


def test_a_stepped_wall_clock_does_not_move_a_start(monkeypatch: pytest.MonkeyPatch) -> None:
    before = process_start.start_time(os.getpid())
    booted = psutil.boot_time()
    # The kernel's view after the wall clock was stepped forward by a minute.
    monkeypatch.setattr("psutil._psplatform.boot_time", lambda: booted + 60.0)
    after_boot = process_start.seconds_after_boot(os.getpid())
    assert psutil.Process().create_time() == pytest.approx(booted + 60.0 + after_boot)
    assert process_start.start_time(os.getpid()) == before
