"""The API process's side of the stages: spawning, routing requests, progress, shutdown.

0.11: the orchestrator runs on the API's event loop and has vLLM-Omni 0.11's bug (a
stage error makes it poll with a blocking sleep forever). 0.30: it runs on its own loop
(the caller puts it in a thread), evicts dead replicas and fails requests quickly; a
stage may run headless on another host, its replicas registered by the coordinator.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from omni_watchdog.instrument.telemetry import StageTelemetry
from omni_watchdog.sim.diffusion import diffusion_proc_main
from omni_watchdog.sim.engine import Message, StageSpec
from omni_watchdog.sim.faults import Fault
from omni_watchdog.sim.metrics import SimMetrics
from omni_watchdog.sim.pipelines import ExecutionType
from omni_watchdog.sim.stages import stage_replica_main, stage_worker_main
from omni_watchdog.types import Topology

logger = logging.getLogger("omni_watchdog.sim")

READY_TIMEOUT_S = 60.0
DRAIN_POLL_S = 0.1
LIVENESS_POLL_S = 0.05
STOP_TIMEOUT_S = 3.0
# vLLM's API server exits about this long after its engine dies (503 in between).
FATAL_EXIT_DELAY_S = 3.0
# vLLM-Omni 0.11's orchestrator poll interval, slept with time.sleep on the event loop.
BLOCKING_POLL_S = 0.005


class StageFailed(RuntimeError):
    """A request failed in a stage, or its stage has no live replica."""


@dataclass
class PendingStage:
    """One request on one stage replica, as the orchestrator follows it."""

    request_id: str
    changed: asyncio.Event
    prompt_tokens: int = 0
    running: bool = False
    result: Message | None = None
    error: str | None = None
    # The client went away: the replica still finishes what it started, as vLLM-Omni
    # 0.11's stage workers do, and its messages still count until it is done.
    abandoned: bool = False


@dataclass
class Replica:
    """One stage replica process, as the API process sees it.

    A remote replica (a headless stage's, on another host) has its connection to the
    coordinator as `process` and `in_q`: it is alive while registered and heartbeating.
    """

    spec: StageSpec
    process: Any
    in_q: Any
    out_q: Any
    ready: threading.Event = field(default_factory=threading.Event)
    pid: int = 0
    engine_pid: int | None = None
    evicted: bool = False
    remote: bool = False
    host: str = ""
    children: list[dict[str, Any]] = field(default_factory=list)
    inflight: dict[str, PendingStage] = field(default_factory=dict)

    @property
    def alive(self) -> bool:
        return not self.evicted and bool(self.process.is_alive())


@dataclass(frozen=True)
class Completion:
    """The pipeline's answer: the first stage's text and its token count."""

    text: str
    tokens: int


class Orchestrator:
    """Starts the stage replicas, routes each request along the topology, tracks progress."""

    def __init__(
        self,
        topology: Topology,
        specs: Sequence[StageSpec],
        generation: str,
        metrics: SimMetrics,
        telemetry: StageTelemetry,
        request_exit: Callable[[], None],
        remote_stages: frozenset[int] = frozenset(),
    ) -> None:
        self.topology = topology
        self.generation = generation
        self._specs = [s for s in specs if s.stage_id not in remote_stages]
        self._metrics = metrics
        self._telemetry = telemetry
        self._request_exit = request_exit
        self.replicas: dict[tuple[int, int], Replica] = {}
        self.fatal_error: str | None = None
        self._round_robin = {s.stage_id: itertools.count() for s in topology.stages}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = threading.Event()
        self._drains: list[threading.Thread] = []
        self._liveness: asyncio.Task[None] | None = None
        self._topology_reports: asyncio.Task[None] | None = None

    def spawn(self) -> None:
        """Start every local replica process; called on the main thread so that the 0.30
        parent-death signal (which follows the spawning thread) lasts as long as the process."""
        for spec in self._specs:
            self.replicas[(spec.stage_id, spec.replica)] = spawn_replica(spec)

    async def start(self) -> None:
        """Follow the replicas from the running loop and wait until all are ready."""
        self._loop = asyncio.get_running_loop()
        for replica in self.replicas.values():
            thread = threading.Thread(target=self._drain, args=(replica,), daemon=True)
            thread.start()
            self._drains.append(thread)
        deadline = time.monotonic() + READY_TIMEOUT_S
        for replica in self.replicas.values():
            while not replica.ready.is_set():
                if time.monotonic() > deadline or not replica.process.is_alive():
                    raise RuntimeError(f"stage {replica.spec.stage_id} did not start")
                await asyncio.sleep(LIVENESS_POLL_S)
        if self.generation == "0.30":
            self._liveness = asyncio.create_task(self._watch_liveness())
            # What the instrument plugin reports from a real 0.30 orchestrator.
            self._topology_reports = asyncio.create_task(
                self._telemetry.topology_loop(lambda: self.topology.stages)
            )

    def _drain(self, replica: Replica) -> None:
        """Move a replica's messages onto the orchestrator's loop (one thread per replica)."""
        loop = self._loop
        assert loop is not None
        while not self._stopping.is_set():
            try:
                message = replica.out_q.get(timeout=DRAIN_POLL_S)
            except Exception:  # queue.Empty, or the queue closed under us at exit
                continue
            if message["type"] == "ready":
                replica.pid = int(message["pid"])
                replica.engine_pid = message.get("engine_pid")
                replica.ready.set()
                continue
            try:
                loop.call_soon_threadsafe(self.dispatch, replica, message)
            except RuntimeError:
                return  # the loop is closed: the server is exiting

    def dispatch(self, replica: Replica, message: Message) -> None:
        """Act on one message of a replica; on the orchestrator's loop."""
        stage, index = replica.spec.stage_id, replica.spec.replica
        kind = message["type"]
        if kind == "child":
            replica.children.append({"kind": message["kind"], "pid": message["pid"]})
            return
        if kind == "fatal":
            self._fatal(str(message["error"]))
            return
        pending = replica.inflight.get(message.get("request_id", ""))
        if pending is None:
            return
        if kind == "started":
            pending.running = True
            self._metrics.started(stage, index, pending.prompt_tokens)
        elif kind == "token":
            self._metrics.token(stage, index)
        elif kind == "done":
            self._metrics.finished(stage, index, float(message["seconds"]))
            pending.result = message
        elif kind == "error":
            self._metrics.finished(stage, index, 0.0)
            self._metrics.request_failed("stage_error")
            pending.error = str(message["error"])
        if pending.abandoned and kind in ("done", "error"):
            del replica.inflight[pending.request_id]
        pending.changed.set()

    def _fatal(self, error: str) -> None:
        """The engine died the way vLLM's does: 503 for a moment, then exit with code 0."""
        if self.fatal_error is not None:
            return
        logger.error("engine dead, the server will exit: %s", error)
        self.fatal_error = error
        for replica in self.replicas.values():
            self._fail_inflight(replica, error)
        assert self._loop is not None
        self._loop.call_later(FATAL_EXIT_DELAY_S, self._request_exit)

    def _fail_inflight(self, replica: Replica, error: str) -> None:
        for pending in list(replica.inflight.values()):
            if pending.result is None and pending.error is None:
                self._metrics.abandoned(
                    replica.spec.stage_id, replica.spec.replica, pending.running
                )
                if pending.abandoned:
                    del replica.inflight[pending.request_id]
                    continue
                self._metrics.request_failed("stage_error")
                pending.error = error
                pending.changed.set()

    async def _watch_liveness(self) -> None:
        """0.30: a replica that died is evicted and its requests fail at once."""
        while not self._stopping.is_set():
            for replica in self.replicas.values():
                if not replica.evicted and not replica.process.is_alive():
                    self._evict(replica)
            await asyncio.sleep(LIVENESS_POLL_S)

    def _evict(self, replica: Replica, why: str = "") -> None:
        replica.evicted = True
        spec = replica.spec
        if replica.remote:
            logger.error(
                "stage %d replica %d died: evicted (remote pid %d on %s: %s)",
                spec.stage_id,
                spec.replica,
                replica.pid,
                replica.host,
                replica.process.reason or why,
            )
            # Cut off, as the coordinator does: a replica that comes back registers anew.
            replica.process.kill()
        else:
            logger.error("stage %d replica %d died: evicted", spec.stage_id, spec.replica)
        self._fail_inflight(replica, f"stage {spec.stage_id} replica died")

    def attach(self, replica: Replica) -> None:
        """Take a remote replica that registered, in place of whatever held its slot; on
        the orchestrator's loop."""
        spec = replica.spec
        key = (spec.stage_id, spec.replica)
        previous = self.replicas.get(key)
        if previous is not None and not previous.evicted:
            self._evict(previous, "replaced by a new registration")
        # A new dict, not an insertion: the API thread reads it without a lock.
        self.replicas = {**self.replicas, key: replica}
        logger.info(
            "stage %d replica %d registered: remote pid %d on %s",
            spec.stage_id,
            spec.replica,
            replica.pid,
            replica.host,
        )

    def healthy(self) -> bool:
        if self.fatal_error is not None:
            return False
        if self.generation == "0.11":
            return True
        return all(
            any(r.alive for r in self._replicas_of(stage.stage_id))
            for stage in self.topology.stages
        )

    def _replicas_of(self, stage_id: int) -> list[Replica]:
        return [r for (s, _), r in sorted(self.replicas.items()) if s == stage_id]

    def _choose(self, stage_id: int) -> Replica:
        candidates = self._replicas_of(stage_id)
        if self.generation == "0.30":
            candidates = [r for r in candidates if r.alive]
        if not candidates or self.fatal_error is not None:
            raise StageFailed(f"stage {stage_id} has no live replica")
        return candidates[next(self._round_robin[stage_id]) % len(candidates)]

    def arm(self, fault: Fault) -> None:
        """Hand a stage fault to its replica process."""
        replica = self.replicas[(fault.stage, fault.replica)]
        replica.in_q.put({"type": "fault", "kind": fault.kind.value})

    async def generate(
        self, request_id: str, prompt_tokens: int, tokens: int, steps: int | None = None
    ) -> Completion:
        """Run one request through every stage of the default path, in order; `steps` is
        what it asks of a diffusion stage (its denoising steps; None: the stage's default).

        A request that does not get through (its client went away, a stage failed) is
        reported abandoned, and one that does finished, as the watchdog's plugin reports
        them from vLLM-Omni.
        """
        path = self.topology.default_path()
        self._telemetry.request_admitted(request_id, path)
        try:
            completion = await self._through_stages(request_id, path, prompt_tokens, tokens, steps)
        except BaseException:
            self._telemetry.request_abandoned(request_id)
            raise
        self._telemetry.request_finished(request_id)
        return completion

    async def _through_stages(
        self,
        request_id: str,
        path: tuple[int, ...],
        prompt_tokens: int,
        tokens: int,
        steps: int | None,
    ) -> Completion:
        first: Message | None = None
        for stage_id in path:
            replica = self._choose(stage_id)
            pending = PendingStage(request_id, asyncio.Event(), prompt_tokens)
            replica.inflight[request_id] = pending
            self._metrics.queued(stage_id, replica.spec.replica)
            request: Message = {
                "type": "request",
                "request_id": request_id,
                "tokens": tokens,
                "prompt_tokens": prompt_tokens,
            }
            if steps is not None:
                request["steps"] = steps
            replica.in_q.put(request)
            try:
                result = await self._wait(pending)
            finally:
                if pending.result is None and pending.error is None:
                    pending.abandoned = True
                else:
                    replica.inflight.pop(request_id, None)
            first = first or result
            prompt_tokens = int(result["tokens"])
        assert first is not None
        return Completion(text=str(first["text"]), tokens=int(first["tokens"]))

    async def _wait(self, pending: PendingStage) -> Message:
        reported = False
        while True:
            if pending.error is not None:
                if self.generation == "0.30" or self.fatal_error is not None:
                    raise StageFailed(pending.error)
                if not reported:
                    logger.error(
                        "[Orchestrator] stage error for %s: %s", pending.request_id, pending.error
                    )
                    reported = True
                # vLLM-Omni 0.11 logs the error, `continue`s and keeps polling for a result
                # that never comes, sleeping with time.sleep on the event loop's thread: from
                # here on nothing else on this loop runs (HTTP, signal handlers, progress).
                time.sleep(BLOCKING_POLL_S)
                continue
            if pending.result is not None:
                return pending.result
            await pending.changed.wait()
            pending.changed.clear()

    def stop(self) -> None:
        """Stop every local replica (blocking); remote ones are the coordinator's."""
        stop_replicas([r for r in self.replicas.values() if not r.remote])
        self._stopping.set()
        for thread in self._drains:
            thread.join(DRAIN_POLL_S * 3)

    def state(self) -> list[dict[str, Any]]:
        return [
            {
                "stage": r.spec.stage_id,
                "replica": r.spec.replica,
                "name": r.spec.name,
                "execution_type": r.spec.execution_type.value,
                "pid": r.pid,
                "engine_pid": r.engine_pid,
                "alive": r.alive,
                "children": list(r.children),
                "remote": r.remote,
                "host": r.host,
            }
            for _, r in sorted(self.replicas.items())
        ]


def spawn_replica(spec: StageSpec) -> Replica:
    """Start one stage replica process of `spec`'s generation and execution type."""
    context = mp.get_context("spawn")
    in_q, out_q = context.Queue(), context.Queue()
    if spec.generation == "0.11":
        process = context.Process(target=stage_worker_main, args=(spec, in_q, out_q))
    else:
        args = (spec, in_q, out_q, os.getpid())
        # 0.30 runs a diffusion stage in a `StageDiffusionProc`, not an engine core.
        diffusion = spec.execution_type is ExecutionType.DIFFUSION
        target = diffusion_proc_main if diffusion else stage_replica_main
        process = context.Process(target=target, args=args)
    process.start()
    return Replica(spec, process, in_q, out_q)


def stop_replicas(replicas: Sequence[Replica]) -> None:
    """Tell local replicas to stop, wait a little, then kill what is left (blocking)."""
    for replica in replicas:
        if replica.process.is_alive():
            replica.in_q.put({"type": "stop"})
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for replica in replicas:
        replica.process.join(max(deadline - time.monotonic(), 0.0))
    for replica in replicas:
        if replica.process.is_alive():
            logger.warning("stage %d did not stop: killed", replica.spec.stage_id)
            replica.process.kill()
            replica.process.join(1.0)
            if replica.engine_pid:
                _kill_quietly(replica.engine_pid)
    for replica in replicas:
        # Never wait at exit for a queue whose reader is gone.
        replica.in_q.cancel_join_thread()
        replica.out_q.cancel_join_thread()


def _kill_quietly(pid: int) -> None:
    """SIGKILL a leftover EngineCore child of a stage worker that was killed, if it lives."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
