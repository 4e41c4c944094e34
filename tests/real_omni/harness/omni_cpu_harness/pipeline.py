"""The harness pipeline: three autoregressive text stages shaped like Qwen2.5-Omni's.

thinker → talker → code2wav, each fed by the one before and the last one final, all the
tiny random Llama of `scripts/make_tiny_model.py` (written with the architecture name
below). The deploy file beside this module selects the pipeline by its name.
"""

from __future__ import annotations

from pathlib import Path

PIPELINE_NAME = "omni_watchdog_harness"
MODEL_ARCHITECTURE = "HarnessLlamaForCausalLM"
STAGE_NAMES = ("thinker", "talker", "code2wav")
DEPLOY_FILE = Path(__file__).with_name("deploy.yaml")


def register() -> None:
    """Entry point of `vllm.general_plugins`: runs in every vLLM process, more than once."""
    from vllm.model_executor.models import ModelRegistry
    from vllm_omni.config.pipeline_registry import OMNI_PIPELINES, register_pipeline
    from vllm_omni.config.stage_config import (
        PipelineConfig,
        StageExecutionType,
        StagePipelineConfig,
    )
    from vllm_omni.model_executor.models.registry import OmniModelRegistry

    from omni_cpu_harness.model import HarnessLlamaForCausalLM

    # The class itself, not its dotted name: vLLM inspects a model registered by name in a
    # fresh interpreter, which costs each server start some fifteen seconds here.
    ModelRegistry.register_model(MODEL_ARCHITECTURE, HarnessLlamaForCausalLM)
    OmniModelRegistry.register_model(MODEL_ARCHITECTURE, HarnessLlamaForCausalLM)
    if PIPELINE_NAME in OMNI_PIPELINES:
        return
    stages = tuple(
        StagePipelineConfig(
            stage_id=stage_id,
            model_stage=name,
            execution_type=StageExecutionType.LLM_AR,
            input_sources=() if stage_id == 0 else (stage_id - 1,),
            final_output=stage_id == len(STAGE_NAMES) - 1,
            final_output_type="text",
            owns_tokenizer=stage_id == 0,
            sampling_constraints={"detokenize": True},
        )
        for stage_id, name in enumerate(STAGE_NAMES)
    )
    register_pipeline(
        PipelineConfig(model_type=PIPELINE_NAME, model_arch=MODEL_ARCHITECTURE, stages=stages)
    )
