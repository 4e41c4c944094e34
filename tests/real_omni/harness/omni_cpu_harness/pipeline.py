"""The harness pipelines, registered by name; each deploy file beside this module selects
one.

- `omni_watchdog_harness` (`deploy.yaml`), shaped like Qwen2.5-Omni's: thinker (`LLM_AR`) →
  talker (`LLM_AR`) → code2wav (`LLM_GENERATION`, audio out, the final output), the
  tiny random Llama of `scripts/make_tiny_model.py` under each.
- `omni_watchdog_harness_image` (`deploy-image.yaml`): text (`LLM_AR`, the same Llama) →
  DiT (`DIFFUSION`, the tiny image pipeline of `diffusion.py`, in a `StageDiffusionProc`).

A model directory holding only `model_index.json` naming the tiny image pipeline is a
one-stage diffusion server of its own, no deploy file needed.
"""

from __future__ import annotations

from pathlib import Path

PIPELINE_NAME = "omni_watchdog_harness"
MODEL_ARCHITECTURE = "HarnessLlamaForCausalLM"
CODE2WAV_ARCHITECTURE = "HarnessCode2Wav"
STAGE_NAMES = ("thinker", "talker", "code2wav")
DEPLOY_FILE = Path(__file__).with_name("deploy.yaml")
IMAGE_PIPELINE_NAME = "omni_watchdog_harness_image"
IMAGE_STAGE_NAMES = ("text", "dit")
IMAGE_DEPLOY_FILE = Path(__file__).with_name("deploy-image.yaml")
# The tiny image pipeline's class, as `model_index.json` and the registry name it.
DIFFUSION_ARCHITECTURE = "HarnessTinyImagePipeline"


def register() -> None:
    """Entry point of `vllm.general_plugins`: runs in every vLLM process, more than once."""
    from vllm.model_executor.models import ModelRegistry
    from vllm_omni.config.pipeline_registry import OMNI_PIPELINES, register_pipeline
    from vllm_omni.config.stage_config import (
        PipelineConfig,
        StageExecutionType,
        StagePipelineConfig,
    )
    from vllm_omni.diffusion.registry import register_diffusion_model
    from vllm_omni.model_executor.models.registry import OmniModelRegistry

    from omni_cpu_harness.model import HarnessCode2Wav, HarnessLlamaForCausalLM

    # The classes themselves, not their dotted names: vLLM inspects a model registered by
    # name in a fresh interpreter, which costs each server start some fifteen seconds here.
    for name, model in (
        (MODEL_ARCHITECTURE, HarnessLlamaForCausalLM),
        (CODE2WAV_ARCHITECTURE, HarnessCode2Wav),
    ):
        ModelRegistry.register_model(name, model)
        OmniModelRegistry.register_model(name, model)
    # By dotted name: torch and the diffusion layers load only where a diffusion stage runs.
    register_diffusion_model(
        DIFFUSION_ARCHITECTURE,
        "omni_cpu_harness.diffusion",
        DIFFUSION_ARCHITECTURE,
        post_process_func_name="get_post_process_func",
    )
    if PIPELINE_NAME not in OMNI_PIPELINES:
        register_pipeline(
            PipelineConfig(
                model_type=PIPELINE_NAME,
                model_arch=MODEL_ARCHITECTURE,
                stages=(
                    # Not a final output: the watchdog's view of the pipeline (and its
                    # tests) has code2wav as the one final stage. The text type keeps
                    # "text" among the pipeline's output modalities, so a request for text
                    # alone is accepted; with no final text stage it runs all three.
                    StagePipelineConfig(
                        stage_id=0,
                        model_stage="thinker",
                        execution_type=StageExecutionType.LLM_AR,
                        input_sources=(),
                        final_output_type="text",
                        owns_tokenizer=True,
                        sampling_constraints={"detokenize": True},
                    ),
                    StagePipelineConfig(
                        stage_id=1,
                        model_stage="talker",
                        execution_type=StageExecutionType.LLM_AR,
                        input_sources=(0,),
                        final_output_type="text",
                        sampling_constraints={"detokenize": True},
                    ),
                    StagePipelineConfig(
                        stage_id=2,
                        model_stage="code2wav",
                        execution_type=StageExecutionType.LLM_GENERATION,
                        input_sources=(1,),
                        final_output=True,
                        final_output_type="audio",
                        model_arch=CODE2WAV_ARCHITECTURE,
                        engine_output_type="audio",
                        sampling_constraints={"detokenize": True},
                    ),
                ),
            )
        )
    if IMAGE_PIPELINE_NAME not in OMNI_PIPELINES:
        register_pipeline(
            PipelineConfig(
                model_type=IMAGE_PIPELINE_NAME,
                model_arch=MODEL_ARCHITECTURE,
                stages=(
                    StagePipelineConfig(
                        stage_id=0,
                        model_stage="text",
                        execution_type=StageExecutionType.LLM_AR,
                        input_sources=(),
                        owns_tokenizer=True,
                        sampling_constraints={"detokenize": True},
                    ),
                    # With no input function of its own, the DiT gets the request's prompt.
                    StagePipelineConfig(
                        stage_id=1,
                        model_stage="dit",
                        execution_type=StageExecutionType.DIFFUSION,
                        input_sources=(0,),
                        final_output=True,
                        final_output_type="image",
                        model_arch=DIFFUSION_ARCHITECTURE,
                    ),
                ),
            )
        )
