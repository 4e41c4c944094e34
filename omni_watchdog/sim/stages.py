"""Stage processes: the 0.11 stage worker (`_stage_worker_async`) and the 0.30 stage replica.

Both run their stage loop on asyncio with the instrument's heartbeat task on it, so
heartbeats stop exactly when the loop blocks. Messages are dicts on `mp.Queue`s.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import queue
import signal
import subprocess
import threading
import time
from typing import Any

from omni_watchdog.instrument.telemetry import StageTelemetry
from omni_watchdog.sim.engine import (
    CONTEXT_BYTES,
    ENGINE_DEAD_MESSAGE,
    ArmedFaults,
    EngineDeadError,
    Message,
    QueueEmitter,
    SimEngine,
    StageSpec,
    configure_child_process,
    start_engine_core,
    start_helper_child,
)
from omni_watchdog.sim.faults import FaultKind
from omni_watchdog.sim.nvml import GpuAllocations

logger = logging.getLogger("omni_watchdog.sim")

PR_SET_PDEATHSIG = 1
POLL_S = 0.05
ENGINE_STOP_TIMEOUT_S = 1.0
HELPER_CHILD_FAULTS = frozenset({FaultKind.ESCAPED_CHILD, FaultKind.ZOMBIE})
ENGINE_DEATHS = frozenset({FaultKind.ENGINE_DEAD_HANG, FaultKind.ENGINE_DEAD_EXIT})


def get_message(source: Any, timeout: float) -> Message | None:
    try:
        message: Message = source.get(timeout=timeout)
    except queue.Empty:
        return None
    return message


async def next_message(source: Any, timeout: float = POLL_S) -> Message | None:
    """The next message of an mp.Queue without blocking the loop, or None after `timeout`."""
    return await asyncio.get_running_loop().run_in_executor(None, get_message, source, timeout)


class HelperChildren:
    """escaped-child and zombie helpers; kept referenced so a zombie is never reaped."""

    def __init__(self, spec: StageSpec, emit: Any) -> None:
        self._spec = spec
        self._emit = emit
        self._children: list[subprocess.Popen[bytes]] = []

    def start(self, kind: FaultKind) -> None:
        child = start_helper_child(self._spec, kind)
        self._children.append(child)
        self._emit({"type": "child", "kind": kind.value, "pid": child.pid})


def stage_telemetry(spec: StageSpec) -> StageTelemetry:
    return StageTelemetry.from_environment(
        process_kind="stage", stage_id=spec.stage_id, stage_name=spec.name, replica=spec.replica
    )


class EngineCoreClient:
    """The stage worker's side of its EngineCore child."""

    def __init__(self, spec: StageSpec) -> None:
        self.process, self._in_q, self._out_q = start_engine_core(spec)

    @property
    def pid(self) -> int:
        return int(self.process.pid or 0)

    async def wait_ready(self) -> None:
        while await self._next() is None:
            pass

    def send(self, message: Message) -> None:
        self._in_q.put(message)

    async def _next(self) -> Message | None:
        message = await next_message(self._out_q)
        if message is None and not self.process.is_alive():
            raise EngineDeadError(ENGINE_DEAD_MESSAGE)
        return message

    async def generate(self, request: Message, relay: Any) -> None:
        """Send `request` and relay the engine's tokens until it is done or dies."""
        self.send(request)
        while True:
            message = await self._next()
            if message is None:
                continue
            relay(message)
            if message["type"] == "done":
                return

    def stop(self) -> None:
        if self.process.is_alive():
            self.send({"type": "stop"})
            self.process.join(ENGINE_STOP_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(ENGINE_STOP_TIMEOUT_S)


def stage_worker_main(spec: StageSpec, in_q: Any, out_q: Any) -> None:
    """Entry point of a 0.11 stage worker process (`SpawnProcess-N`, no title)."""
    configure_child_process()
    asyncio.run(_stage_worker_async(spec, in_q, out_q))


async def _stage_worker_async(spec: StageSpec, in_q: Any, out_q: Any) -> None:
    """The 0.11 stage loop: one request at a time through its EngineCore child."""
    telemetry = stage_telemetry(spec)
    heartbeats = asyncio.create_task(telemetry.heartbeat_loop())
    gpu = GpuAllocations(spec.state_dir)
    gpu.hold_memory(spec.device, CONTEXT_BYTES)
    engine = EngineCoreClient(spec)
    await engine.wait_ready()
    faults = ArmedFaults(spec)
    children = HelperChildren(spec, out_q.put)
    for kind in spec.faults:
        if kind in HELPER_CHILD_FAULTS:
            children.start(kind)
    death = next((kind for kind in spec.faults if kind in ENGINE_DEATHS), None)
    out_q.put({"type": "ready", "pid": os.getpid(), "engine_pid": engine.pid})
    engine_dead = False
    while True:
        if engine_dead:
            # vLLM-Omni 0.11 goes back to its queue with a blocking get on the loop's
            # thread; after an engine death nothing ever arrives, so the loop is gone.
            message: Message | None = in_q.get()
        else:
            message = await next_message(in_q)
        if message is None:
            continue
        if message["type"] == "stop":
            break
        if message["type"] == "fault":
            kind = FaultKind(message["kind"])
            if kind in HELPER_CHILD_FAULTS:
                children.start(kind)
            elif kind is FaultKind.SILENT_STALL:
                faults.armed.add(kind)
            else:
                death = kind if kind in ENGINE_DEATHS else death
                engine.send(message)
            continue
        request_id = message["request_id"]
        out_q.put({"type": "started", "request_id": request_id})
        faults.deadlock_if_stalled()
        try:
            with telemetry.stage_request(request_id):
                await engine.generate(message, out_q.put)
        except EngineDeadError as error:
            logger.error("stage %d: EngineDeadError: %s", spec.stage_id, error)
            if death is FaultKind.ENGINE_DEAD_EXIT:
                out_q.put({"type": "fatal", "error": f"EngineDeadError: {error}"})
                continue
            # The report's bug: the error goes to the orchestrator, shutdown() is never called.
            out_q.put({"type": "error", "request_id": request_id, "error": str(error)})
            engine_dead = True
    engine.stop()
    gpu.release()
    heartbeats.cancel()
    telemetry.shutdown()


def set_parent_death_signal() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def stage_replica_main(spec: StageSpec, in_q: Any, out_q: Any, parent_pid: int) -> None:
    """Entry point of a 0.30 stage replica: the stage's engine itself, with no child."""
    set_parent_death_signal()
    if os.getppid() != parent_pid:
        return  # the parent died before the death signal was armed
    from setproctitle import setproctitle

    setproctitle(f"VLLM::StageEngineCoreProc_stage{spec.stage_id}_replica{spec.replica}_DP0")
    configure_child_process()
    asyncio.run(_stage_replica_async(spec, in_q, out_q))


def beat_to_master(out_q: Any, interval: float) -> None:
    """A headless replica's heartbeats to the master, from a thread of their own: as in
    vLLM-Omni 0.30 they are off the forward path, so a blocked forward keeps beating while a
    stopped or killed process falls silent."""
    while True:
        try:
            out_q.put({"type": "heartbeat"})
        except ValueError:
            return  # the queue is closed: the replica is on its way out
        time.sleep(interval)


async def _stage_replica_async(spec: StageSpec, in_q: Any, out_q: Any) -> None:
    """The 0.30 replica loop: it generates on its own loop."""
    telemetry = stage_telemetry(spec)
    heartbeats = asyncio.create_task(telemetry.heartbeat_loop())
    gpu = GpuAllocations(spec.state_dir)
    gpu.hold_memory(spec.device, spec.memory_bytes)
    emit = QueueEmitter(out_q)
    faults = ArmedFaults(spec)
    engine = SimEngine(spec, gpu, emit, faults)
    children = HelperChildren(spec, emit)
    for kind in spec.faults:
        if kind in HELPER_CHILD_FAULTS:
            children.start(kind)
    if spec.master_heartbeat_s > 0:
        threading.Thread(
            target=beat_to_master, args=(out_q, spec.master_heartbeat_s), daemon=True
        ).start()
    emit({"type": "ready", "pid": os.getpid(), "engine_pid": None})
    while True:
        message = await next_message(in_q)
        if message is None:
            continue
        if message["type"] == "stop":
            break
        if message["type"] == "fault":
            kind = FaultKind(message["kind"])
            if kind in HELPER_CHILD_FAULTS:
                children.start(kind)
            else:
                faults.armed.add(kind)
            continue
        emit({"type": "started", "request_id": message["request_id"]})
        faults.deadlock_if_stalled()
        with telemetry.stage_request(message["request_id"]):
            engine.begin(message)
            for delay in engine.steps(message):
                await asyncio.sleep(delay)
    gpu.release()
    heartbeats.cancel()
    telemetry.shutdown()
    emit.flush()
