"""The capture step: which py-spy it runs (the ptrace-capable copy only where it can start),
and what it writes into the bundle: private files, redacted, whatever the disk does."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import json
import os
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import BaseTestServer, TestServer
from fakes import FakePsutil, info

from omni_watchdog.clock import FakeClock
from omni_watchdog.policy.actuators import Actuators, SignalGuard
from omni_watchdog.policy.capture import (
    MAX_CAPTURED_BODY,
    Capturer,
    find_py_spy,
    ptrace_in_bounding_set,
)
from omni_watchdog.policy.incidents import BundleWriter, StateWriteErrors
from omni_watchdog.semconv import GEN_AI_USAGE_PROMPT_TOKENS
from omni_watchdog.types import Incident, Mode, ProcessRole, StepOutcome, StepResult, TargetSnapshot

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


# ---- what capture writes ------------------------------------------------------------------

SECRET_TITLE = "python -m vllm.entrypoints.openai.api_server --model m --api-key sk-123"


class PySpy(Actuators):
    """Answers every py-spy dump the way py-spy does: the command line, then the threads."""

    def __init__(self) -> None:
        super().__init__(SignalGuard(FakePsutil(), lambda identity: False, 1, 1), None)  # type: ignore[arg-type]

    async def run_bounded(self, argv: list[str], timeout: float) -> tuple[int | None, str]:
        pid = argv[-1]
        return 0, f'Process {pid}: {SECRET_TITLE}\n\nThread {pid} (idle): "MainThread"\n'


def capture_with(
    bundles: BundleWriter, session: aiohttp.ClientSession, target: str = "http://127.0.0.1:1"
) -> Capturer:
    return Capturer(
        PySpy(),
        session,
        bundles,
        FakeClock(),
        1.0,
        target,
        "/health",
        "/metrics",
        lambda: {"attributes": {"x.api_key": "sk-123", GEN_AI_USAGE_PROMPT_TOKENS: 12}},
        dict,
        lambda process: True,
        "py-spy",
    )


def capture_of(bundles: BundleWriter) -> StepResult:
    server = dataclasses.replace(info(101, 100, ProcessRole.API), title=SECRET_TITLE)
    snapshot = TargetSnapshot("http://127.0.0.1:1", server.identity, (server,), None)
    incident = Incident("20260101T000000Z-abcdef", snapshot.target, Mode.ENFORCE, 0.0, "stalled")

    async def scenario() -> StepResult:
        async with aiohttp.ClientSession() as session:
            return await capture_with(bundles, session)(incident, snapshot)

    return asyncio.run(scenario())


def test_capture_writes_private_files_without_the_servers_secrets(tmp_path: Path) -> None:
    errors = StateWriteErrors()
    bundles = BundleWriter(tmp_path / "incidents", errors)
    result = capture_of(bundles)
    assert result.outcome is StepOutcome.OK and result.targets == (101,)
    files = {p.name: p for p in bundles.files("20260101T000000Z-abcdef")}
    assert sorted(files) == [
        "101.txt",
        "gpu.json",
        "health.txt",
        "metrics.txt",
        "processes.json",
        "spans.json",
    ]
    assert all("sk-123" not in p.read_text() for p in files.values())
    assert all(os.stat(p).st_mode & 0o777 == 0o600 for p in files.values())
    (process,) = json.loads(files["processes.json"].read_text())
    assert process["title"].endswith("--model m --api-key ***")
    stack = files["101.txt"].read_text()
    assert stack.startswith("# pid 101 python -m vllm.entrypoints.openai.api_server")
    assert "Process 101: python" in stack and "--api-key ***" in stack
    spans = json.loads(files["spans.json"].read_text())
    assert spans == {"attributes": {"x.api_key": "***", GEN_AI_USAGE_PROMPT_TOKENS: 12}}
    assert errors.total == 0


def test_a_full_disk_is_counted_and_does_not_fail_the_capture(tmp_path: Path) -> None:
    def full(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    errors = StateWriteErrors()
    result = capture_of(BundleWriter(tmp_path / "incidents", errors, full))
    assert result.outcome is StepOutcome.OK
    assert "stacks of 1/1 live processes" in result.detail
    # processes, spans, gpu, one stack, /health and /metrics
    assert errors.total == 6


def capturer_target(server: BaseTestServer) -> str:
    return str(server.make_url("")).rstrip("/")


def test_a_page_of_the_target_past_the_bound_is_kept_cut(tmp_path: Path) -> None:
    """What a post-mortem needs of /metrics is at its top; a target's page must not fill
    the state disk (a 200 MiB one was read and written whole)."""
    huge = b"vllm:x 1\n" * (MAX_CAPTURED_BODY // 9 + 10)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=huge)

    async def scenario() -> StepResult:
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as session:
            capturer = capture_with(bundles, session, capturer_target(server))
            server_info = info(101, 100, ProcessRole.API)
            snapshot = TargetSnapshot(
                capturer_target(server), server_info.identity, (server_info,), None
            )
            incident = Incident("20260101T000000Z-abcdef", snapshot.target, Mode.ENFORCE, 0.0, "x")
            return await capturer(incident, snapshot)

    bundles = BundleWriter(tmp_path / "incidents", StateWriteErrors())
    asyncio.run(scenario())
    files = {p.name: p for p in bundles.files("20260101T000000Z-abcdef")}
    kept = files["metrics.txt"].read_bytes()
    assert kept.startswith(b"HTTP 200\nvllm:x 1\n")
    assert len(kept) < MAX_CAPTURED_BODY + 200
    assert kept.endswith(b"[cut at 2 MiB: the server sent more]\n")
