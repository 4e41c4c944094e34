"""A DIFFUSION stage: vLLM-Omni 0.30's `StageDiffusionProc`, titled `vLLM-Omni::DiffusionWorker`.

Its engine loop waits for work a second at a time while idle and beats once a pass (rate
limited), as the instrument plugin makes the real engine loop beat. A request is a
denoising loop of the request's steps, each one call of the DiT doing real CPU work on the
loop's own thread. The plugin's own `DenoisingProgress` tells the steps and the request, so
the spans are the real ones: `omni.diffusion.step` for the first and the last step and at
most one a heartbeat interval between them, one `omni.diffusion.request` per request, and
the stage's `omni.stage.request`. Nothing else beats: a step that blocks leaves the stage
silent and asleep, as the real engine, which has no timeout on a step, is.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from typing import Any

from omni_watchdog.instrument.diffusion import DenoisingProgress
from omni_watchdog.instrument.hooks import HookContext, LoopBeat, ProcessIdentity
from omni_watchdog.sim.engine import (
    LONG_STEP_EVERY,
    LONG_STEP_S,
    SLOW_FACTOR,
    ArmedFaults,
    Message,
    QueueEmitter,
    SimEngine,
    StageSpec,
    configure_child_process,
)
from omni_watchdog.sim.faults import FaultKind
from omni_watchdog.sim.nvml import GpuAllocations
from omni_watchdog.sim.pipelines import requested_steps
from omni_watchdog.sim.stages import (
    HELPER_CHILD_FAULTS,
    HelperChildren,
    beat_to_master,
    get_message,
    set_parent_death_signal,
    stage_telemetry,
)

logger = logging.getLogger("omni_watchdog.sim")

# What vLLM-Omni 0.30 titles every process that runs a diffusion model.
DIFFUSION_TITLE = "vLLM-Omni::DiffusionWorker"
# `DiffusionEngine._busy_loop` waits on its condition this long at a time while idle.
IDLE_WAIT_S = 1.0
# What one layer of the DiT works through: hashing releases the GIL on a buffer this big,
# so the work is native, between Python frames that move, as tensor operations look.
_LATENT = bytes(256 * 1024)


class DenoiseError(RuntimeError):
    """What a denoising step armed with denoise-raise raises."""


def diffusion_proc_main(spec: StageSpec, in_q: Any, out_q: Any, parent_pid: int) -> None:
    """Entry point of a diffusion stage replica: the stage's engine itself, with no child."""
    set_parent_death_signal()
    if os.getppid() != parent_pid:
        return  # the parent died before the death signal was armed
    from setproctitle import setproctitle

    setproctitle(DIFFUSION_TITLE)
    configure_child_process()
    DiffusionStage(spec, in_q, out_q).run()


class DiffusionStage:
    """The engine loop of a diffusion stage replica and the denoising of its requests."""

    def __init__(self, spec: StageSpec, in_q: Any, out_q: Any) -> None:
        self.spec = spec
        self._in_q = in_q
        self._out_q = out_q
        self._telemetry = stage_telemetry(spec)
        identity = ProcessIdentity("stage", spec.stage_id, spec.replica)
        context = HookContext(lambda _: self._telemetry, lambda: identity)
        self._progress = DenoisingProgress(self._telemetry, context)
        self._beat = LoopBeat(self._telemetry, time.monotonic)
        self._gpu = GpuAllocations(spec.state_dir)
        self._emit = QueueEmitter(out_q)
        self._faults = ArmedFaults(spec)
        self._engine = SimEngine(spec, self._gpu, self._emit, self._faults)
        self._children = HelperChildren(spec, self._emit)

    def run(self) -> None:
        """Serve requests one at a time until told to stop."""
        spec = self.spec
        self._gpu.hold_memory(spec.device, spec.memory_bytes)
        for kind in spec.faults:
            if kind in HELPER_CHILD_FAULTS:
                self._children.start(kind)
        if spec.master_heartbeat_s > 0:
            threading.Thread(
                target=beat_to_master, args=(self._out_q, spec.master_heartbeat_s), daemon=True
            ).start()
        self._emit({"type": "ready", "pid": os.getpid(), "engine_pid": None})
        while True:
            self._beat.tick()
            message = get_message(self._in_q, IDLE_WAIT_S)
            if message is None:
                continue
            if message["type"] == "stop":
                break
            if message["type"] == "fault":
                kind = FaultKind(message["kind"])
                if kind in HELPER_CHILD_FAULTS:
                    self._children.start(kind)
                else:
                    self._faults.armed.add(kind)
                continue
            self._serve(message)
        self._gpu.release()
        self._telemetry.shutdown()
        self._emit.flush()

    def _serve(self, request: Message) -> None:
        request_id = request["request_id"]
        steps = requested_steps(request.get("steps"))
        self._emit({"type": "started", "request_id": request_id})
        self._faults.deadlock_if_stalled()
        started = time.monotonic()
        try:
            with self._telemetry.stage_request(request_id):
                # The faults every stage has (deaths, a frozen engine, builds, slowness).
                self._engine.begin(request)
                if self._faults.take(FaultKind.DENOISE_SLOW):
                    self._faults.slow_denoising = True
                self._denoise(request_id, steps)
        except DenoiseError as error:
            # vLLM-Omni returns a diffusion error with its request: that request fails (500)
            # and the stage serves the next.
            logger.error("stage %d: request %s failed: %s", self.spec.stage_id, request_id, error)
            self._emit(
                {"type": "error", "request_id": request_id, "error": f"DenoiseError: {error}"}
            )
            return
        finally:
            self._gpu.set_utilization(self.spec.device, 0)
        self._emit(
            {
                "type": "done",
                "request_id": request_id,
                "text": "",
                "tokens": 0,
                "seconds": time.monotonic() - started,
            }
        )

    def _denoise(self, request_id: str, steps: int) -> None:
        """The pipeline's forward: `steps` calls of the DiT, told as the plugin tells them."""
        progress = self._progress
        progress.begin([(request_id, steps)])
        # Faults strike half-way, once step spans have gone out.
        fault_step = (steps + 1) // 2
        try:
            for step in range(1, steps + 1):
                progress.count_step()
                if step == fault_step:
                    self._strike(step, steps)
                self._dit_step(step)
        except BaseException as error:
            progress.end(error)
            raise
        progress.end(None)

    def _strike(self, step: int, steps: int) -> None:
        """denoise-block and denoise-raise, in the denoising step they are armed for."""
        stage = self.spec.stage_id
        if self._faults.take(FaultKind.DENOISE_BLOCK):
            logger.info("stage %d: denoise-block: step %d of %d never returns", stage, step, steps)
            # Asleep on a futex, the device idle: nothing in the engine times a step out.
            self._gpu.set_utilization(self.spec.device, 0)
            threading.Event().wait()
        if self._faults.take(FaultKind.DENOISE_RAISE):
            raise DenoiseError(f"denoise-raise: step {step} of {steps} raised in stage {stage}")

    def _dit_step(self, step: int) -> None:
        faults = self._faults
        seconds = self.spec.denoise_step_s
        if faults.slow_denoising:
            seconds = self.spec.slow_denoise_step_s
        if faults.slow:
            seconds *= SLOW_FACTOR
        if faults.long_steps and step % LONG_STEP_EVERY == 0:
            # A step that holds its thread without working, as long-steps' token steps do.
            time.sleep(LONG_STEP_S)
        dit_forward(seconds)


def dit_forward(seconds: float) -> None:
    """One call of the DiT: `seconds` of CPU work through its layers (at least one pass)."""
    end = time.monotonic() + seconds
    while True:
        _attention()
        _feed_forward()
        if time.monotonic() >= end:
            return


def _attention() -> None:
    hashlib.sha256(_LATENT).digest()


def _feed_forward() -> None:
    hashlib.sha256(_LATENT).digest()
