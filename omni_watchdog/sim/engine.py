"""The simulated engine: "generates" tokens at a set pace and misbehaves on request.

Imported by every stage and engine process, so it stays light (no aiohttp, no SDK).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from omni_watchdog.sim.faults import Fault, FaultKind, record_fault_triggered
from omni_watchdog.sim.nvml import MIB, GpuAllocations
from omni_watchdog.sim.pipelines import ExecutionType

logger = logging.getLogger("omni_watchdog.sim")

CONTEXT_BYTES = 512 * MIB
ESCAPED_CHILD_BYTES = 512 * MIB
ZOMBIE_CHILD_BYTES = 256 * MIB
SLOW_FACTOR = 10.0
# long-steps: every LONG_STEP_EVERY-th token takes one blocking step of LONG_STEP_S, which
# stays within the default heartbeat and progress timeouts (3 s) with a beat period to spare.
LONG_STEP_EVERY = 4
LONG_STEP_S = 1.5
# compile and jit: the request's forward waits on a child that works at full CPU this
# long, named as a C++ compiler (compile) or as Python (jit: Triton, DeepGEMM, FlashInfer
# build in Python children), as a cold torch.compile or a JIT build looks from outside.
BUILD_S = 12.0
BUILDER_NAMES = {"compile": "cc1plus", "jit": "python3"}
# The builder: names itself (the kernel's comm, what /proc and ps show) and burns CPU.
_BUILDER = """\
import ctypes, sys, time
name, seconds = sys.argv[1].encode(), float(sys.argv[2])
ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name), 0, 0, 0)  # PR_SET_NAME
end = time.monotonic() + seconds
while time.monotonic() < end:
    pass
"""
BUSY_PERCENT = 90
# A denoising step's CPU work by default (a 4-step image in about 0.2 s: the tiny pipelines
# on CPU take 11-120 ms), and under denoise-slow (a legit slow image of 4 steps of 3 s, which
# a watchdog at its defaults once took for a hang on the real server).
DENOISE_STEP_S = 0.05
SLOW_DENOISE_STEP_S = 3.0
WORDS = ("vLLM", "is", "a", "fast", "and", "easy-to-use", "library", "for", "LLM", "inference")
INDUCTOR_TRACEBACK = """\
Traceback (most recent call last):
  File "vllm/v1/engine/core.py", line 701, in run_engine_core
    engine_core.run_busy_loop()
  File "vllm/v1/engine/core.py", line 728, in run_busy_loop
    self._process_engine_step()
  File "vllm/v1/engine/core.py", line 754, in _process_engine_step
    outputs, model_executed = self.step_fn()
  File "vllm/v1/worker/gpu_model_runner.py", line 2101, in execute_model
    model_output = self.model(input_ids=input_ids, positions=positions)
  File "torch/_inductor/compile_fx.py", line 1023, in fx_codegen_and_compile
    raise InductorError(e, currentframe()).with_traceback(e.__traceback__) from None
torch._inductor.exc.InductorError: AssertionError: 'XBLOCK' too large. Maximum: 4096. Actual: 8192
"""
ENGINE_DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."

Message = dict[str, Any]
Emit = Callable[[Message], None]


class EngineDeadError(RuntimeError):
    """The engine process died: vLLM's EngineDeadError."""


@dataclass(frozen=True)
class StageSpec:
    """Everything a stage process needs to know, sent to it at spawn."""

    stage_id: int
    replica: int
    name: str
    generation: str
    device: int
    memory_bytes: int
    state_dir: str
    token_delay: float
    faults: tuple[FaultKind, ...] = ()
    # A headless replica's heartbeat period to its master's coordinator; 0: a local one.
    master_heartbeat_s: float = 0.0
    execution_type: ExecutionType = ExecutionType.LLM_AR
    # A DIFFUSION stage's CPU work per denoising step, normally and under denoise-slow.
    denoise_step_s: float = DENOISE_STEP_S
    slow_denoise_step_s: float = SLOW_DENOISE_STEP_S

    def fault(self, kind: FaultKind) -> Fault:
        return Fault(kind, self.stage_id, self.replica)


def configure_child_process() -> None:
    """Logging to stderr, and Ctrl+C on the terminal left to the API process to handle."""
    logging.basicConfig(
        level=logging.INFO, format=f"(pid={os.getpid()}) %(levelname)s %(name)s: %(message)s"
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@dataclass
class ArmedFaults:
    """Faults waiting for the next request in this process; slowness, long steps and slow
    denoising stay once fired."""

    spec: StageSpec
    armed: set[FaultKind] = field(default_factory=set)
    slow: bool = False
    long_steps: bool = False
    slow_denoising: bool = False

    def __post_init__(self) -> None:
        self.armed.update(self.spec.faults)

    def take(self, kind: FaultKind) -> bool:
        """Whether `kind` fires now; records the firing."""
        if kind not in self.armed:
            return False
        self.armed.discard(kind)
        record_fault_triggered(self.spec.state_dir, self.spec.fault(kind), os.getpid())
        return True

    def deadlock_if_stalled(self) -> None:
        """silent-stall: take a non-reentrant lock twice on this thread; never returns."""
        if self.take(FaultKind.SILENT_STALL):
            logger.info("stage %d: silent-stall: the stage loop deadlocks", self.spec.stage_id)
            lock = threading.Lock()
            lock.acquire()
            lock.acquire()


class SimEngine:
    """Token generation with the engine's faults; the caller supplies the sleeping."""

    def __init__(
        self, spec: StageSpec, gpu: GpuAllocations, emit: Emit, faults: ArmedFaults
    ) -> None:
        self.spec = spec
        self._gpu = gpu
        self._emit = emit
        self.faults = faults

    def begin(self, request: Message) -> None:
        """Fire the faults a request reaching the engine triggers."""
        faults = self.faults
        if faults.take(FaultKind.FROZEN_ENGINE):
            logger.info("stage %d: frozen-engine: SIGSTOP to itself", self.spec.stage_id)
            # A queue's feeder thread stops with the process: what it had not sent yet
            # (the request's "started", in 0.30) would never arrive. The engine stays
            # frozen until it is killed, so it has nothing more to say.
            self._flush_emitter()
            os.kill(os.getpid(), signal.SIGSTOP)
        for kind in (FaultKind.COMPILE, FaultKind.JIT):
            if faults.take(kind):
                name = BUILDER_NAMES[kind.value]
                logger.info(
                    "stage %d: %s: waits on %s for %gs",
                    self.spec.stage_id,
                    kind.value,
                    name,
                    BUILD_S,
                )
                subprocess.run([sys.executable, "-c", _BUILDER, name, str(BUILD_S)], check=False)
        if faults.take(FaultKind.SLOW_BUT_ALIVE):
            faults.slow = True
        if faults.take(FaultKind.LONG_STEPS):
            faults.long_steps = True
        for kind in (
            FaultKind.ENGINE_DEAD_HANG,
            FaultKind.ENGINE_DEAD_EXIT,
            FaultKind.STAGE_DEAD_503,
        ):
            if faults.take(kind):
                self.die()
        self._gpu.set_utilization(self.spec.device, BUSY_PERCENT)

    def die(self) -> None:
        """Log the report's fatal error and exit the process at once."""
        sys.stderr.write(f"ERROR EngineCore encountered a fatal error.\n{INDUCTOR_TRACEBACK}")
        sys.stderr.flush()
        self._flush_emitter()
        os._exit(1)

    def _flush_emitter(self) -> None:
        flush = getattr(self._emit, "flush", None)
        if flush is not None:
            flush()

    def steps(self, request: Message) -> Iterator[float]:
        """The delay before each engine step of `request`; emits its output after each.

        An LLM_AR stage makes one token a step; an LLM_GENERATION stage (code2wav) one
        forward over the whole request, as long as the tokens would have taken, and no text.
        """
        delay = self.spec.token_delay * (SLOW_FACTOR if self.faults.slow else 1.0)
        count = int(request["tokens"])
        generation = self.spec.execution_type is ExecutionType.LLM_GENERATION
        forwards = 1 if generation else count
        if generation:
            delay *= count
        started = time.monotonic()
        words: list[str] = []
        for index in range(forwards):
            if self.faults.long_steps and index % LONG_STEP_EVERY == LONG_STEP_EVERY - 1:
                # One engine step that holds its thread, as a long prefill or a big batch
                # does: in 0.30 the replica's loop, heartbeats included, waits with it.
                time.sleep(LONG_STEP_S)
            yield delay
            if not generation:
                words.append(WORDS[index % len(WORDS)])
            self._emit({"type": "token", "request_id": request["request_id"]})
        self._gpu.set_utilization(self.spec.device, 0)
        self._emit(
            {
                "type": "done",
                "request_id": request["request_id"],
                "text": " ".join(words),
                "tokens": count,
                "seconds": time.monotonic() - started,
            }
        )

    def generate_blocking(self, request: Message) -> None:
        self.begin(request)
        for delay in self.steps(request):
            time.sleep(delay)


class QueueEmitter:
    """`emit` onto an mp.Queue, with a `flush` that waits until everything is sent."""

    def __init__(self, queue: Any) -> None:
        self._queue = queue

    def __call__(self, message: Message) -> None:
        self._queue.put(message)

    def flush(self) -> None:
        self._queue.close()
        self._queue.join_thread()


def engine_core_main(spec: StageSpec, in_q: Any, out_q: Any) -> None:
    """The 0.11 EngineCore child of a stage worker: holds the stage's memory and generates."""
    from setproctitle import setproctitle

    setproctitle("VLLM::EngineCore")
    configure_child_process()
    gpu = GpuAllocations(spec.state_dir)
    gpu.hold_memory(spec.device, spec.memory_bytes)
    emit = QueueEmitter(out_q)
    engine = SimEngine(spec, gpu, emit, ArmedFaults(spec))
    emit({"type": "ready", "pid": os.getpid()})
    while True:
        message = in_q.get()
        if message["type"] == "stop":
            break
        if message["type"] == "fault":
            engine.faults.armed.add(FaultKind(message["kind"]))
        elif message["type"] == "request":
            engine.generate_blocking(message)
    gpu.release()
    emit.flush()


def start_engine_core(spec: StageSpec) -> tuple[Any, Any, Any]:
    """Spawn the EngineCore child; (process, its in-queue, its out-queue)."""
    context = mp.get_context("spawn")
    in_q, out_q = context.Queue(), context.Queue()
    process = context.Process(target=engine_core_main, args=(spec, in_q, out_q))
    process.start()
    return process, in_q, out_q


def start_helper_child(spec: StageSpec, kind: FaultKind) -> subprocess.Popen[bytes]:
    """escaped-child or zombie: a child of this stage process, told what to hold."""
    nbytes = ESCAPED_CHILD_BYTES if kind is FaultKind.ESCAPED_CHILD else ZOMBIE_CHILD_BYTES
    command = [sys.executable, "-m", "omni_watchdog.sim.children", kind.value]
    command += [str(spec.device), str(nbytes)]
    child = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    record_fault_triggered(spec.state_dir, spec.fault(kind), child.pid)
    return child
