"""The tiny models under vLLM-Omni's LLM stages.

`HarnessLlamaForCausalLM` (the thinker and the talker) takes the omni runner's extra
forward arguments; `HarnessCode2Wav` (the code2wav stage) is the same Llama under vLLM-Omni's
generation runner, turning its input codes into a waveform in one forward.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm_omni.model_executor.models.output_templates import OmniOutput

from omni_cpu_harness.faults import strike

# Samples of waveform per input code, and their rate: Qwen-Omni's code2wav makes 24 kHz
# audio; the numbers only shape the answer's WAV.
SAMPLES_PER_CODE = 240
SAMPLE_RATE = 24000


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


class HarnessCode2Wav(HarnessLlamaForCausalLM):
    """A code2wav stage: every request's codes (the talker's tokens) become a waveform.

    vLLM-Omni's generation runner calls one forward per request batch and takes what
    `multimodal_outputs` holds, one entry per request, as the stage's output (as the real
    Qwen3-Omni code2wav returns it: `model_outputs` waveforms and their `sr`).
    """

    have_multimodal_outputs = True

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        hidden_size = vllm_config.model_config.hf_config.hidden_size
        # Seeded and not a parameter: the checkpoint has no such weight, and every start
        # turns the same codes into the same sound.
        generator = torch.Generator().manual_seed(0)
        self.register_buffer(
            "to_samples",
            torch.randn(hidden_size, SAMPLES_PER_CODE, generator=generator) / hidden_size**0.5,
            persistent=False,
        )

    def forward(
        self,
        input_ids: Any,
        positions: Any,
        intermediate_tensors: Any = None,
        inputs_embeds: Any = None,
        **omni_arguments: Any,
    ) -> Any:
        hidden = super().forward(input_ids, positions, intermediate_tensors, inputs_embeds)
        # The runner passes each request's token count; its own warm-up runs may not.
        counts = omni_arguments.get("seq_token_counts") or [hidden.shape[0]]
        samples = torch.tanh(hidden.float() @ self.to_samples.to(hidden.device))
        waveforms = [
            chunk.reshape(1, -1) for chunk in torch.split(samples[: sum(counts)], counts, dim=0)
        ]
        rate = [torch.tensor(SAMPLE_RATE, dtype=torch.int32) for _ in waveforms]
        return OmniOutput(
            text_hidden_states=hidden,
            multimodal_outputs={"model_outputs": waveforms, "sr": rate},
        )
