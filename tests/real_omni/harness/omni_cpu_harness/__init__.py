"""The real vLLM-Omni 0.30 on a CPU, for omni-watchdog's tests.

vLLM-Omni detects CUDA, ROCm, NPU, XPU and MUSA only, keeps its stage graphs in code, and
calls each model's forward with arguments a stock vLLM model rejects. This package fills
those gaps through vLLM-Omni's and vLLM's own plugin entry points, patching no file of
either: a CPU platform (for autoregressive, generation and diffusion stages alike), a
registered three-stage pipeline shaped like Qwen-Omni's (thinker, talker, code2wav making
audio), a text-to-image pipeline and a tiny random diffusion model, a Llama that takes the
extra arguments, and faults a test arms inside one stage's forward or denoising step.
"""
