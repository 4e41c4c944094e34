"""The NVML stand-in: pynvml's shapes, and memory that counts only while its process lives."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from deadline import wait_until

from omni_watchdog.sim import nvml
from omni_watchdog.sim.nvml import GIB, GpuAllocations, NVMLError, SimulatedNvml, write_devices


def fake_table(table: dict[int, tuple[float, bool]]) -> nvml.ProcessLookup:
    return table.get


def hold(state: Path, pid: int, started: float, nbytes: int, percent: int = 0) -> None:
    holder = GpuAllocations(state, pid=pid, started=started)
    holder.hold_memory(0, nbytes)
    holder.set_utilization(0, percent)


def test_memory_counts_only_for_live_non_zombie_pids_with_their_start_time(
    tmp_path: Path,
) -> None:
    write_devices(tmp_path, 2)
    hold(tmp_path, 10, 100.0, GIB, percent=60)
    hold(tmp_path, 11, 100.0, 2 * GIB, percent=60)  # exited
    hold(tmp_path, 12, 100.0, 3 * GIB)  # a zombie
    hold(tmp_path, 13, 100.0, 4 * GIB)  # pid reused by a later process
    table = {10: (100.0, False), 12: (100.0, True), 13: (250.0, False)}
    driver = SimulatedNvml(tmp_path, lookup=fake_table(table))
    device = driver.handle(0)
    assert driver.device_count() == 2
    assert driver.memory(device) == nvml.Memory(total=24 * GIB, used=GIB, free=23 * GIB)
    assert driver.processes(device) == [nvml.ProcessMemory(pid=10, usedGpuMemory=GIB)]
    assert driver.utilization(device) == nvml.Utilization(gpu=60, memory=60)
    assert driver.memory(driver.handle(1)).used == 0
    assert driver.name(device) == "Simulated NVIDIA GPU"
    assert driver.uuid(device).startswith("GPU-")
    with pytest.raises(NVMLError):
        driver.handle(2)


def test_utilization_is_capped_at_100(tmp_path: Path) -> None:
    write_devices(tmp_path, 1)
    hold(tmp_path, 10, 1.0, GIB, percent=90)
    hold(tmp_path, 11, 1.0, GIB, percent=90)
    driver = SimulatedNvml(tmp_path, lookup=fake_table({10: (1.0, False), 11: (1.0, False)}))
    assert driver.utilization(driver.handle(0)).gpu == 100


def test_init_needs_the_state_variable_and_devices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(nvml.STATE_ENV, raising=False)
    with pytest.raises(NVMLError):
        nvml.nvmlInit()
    monkeypatch.setenv(nvml.STATE_ENV, str(tmp_path))
    with pytest.raises(NVMLError):
        nvml.nvmlInit()
    write_devices(tmp_path, 1)
    nvml.nvmlInit()
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(0)
        assert nvml.nvmlDeviceGetCount() == 1
        assert nvml.nvmlDeviceGetMemoryInfo(handle).total == 24 * GIB
        assert nvml.nvmlDeviceGetComputeRunningProcesses(handle) == []
    finally:
        nvml.nvmlShutdown()
    with pytest.raises(NVMLError):
        nvml.nvmlDeviceGetCount()


def test_a_real_process_memory_is_freed_when_it_exits_and_while_it_is_a_zombie(
    tmp_path: Path,
) -> None:
    write_devices(tmp_path, 1)
    holder = (
        "import sys; from omni_watchdog.sim.nvml import GpuAllocations; "
        "GpuAllocations(sys.argv[1]).hold_memory(0, 1 << 30); sys.stdin.read()"
    )
    child = subprocess.Popen([sys.executable, "-c", holder, str(tmp_path)], stdin=subprocess.PIPE)
    try:
        driver = SimulatedNvml(tmp_path)
        device = driver.handle(0)
        wait_until(lambda: {p.pid for p in driver.processes(device)} == {child.pid}, 10)
        assert driver.memory(device).used == GIB
        assert child.stdin is not None
        child.stdin.close()  # the child exits; it is not reaped yet, so it is a zombie
        wait_until(lambda: psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE, 10)
        assert driver.memory(device).used == 0
        child.wait(5)
        assert driver.memory(device).used == 0 and driver.processes(device) == []
    finally:
        child.kill()
        child.wait(5)
