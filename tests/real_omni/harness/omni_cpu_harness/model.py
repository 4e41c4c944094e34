"""The tiny Llama under vLLM-Omni: takes the omni runner's extra forward arguments."""

from __future__ import annotations

from typing import Any

from vllm.model_executor.models.llama import LlamaForCausalLM

from omni_cpu_harness.faults import strike


class HarnessLlamaForCausalLM(LlamaForCausalLM):
    """vLLM's Llama, plus a stage id (for armed faults) and vLLM-Omni's forward arguments."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.harness_stage_id = int(getattr(vllm_config.model_config, "stage_id", None) or 0)

    def forward(
        self,
        input_ids: Any,
        positions: Any,
        intermediate_tensors: Any = None,
        inputs_embeds: Any = None,
        **omni_arguments: Any,
    ) -> Any:
        # vLLM-Omni's AR runner adds sampling_metadata, logits_index and sampler; a text
        # model has no use for them.
        strike(self.harness_stage_id)
        return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds)
