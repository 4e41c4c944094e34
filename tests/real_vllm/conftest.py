"""Fixtures of the real-server tests: the vLLM environment, the tiny model, the servers.

`make tools` installs vLLM into its own environment; without it these tests skip, except
in CI, where a missing environment is a failure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import explain
import pytest
from real_vllm.server import (
    READY_TIMEOUT,
    VLLM_PYTHON,
    VLLM_STAMP,
    Shared,
    VllmServer,
    installed_python,
    make_tiny_model,
    start_ready,
)


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The vLLM environment's Python; its absence fails CI and skips elsewhere."""
    return installed_python(VLLM_STAMP, VLLM_PYTHON, "vLLM")


@pytest.fixture(scope="session")
def tiny_model(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight model, generated once per session."""
    return make_tiny_model(vllm_python, tmp_path_factory.mktemp("tiny-model"), {})


@pytest.fixture(scope="module")
def shared_vllm_server(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Shared[VllmServer]]:
    """One ready server for the tests of a module that do not harm it."""
    workdir = tmp_path_factory.mktemp("shared-vllm")
    server = start_ready(lambda: VllmServer.start(tiny_model, workdir), READY_TIMEOUT, alone=False)
    try:
        with explain.witnessed("the shared vLLM server", server.account):
            yield Shared(server, server)
    finally:
        server.stop()


@pytest.fixture
def shared_server(
    shared_vllm_server: Shared[VllmServer], request: pytest.FixtureRequest
) -> Iterator[VllmServer]:
    """The module's shared server, alive: a test that finds it ended by an earlier test
    fails at once, naming that test, since its failure is a consequence."""
    with shared_vllm_server.used_by(request.node.nodeid):
        yield shared_vllm_server.value


@pytest.fixture
def fresh_server(tiny_model: Path, tmp_path: Path) -> Iterator[Callable[..., VllmServer]]:
    """Starts a server of this test's own (ready when returned); all of it dies at the end."""
    started: list[VllmServer] = []

    def start(env: Mapping[str, str] | None = None) -> VllmServer:
        workdir = tmp_path / f"vllm-{len(started)}"
        server = start_ready(
            lambda: VllmServer.start(tiny_model, workdir, env), READY_TIMEOUT, alone=False
        )
        started.append(server)
        explain.witness_this_test(f"vLLM server {server.url}", server.account)
        return server

    try:
        yield start
    finally:
        for server in started:
            server.stop()
