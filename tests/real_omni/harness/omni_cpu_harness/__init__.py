"""The real vLLM-Omni 0.30 on a CPU, for omni-watchdog's tests.

vLLM-Omni detects CUDA, ROCm, NPU, XPU and MUSA only, keeps its stage graphs in code, and
calls each model's forward with arguments a stock vLLM model rejects. This package fills
those gaps through vLLM-Omni's and vLLM's own plugin entry points, patching no file of
either: a CPU platform, a registered three-stage text pipeline, a Llama that takes the
extra arguments, and faults a test arms inside one stage's forward.
"""
