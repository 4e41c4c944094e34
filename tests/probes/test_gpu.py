"""The GPU probe against a fake pynvml module with the same call names."""

from __future__ import annotations

import asyncio

import pynvml
import pytest
from fakes import FakeDevice, FakeGpuProcess, FakeNvml

from omni_watchdog.clock import FakeClock
from omni_watchdog.probes.gpu import GpuProbe, load_nvml
from omni_watchdog.sim import nvml as simulated_nvml
from omni_watchdog.types import GpuProcess, Observation, ObservationKind, ProbeError, StageRef

GIB = 1 << 30


def two_devices() -> list[FakeDevice]:
    return [
        FakeDevice(
            used=10 * GIB,
            total=80 * GIB,
            utilization=37,
            processes=[FakeGpuProcess(200, 6 * GIB), FakeGpuProcess(300, 4 * GIB)],
        ),
        FakeDevice(
            used=3 * GIB,
            total=80 * GIB,
            utilization=None,
            processes=[FakeGpuProcess(300, 2 * GIB), FakeGpuProcess(400, None)],
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
    reading = probe.last_reading
    assert reading is not None and reading.time == 1000.0
    assert reading.used_by_pid == {200: 6.0 * GIB, 300: 6.0 * GIB, 400: 0.0}
    assert [held for held in reading.processes if held.gpu == 1] == [
        GpuProcess(1, 300, 2.0 * GIB, StageRef(1)),
        GpuProcess(1, 400, 0.0, None),
    ]
    collect(probe)
    assert nvml.init_calls == 1


def test_memory_given_back_shows_in_the_next_collect() -> None:
    devices = two_devices()
    probe = GpuProbe(FakeNvml(devices), FakeClock(), STAGES.get)
    collect(probe)
    devices[0].processes = [FakeGpuProcess(300, 4 * GIB)]
    collect(probe)
    assert probe.last_reading is not None and 200 not in probe.last_reading.used_by_pid


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
    assert probe.last_reading is None


def test_load_nvml_backends() -> None:
    assert load_nvml("none") is None
    assert load_nvml("nvml") is pynvml
    assert load_nvml("sim") is simulated_nvml
    with pytest.raises(ValueError, match="unknown GPU backend 'cuda'"):
        load_nvml("cuda")
