"""A tiny random image pipeline for vLLM-Omni's diffusion stages, and their CPU attention.

`HarnessTinyImagePipeline` is registered with `register_diffusion_model` (see
`pipeline.py`); its model directory holds only `model_index.json` naming it, and its
weights are seeded random here. It has what a real pipeline (SD3, Qwen-Image) has where a
watchdog looks: a `transformer` (a one-block DiT using vLLM-Omni's `Attention` layer) that
is called once per denoising step, a step loop over the request's `num_inference_steps`,
and the request's height and width. There is no classifier-free guidance: a forward hook on
the DiT fires exactly once per step. Each step calls `strike_step`, so a test can arm a
fault inside a denoising step (see `faults.py`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch import nn
from vllm_omni.diffusion.attention.backends.sdpa import SDPABackend, SDPAImpl
from vllm_omni.diffusion.attention.layer import Attention
from vllm_omni.diffusion.data import DiffusionOutput

from omni_cpu_harness.faults import strike_step

# Latent channels, the image-to-latent scale and the DiT's patch: SD3's shape, scaled down.
LATENT_CHANNELS = 4
VAE_SCALE = 8
PATCH = 2
DIT_DIM = 32
DIT_HEADS = 2
DEFAULT_SIZE = 64
DEFAULT_STEPS = 4


class CpuSdpaImpl(SDPAImpl):
    """vLLM-Omni's SDPA attention, called on a CPU.

    The stock backends dispatch on the platform (CUDA, ROCm, NPU, XPU, MUSA) and raise on
    any other; this is their plain `torch.nn.functional.scaled_dot_product_attention`.
    """

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_metadata: Any = None,
    ) -> torch.Tensor:
        return self._forward_impl(query, key, value, attn_metadata, mask_mode="broadcast_k")


class CpuSdpaBackend(SDPABackend):
    @staticmethod
    def get_name() -> str:
        return "CPU_SDPA"

    @staticmethod
    def get_impl_cls() -> type[SDPAImpl]:
        return CpuSdpaImpl


class HarnessTinyDiT(nn.Module):
    """One transformer block over 2x2 patches of the latent, conditioned on the timestep and
    the prompt's bytes."""

    def __init__(self) -> None:
        super().__init__()
        patch_size = LATENT_CHANNELS * PATCH * PATCH
        self.patch_in = nn.Linear(patch_size, DIT_DIM)
        self.time_in = nn.Linear(1, DIT_DIM)
        self.text_in = nn.Embedding(256, DIT_DIM)
        self.norm = nn.LayerNorm(DIT_DIM)
        self.qkv = nn.Linear(DIT_DIM, 3 * DIT_DIM)
        head_size = DIT_DIM // DIT_HEADS
        self.attn = Attention(
            num_heads=DIT_HEADS,
            head_size=head_size,
            causal=False,
            softmax_scale=1.0 / math.sqrt(head_size),
            prefix="transformer.attn",
        )
        self.proj_out = nn.Linear(DIT_DIM, patch_size)

    def forward(
        self, latents: torch.Tensor, timestep: torch.Tensor, prompt_bytes: torch.Tensor
    ) -> torch.Tensor:
        batch, channels, height, width = latents.shape
        rows, cols = height // PATCH, width // PATCH
        patches = (
            latents.reshape(batch, channels, rows, PATCH, cols, PATCH)
            .permute(0, 2, 4, 1, 3, 5)
            .reshape(batch, rows * cols, channels * PATCH * PATCH)
        )
        tokens = self.patch_in(patches)
        tokens = tokens + self.time_in(timestep.reshape(batch, 1, 1).to(tokens.dtype))
        tokens = tokens + self.text_in(prompt_bytes).mean(dim=1, keepdim=True)
        query, key, value = self.qkv(self.norm(tokens)).chunk(3, dim=-1)
        shape = (batch, rows * cols, DIT_HEADS, DIT_DIM // DIT_HEADS)
        attended = self.attn(query.reshape(shape), key.reshape(shape), value.reshape(shape))
        tokens = tokens + attended.reshape(batch, rows * cols, DIT_DIM)
        noise = self.proj_out(tokens)
        return (
            noise.reshape(batch, rows, cols, channels, PATCH, PATCH)
            .permute(0, 3, 1, 4, 2, 5)
            .reshape(batch, channels, height, width)
        )


class HarnessTinyImagePipeline(nn.Module):
    """Text to image: noise, `num_inference_steps` Euler steps of the DiT, a x8 decode."""

    # The startup warm-up (512x512, 2 steps) costs this pipeline a few milliseconds; kept,
    # it runs the worker's output path before the first request, as for a real model.
    dummy_run_num_frames: ClassVar[int] = 1

    def __init__(self, *, od_config: Any, prefix: str = "") -> None:
        super().__init__()
        self.od_config = od_config
        self.stage_id = int(getattr(od_config, "stage_id", 0) or 0)
        # Seeded: every process of every start builds the same weights.
        state = torch.random.get_rng_state()
        torch.manual_seed(0)
        try:
            self.transformer = HarnessTinyDiT()
            self.decoder = nn.Conv2d(LATENT_CHANNELS, 3, kernel_size=1)
        finally:
            torch.random.set_rng_state(state)
        # No checkpoint: nothing is read from the model directory.
        self.weights_sources: list[Any] = []

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for _ in weights:
            pass
        return {name for name, _ in self.named_parameters()}

    def forward(self, batch: Any) -> list[DiffusionOutput]:
        return [
            self._generate(prompt, sampling)
            for prompt, sampling in zip(batch.prompts, batch.sampling_params_list, strict=True)
        ]

    def _generate(self, prompt: Any, sampling: Any) -> DiffusionOutput:
        text = prompt if isinstance(prompt, str) else str(prompt.get("prompt") or "")
        height = int(sampling.height or DEFAULT_SIZE)
        width = int(sampling.width or DEFAULT_SIZE)
        steps = int(sampling.num_inference_steps or DEFAULT_STEPS)
        device = next(self.parameters()).device
        dtype = next(self.parameters()).dtype
        generator = torch.Generator(device="cpu").manual_seed(
            int(sampling.seed) if sampling.seed is not None else 0
        )
        shape = (1, LATENT_CHANNELS, height // VAE_SCALE, width // VAE_SCALE)
        latents = torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
        prompt_bytes = torch.tensor([list(text.encode()[:64]) or [0]], device=device)
        # Flow matching from noise (t = 1) to image (t = 0), one DiT call a step.
        sigmas = torch.linspace(1.0, 0.0, steps + 1)
        for index in range(steps):
            strike_step(self.stage_id)
            sigma, next_sigma = float(sigmas[index]), float(sigmas[index + 1])
            timestep = torch.full((1,), sigma * 1000.0, device=device, dtype=dtype)
            velocity = self.transformer(latents, timestep, prompt_bytes)
            latents = latents + (next_sigma - sigma) * velocity
        image = torch.nn.functional.interpolate(latents, scale_factor=VAE_SCALE, mode="nearest")
        return DiffusionOutput(output=torch.tanh(self.decoder(image)).float())


def get_post_process_func(od_config: Any) -> Callable[[torch.Tensor], Any]:
    """Images in [-1, 1] to PIL images, as SD3's post-processing does."""
    from diffusers.image_processor import VaeImageProcessor

    processor = VaeImageProcessor(vae_scale_factor=VAE_SCALE)

    def post_process(images: torch.Tensor) -> Any:
        return processor.postprocess(images)

    return post_process
