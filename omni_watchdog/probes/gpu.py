"""The GPU probe: device memory and utilization, and memory per pid, through NVML."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from omni_watchdog.types import (
    Clock,
    GpuDevice,
    GpuProcess,
    GpuReading,
    Nvml,
    Observation,
    ObservationKind,
    ProbeError,
    StageRef,
)


def load_nvml(backend: str) -> Nvml[Any] | None:
    """The NVML module of a backend: real pynvml, the simulator's stand-in, or none.

    Which one is known only when the config is read, and each names devices by handles of
    its own type: hence `Nvml[Any]`.
    """
    if backend == "none":
        return None
    if backend == "nvml":
        import pynvml

        # pynvml carries no types: it is the API `Nvml` was written from.
        real: Nvml[Any] = pynvml
        return real
    if backend == "sim":
        from omni_watchdog.sim import nvml as simulated

        return simulated
    raise ValueError(f"unknown GPU backend {backend!r}: expected nvml, sim or none")


class GpuProbe:
    """Reads every device's memory and utilization and the memory each pid holds on it."""

    name = "gpu"

    def __init__(
        self,
        nvml: Nvml[Any],
        clock: Clock,
        stage_of: Callable[[int], StageRef | None],
    ) -> None:
        self._nvml = nvml
        self._clock = clock
        self._stage_of = stage_of
        self._initialized = False
        # The last complete reading; None until the first.
        self.last_reading: GpuReading | None = None

    async def collect(self) -> Sequence[Observation]:
        devices = await asyncio.to_thread(self._read)
        now = self._clock.monotonic()
        reading = GpuReading(
            now,
            tuple(device for device, _ in devices),
            tuple(
                GpuProcess(device.index, pid, float(used), self._stage_of(pid))
                for device, held in devices
                for pid, used in sorted(held.items())
            ),
        )
        self.last_reading = reading
        return observations_of(reading)

    def _read(self) -> tuple[tuple[GpuDevice, dict[int, int]], ...]:
        nvml = self._nvml
        if not self._initialized:
            try:
                nvml.nvmlInit()
            except nvml.NVMLError as error:
                raise ProbeError(f"NVML is not available: {error}") from None
            self._initialized = True
        try:
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as error:
            raise ProbeError(f"NVML cannot count devices: {error}") from None
        return tuple(self._read_device(index) for index in range(count))

    def _read_device(self, index: int) -> tuple[GpuDevice, dict[int, int]]:
        """The device, and the bytes each pid holds on it."""
        nvml = self._nvml
        # Memory and the pid list must be complete: a partial reading would look like
        # memory given back, which is exactly what the verify step must not believe.
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            running = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except nvml.NVMLError as error:
            raise ProbeError(f"NVML cannot read device {index}: {error}") from None
        try:
            utilization: float | None = nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
        except nvml.NVMLError:
            # Some devices (MIG instances among them) do not report utilization.
            utilization = None
        processes: dict[int, int] = {}
        for process in running:
            # Some drivers report no per-process figure (None) rather than a number.
            used = int(process.usedGpuMemory or 0)
            processes[process.pid] = processes.get(process.pid, 0) + used
        device = GpuDevice(index, float(memory.used), float(memory.total), utilization)
        return device, processes


def observations_of(reading: GpuReading) -> list[Observation]:
    """A reading as the detector takes it: one observation per device and per pid."""
    observations = [
        Observation(
            ObservationKind.GPU_DEVICE,
            reading.time,
            gpu=device.index,
            value=device.used_bytes,
            utilization=device.utilization,
        )
        for device in reading.devices
    ]
    observations.extend(
        Observation(
            ObservationKind.GPU_PROCESS,
            reading.time,
            pid=held.pid,
            gpu=held.gpu,
            value=held.used_bytes,
            stage=held.stage,
        )
        for held in reading.processes
    )
    return observations
