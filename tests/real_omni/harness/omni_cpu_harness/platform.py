"""A CPU platform for vLLM-Omni: vLLM's CPU worker and model runner under its AR and
generation stages, and what its diffusion stages need on a CPU.

Only one out-of-tree platform can be active in a process, so this one class serves every
stage type of a pipeline together.
"""

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

        # One device, the CPU: a diffusion stage places its rank on `rank % count`.
        @classmethod
        def get_device_count(cls) -> int:
            return 1

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
            return f"{__name__}.CpuGenerationWorker"

        # The diffusion runner and workers ask the platform for the CUDA allocator's
        # statistics, which `torch.cpu` lacks; a CPU has no cache to empty.
        @classmethod
        def empty_cache(cls) -> None:
            return None

        @classmethod
        def reset_peak_memory_stats(cls, device: torch.device | None = None) -> None:
            return None

        @classmethod
        def max_memory_reserved(cls, device: torch.device | None = None) -> int:
            return 0

        @classmethod
        def max_memory_allocated(cls, device: torch.device | None = None) -> int:
            return 0

        @classmethod
        def memory_allocated(cls, device: torch.device | None = None) -> int:
            return 0

        @classmethod
        def get_diffusion_attn_backend_cls(
            cls,
            selected_backend: str | None,
            head_size: int,
            allow_trtllm_default: bool = False,
        ) -> str:
            # Every built-in backend dispatches on the platform and has no CPU branch.
            return "omni_cpu_harness.diffusion.CpuSdpaBackend"

        @classmethod
        def get_diffusion_worker_cls(cls) -> str:
            # Asked in the diffusion worker's process before its output thread starts,
            # whichever executor runs it: the one moment to replace that thread's loop.
            _replace_async_output_loop()
            return "vllm_omni.diffusion.worker.diffusion_worker.DiffusionWorker"

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


@functools.cache
def _generation_worker_class() -> type[Any]:
    import torch
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm_omni.worker.gpu_generation_model_runner import GPUGenerationModelRunner
    from vllm_omni.worker.mixins import OmniWorkerMixin

    # As for the AR stage: vLLM's CPU runner ahead of the omni generation runner.
    class CpuGenerationModelRunner(CPUModelRunner, GPUGenerationModelRunner):
        pass

    class CpuGenerationWorker(OmniWorkerMixin, CPUWorker):
        def init_device(self) -> None:
            super().init_device()
            self.model_runner = CpuGenerationModelRunner(self.vllm_config, torch.device("cpu"))

    return CpuGenerationWorker


@functools.cache
def _replace_async_output_loop() -> None:
    """The diffusion worker's output thread, without an accelerator stream.

    vLLM-Omni's loop (`WorkerProc._async_output_loop`, the multiprocess executor's) opens a
    stream on `torch.accelerator.current_accelerator()`, None on a CPU: the thread dies at
    once and the startup warm-up waits for its output for good. This one packs each output
    into shared memory in the same thread, the way the loop does with no stream.
    """
    from vllm.logger import init_logger
    from vllm_omni.diffusion.ipc import pack_diffusion_output_shm
    from vllm_omni.diffusion.worker.diffusion_worker import (
        AsyncDiffusionOutput,
        AsyncOutputKind,
        WorkerProc,
    )

    logger = init_logger(__name__)

    def _async_output_loop(self: Any) -> None:
        while True:
            item = self._async_output_queue.get()
            if item is None:
                break
            output, async_output_id, _ = item
            try:
                pack_diffusion_output_shm(output)
                ready = AsyncDiffusionOutput(
                    kind=AsyncOutputKind.OUTPUT_READY,
                    async_output_id=async_output_id,
                    output=output,
                )
            except Exception:
                logger.exception("Async output packing failed for id '%s'", async_output_id)
                ready = AsyncDiffusionOutput(
                    kind=AsyncOutputKind.OUTPUT_READY,
                    async_output_id=async_output_id,
                    error="Background D2H/SHM packing failed",
                )
            try:
                self._enqueue_result(ready)
            finally:
                with self._async_output_done:
                    self._async_output_pending = max(0, self._async_output_pending - 1)
                    self._async_output_done.notify_all()

    WorkerProc._async_output_loop = _async_output_loop


def __getattr__(name: str) -> Any:
    # vLLM resolves each by qualified name in each process; building them lazily keeps the
    # entry point cheap to import where it answers None.
    if name == "CpuOmniPlatform":
        return _platform_class()
    if name == "CpuARWorker":
        return _worker_class()
    if name == "CpuGenerationWorker":
        return _generation_worker_class()
    raise AttributeError(name)
