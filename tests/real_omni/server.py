"""The real vLLM-Omni 0.30 (in `.venv-omni`, with the CPU harness) and its faults.

The server is the one `README.md` tells a user to start: `vllm serve MODEL --omni
--deploy-config FILE`, the omni-watchdog plugin loaded by its entry points alone (no
`VLLM_PLUGINS`), the admin route there because `OMNI_WATCHDOG_ADMIN_TOKEN` is set.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from ports import free_port
from real_vllm.server import MODEL_NAME, REAL_FAST, REPO, VllmServer, watching

from omni_watchdog.config import LadderConfig, merge_layers
from omni_watchdog.types import StageRef

OMNI_VENV = REPO / ".venv-omni"
OMNI_PYTHON = OMNI_VENV / "bin" / "python"
OMNI_VLLM = OMNI_VENV / "bin" / "vllm"
# Written by make/omni.mk once the whole environment is installed.
OMNI_STAMP = OMNI_VENV / ".installed-stamp"
HARNESS = REPO / "tests" / "real_omni" / "harness"
DEPLOY_FILE = HARNESS / "omni_cpu_harness" / "deploy.yaml"
# Lets the CUDA builds of torchvision and torchaudio import beside the CPU torch.
IMPORT_SHIM = REPO / "tests" / "real_omni" / "shim"
MODEL_ARCHITECTURE = "HarnessLlamaForCausalLM"
STAGE_NAMES = ("thinker", "talker", "code2wav")
FAULTS_ENV = "OMNI_CPU_HARNESS_FAULTS"
# Where a server's fault files live, under its work directory.
FAULTS_DIR = "faults"
# The receiver's token, as the README sets it on both sides.
OTLP_TOKEN = "real-omni-test-otlp-token"
# Three stages start one after another, each in two freshly spawned processes: about two
# minutes on two cores, and a loaded CI machine takes longer.
READY_TIMEOUT = 420.0
STAGES = tuple(StageRef(stage_id) for stage_id in range(len(STAGE_NAMES)))
ENGINE_TITLE = "VLLM::StageEngineCoreProc_stage{stage}_replica0"
# The real server's graceful shutdown takes 5 to 12 s: long enough that the ladder's
# first step, the admin shutdown, is the one that ends it. A stage worker it left behind
# was once still in state "running" 7 s after SIGKILL on two loaded cores: the bound on
# the release stays at its default, not the simulator tests' 5 s.
OMNI_FAST = merge_layers(
    REAL_FAST,
    {
        "otlp_token": OTLP_TOKEN,
        "ladder": {
            "shutdown_grace": "20s",
            "release_timeout": f"{LadderConfig().release_timeout:g}s",
        },
    },
)


def omni_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """What every Python of the vLLM-Omni environment needs: the import shim, offline."""
    return {"PYTHONPATH": str(IMPORT_SHIM), "HF_HUB_OFFLINE": "1", **(env or {})}


@dataclass
class Faults:
    """The fault files of one server: a word per stage, read at each of its forwards."""

    directory: Path

    def arm(self, stage_id: int, word: str) -> None:
        # The stage reads the file at every forward: renamed into place, it never sees a
        # half-written word (`slow:` without its seconds would make the forward raise).
        staged = self.directory / f".stage-{stage_id}.new"
        staged.write_text(word)
        # A one-forward fault armed again fires again.
        (self.directory / f"stage-{stage_id}.fired").unlink(missing_ok=True)
        staged.replace(self.directory / f"stage-{stage_id}")

    def disarm(self, stage_id: int) -> None:
        (self.directory / f"stage-{stage_id}").unlink(missing_ok=True)


# A started server and the fault files of its stages.
OmniServer = tuple[VllmServer, Faults]


def omni_serve(model: Path, deploy_file: Path, *flags: str) -> list[str]:
    """`vllm serve MODEL --omni --deploy-config FILE` of the vLLM-Omni environment, then
    `flags`."""
    return [
        str(OMNI_VLLM),
        "serve",
        str(model),
        "--omni",
        "--deploy-config",
        str(deploy_file),
        *flags,
    ]


def start_omni_server(
    model: Path,
    workdir: Path,
    env: Mapping[str, str] | None = None,
    deploy_file: Path = DEPLOY_FILE,
) -> tuple[VllmServer, Faults]:
    """`vllm serve MODEL --omni` with the harness pipeline (or another deploy file of it);
    ready only after `wait_ready`."""
    port, otlp_port = free_port(), free_port()
    faults = Faults(workdir / FAULTS_DIR)
    faults.directory.mkdir(parents=True, exist_ok=True)
    argv = omni_serve(
        model,
        deploy_file,
        "--served-model-name",
        MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    )
    server = VllmServer.spawn(
        argv,
        workdir,
        port,
        otlp_port,
        omni_environment(
            {
                FAULTS_ENV: str(faults.directory),
                "OMNI_WATCHDOG_OTLP_TOKEN": OTLP_TOKEN,
                **(env or {}),
            }
        ),
    )
    return server, faults


@contextlib.asynccontextmanager
async def watched(
    server: VllmServer, workdir: Path, mode: str = "enforce", overrides: Any = None
) -> AsyncIterator[Any]:
    async with watching(server, workdir, mode, merge_layers(OMNI_FAST, overrides or {})) as dog:
        yield dog


def engine_of(server: VllmServer, stage_id: int) -> psutil.Process:
    return server.titled(ENGINE_TITLE.format(stage=stage_id))
