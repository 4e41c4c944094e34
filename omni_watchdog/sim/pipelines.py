"""The pipelines the simulator runs, and the execution type of each of their stages.

vLLM-Omni 0.30 keeps a pipeline's stage graph and stage types in code (a registered
`PipelineConfig`, each stage an `LLM_AR`, `LLM_GENERATION` or `DIFFUSION` stage); a stage
config only places the stages. `--pipeline` names the simulator's counterpart of that
registry entry; without it every stage runs as an `LLM_AR` stage, one token per engine step,
as the simulator always did. Light on purpose: every stage process imports it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any


class ExecutionType(str, enum.Enum):
    """vLLM-Omni's `StageExecutionType`: how a stage runs a request."""

    # Autoregressive: one token per engine step (thinker, talker, a text encoder).
    LLM_AR = "LLM_AR"
    # One forward per request, no sampling (code2wav: codec tokens in, audio out).
    LLM_GENERATION = "LLM_GENERATION"
    # A denoising loop of N steps per request, each one call of the DiT (an image model).
    DIFFUSION = "DIFFUSION"


OMNI_PIPELINE = "qwen2_5_omni"
IMAGE_PIPELINE = "image"
# Each pipeline's stages by name (the stage config's `model_stage`, or the name the
# topology gives them), as the real registry entries type them.
PIPELINES: Mapping[str, Mapping[str, ExecutionType]] = {
    OMNI_PIPELINE: {
        "thinker": ExecutionType.LLM_AR,
        "talker": ExecutionType.LLM_AR,
        "code2wav": ExecutionType.LLM_GENERATION,
    },
    IMAGE_PIPELINE: {"text": ExecutionType.LLM_AR, "dit": ExecutionType.DIFFUSION},
}

# The image pipeline's stage config in the 0.30 deploy schema: a text encoder (LLM_AR) and
# a DiT (DIFFUSION) on device 0, chained in stage order. The pipeline name is unknown to
# vLLM-Omni's registry, so readers take the names from `model_stage`; `stage_type` is the
# field real stage configs mark a diffusion stage with.
IMAGE_STAGE_CONFIG: Mapping[str, Any] = {
    "pipeline": "omni_sim_image",
    "async_chunk": False,
    "stages": [
        {
            "stage_id": 0,
            "model_stage": "text",
            "stage_type": "llm",
            "gpu_memory_utilization": 0.3,
            "max_num_seqs": 1,
            "enforce_eager": True,
            "devices": "0",
        },
        {
            "stage_id": 1,
            "model_stage": "dit",
            "stage_type": "diffusion",
            "gpu_memory_utilization": 0.5,
            "max_num_seqs": 1,
            "devices": "0",
            "final_output": True,
            "final_output_type": "image",
        },
    ],
}
BUILT_IN_CONFIGS: Mapping[str, Mapping[str, Any]] = {IMAGE_PIPELINE: IMAGE_STAGE_CONFIG}

# A request's denoising steps when it names none (vLLM-Omni's tiny test pipelines run 4),
# and the most one may ask for.
DEFAULT_DENOISE_STEPS = 4
MAX_DENOISE_STEPS = 1000


class PipelineError(ValueError):
    """A pipeline that does not fit the stages it is given."""


def execution_types(
    pipeline: str | None, stages: Iterable[tuple[int, str]]
) -> dict[int, ExecutionType]:
    """The execution type of each (stage id, stage name) under `pipeline`; every stage is
    LLM_AR without one. PipelineError names a stage the pipeline does not have."""
    if pipeline is None:
        return {stage_id: ExecutionType.LLM_AR for stage_id, _ in stages}
    types = PIPELINES.get(pipeline)
    if types is None:
        raise PipelineError(f"unknown pipeline {pipeline!r}; known: {', '.join(PIPELINES)}")
    found: dict[int, ExecutionType] = {}
    for stage_id, name in stages:
        if name not in types:
            raise PipelineError(
                f"stage {stage_id} ({name}) is not a stage of the {pipeline} pipeline"
                f" ({', '.join(types)})"
            )
        found[stage_id] = types[name]
    return found


def write_stage_config(pipeline: str, path: Path) -> Path:
    """Write the built-in stage config of `pipeline` to `path` (for a watchdog told the
    stage config its server runs); `path`."""
    import yaml

    path.write_text(yaml.safe_dump(dict(BUILT_IN_CONFIGS[pipeline]), sort_keys=False))
    return path


def requested_steps(value: Any) -> int:
    """The denoising steps a request asks for: a positive integer up to the bound, else the
    default."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_DENOISE_STEPS:
        return value
    return DEFAULT_DENOISE_STEPS
