"""The version-specific part: which functions of vLLM / vLLM-Omni are wrapped, and how.

Every hook finds its target by module path and attribute name, checks that it exists, and
does nothing but log one line when the installed version does not have it. Each hook names
the versions it was checked against. Hooks look up their process's telemetry when they
fire, not when installed, because a forked child inherits the patched classes.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import logging
import os
import queue
import sys
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from omni_watchdog.instrument.telemetry import StageTelemetry
from omni_watchdog.types import Stage

logger = logging.getLogger(__name__)

WRAPPED_MARK = "__omni_watchdog_wrapped__"
# Set by an instrumented 0.11 stage worker so that its EngineCore child knows its stage.
STAGE_ID_ENV = "OMNI_WATCHDOG_STAGE_ID"


@dataclass(frozen=True)
class ProcessIdentity:
    """What a process is in the served pipeline."""

    kind: str
    stage_id: int | None = None
    replica: int | None = None


class HookContext:
    """What hooks need from the world: telemetry per process, clocks, the environment."""

    def __init__(
        self,
        telemetry_factory: Callable[[ProcessIdentity], StageTelemetry],
        identify: Callable[[], ProcessIdentity],
        *,
        environ: MutableMapping[str, str] = os.environ,
        getpid: Callable[[], int] = os.getpid,
        monotonic: Callable[[], float] = time.monotonic,
        wall_ns: Callable[[], int] = time.time_ns,
        start_thread: Callable[[str, Callable[[], None]], None] | None = None,
    ) -> None:
        self._telemetry_factory = telemetry_factory
        self.identify = identify
        self.environ = environ
        self.getpid = getpid
        self.monotonic = monotonic
        self.wall_ns = wall_ns
        self.start_thread = start_thread or start_daemon_thread
        self._telemetry: dict[tuple[int, ProcessIdentity], StageTelemetry] = {}
        self._heartbeat_tasks: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, asyncio.Task[None]
        ] = weakref.WeakKeyDictionary()
        self._topology_tasks: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, asyncio.Task[None]
        ] = weakref.WeakKeyDictionary()

    def telemetry(self, identity: ProcessIdentity | None = None) -> StageTelemetry:
        """This process's telemetry for `identity` (default: what the process is), made once."""
        key = (self.getpid(), identity or self.identify())
        if key not in self._telemetry:
            self._telemetry[key] = self._telemetry_factory(key[1])
        return self._telemetry[key]

    def ensure_loop_heartbeat(self, telemetry: StageTelemetry) -> None:
        """Run one heartbeat task on the running event loop, if there is one and it has none."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if not telemetry.enabled or loop in self._heartbeat_tasks:
            return
        self._heartbeat_tasks[loop] = loop.create_task(
            telemetry.heartbeat_loop(), name="omni-watchdog-heartbeat"
        )

    def ensure_topology_reports(
        self, telemetry: StageTelemetry, read_stages: Callable[[], tuple[Stage, ...]]
    ) -> None:
        """Run one topology-reporting task on the running event loop, if it has none."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if not telemetry.enabled or loop in self._topology_tasks:
            return
        self._topology_tasks[loop] = loop.create_task(
            telemetry.topology_loop(read_stages), name="omni-watchdog-topology"
        )


class LoopBeat:
    """Heartbeats from a synchronous loop, at most one per interval however fast it spins."""

    def __init__(self, telemetry: StageTelemetry, monotonic: Callable[[], float]) -> None:
        self._telemetry = telemetry
        self._monotonic = monotonic
        self._last: float | None = None

    @property
    def interval(self) -> float:
        return self._telemetry.heartbeat_interval

    def tick(self) -> None:
        now = self._monotonic()
        if self._last is None or now - self._last >= self.interval:
            self._last = now
            self._telemetry.heartbeat()


def beat_while_waiting(
    work_queue: Any, beat: LoopBeat, on_item: Callable[[Any], None] | None = None
) -> None:
    """Make a blocking `get()` on this queue beat every interval while it waits for work.

    The beat comes from the waiting thread itself, so a loop blocked anywhere else still
    goes silent; a helper thread would beat on and hide exactly that.
    """
    original_get = work_queue.get
    if getattr(original_get, WRAPPED_MARK, False):
        return

    def get(block: bool = True, timeout: float | None = None) -> Any:
        if not block or timeout is not None:
            item = original_get(block, timeout)
        else:
            while True:
                try:
                    item = original_get(True, beat.interval)
                    break
                except queue.Empty:
                    quietly(beat.tick)
        if on_item is not None:
            quietly(on_item, item)
        return item

    setattr(get, WRAPPED_MARK, True)
    work_queue.get = get


def start_daemon_thread(name: str, target: Callable[[], None]) -> None:
    """Run `target` in a daemon thread: the process may exit whatever it does."""
    threading.Thread(target=target, name=name, daemon=True).start()


def quietly(function: Callable[..., None], *args: Any) -> None:
    """Run instrumentation code; whatever it raises stays out of the server's code path."""
    try:
        function(*args)
    except Exception:
        logger.debug("omni-watchdog instrumentation failed", exc_info=True)


def wrap_attribute(
    module_name: str,
    attribute_path: str,
    make_wrapper: Callable[[Any], Any],
    checked_against: str,
    *,
    modules: Mapping[str, Any] | None = None,
) -> bool:
    """Replace `module.attribute_path` by `make_wrapper(original)`, once; False if absent."""
    try:
        module = (
            modules.get(module_name)
            if modules is not None
            else importlib.import_module(module_name)
        )
        owner: Any = module
        *parents, name = attribute_path.split(".")
        for parent in parents:
            owner = getattr(owner, parent, None)
        original = getattr(owner, name, None)
    except Exception:
        original = None
    if not callable(original):
        logger.info(
            "omni-watchdog: %s.%s not found (hook checked against %s); not hooked",
            module_name,
            attribute_path,
            checked_against,
        )
        return False
    if getattr(original, WRAPPED_MARK, False):
        return True
    wrapper = functools.wraps(original)(make_wrapper(original))
    setattr(wrapper, WRAPPED_MARK, True)
    setattr(owner, name, wrapper)
    return True


def install_engine_core_loop(context: HookContext) -> bool:
    """vLLM EngineCore busy loop: a beat per iteration (rate-limited) and while idle.

    Checked against vLLM 0.32.0 (`EngineCoreProc.run_busy_loop` and the data-parallel one
    both call `_process_input_queue` once per iteration, which blocks on
    `self.input_queue.get()` while idle) and vLLM-Omni 0.30.0, whose
    `StageEngineCoreProc` inherits that loop unchanged.
    """

    def make_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        def _process_input_queue(self: Any, *args: Any, **kwargs: Any) -> Any:
            beat: LoopBeat | None = getattr(self, "_omni_watchdog_beat", None)
            if beat is None:
                try:
                    beat = LoopBeat(context.telemetry(), context.monotonic)
                    beat_while_waiting(self.input_queue, beat)
                    self._omni_watchdog_beat = beat
                except Exception:
                    logger.debug("omni-watchdog: engine loop not instrumented", exc_info=True)
            if beat is not None:
                quietly(beat.tick)
            return original(self, *args, **kwargs)

        return _process_input_queue

    return wrap_attribute(
        "vllm.v1.engine.core",
        "EngineCoreProc._process_input_queue",
        make_wrapper,
        "vLLM 0.32.0, vLLM-Omni 0.30.0",
    )


def install_omni030_orchestrator(context: HookContext) -> bool:
    """vLLM-Omni 0.30 orchestrator: admitted spans, stage spans, its loop's heartbeat, and
    the pipeline it runs (`pipeline_stages`), reported from its loop every little while.

    Checked against vLLM-Omni 0.30.0 `vllm_omni.engine.orchestrator`: requests enter in
    `Orchestrator._handle_add_request(msg)` (`msg.request_id`, `msg.final_stage_id`),
    stage outputs arrive in `OrchestratorBase._handle_processed_outputs(stage_id,
    replica_id, outputs)` with the submit time in `request_states[id].stage_submit_ts`,
    every request leaves through `OrchestratorBase._cleanup_request_ids(request_ids, *,
    abort=...)`, with `abort=True` when a client went away, a stage failed or a replica was
    lost (the stages then drop it and send nothing more) and without it once it is done,
    its last stage's processed output or not (`_finish_raw_terminal_requests` ends one
    whose last stage produced none), and `OrchestratorBase.run()` is
    the coroutine of the orchestrator's own event loop.
    """
    orchestrator = ProcessIdentity("orchestrator")

    def make_add_request(original: Callable[..., Any]) -> Callable[..., Any]:
        async def _handle_add_request(self: Any, msg: Any, *args: Any, **kwargs: Any) -> Any:
            quietly(admit, msg)
            return await original(self, msg, *args, **kwargs)

        return _handle_add_request

    def admit(msg: Any) -> None:
        final_stage = int(getattr(msg, "final_stage_id", 0))
        context.telemetry(orchestrator).request_admitted(
            str(msg.request_id), range(max(final_stage, 0) + 1)
        )

    def make_processed_outputs(original: Callable[..., Any]) -> Callable[..., Any]:
        async def _handle_processed_outputs(
            self: Any, stage_id: int, replica_id: int, outputs: list[Any], *args: Any
        ) -> Any:
            quietly(record_outputs, self, stage_id, replica_id, outputs)
            return await original(self, stage_id, replica_id, outputs, *args)

        return _handle_processed_outputs

    def record_outputs(self: Any, stage_id: int, replica_id: int, outputs: list[Any]) -> None:
        telemetry = context.telemetry(orchestrator)
        now_ns = context.wall_ns()
        for output in outputs:
            error = getattr(output, "error", None)
            if not getattr(output, "finished", False) and error is None:
                continue
            state = self.request_states.get(output.request_id)
            submitted = state.stage_submit_ts.get(stage_id) if state is not None else None
            if submitted is None:
                continue
            telemetry.record_stage_request(
                str(output.request_id),
                int(submitted * 1e9),
                now_ns,
                None if error is None else str(error),
                stage_id=int(stage_id),
                replica=int(replica_id),
            )

    def make_cleanup(original: Callable[..., Any]) -> Callable[..., Any]:
        async def _cleanup_request_ids(
            self: Any, request_ids: Any, *args: Any, **kwargs: Any
        ) -> Any:
            quietly(end, request_ids, bool(kwargs.get("abort")))
            return await original(self, request_ids, *args, **kwargs)

        return _cleanup_request_ids

    def end(request_ids: Any, abort: bool) -> None:
        telemetry = context.telemetry(orchestrator)
        for request_id in request_ids:
            if abort:
                telemetry.request_abandoned(str(request_id))
            else:
                telemetry.request_finished(str(request_id))

    def make_run(original: Callable[..., Any]) -> Callable[..., Any]:
        async def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            context.ensure_loop_heartbeat(context.telemetry(orchestrator))
            quietly(report_topology, self)
            return await original(self, *args, **kwargs)

        return run

    def report_topology(self: Any) -> None:
        known: dict[int, Stage] = {}
        context.ensure_topology_reports(
            context.telemetry(orchestrator), lambda: pipeline_stages(self, known)
        )

    module = "vllm_omni.engine.orchestrator"
    checked = "vLLM-Omni 0.30.0"
    return all(
        [
            wrap_attribute(module, "Orchestrator._handle_add_request", make_add_request, checked),
            wrap_attribute(
                module,
                "OrchestratorBase._handle_processed_outputs",
                make_processed_outputs,
                checked,
            ),
            wrap_attribute(module, "OrchestratorBase._cleanup_request_ids", make_cleanup, checked),
            wrap_attribute(module, "OrchestratorBase.run", make_run, checked),
        ]
    )


# What the report says of a stage whose replicas are all gone, before one was ever seen.
_UNNAMED_STAGE = "stage{}"


def pipeline_stages(orchestrator: Any, known: dict[int, Stage]) -> tuple[Stage, ...]:
    """The stages a vLLM-Omni 0.30 orchestrator runs, read from its stage pools.

    Checked against vLLM-Omni 0.30.0: `Orchestrator.stage_pools` holds one `StagePool` per
    stage, indexed by stage id; `num_replicas` counts its replica slots, evicted ones (left
    as holes) included; `stage_client` is the first live replica's client, None when none
    is live (all evicted, or on another host), which carries the stage's `model_stage`,
    `engine_input_source`, `final_output` and `stage_type` ("llm" or "diffusion"). What a
    live client said is kept in `known`, so the report does not forget a stage's name and
    inputs once its replicas are gone.
    """
    stages: list[Stage] = []
    for stage_id, pool in enumerate(orchestrator.stage_pools):
        # A stage served from another host may have no slot here yet; it is a stage still.
        replicas = max(1, int(pool.num_replicas))
        client = pool.stage_client
        if client is not None:
            name = str(getattr(client, "model_stage", None) or _UNNAMED_STAGE.format(stage_id))
            known[stage_id] = Stage(
                stage_id,
                name,
                upstream=tuple(int(s) for s in getattr(client, "engine_input_source", ()) or ()),
                final_output=bool(getattr(client, "final_output", False)),
                stage_type=str(getattr(client, "stage_type", None) or ""),
            )
        seen = known.get(stage_id, Stage(stage_id, _UNNAMED_STAGE.format(stage_id)))
        stages.append(
            Stage(
                stage_id,
                seen.name,
                replicas=replicas,
                upstream=seen.upstream,
                final_output=seen.final_output,
                stage_type=seen.stage_type,
            )
        )
    return tuple(stages)


def instrument_omni011_stage(context: HookContext, omni_stage: Any, stage_id: int) -> None:
    """Heartbeats and request spans for one vLLM-Omni 0.11 stage worker, from its queues."""
    context.environ[STAGE_ID_ENV] = str(stage_id)
    telemetry = context.telemetry(ProcessIdentity("stage", stage_id, 0))
    context.ensure_loop_heartbeat(telemetry)
    started_ns: dict[str, int] = {}

    def on_task(task: Any) -> None:
        if isinstance(task, dict) and "request_id" in task:
            started_ns[str(task["request_id"])] = context.wall_ns()

    # The worker blocks its own event loop in `in_q.get()` while idle, so the heartbeat
    # task cannot run then; the queue beats instead.
    beat_while_waiting(omni_stage._in_q, LoopBeat(telemetry, context.monotonic), on_task)
    out_queue = omni_stage._out_q
    original_put = out_queue.put
    if getattr(original_put, WRAPPED_MARK, False):
        return

    def record(item: Any) -> None:
        if not isinstance(item, dict) or "request_id" not in item:
            return
        request_id = str(item["request_id"])
        start_ns = started_ns.pop(request_id, None)
        if start_ns is not None:
            error = item.get("error")
            telemetry.record_stage_request(
                request_id, start_ns, context.wall_ns(), None if error is None else str(error)
            )

    def put(item: Any, *args: Any, **kwargs: Any) -> None:
        original_put(item, *args, **kwargs)
        quietly(record, item)

    setattr(put, WRAPPED_MARK, True)
    out_queue.put = put


def install_omni011_stage_worker(context: HookContext, process: Any) -> bool:
    """vLLM-Omni 0.11 stage worker: `_stage_worker_async(omni_stage, model, stage_payload)`.

    Checked against vLLM-Omni 0.11.0rc1 `vllm_omni/entrypoints/omni_stage.py`: the spawned
    child runs `asyncio.run(_stage_worker_async(...))`, reads `omni_stage._in_q` with a
    blocking `get()` and answers each task (`request_id`) on `omni_stage._out_q`, with an
    `error` key on failure. vLLM loads this plugin in that child only once the worker is
    already running (from `create_engine_config`), so the running worker found in
    `process` (its multiprocessing process object) is instrumented too.
    """
    module = "vllm_omni.entrypoints.omni_stage"

    def make_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        async def _stage_worker_async(
            omni_stage: Any, model: Any, stage_payload: Any, *args: Any, **kwargs: Any
        ) -> Any:
            quietly(instrument_omni011_stage, context, omni_stage, int(stage_payload["stage_id"]))
            return await original(omni_stage, model, stage_payload, *args, **kwargs)

        return _stage_worker_async

    hooked = wrap_attribute(module, "_stage_worker_async", make_wrapper, "vLLM-Omni 0.11.0rc1")
    target = getattr(process, "_target", None)
    arguments: tuple[Any, ...] = tuple(getattr(process, "_args", ()))
    if getattr(target, "__name__", "") == "_stage_worker_async_entry" and len(arguments) >= 3:
        quietly(instrument_omni011_stage, context, arguments[0], int(arguments[2]["stage_id"]))
    return hooked


def install_omni011_api(context: HookContext, *, admits: bool = True) -> bool:
    """vLLM-Omni 0.11 API server: `AsyncOmni.generate(prompt, request_id, ...)`.

    Checked against vLLM-Omni 0.11.0rc1 `vllm_omni/entrypoints/async_omni.py`: every
    request passes through this async generator, through all of `self.stage_list` in
    order, and submits a stage only once the one before it answered. A generator closed
    before its end (the client went away, a stage failed) sends nothing to the stages
    after the current one. The first call also starts the API loop's heartbeat (the loop
    that 0.11 starves).

    vLLM-Omni 0.30 still has this generator, above its orchestrator, which admits every
    request itself under an internal id (`install_omni030_orchestrator`): there
    `admits=False` keeps only the heartbeat. Admitted here too, each request would be
    owed twice, once under an id no stage ever reports (seen on the real server: the
    thinker judged stalled under load).
    """
    api = ProcessIdentity("api")

    def make_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        async def generate(self: Any, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            found = kwargs.get("request_id", args[1] if len(args) > 1 else None)
            request_id = found if admits else None
            quietly(admit, self, request_id)
            outputs = original(self, *args, **kwargs)
            completed = False
            try:
                async for output in outputs:
                    yield output
                completed = True
            finally:
                if not completed:
                    quietly(abandon, request_id)
                await outputs.aclose()

        return generate

    def admit(engine: Any, request_id: Any) -> None:
        telemetry = context.telemetry(api)
        context.ensure_loop_heartbeat(telemetry)
        if request_id is not None:
            stages = range(len(getattr(engine, "stage_list", ())))
            telemetry.request_admitted(str(request_id), stages)

    def abandon(request_id: Any) -> None:
        if request_id is not None:
            context.telemetry(api).request_abandoned(str(request_id))

    return wrap_attribute(
        "vllm_omni.entrypoints.async_omni",
        "AsyncOmni.generate",
        make_wrapper,
        "vLLM-Omni 0.11.0rc1, 0.30.0",
    )


# Where vLLM's OpenAI app is built, as (module, function): vLLM 0.11's own; vLLM-Omni 0.11,
# which imports it by name; vLLM-Omni 0.30, which imports it as `build_openai_app`.
BUILD_APP_FUNCTIONS = (
    ("vllm.entrypoints.openai.api_server", "build_app"),
    ("vllm_omni.entrypoints.openai.api_server", "build_app"),
    ("vllm_omni.entrypoints.openai.api_server", "build_openai_app"),
)


def install_build_app_route(add_route: Callable[[Any], None]) -> bool:
    """Add the admin route to the app from the function that builds it.

    Checked against vLLM 0.11 (`vllm.entrypoints.openai.api_server.build_app(args)`,
    called by `run_server_worker`), vLLM-Omni 0.11.0rc1, which imports it into
    `vllm_omni.entrypoints.openai.api_server`, and vLLM-Omni 0.30.0, which imports vLLM's
    `build_app` there as `build_openai_app` and calls it from `omni_run_server_worker`.
    Only modules already imported are patched: this runs in every vLLM process, and the
    API server has imported them by then.
    """

    def make_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        def build_app(*args: Any, **kwargs: Any) -> Any:
            app = original(*args, **kwargs)
            quietly(add_route, app)
            return app

        return build_app

    loaded: dict[str, Any] = dict(sys.modules)
    main = loaded.get("__main__")
    main_name = getattr(getattr(main, "__spec__", None), "name", None)
    if main_name in {module for module, _ in BUILD_APP_FUNCTIONS}:
        loaded[main_name] = main
    hooked = [
        wrap_attribute(
            module, function, make_wrapper, "vLLM 0.11, vLLM-Omni 0.30.0", modules=loaded
        )
        for module, function in BUILD_APP_FUNCTIONS
        if module in loaded and hasattr(loaded[module], function)
    ]
    return any(hooked)
