#!/usr/bin/env bash
# GPU check for a machine with an NVIDIA GPU: real pynvml attributes a hung child's CUDA
# memory, the watchdog kills the tree and sees the memory come back. Exit 0 only then.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
"$python" scripts/gpu_check.py
nvidia-smi --query-compute-apps=pid,used_memory --format=csv
