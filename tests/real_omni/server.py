"""The real vLLM-Omni 0.30 (in `.venv-omni`, with the CPU harness) and its faults.

The server is the one `README.md` tells a user to start: `vllm serve MODEL --omni
--deploy-config FILE`, the omni-watchdog plugin loaded by its entry points alone (no
`VLLM_PLUGINS`), the admin route there because `OMNI_WATCHDOG_ADMIN_TOKEN` is set.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from ports import free_port
from real_vllm.server import MODEL_NAME, REAL_FAST, REPO, VllmServer, watching

from omni_watchdog.app import Watchdog
from omni_watchdog.config import LadderConfig, merge_layers
from omni_watchdog.types import StageRef

OMNI_VENV = REPO / ".venv-omni"
OMNI_PYTHON = OMNI_VENV / "bin" / "python"
OMNI_VLLM = OMNI_VENV / "bin" / "vllm"
# Written by make/omni.mk once the whole environment is installed.
OMNI_STAMP = OMNI_VENV / ".installed-stamp"
HARNESS = REPO / "tests" / "real_omni" / "harness"
DEPLOY_FILE = HARNESS / "omni_cpu_harness" / "deploy.yaml"
# The harness image pipeline: text (LLM_AR, the tiny Llama) → DiT (DIFFUSION).
IMAGE_DEPLOY_FILE = HARNESS / "omni_cpu_harness" / "deploy-image.yaml"
IMAGE_STAGE_NAMES = ("text", "dit")
# The tiny image pipeline the harness registers; a model directory naming it in its
# `model_index.json` is a one-stage diffusion server.
DIFFUSION_ARCHITECTURE = "HarnessTinyImagePipeline"
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
# The process that runs a diffusion stage's denoising: the API server itself for a
# one-stage server (inline), its `StageDiffusionProc` child in a multi-stage pipeline, its
# executor's child with `--distributed-executor-backend mp`.
DIFFUSION_TITLE = "vLLM-Omni::DiffusionWorker"
# A one-stage diffusion server answers images here; a pipeline with an LLM stage first
# answers them at /v1/chat/completions only (see `image_chat_body`).
IMAGES_PATH = "/v1/images/generations"
# Diffusion's CPU paths reject bfloat16, the default dtype of a diffusion stage.
DIFFUSION_FLAGS = ("--dtype", "float32")
# Denoising steps of a request that names none: the image deploy file's default, and the
# one the bodies below ask for.
DIFFUSION_STEPS = 4
# Starts alone, one process (two with the mp executor): seconds, not minutes.
DIFFUSION_READY_TIMEOUT = 180.0
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


def omni_serve(model: Path, deploy_file: Path | None, *flags: str) -> list[str]:
    """`vllm serve MODEL --omni --deploy-config FILE` of the vLLM-Omni environment, then
    `flags`; without a deploy file (a diffusion model directory), `vllm serve MODEL
    --omni`."""
    deploy = ["--deploy-config", str(deploy_file)] if deploy_file is not None else []
    return [str(OMNI_VLLM), "serve", str(model), "--omni", *deploy, *flags]


def start_omni_server(
    model: Path,
    workdir: Path,
    env: Mapping[str, str] | None = None,
    deploy_file: Path | None = DEPLOY_FILE,
    flags: Sequence[str] = (),
) -> tuple[VllmServer, Faults]:
    """`vllm serve MODEL --omni` with the harness pipeline (or another deploy file of it,
    or none for a diffusion model directory), then `flags`; ready only after
    `wait_ready`."""
    port, otlp_port = free_port(), free_port()
    faults = Faults(workdir / FAULTS_DIR)
    faults.directory.mkdir(parents=True, exist_ok=True)
    argv = omni_serve(
        model,
        deploy_file,
        *flags,
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


def start_image_server(
    model: Path, workdir: Path, env: Mapping[str, str] | None = None
) -> tuple[VllmServer, Faults]:
    """The harness image pipeline (text → DiT in a `StageDiffusionProc`) on the tiny Llama
    `model`; stage 1's fault file is read at each denoising step."""
    return start_omni_server(model, workdir, env, IMAGE_DEPLOY_FILE)


def start_diffusion_server(
    model: Path,
    workdir: Path,
    env: Mapping[str, str] | None = None,
    *,
    multiprocess: bool = False,
) -> tuple[VllmServer, Faults]:
    """A one-stage diffusion server of the tiny image pipeline `model` (a directory naming
    it, see `omni_diffusion_model`): inline, the API server process runs the denoising, or
    with `multiprocess` in a `DiffusionWorker` child (`--distributed-executor-backend mp`).
    Stage 0's fault file is read at each denoising step."""
    flags = [*DIFFUSION_FLAGS]
    if multiprocess:
        flags += ["--distributed-executor-backend", "mp"]
    return start_omni_server(model, workdir, env, None, flags)


def text_chat_body(max_tokens: int = 8) -> dict[str, Any]:
    """A chat request of the default pipeline answered with text only. It runs all three
    stages all the same: no stage of the pipeline has a final text output, so vLLM-Omni
    answers 200 with no choices (the watchdog's canary sends this shape). The same body
    without `modalities` is answered with the code2wav stage's audio (a WAV in
    `choices[0].message.audio.data`)."""
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "What is vLLM?"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "modalities": ["text"],
    }


def audio_chat_body(max_tokens: int = 8) -> dict[str, Any]:
    """A chat request of the default pipeline answered with code2wav's audio."""
    body = text_chat_body(max_tokens)
    del body["modalities"]
    return body


def image_chat_body(prompt: str = "a small red boat") -> dict[str, Any]:
    """A chat request of the image pipeline: the answer's `choices[0].message.content[0]`
    is an `image_url` (a PNG data URL). `modalities` must be empty: with none (or
    `["image"]`) vLLM-Omni 0.30 answers 400, "Multi-modal processor not available for
    text-only models". Size and steps are the deploy file's (64x64, `DIFFUSION_STEPS`)."""
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": prompt}],
        "modalities": [],
    }


def image_generation_body(
    prompt: str = "a small red boat", steps: int = DIFFUSION_STEPS, size: str = "64x64"
) -> dict[str, Any]:
    """A request to a one-stage diffusion server's `IMAGES_PATH`: `data[0].b64_json` is a
    PNG of `size`, made in `steps` denoising steps."""
    return {
        "model": MODEL_NAME,
        "prompt": prompt,
        "size": size,
        "num_inference_steps": steps,
        "n": 1,
        "response_format": "b64_json",
    }


@contextlib.asynccontextmanager
async def watched(
    server: VllmServer, workdir: Path, mode: str = "enforce", overrides: Any = None
) -> AsyncIterator[Watchdog]:
    async with watching(server, workdir, mode, merge_layers(OMNI_FAST, overrides or {})) as dog:
        yield dog


def engine_of(server: VllmServer, stage_id: int) -> psutil.Process:
    return server.titled(ENGINE_TITLE.format(stage=stage_id))


def diffusion_worker_of(server: VllmServer) -> psutil.Process:
    """The process that runs the denoising (the API server itself when inline)."""
    return server.titled(DIFFUSION_TITLE)
