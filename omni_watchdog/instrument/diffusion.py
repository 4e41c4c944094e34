"""Hooks of vLLM-Omni's diffusion stages: beats from their loops, a beat and a progress
span per denoising step, and a span per request with its phases.

A diffusion request is one call of the pipeline's `forward`, with the whole denoising loop
inside it: a loop that beats per engine step is silent for a whole image. No generic
per-step callback exists in vLLM-Omni 0.30 (its progress bar is used by some pipelines
only), so a forward pre-hook on the pipeline's DiT (`pipeline.transformer`), called once
per denoising step by any DiT pipeline, marks the steps.

Checked against vLLM-Omni 0.30.0 `vllm_omni.diffusion`: the engine's
`DiffusionEngine._busy_loop` runs in its own thread, calls `_process_aborts_queue()` at
each pass and waits on `self._cv` (1 s at a time) while idle; the model runner's
`DiffusionModelRunner._execute_request_list(reqs, *, od_config, ...)` runs one batch
through `self.pipeline.forward`; the mp executor's worker process loops in
`WorkerProc._worker_busy_loop`, calling `recv_message()` once per message. Each runs in the
process that does the work: the API server itself for a one-stage pipeline (inline), a
`StageDiffusionProc` subprocess in a multi-stage one, and a `DiffusionWorker` process under
`--distributed-executor-backend mp`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from omni_watchdog.instrument.hooks import (
    HookContext,
    LoopBeat,
    ProcessIdentity,
    quietly,
    wrap_attribute,
)
from omni_watchdog.instrument.telemetry import StageTelemetry

logger = logging.getLogger(__name__)

CHECKED_AGAINST = "vLLM-Omni 0.30.0"
_BEAT = "_omni_watchdog_beat"
# Where a runner keeps its `DenoisingProgress`.
DENOISING_ATTRIBUTE = "_omni_watchdog_denoising"


def diffusion_identity(
    context: HookContext, od_config: Any, kind: str = "stage"
) -> ProcessIdentity:
    """The stage a diffusion component serves: its config's stage id, and the replica this
    process was started as (a `StageDiffusionProc` knows it; elsewhere the first)."""
    stage_id = int(getattr(od_config, "stage_id", 0) or 0)
    own = context.identify()
    replica = own.replica if own.stage_id == stage_id and own.replica is not None else 0
    return ProcessIdentity(kind, stage_id, replica)


class DenoisingProgress:
    """The denoising steps of the batch a runner is working on, told as spans.

    `begin` when the batch enters the pipeline, `count_step` at each DiT call (a pre-hook),
    `end` when the pipeline returns. The hook only counts the step and reads the clock: the
    tiny CPU DiT's steps take under a millisecond, and a span at the first and the last
    step with three calls at each showed in its server's throughput. `look`, once a
    heartbeat interval from a thread of its own while a batch is in, tells the latest step,
    and only if one began since it last looked: a step that does not end stops the telling
    as surely as it stops the loop, so that thread sends no beat the denoising loop did not
    earn. An image done within the interval is told by its request span alone.
    """

    def __init__(self, telemetry: StageTelemetry, context: HookContext) -> None:
        self._telemetry = telemetry
        self._monotonic = context.monotonic
        self._wall_ns = context.wall_ns
        self._getpid = context.getpid
        self._start_thread = context.start_thread
        self._watching_in: int | None = None
        # `look` and `begin`/`end` run on two threads: a step told after its request's
        # span would bring a finished request back.
        self._lock = threading.Lock()
        self._in_batch = threading.Event()
        self._requests: tuple[tuple[str, int], ...] = ()
        self._begun_at = 0.0
        self._started_ns = 0
        self._told_step = 0
        # Written by the DiT's pre-hook, on the denoising thread.
        self.steps = 0
        self.first_step_at = 0.0
        self.step_started = 0.0
        self.step_seconds = 0.0

    def count_step(self) -> None:
        """The DiT is called: a denoising step begins (the pre-hook's whole work)."""
        now = self._monotonic()
        self.step_seconds = now - self.step_started
        self.step_started = now
        self.steps += 1
        if self.steps == 1:
            self.first_step_at = now

    def begin(self, requests: Sequence[tuple[str, int]]) -> None:
        """A batch of (request id, step count; 0 when unknown) enters the pipeline."""
        with self._lock:
            self.steps = self._told_step = 0
            self.step_seconds = 0.0
            self._requests = tuple(requests)
            self._begun_at = self._monotonic()
            self._started_ns = self._wall_ns()
        if self._watching_in != self._getpid():
            # Once per process: a thread does not outlive a fork.
            self._watching_in = self._getpid()
            self._start_thread("omni-watchdog-denoising", self._watch)
        self._in_batch.set()

    def look(self) -> None:
        """Tell the latest step of the batch in the pipeline, if one began since the last
        look; the step before it took `step_seconds`."""
        with self._lock:
            step = self.steps
            if not self._requests or step == self._told_step:
                return
            self._told_step = step
            previous = self.step_seconds if step > 1 else None
            for request_id, steps in self._requests:
                # A pipeline that calls its DiT more than once a step outruns the count.
                self._telemetry.denoise_step(
                    request_id, step, steps if step <= steps else 0, previous
                )

    def end(self, error: BaseException | None) -> None:
        """The pipeline returned (or raised `error`): one request span each."""
        self._in_batch.clear()
        with self._lock:
            requests, self._requests = self._requests, ()
            ended_at, end_ns = self._monotonic(), self._wall_ns()
            steps = self.steps
        first = self.first_step_at if steps else ended_at
        # The last step's end, estimated by the step before it: a hook after every DiT
        # call would cost each step a second call.
        last = self.step_started + self.step_seconds if steps > 1 else ended_at
        first = min(max(first, self._begun_at), ended_at)
        last = min(max(last, first), ended_at)
        phases = (
            (first - self._begun_at) * 1e3,
            (last - first) * 1e3,
            (ended_at - last) * 1e3,
        )
        for request_id, count in requests:
            self._telemetry.diffusion_request(
                request_id, self._started_ns, end_ns, phases, (steps, count), error
            )

    def _watch(self) -> None:
        while True:
            self._in_batch.wait()
            time.sleep(self._telemetry.heartbeat_interval)
            quietly(self.look)


def _request_steps(request: Any) -> tuple[str, int]:
    params = getattr(request, "sampling_params", None)
    steps = getattr(params, "num_inference_steps", None)
    return str(getattr(request, "request_id", "")), steps if isinstance(steps, int) else 0


def _watch_denoising(runner: Any, context: HookContext) -> DenoisingProgress | None:
    """The runner's progress, made once: a pre-hook on its pipeline's DiT."""
    progress: DenoisingProgress | None = getattr(runner, DENOISING_ATTRIBUTE, None)
    if progress is not None:
        return progress
    transformer = getattr(getattr(runner, "pipeline", None), "transformer", None)
    if transformer is None or not hasattr(transformer, "register_forward_pre_hook"):
        return None
    identity = diffusion_identity(
        context, getattr(runner, "od_config", None), _worker_kind(context)
    )
    progress = DenoisingProgress(context.telemetry(identity), context)

    def before_step(_module: Any, _arguments: Any) -> None:
        progress.count_step()

    transformer.register_forward_pre_hook(before_step)
    setattr(runner, DENOISING_ATTRIBUTE, progress)
    return progress


def _worker_kind(context: HookContext) -> str:
    # The mp executor's DiffusionWorker is a worker of its stage; elsewhere the process
    # that denoises is the stage itself (inline: the API server, which the watchdog knows).
    return "worker" if context.identify().kind == "worker" else "stage"


def install_diffusion_runner(context: HookContext) -> bool:
    """`DiffusionModelRunner._execute_request_list`: the steps and the request spans."""

    def make_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        def _execute_request_list(self: Any, reqs: Any, *args: Any, **kwargs: Any) -> Any:
            progress = None
            try:
                progress = _watch_denoising(self, context)
                if progress is not None:
                    progress.begin([_request_steps(request) for request in reqs])
            except Exception:
                logger.debug("omni-watchdog: denoising not followed", exc_info=True)
            try:
                result = original(self, reqs, *args, **kwargs)
            except BaseException as error:
                if progress is not None:
                    quietly(progress.end, error)
                raise
            if progress is not None:
                quietly(progress.end, None)
            return result

        return _execute_request_list

    return wrap_attribute(
        "vllm_omni.diffusion.worker.diffusion_model_runner",
        "DiffusionModelRunner._execute_request_list",
        make_wrapper,
        CHECKED_AGAINST,
    )


def _beat_after_waits(condition: Any, beat: LoopBeat, thread_id: int) -> None:
    """Make `condition.wait` beat when the engine's own thread wakes from it: the busy
    loop waits there, a second at a time, while it has nothing to do. Another thread's
    wait beats nothing, so it cannot stand in for a stuck loop."""
    original_wait = condition.wait

    def wait(timeout: float | None = None) -> bool:
        woken = bool(original_wait(timeout))
        if threading.get_ident() == thread_id:
            quietly(beat.tick)
        return woken

    condition.wait = wait


def install_diffusion_engine_loop(context: HookContext) -> bool:
    """`DiffusionEngine._busy_loop`: a beat per pass (rate-limited) and while it idles, from
    the loop's own thread only. Other threads drain the same queues (the start-up warm-up
    runs a request on the caller's thread); their calls beat only where no loop runs."""

    def beat_of(engine: Any) -> LoopBeat:
        identity = diffusion_identity(context, getattr(engine, "od_config", None))
        return LoopBeat(context.telemetry(identity), context.monotonic)

    def make_loop(original: Callable[..., Any]) -> Callable[..., Any]:
        def _busy_loop(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                beat = beat_of(self)
                _beat_after_waits(self._cv, beat, threading.get_ident())
                setattr(self, _BEAT, (beat, threading.get_ident()))
            except Exception:
                logger.debug("omni-watchdog: diffusion loop not instrumented", exc_info=True)
            return original(self, *args, **kwargs)

        return _busy_loop

    def make_pass(original: Callable[..., Any]) -> Callable[..., Any]:
        def _process_aborts_queue(self: Any, *args: Any, **kwargs: Any) -> Any:
            loop: tuple[LoopBeat, int] | None = getattr(self, _BEAT, None)
            if loop is None:
                quietly(lambda: setattr(self, _BEAT, (beat_of(self), 0)))
                loop = getattr(self, _BEAT, None)
            if loop is not None and loop[1] in (0, threading.get_ident()):
                quietly(loop[0].tick)
            return original(self, *args, **kwargs)

        return _process_aborts_queue

    module = "vllm_omni.diffusion.diffusion_engine"
    looped = wrap_attribute(module, "DiffusionEngine._busy_loop", make_loop, CHECKED_AGAINST)
    passed = wrap_attribute(
        module, "DiffusionEngine._process_aborts_queue", make_pass, CHECKED_AGAINST
    )
    return looped and passed


def install_diffusion_worker_loop(context: HookContext) -> bool:
    """`WorkerProc._worker_busy_loop` (mp executor): a beat per message it takes."""

    def make_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        def recv_message(self: Any, *args: Any, **kwargs: Any) -> Any:
            beat: LoopBeat | None = getattr(self, _BEAT, None)
            if beat is None:
                try:
                    identity = diffusion_identity(
                        context, getattr(self, "od_config", None), "worker"
                    )
                    beat = LoopBeat(context.telemetry(identity), context.monotonic)
                    setattr(self, _BEAT, beat)
                except Exception:
                    logger.debug("omni-watchdog: diffusion worker not instrumented", exc_info=True)
            if beat is not None:
                quietly(beat.tick)
            return original(self, *args, **kwargs)

        return recv_message

    return wrap_attribute(
        "vllm_omni.diffusion.worker.diffusion_worker",
        "WorkerProc.recv_message",
        make_wrapper,
        CHECKED_AGAINST,
    )
