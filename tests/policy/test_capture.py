"""Which py-spy the capture step runs: the ptrace-capable copy only where it can start."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from omni_watchdog.policy.capture import find_py_spy, ptrace_in_bounding_set

ALL_CAPABILITIES = "000001ffffffffff"
DOCKER_DEFAULT = "00000000a80425fb"  # no CAP_SYS_PTRACE (bit 19)


def status_file(tmp_path: Path, bounding: str) -> Path:
    path = tmp_path / "status"
    path.write_text(f"Name:\tpython\nCapPrm:\t0000000000000000\nCapBnd:\t{bounding}\n")
    return path


@pytest.mark.parametrize(
    ("bounding", "allowed"),
    [(ALL_CAPABILITIES, True), (DOCKER_DEFAULT, False), ("0000000000080000", True)],
)
def test_the_bounding_set_is_read_from_proc_status(
    tmp_path: Path, bounding: str, allowed: bool
) -> None:
    assert ptrace_in_bounding_set(status_file(tmp_path, bounding)) is allowed


def test_an_unreadable_status_allows_nothing(tmp_path: Path) -> None:
    assert not ptrace_in_bounding_set(tmp_path / "missing")
    assert not ptrace_in_bounding_set(status_file(tmp_path, "not-hex"))


@pytest.fixture
def tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A PATH with both copies of py-spy, and a Python with nothing beside it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("py-spy", "py-spy-ptrace"):
        tool = bin_dir / name
        tool.write_text("#!/bin/sh\n")
        tool.chmod(0o755)
    python_dir = tmp_path / "python"
    python_dir.mkdir()
    monkeypatch.setattr(sys, "executable", str(python_dir / "python"))
    monkeypatch.setenv("PATH", str(bin_dir))
    return bin_dir


def test_the_ptrace_copy_is_chosen_where_the_bounding_set_lets_it_start(tools: Path) -> None:
    assert find_py_spy(lambda: True) == str(tools / "py-spy-ptrace")


def test_plain_py_spy_is_chosen_where_the_capability_would_stop_it_starting(
    tools: Path,
) -> None:
    assert find_py_spy(lambda: False) == str(tools / "py-spy")


def test_without_the_copy_plain_py_spy_serves_either_way(tools: Path) -> None:
    (tools / "py-spy-ptrace").unlink()
    assert find_py_spy(lambda: True) == str(tools / "py-spy")


def test_py_spy_beside_this_python_wins_over_path(tools: Path) -> None:
    beside = Path(sys.executable).parent / "py-spy"
    beside.write_text("#!/bin/sh\n")
    beside.chmod(0o755)
    assert find_py_spy(lambda: False) == str(beside)


def test_no_py_spy_anywhere_is_none(tools: Path) -> None:
    for tool in tools.iterdir():
        tool.unlink()
    assert find_py_spy(lambda: True) is None
