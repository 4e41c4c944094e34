"""Fixtures of the real-server tests: the vLLM environment, the tiny model, the servers.

`make tools` installs vLLM into its own environment; without it these tests skip, except
in CI, where a missing environment is a failure.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest
from real_vllm.server import (
    VLLM_PYTHON,
    VLLM_STAMP,
    VllmServer,
    installed_python,
    make_tiny_model,
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
def shared_server(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    """One ready server for the tests that do not harm it."""
    server = VllmServer.start(tiny_model, tmp_path_factory.mktemp("shared-vllm"))
    try:
        asyncio.run(server.wait_ready())
        yield server
    finally:
        server.stop()


@pytest.fixture
def fresh_server(tiny_model: Path, tmp_path: Path) -> Iterator[Callable[..., VllmServer]]:
    """Starts a server of this test's own (ready when returned); all of it dies at the end."""
    started: list[VllmServer] = []

    def start(env: Mapping[str, str] | None = None) -> VllmServer:
        server = VllmServer.start(tiny_model, tmp_path / f"vllm-{len(started)}", env)
        started.append(server)
        asyncio.run(server.wait_ready())
        return server

    try:
        yield start
    finally:
        for server in started:
            server.stop()
