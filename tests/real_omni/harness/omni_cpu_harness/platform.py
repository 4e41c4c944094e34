"""A CPU platform for vLLM-Omni: vLLM's CPU worker and model runner under its AR stage."""

from __future__ import annotations

import functools
from typing import Any


def activate() -> str | None:
    """Entry point of `vllm_omni.platform_plugins`: this platform where no GPU is in sight.

    Installed beside a GPU build it must not win, so it answers only when vLLM itself runs
    on its CPU platform.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    return f"{__name__}.CpuOmniPlatform"


@functools.cache
def _platform_class() -> type[Any]:
    import psutil
    import torch
    from vllm.platforms.cpu import CpuPlatform
    from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum

    # OmniPlatform's device methods only raise; ahead of CpuPlatform in the order, each
    # needs its CPU answer here.
    class CpuOmniPlatform(OmniPlatform, CpuPlatform):
        _omni_enum = OmniPlatformEnum.OOT

        @classmethod
        def get_torch_device(cls, local_rank: int | None = None) -> torch.device:
            return torch.device("cpu")

        @classmethod
        def get_device_count(cls) -> int:
            return 0

        @classmethod
        def get_device_version(cls) -> str | None:
            return None

        @classmethod
        def synchronize(cls) -> None:
            return None

        @classmethod
        def get_free_memory(cls, device: torch.device | None = None) -> int:
            return int(psutil.virtual_memory().available)

        @classmethod
        def get_device_memory(cls, device: torch.device | None = None) -> tuple[int, int]:
            memory = psutil.virtual_memory()
            return int(memory.available), int(memory.total)

        @classmethod
        def supports_torch_inductor(cls) -> bool:
            return False

        @classmethod
        def get_omni_ar_worker_cls(cls) -> str:
            return f"{__name__}.CpuARWorker"

        @classmethod
        def get_omni_generation_worker_cls(cls) -> str:
            raise NotImplementedError("the harness pipeline has autoregressive stages only")

        @classmethod
        def get_default_stage_config_path(cls) -> str:
            return "vllm_omni/deploy"

    return CpuOmniPlatform


@functools.cache
def _worker_class() -> type[Any]:
    import torch
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm_omni.worker.gpu_ar_model_runner import GPUARModelRunner
    from vllm_omni.worker.mixins import OmniWorkerMixin

    # vLLM's CPU runner first: it swaps device buffers for host ones around the omni
    # runner's own set-up, which otherwise asks for CUDA.
    class CpuARModelRunner(CPUModelRunner, GPUARModelRunner):
        pass

    class CpuARWorker(OmniWorkerMixin, CPUWorker):
        def init_device(self) -> None:
            super().init_device()
            # CPUWorker builds its runner by name; the omni stage needs the one above.
            self.model_runner = CpuARModelRunner(self.vllm_config, torch.device("cpu"))

    return CpuARWorker


def __getattr__(name: str) -> Any:
    # vLLM resolves both by qualified name in each process; building them lazily keeps the
    # entry point cheap to import where it answers None.
    if name == "CpuOmniPlatform":
        return _platform_class()
    if name == "CpuARWorker":
        return _worker_class()
    raise AttributeError(name)
