"""A stand-in for pynvml (nvidia-ml-py), backed by files the simulated server writes.

The calls the watchdog's GPU probe makes have the same names and shapes as pynvml's, so
the probe's code path is the real one with this module in place of `pynvml`. State lives
under `$OMNI_WATCHDOG_SIM_STATE/gpu/`: `devices.json` (written at the sim's start) and one
`process-<pid>.json` per process that holds memory (written by that process only, each
write a temp file and a rename). Like the driver, memory counts only while its process
lives: a pid that exited, was reused (another create time) or is a zombie holds nothing.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from omni_watchdog.process_start import seconds_after_boot
from omni_watchdog.types import ProcessIdentity

STATE_ENV = "OMNI_WATCHDOG_SIM_STATE"
GIB = 1024**3
MIB = 1024**2
DEFAULT_DEVICE_BYTES = 24 * GIB
DEVICE_NAME = "Simulated NVIDIA GPU"
DEVICES_FILE = "devices.json"
PROCESS_FILE_PREFIX = "process-"


class NVMLError(Exception):
    """Raised like pynvml's NVMLError when the simulated driver cannot answer."""


@dataclass(frozen=True)
class Memory:
    """`nvmlDeviceGetMemoryInfo`: bytes."""

    total: int
    used: int
    free: int


@dataclass(frozen=True)
class Utilization:
    """`nvmlDeviceGetUtilizationRates`: percent."""

    gpu: int
    memory: int


@dataclass(frozen=True)
class ProcessMemory:
    """One entry of `nvmlDeviceGetComputeRunningProcesses`."""

    pid: int
    usedGpuMemory: int


@dataclass(frozen=True)
class DeviceHandle:
    """What `nvmlDeviceGetHandleByIndex` returns."""

    index: int


ProcessLookup = Callable[[int], "tuple[float, bool] | None"]


def psutil_lookup(pid: int) -> tuple[float, bool] | None:
    """(seconds after boot it started, is a zombie) of a live pid, or None once it is gone.

    Seconds after boot, not psutil's create time: that moves when the wall clock is stepped,
    and two processes must agree on it."""
    try:
        process = psutil.Process(pid)
        return seconds_after_boot(pid), process.status() == psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def gpu_dir(state_dir: str | Path) -> Path:
    return Path(state_dir) / "gpu"


def write_json_atomically(path: Path, document: dict[str, Any]) -> None:
    """Replace `path` whole: a reader sees the old document or the new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    with os.fdopen(handle, "w") as stream:
        json.dump(document, stream)
    os.replace(temporary, path)


def write_devices(
    state_dir: str | Path, count: int, total_bytes: int = DEFAULT_DEVICE_BYTES
) -> None:
    """Create `count` simulated devices of `total_bytes` each."""
    devices = [
        {
            "index": index,
            "name": DEVICE_NAME,
            "uuid": f"GPU-5170a7ed-0000-4000-8000-{index:012d}",
            "total": total_bytes,
        }
        for index in range(count)
    ]
    write_json_atomically(gpu_dir(state_dir) / DEVICES_FILE, {"devices": devices})


class GpuAllocations:
    """What one process holds on the simulated devices; only that process writes its file."""

    def __init__(
        self, state_dir: str | Path, pid: int | None = None, started: float | None = None
    ) -> None:
        self.pid = os.getpid() if pid is None else pid
        self._path = gpu_dir(state_dir) / f"{PROCESS_FILE_PREFIX}{self.pid}.json"
        self._started = seconds_after_boot(self.pid) if started is None else started
        self._memory: dict[int, int] = {}
        self._utilization: dict[int, int] = {}

    def hold_memory(self, device: int, nbytes: int) -> None:
        """Hold `nbytes` on `device` (replacing what this process held there)."""
        self._memory[device] = int(nbytes)
        self._save()

    def set_utilization(self, device: int, percent: int) -> None:
        """This process keeps `device` busy at `percent`."""
        if self._utilization.get(device) == percent:
            return
        self._utilization[device] = int(percent)
        self._save()

    def release(self) -> None:
        """Free everything, as a process exiting cleanly does."""
        self._memory.clear()
        self._utilization.clear()
        self._path.unlink(missing_ok=True)

    def _save(self) -> None:
        write_json_atomically(
            self._path,
            {
                "pid": self.pid,
                "started_after_boot": self._started,
                "memory": {str(k): v for k, v in self._memory.items()},
                "utilization": {str(k): v for k, v in self._utilization.items()},
            },
        )


@dataclass(frozen=True)
class _Holding:
    pid: int
    memory: dict[int, int]
    utilization: dict[int, int]


class SimulatedNvml:
    """The driver's view of the state directory; `lookup` says which pids still live."""

    def __init__(self, state_dir: str | Path, lookup: ProcessLookup = psutil_lookup) -> None:
        self._dir = gpu_dir(state_dir)
        self._lookup = lookup
        self._devices = self._read_devices()

    def _read_devices(self) -> list[dict[str, Any]]:
        try:
            document = json.loads((self._dir / DEVICES_FILE).read_text())
        except (OSError, ValueError) as error:
            raise NVMLError(f"no simulated devices in {self._dir}: {error}") from None
        devices = document.get("devices") if isinstance(document, dict) else None
        if not devices:
            raise NVMLError(f"no simulated devices in {self._dir}")
        return list(devices)

    def device_count(self) -> int:
        return len(self._devices)

    def handle(self, index: int) -> DeviceHandle:
        if not 0 <= index < len(self._devices):
            raise NVMLError(f"invalid device index {index}")
        return DeviceHandle(index)

    def name(self, handle: DeviceHandle) -> str:
        return str(self._devices[handle.index]["name"])

    def uuid(self, handle: DeviceHandle) -> str:
        return str(self._devices[handle.index]["uuid"])

    def memory(self, handle: DeviceHandle) -> Memory:
        total = int(self._devices[handle.index]["total"])
        used = sum(h.memory.get(handle.index, 0) for h in self._live_holdings())
        return Memory(total=total, used=used, free=max(total - used, 0))

    def utilization(self, handle: DeviceHandle) -> Utilization:
        busy = sum(h.utilization.get(handle.index, 0) for h in self._live_holdings())
        percent = min(busy, 100)
        return Utilization(gpu=percent, memory=percent)

    def processes(self, handle: DeviceHandle) -> list[ProcessMemory]:
        return [
            ProcessMemory(pid=h.pid, usedGpuMemory=h.memory[handle.index])
            for h in self._live_holdings()
            if h.memory.get(handle.index, 0) > 0
        ]

    def _live_holdings(self) -> list[_Holding]:
        holdings: list[_Holding] = []
        for path in sorted(self._dir.glob(f"{PROCESS_FILE_PREFIX}*.json")):
            try:
                document = json.loads(path.read_text())
                pid = int(document["pid"])
                started = float(document["started_after_boot"])
                memory = {int(k): int(v) for k, v in document["memory"].items()}
                utilization = {int(k): int(v) for k, v in document["utilization"].items()}
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                continue  # removed or half-written by its owner this instant
            alive = self._lookup(pid)
            if alive is None or alive[1]:
                continue
            if not ProcessIdentity(pid, started).matches(ProcessIdentity(pid, alive[0])):
                continue  # the pid was reused by an unrelated process
            holdings.append(_Holding(pid, memory, utilization))
        return holdings


_driver: SimulatedNvml | None = None


def _active() -> SimulatedNvml:
    if _driver is None:
        raise NVMLError("NVML is not initialized (call nvmlInit)")
    return _driver


def nvmlInit() -> None:
    """Open the simulated devices named by `$OMNI_WATCHDOG_SIM_STATE`."""
    global _driver
    state_dir = os.environ.get(STATE_ENV, "")
    if not state_dir:
        raise NVMLError(f"{STATE_ENV} is not set: no simulated devices")
    _driver = SimulatedNvml(state_dir)


def nvmlShutdown() -> None:
    global _driver
    _active()
    _driver = None


def nvmlDeviceGetCount() -> int:
    return _active().device_count()


def nvmlDeviceGetHandleByIndex(index: int) -> DeviceHandle:
    return _active().handle(index)


def nvmlDeviceGetName(handle: DeviceHandle) -> str:
    return _active().name(handle)


def nvmlDeviceGetUUID(handle: DeviceHandle) -> str:
    return _active().uuid(handle)


def nvmlDeviceGetMemoryInfo(handle: DeviceHandle) -> Memory:
    return _active().memory(handle)


def nvmlDeviceGetUtilizationRates(handle: DeviceHandle) -> Utilization:
    return _active().utilization(handle)


def nvmlDeviceGetComputeRunningProcesses(handle: DeviceHandle) -> list[ProcessMemory]:
    return _active().processes(handle)
