"""The GPU probe against a fake pynvml module with the same call names."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from dataclasses import dataclass, field
from typing import Any

import pynvml
import pytest

from omni_watchdog.clock import FakeClock
from omni_watchdog.probes.gpu import GpuProbe, load_nvml
from omni_watchdog.types import Observation, ObservationKind, ProbeError, StageRef

GIB = 1 << 30


class NVMLError(Exception):
    """Stands for pynvml.NVMLError."""


@dataclass
class FakeProcess:
    pid: int
    usedGpuMemory: int | None


@dataclass
class FakeDevice:
    used: int
    total: int
    utilization: int | None
    processes: list[FakeProcess] = field(default_factory=list)
    broken: bool = False


class FakeNvml:
    """The pynvml calls the probe makes, over a list of fake devices."""

    NVMLError = NVMLError

    def __init__(self, devices: list[FakeDevice], init_failures: int = 0) -> None:
        self.devices = devices
        self.init_failures = init_failures
        self.init_calls = 0

    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.init_failures:
            self.init_failures -= 1
            raise NVMLError("Driver Not Loaded")

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeDevice:
        return self.devices[index]

    def nvmlDeviceGetMemoryInfo(self, handle: FakeDevice) -> Any:
        if handle.broken:
            raise NVMLError("GPU is lost")
        return type("Memory", (), {"used": handle.used, "total": handle.total})()

    def nvmlDeviceGetUtilizationRates(self, handle: FakeDevice) -> Any:
        if handle.utilization is None:
            raise NVMLError("Not Supported")
        return type("Utilization", (), {"gpu": handle.utilization, "memory": 0})()

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeDevice) -> list[FakeProcess]:
        return list(handle.processes)


def two_devices() -> list[FakeDevice]:
    return [
        FakeDevice(
            used=10 * GIB,
            total=80 * GIB,
            utilization=37,
            processes=[FakeProcess(200, 6 * GIB), FakeProcess(300, 4 * GIB)],
        ),
        FakeDevice(
            used=3 * GIB,
            total=80 * GIB,
            utilization=None,
            processes=[FakeProcess(300, 2 * GIB), FakeProcess(400, None)],
        ),
    ]


STAGES = {200: StageRef(0), 300: StageRef(1)}


def collect(probe: GpuProbe) -> list[Observation]:
    return list(asyncio.run(probe.collect()))


def test_devices_and_processes_with_stages() -> None:
    nvml = FakeNvml(two_devices())
    probe = GpuProbe(nvml, FakeClock(), STAGES.get)
    observations = collect(probe)
    devices = [
        (o.gpu, o.value, o.utilization)
        for o in observations
        if o.kind == ObservationKind.GPU_DEVICE
    ]
    assert devices == [(0, 10.0 * GIB, 0.37), (1, 3.0 * GIB, None)]
    processes = [
        (o.gpu, o.pid, o.value, o.stage)
        for o in observations
        if o.kind == ObservationKind.GPU_PROCESS
    ]
    assert processes == [
        (0, 200, 6.0 * GIB, StageRef(0)),
        (0, 300, 4.0 * GIB, StageRef(1)),
        (1, 300, 2.0 * GIB, StageRef(1)),
        (1, 400, 0.0, None),
    ]
    assert {o.time for o in observations} == {1000.0}
    assert probe.held_bytes([300, 400]) == 6 * GIB
    assert probe.held_bytes([999]) == 0
    snapshot = json.loads(json.dumps(probe.last_snapshot()))
    assert snapshot["devices"][1]["processes"] == [
        {"pid": 300, "used_bytes": 2 * GIB, "stage": "1.0"},
        {"pid": 400, "used_bytes": 0, "stage": None},
    ]
    collect(probe)
    assert nvml.init_calls == 1


def test_memory_given_back_shows_in_the_next_collect() -> None:
    devices = two_devices()
    probe = GpuProbe(FakeNvml(devices), FakeClock(), STAGES.get)
    collect(probe)
    devices[0].processes = [FakeProcess(300, 4 * GIB)]
    collect(probe)
    assert probe.held_bytes([200]) == 0


def test_failed_init_is_reported_each_collect_and_retried() -> None:
    nvml = FakeNvml(two_devices(), init_failures=2)
    probe = GpuProbe(nvml, FakeClock(), STAGES.get)
    for _ in range(2):
        with pytest.raises(ProbeError, match="NVML is not available: Driver Not Loaded"):
            collect(probe)
    assert len(collect(probe)) == 6
    assert nvml.init_calls == 3


def test_a_failing_device_call_is_a_probe_error_not_a_partial_reading() -> None:
    devices = two_devices()
    devices[1].broken = True
    probe = GpuProbe(FakeNvml(devices), FakeClock(), STAGES.get)
    with pytest.raises(ProbeError, match="device 1: GPU is lost"):
        collect(probe)
    assert probe.last_snapshot()["devices"] == []


def test_load_nvml_backends() -> None:
    assert load_nvml("none") is None
    assert load_nvml("nvml") is pynvml
    with pytest.raises(ValueError, match="unknown GPU backend 'cuda'"):
        load_nvml("cuda")


@pytest.mark.skipif(
    importlib.util.find_spec("omni_watchdog.sim.nvml") is None, reason="sim NVML not built yet"
)
def test_load_nvml_sim_has_the_pynvml_calls() -> None:
    module = load_nvml("sim")
    assert module is not None
    for name in (
        "nvmlInit",
        "nvmlDeviceGetCount",
        "nvmlDeviceGetHandleByIndex",
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetUtilizationRates",
        "nvmlDeviceGetComputeRunningProcesses",
        "NVMLError",
    ):
        assert hasattr(module, name), name
