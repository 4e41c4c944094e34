"""The simulated server's API process: an OpenAI-compatible aiohttp app over the stages."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from omni_watchdog.instrument.admin import add_aiohttp_admin_route
from omni_watchdog.instrument.telemetry import StageTelemetry
from omni_watchdog.sim.coordinator import Coordinator
from omni_watchdog.sim.engine import DENOISE_STEP_S, SLOW_DENOISE_STEP_S, StageSpec
from omni_watchdog.sim.faults import (
    EVENTS_FILE,
    START_ONLY,
    Fault,
    FaultError,
    FaultKind,
    check_fault,
    fault_from_mapping,
    record_fault_triggered,
)
from omni_watchdog.sim.metrics import SimMetrics
from omni_watchdog.sim.nvml import DEFAULT_DEVICE_BYTES, write_json_atomically
from omni_watchdog.sim.orchestrator import Completion, Orchestrator, StageFailed
from omni_watchdog.sim.pipelines import MAX_DENOISE_STEPS, ExecutionType
from omni_watchdog.sim.wire import DEFAULT_HEARTBEAT_TIMEOUT_S
from omni_watchdog.types import Topology

logger = logging.getLogger("omni_watchdog.sim")

API_FILE = "api.json"
DEFAULT_MAX_TOKENS = 16
# vLLM's default when a stage config gives no memory share.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
ANSWER_GRACE_S = 0.1
T = TypeVar("T")


@dataclass(frozen=True)
class SimSettings:
    """Everything the simulated server is started with."""

    topology: Topology
    generation: str
    host: str
    port: int
    model: str
    faults: tuple[Fault, ...]
    state_dir: Path
    token_delay: float
    startup_seconds: float
    max_tokens_cap: int
    gpus: int
    device_bytes: int = DEFAULT_DEVICE_BYTES
    # Stages that run headless on other hosts and register with the coordinator (0.30).
    remote_stages: frozenset[int] = frozenset()
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    # The pipeline the stages run (`--pipeline`), and each stage's execution type; a stage
    # not named is an LLM_AR stage.
    pipeline: str | None = None
    execution_types: Mapping[int, ExecutionType] = field(default_factory=dict)
    denoise_step_s: float = DENOISE_STEP_S
    slow_denoise_step_s: float = SLOW_DENOISE_STEP_S

    def diffusion_stages(self) -> frozenset[int]:
        return frozenset(
            stage_id
            for stage_id, kind in self.execution_types.items()
            if kind is ExecutionType.DIFFUSION
        )


class SimError(ValueError):
    """Settings the simulated server cannot start with."""


def stage_specs(settings: SimSettings) -> list[StageSpec]:
    """One spec per stage replica, with its device, memory share and start-time faults."""
    specs: list[StageSpec] = []
    for stage in settings.topology.stages:
        share = stage.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
        for ref in stage.refs():
            device = stage.devices[ref.replica % len(stage.devices)] if stage.devices else 0
            if device >= settings.gpus:
                raise SimError(
                    f"stage {stage.stage_id} uses device {device} but the simulator has "
                    f"{settings.gpus} device(s) (--gpus)"
                )
            faults = tuple(
                f.kind
                for f in settings.faults
                if (f.stage, f.replica) == (ref.stage_id, ref.replica)
            )
            specs.append(
                StageSpec(
                    stage_id=stage.stage_id,
                    replica=ref.replica,
                    name=stage.name,
                    generation=settings.generation,
                    device=device,
                    memory_bytes=int(share * settings.device_bytes),
                    state_dir=str(settings.state_dir),
                    token_delay=settings.token_delay,
                    faults=faults,
                    execution_type=settings.execution_types.get(
                        stage.stage_id, ExecutionType.LLM_AR
                    ),
                    denoise_step_s=settings.denoise_step_s,
                    slow_denoise_step_s=settings.slow_denoise_step_s,
                )
            )
    return specs


class SimServer:
    """The API process: HTTP in front, the orchestrator behind, faults on the side; with a
    `master` listener, the coordinator that headless stages register with."""

    def __init__(
        self, settings: SimSettings, listener: socket.socket, master: socket.socket | None = None
    ) -> None:
        self.settings = settings
        self._listener = listener
        self._replica_counts = {s.stage_id: s.replicas for s in settings.topology.stages}
        self.metrics = SimMetrics(
            settings.topology,
            settings.model,
            gauges_follow_batches=settings.generation == "0.30",
            execution_types=settings.execution_types,
        )
        self.telemetry = StageTelemetry.from_environment(process_kind="api")
        self._shutdown = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._orchestrator_loop: asyncio.AbstractEventLoop | None = None
        self._armed: list[Fault] = list(settings.faults)
        specs = stage_specs(settings)
        self.orchestrator = Orchestrator(
            settings.topology,
            specs,
            settings.generation,
            self.metrics,
            self.telemetry,
            self.request_shutdown,
            settings.remote_stages,
        )
        self.coordinator: Coordinator | None = None
        if master is not None:
            self.coordinator = Coordinator(
                self.orchestrator,
                specs,
                settings.remote_stages,
                settings.heartbeat_timeout,
                master,
            )

    def request_shutdown(self) -> None:
        """Start the graceful shutdown from any thread (what SIGTERM does)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._shutdown.set)

    async def _on_orchestrator(self, make: Callable[[], Awaitable[T]]) -> T:
        """Run orchestrator work where it lives: this loop (0.11) or its own thread (0.30)."""
        if self._orchestrator_loop is None:
            return await make()

        async def run() -> T:
            return await make()

        future: Future[T] = asyncio.run_coroutine_threadsafe(run(), self._orchestrator_loop)
        return await asyncio.wrap_future(future)

    async def serve(self) -> int:
        """Start the stages, answer HTTP until shut down, stop everything; the exit code."""
        loop = self._loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._shutdown.set)
        self.orchestrator.spawn()
        if self.settings.generation == "0.30":
            self._orchestrator_loop = asyncio.new_event_loop()
            threading.Thread(
                target=self._orchestrator_loop.run_forever, name="orchestrator", daemon=True
            ).start()
        await self._on_orchestrator(self.orchestrator.start)
        if self.coordinator is not None:
            await self._on_orchestrator(self.coordinator.start)
        logger.info("stages: %s", self._describe_stages())
        await self._slow_startup()
        for fault in self.settings.faults:
            self._apply_now(fault)
        # vLLM cancels a request whose client went away (`with_cancellation`).
        runner = web.AppRunner(
            self.build_app(), access_log=None, handle_signals=False, handler_cancellation=True
        )
        await runner.setup()
        if not self._shutdown.is_set():
            await web.SockSite(runner, self._listener, shutdown_timeout=0.5).start()
            logger.info("ready on %s:%d", self.settings.host, self._listener.getsockname()[1])
            await self._shutdown.wait()
        logger.info("shutting down")
        await runner.cleanup()
        await loop.run_in_executor(None, self.orchestrator.stop)
        if self.coordinator is not None:
            # After the orchestrator stopped watching: dropping them is no eviction.
            await self._on_orchestrator(self.coordinator.close)
        if self._orchestrator_loop is not None:
            self._orchestrator_loop.call_soon_threadsafe(self._orchestrator_loop.stop)
        self.telemetry.shutdown()
        return 0

    def _describe_stages(self) -> str:
        """Each stage with its execution type, e.g. `0 text (LLM_AR), 1 dit (DIFFUSION)`."""
        types = self.settings.execution_types
        return ", ".join(
            f"{stage.stage_id} {stage.name} "
            f"({types.get(stage.stage_id, ExecutionType.LLM_AR).value})"
            for stage in self.settings.topology.stages
        )

    async def _slow_startup(self) -> None:
        seconds = self.settings.startup_seconds
        if seconds <= 0:
            return
        for fault in self.settings.faults:
            if fault.kind is FaultKind.SLOW_STARTUP:
                record_fault_triggered(self.settings.state_dir, fault, os.getpid())
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._shutdown.wait(), timeout=seconds)

    def _apply_now(self, fault: Fault) -> None:
        """Act on a fault that is not waiting for a request, or hand it to its stage."""
        state_dir = self.settings.state_dir
        if fault.kind is FaultKind.IGNORE_SIGTERM:
            assert self._loop is not None
            self._loop.remove_signal_handler(signal.SIGTERM)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            record_fault_triggered(state_dir, fault, os.getpid())
        elif fault.kind is FaultKind.ORPHANED_STAGES:
            record_fault_triggered(state_dir, fault, os.getpid())
            logging.shutdown()
            # As if someone else did it: no clean-up code runs.
            os.kill(os.getpid(), signal.SIGKILL)

    def build_app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_page)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/sim/faults", self.inject_fault)
        app.router.add_get("/sim/state", self.state)
        add_aiohttp_admin_route(app, lambda: os.kill(os.getpid(), signal.SIGTERM))
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.orchestrator.healthy() else 503)

    async def metrics_page(self, request: web.Request) -> web.Response:
        response = web.Response(body=self.metrics.render())
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    async def models(self, request: web.Request) -> web.Response:
        model = self.settings.model
        entry = {
            "id": model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "vllm",
            "root": model,
            "parent": None,
            "permission": [],
        }
        return web.json_response({"object": "list", "data": [entry]})

    async def chat_completions(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "BadRequestError", "the body is not valid JSON")
        problem = _chat_problem(body, self.settings.model)
        if problem is not None:
            status, message = problem
            kind = "NotFoundError" if status == 404 else "BadRequestError"
            return _error(status, kind, message)
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 0)
        max_tokens = max_tokens or DEFAULT_MAX_TOKENS
        tokens = min(max_tokens, self.settings.max_tokens_cap)
        prompt_tokens = sum(len(str(m.get("content", "")).split()) for m in body["messages"])
        steps = body.get("num_inference_steps")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            completion: Completion = await self._on_orchestrator(
                lambda: self.orchestrator.generate(request_id, prompt_tokens, tokens, steps)
            )
        except StageFailed as error:
            return _error(500, "InternalServerError", str(error))
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": completion.text, "tool_calls": []},
            "logprobs": None,
            "finish_reason": "length" if completion.tokens >= max_tokens else "stop",
            "stop_reason": None,
        }
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion.tokens,
            "total_tokens": prompt_tokens + completion.tokens,
        }
        return web.json_response(
            {
                "id": request_id,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.settings.model,
                "choices": [choice],
                "usage": usage,
            }
        )

    async def inject_fault(self, request: web.Request) -> web.Response:
        try:
            document = await request.json()
            if not isinstance(document, dict):
                raise FaultError('expected a JSON object like {"kind": "silent-stall"}')
            fault = fault_from_mapping(document)
            check_fault(
                fault,
                self.settings.generation,
                self._replica_counts,
                self.settings.remote_stages,
                self.settings.diffusion_stages(),
            )
            if fault.kind in START_ONLY:
                raise FaultError(f"{fault.kind.value} can only be given at start (--fault)")
        except (FaultError, json.JSONDecodeError) as error:
            return web.json_response({"error": str(error)}, status=400)
        self._armed.append(fault)
        if fault.kind in (FaultKind.IGNORE_SIGTERM, FaultKind.ORPHANED_STAGES):
            # After this answer has gone out: orphaned-stages kills this very process.
            asyncio.get_running_loop().call_later(ANSWER_GRACE_S, self._apply_now, fault)
        else:
            self.orchestrator.arm(fault)
        return web.json_response({"armed": fault.as_dict()})

    async def state(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "generation": self.settings.generation,
                "pipeline": self.settings.pipeline,
                "api_pid": os.getpid(),
                "healthy": self.orchestrator.healthy(),
                "stages": self.orchestrator.state(),
                "master": None if self.coordinator is None else self.coordinator.state(),
                "armed_faults": [f.as_dict() for f in self._armed],
                "triggered_faults": _triggered(self.settings.state_dir),
            }
        )


def _chat_problem(body: Any, model: str) -> tuple[int, str] | None:
    if not isinstance(body, dict):
        return 400, "expected a JSON object"
    if body.get("model", model) != model:
        return 404, f"The model `{body.get('model')}` does not exist."
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return 400, "messages: expected a non-empty list"
    if not all(isinstance(m, dict) for m in messages):
        return 400, "messages: expected objects with role and content"
    if body.get("stream"):
        return 400, "stream: the simulator answers only non-streamed requests"
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        return 400, "max_tokens: expected a positive integer"
    steps = body.get("num_inference_steps")
    if steps is not None and (
        isinstance(steps, bool) or not isinstance(steps, int) or not 0 < steps <= MAX_DENOISE_STEPS
    ):
        return 400, f"num_inference_steps: expected 1 to {MAX_DENOISE_STEPS}"
    return None


def _error(status: int, kind: str, message: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": None, "code": status}},
        status=status,
    )


def _triggered(state_dir: Path) -> list[dict[str, Any]]:
    try:
        lines = (state_dir / EVENTS_FILE).read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.strip()]


def write_listen_file(state_dir: Path, name: str, host: str, port: int) -> None:
    """`$STATE/<name>`: where the server listens (`api.json`: HTTP, `master.json`: the
    coordinator) and its pid, before start-up ends."""
    document = {"pid": os.getpid(), "host": host, "port": port}
    write_json_atomically(state_dir / name, document)
