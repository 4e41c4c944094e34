"""Fixtures of the real vLLM-Omni tests: its environment, the tiny model, the servers.

`make tools` installs vLLM-Omni and the harness into `.venv-omni`; without it these tests
skip, except in CI, where a missing environment is a failure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import explain
import pytest
from real_omni.server import (
    DIFFUSION_ARCHITECTURE,
    FAULTS_DIR,
    MODEL_ARCHITECTURE,
    OMNI_PYTHON,
    OMNI_STAMP,
    READY_TIMEOUT,
    Faults,
    OmniServer,
    omni_environment,
    start_omni_server,
)
from real_vllm.server import (
    Shared,
    VllmServer,
    installed_python,
    make_tiny_model,
    start_ready,
)


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


@pytest.fixture(scope="session")
def omni_diffusion_model(omni_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-stage diffusion model: a directory whose `model_index.json` names the tiny
    image pipeline the harness registers (its weights are random in the harness's code).
    The image pipeline's server takes `omni_model` instead."""
    output = tmp_path_factory.mktemp("omni-tiny-diffusion-model")
    return make_tiny_model(
        omni_python, output, omni_environment(), "--diffusion", DIFFUSION_ARCHITECTURE
    )


@pytest.fixture(scope="module")
def shared_omni_server(
    omni_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Shared[OmniServer]]:
    """One ready server for the tests of a module that do not harm it."""
    workdir = tmp_path_factory.mktemp("shared-omni")
    server = start_ready(
        lambda: start_omni_server(omni_model, workdir)[0], READY_TIMEOUT, alone=True
    )
    faults = Faults(workdir / FAULTS_DIR)
    try:
        with explain.witnessed("the shared vLLM-Omni server", server.account):
            yield Shared((server, faults), server)
    finally:
        server.stop()


@pytest.fixture
def shared_omni(
    shared_omni_server: Shared[OmniServer], request: pytest.FixtureRequest
) -> Iterator[OmniServer]:
    """The module's shared server, alive: a test that finds it ended by an earlier test
    fails at once, naming that test, since its failure is a consequence."""
    with shared_omni_server.used_by(request.node.nodeid):
        yield shared_omni_server.value


@pytest.fixture
def fresh_omni(omni_model: Path, tmp_path: Path) -> Iterator[Callable[..., OmniServer]]:
    """Starts a server of this test's own (ready when returned); all of it dies at the end."""
    started: list[VllmServer] = []

    def start(env: Mapping[str, str] | None = None) -> OmniServer:
        workdir = tmp_path / f"omni-{len(started)}"
        server = start_ready(
            lambda: start_omni_server(omni_model, workdir, env)[0], READY_TIMEOUT, alone=True
        )
        faults = Faults(workdir / FAULTS_DIR)
        started.append(server)
        explain.witness_this_test(f"vLLM-Omni server {server.url}", server.account)
        return server, faults

    try:
        yield start
    finally:
        for server in started:
            server.stop()
