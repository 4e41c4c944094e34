"""The GPU probe: device memory and utilization, and memory per pid, through NVML."""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from omni_watchdog.types import Clock, Observation, ObservationKind, ProbeError, StageRef

NVML_MODULES = {"nvml": "pynvml", "sim": "omni_watchdog.sim.nvml"}


def load_nvml(backend: str) -> ModuleType | None:
    """The NVML module of a backend: real pynvml, the simulator's stand-in, or none."""
    if backend == "none":
        return None
    if backend not in NVML_MODULES:
        raise ValueError(f"unknown GPU backend {backend!r}: expected nvml, sim or none")
    return importlib.import_module(NVML_MODULES[backend])


@dataclass(frozen=True)
class DeviceReading:
    """One device as NVML reported it in one collect."""

    index: int
    used_bytes: int
    total_bytes: int
    utilization: float | None
    processes: dict[int, int]


class GpuProbe:
    """Reads every device's memory and utilization and the memory each pid holds on it."""

    name = "gpu"

    def __init__(
        self,
        nvml_module: ModuleType,
        clock: Clock,
        stage_of: Callable[[int], StageRef | None],
    ) -> None:
        self._nvml = nvml_module
        self._clock = clock
        self._stage_of = stage_of
        self._initialized = False
        self._devices: tuple[DeviceReading, ...] = ()
        self._snapshot_time: float | None = None

    async def collect(self) -> Sequence[Observation]:
        devices = await asyncio.to_thread(self._read)
        now = self._clock.monotonic()
        self._devices = devices
        self._snapshot_time = now
        observations: list[Observation] = []
        for device in devices:
            observations.append(
                Observation(
                    ObservationKind.GPU_DEVICE,
                    now,
                    gpu=device.index,
                    value=float(device.used_bytes),
                    utilization=device.utilization,
                )
            )
            observations.extend(
                Observation(
                    ObservationKind.GPU_PROCESS,
                    now,
                    pid=pid,
                    gpu=device.index,
                    value=float(used),
                    stage=self._stage_of(pid),
                )
                for pid, used in sorted(device.processes.items())
            )
        return observations

    def held_bytes(self, pids: Iterable[int]) -> int:
        """Device memory the given pids held at the last collect, over all devices."""
        wanted = set(pids)
        return sum(
            used
            for device in self._devices
            for pid, used in device.processes.items()
            if pid in wanted
        )

    def last_snapshot(self) -> dict[str, Any]:
        """The last reading of every device, as plain JSON-able data for incident bundles."""
        return {
            "time": self._snapshot_time,
            "devices": [
                {
                    "index": device.index,
                    "used_bytes": device.used_bytes,
                    "total_bytes": device.total_bytes,
                    "utilization": device.utilization,
                    "processes": [
                        {"pid": pid, "used_bytes": used, "stage": _stage_name(self._stage_of(pid))}
                        for pid, used in sorted(device.processes.items())
                    ],
                }
                for device in self._devices
            ],
        }

    def _read(self) -> tuple[DeviceReading, ...]:
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

    def _read_device(self, index: int) -> DeviceReading:
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
        return DeviceReading(
            index=index,
            used_bytes=int(memory.used),
            total_bytes=int(memory.total),
            utilization=utilization,
            processes=processes,
        )


def _stage_name(stage: StageRef | None) -> str | None:
    return str(stage) if stage is not None else None
