"""Fixtures of the real vLLM-Omni tests: its environment, the tiny model, the servers.

`make tools` installs vLLM-Omni and the harness into `.venv-omni`; without it these tests
skip, except in CI, where a missing environment is a failure.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest
from real_omni.server import (
    MODEL_ARCHITECTURE,
    OMNI_PYTHON,
    OMNI_STAMP,
    READY_TIMEOUT,
    OmniServer,
    omni_environment,
    start_omni_server,
)
from real_vllm.server import VllmServer, installed_python, make_tiny_model


@pytest.fixture(scope="session")
def omni_python() -> Path:
    """The vLLM-Omni environment's Python; its absence fails CI and skips elsewhere."""
    return installed_python(OMNI_STAMP, OMNI_PYTHON, "vLLM-Omni")


@pytest.fixture(scope="session")
def omni_model(omni_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama, under the class name the harness registers."""
    output = tmp_path_factory.mktemp("omni-tiny-model")
    return make_tiny_model(
        omni_python, output, omni_environment(), "--architecture", MODEL_ARCHITECTURE
    )


@pytest.fixture(scope="module")
def shared_omni(omni_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OmniServer]:
    """One ready server for the tests that do not harm it."""
    server, faults = start_omni_server(omni_model, tmp_path_factory.mktemp("shared-omni"))
    try:
        asyncio.run(server.wait_ready(READY_TIMEOUT))
        yield server, faults
    finally:
        server.stop()


@pytest.fixture
def fresh_omni(omni_model: Path, tmp_path: Path) -> Iterator[Callable[..., OmniServer]]:
    """Starts a server of this test's own (ready when returned); all of it dies at the end."""
    started: list[VllmServer] = []

    def start(env: Mapping[str, str] | None = None) -> OmniServer:
        server, faults = start_omni_server(omni_model, tmp_path / f"omni-{len(started)}", env)
        started.append(server)
        asyncio.run(server.wait_ready(READY_TIMEOUT))
        return server, faults

    try:
        yield start
    finally:
        for server in started:
            server.stop()
