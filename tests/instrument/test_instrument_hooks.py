"""Hooks against small fake modules shaped like vLLM 0.32 and vLLM-Omni 0.11 / 0.30."""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
from deadline import wait_until

from omni_watchdog.instrument import diffusion, hooks, plugin
from omni_watchdog.instrument.hooks import HookContext, ProcessIdentity, pipeline_stages
from omni_watchdog.instrument.telemetry import StageTelemetry
from omni_watchdog.types import Stage

# The plugin's telemetry factory, which some tests fake with one that makes nothing.
MakeTelemetry = Callable[..., StageTelemetry]


class FakeTelemetry:
    """Records what a hook emits instead of exporting it."""

    def __init__(self, identity: ProcessIdentity, interval: float = 0.02) -> None:
        self.identity = identity
        self.heartbeat_interval = interval
        self.enabled = True
        self.heartbeats = 0
        self.admitted: list[tuple[str, list[int]]] = []
        self.abandoned: list[str] = []
        self.finished: list[str] = []
        self.stage_requests: list[dict[str, Any]] = []
        self.loops: list[asyncio.AbstractEventLoop] = []
        self.topologies: list[tuple[Stage, ...]] = []
        self.steps: list[tuple[str, int, int, float | None]] = []
        self.diffusion_requests: list[dict[str, Any]] = []

    def denoise_step(
        self, request_id: str, step: int, steps: int, previous_seconds: float | None
    ) -> None:
        self.steps.append((request_id, step, steps, previous_seconds))

    def diffusion_request(
        self,
        request_id: str,
        start_ns: int,
        end_ns: int,
        phases_ms: tuple[float, float, float],
        steps: tuple[int, int],
        error: BaseException | None = None,
    ) -> None:
        self.diffusion_requests.append(
            {"id": request_id, "phases": phases_ms, "steps": steps, "error": error}
        )

    def heartbeat(self) -> None:
        self.heartbeats += 1

    async def heartbeat_loop(self) -> None:
        self.loops.append(asyncio.get_running_loop())
        await asyncio.Event().wait()

    async def topology_loop(self, read_stages: Callable[[], tuple[Stage, ...]]) -> None:
        self.topologies.append(read_stages())
        await asyncio.Event().wait()

    def request_admitted(self, request_id: str, stage_path: Any) -> None:
        self.admitted.append((request_id, list(stage_path)))

    def request_abandoned(self, request_id: str) -> None:
        self.abandoned.append(request_id)

    def request_finished(self, request_id: str) -> None:
        self.finished.append(request_id)

    def record_stage_request(
        self, request_id: str, start: int, end: int, error: str | None = None, **stage: Any
    ) -> None:
        self.stage_requests.append(
            {"id": request_id, "start": start, "end": end, "error": error, **stage}
        )


@dataclass
class FakeClock:
    now: float = 0.0


@dataclass
class Fixture:
    context: HookContext
    clock: FakeClock
    environ: dict[str, str]
    made: dict[ProcessIdentity, FakeTelemetry] = field(default_factory=dict)
    # The names of the threads hooks asked for; none is started.
    threads: list[str] = field(default_factory=list)


@pytest.fixture
def fx() -> Fixture:
    clock = FakeClock()
    environ: dict[str, str] = {}
    made: dict[ProcessIdentity, FakeTelemetry] = {}
    threads: list[str] = []

    def make(identity: ProcessIdentity) -> Any:
        made[identity] = FakeTelemetry(identity)
        return made[identity]

    context = HookContext(
        make,
        lambda: ProcessIdentity("engine", 0, 0),
        environ=environ,
        monotonic=lambda: clock.now,
        wall_ns=lambda: int(clock.now * 1e9),
        start_thread=lambda name, target: threads.append(name),
    )
    return Fixture(context, clock, environ, made, threads)


@pytest.fixture
def fake_modules(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], types.ModuleType]:
    def register(name: str) -> types.ModuleType:
        module = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, module)
        return module

    return register


def fake_engine_core(register: Callable[[str], types.ModuleType]) -> type[Any]:
    class EngineCoreProc:
        def __init__(self) -> None:
            self.input_queue: queue.Queue[str] = queue.Queue()
            self.handled: list[str] = []

        def _process_input_queue(self) -> None:
            self.handled.append(self.input_queue.get())

    register("vllm.v1.engine.core").EngineCoreProc = EngineCoreProc  # type: ignore[attr-defined]
    return EngineCoreProc


def test_engine_loop_beats_at_most_once_per_interval(
    fx: Fixture, fake_modules: Callable[[str], types.ModuleType]
) -> None:
    engine_class = fake_engine_core(fake_modules)
    assert hooks.install_engine_core_loop(fx.context)
    engine = engine_class()
    for index in range(5):
        engine.input_queue.put(f"req-{index}")
        engine._process_input_queue()
    telemetry = fx.made[ProcessIdentity("engine", 0, 0)]
    assert engine.handled == [f"req-{index}" for index in range(5)]
    assert telemetry.heartbeats == 1
    fx.clock.now += telemetry.heartbeat_interval
    engine.input_queue.put("later")
    engine._process_input_queue()
    assert telemetry.heartbeats == 2


def test_engine_loop_beats_while_idle_and_still_gets_its_work(
    fx: Fixture, fake_modules: Callable[[str], types.ModuleType]
) -> None:
    engine_class = fake_engine_core(fake_modules)
    hooks.install_engine_core_loop(fx.context)
    engine = engine_class()
    telemetry = cast(FakeTelemetry, fx.context.telemetry())
    loop_thread = threading.Thread(target=engine._process_input_queue)

    def advance_and_count() -> bool:
        fx.clock.now += 1.0
        return telemetry.heartbeats >= 4

    loop_thread.start()
    try:
        wait_until(advance_and_count, 4.0, "four heartbeats", 0.02)
    finally:
        engine.input_queue.put("work")
        loop_thread.join(5)
    assert engine.handled == ["work"]


def test_hooks_wrap_once_and_skip_what_is_missing(
    fx: Fixture, fake_modules: Callable[[str], types.ModuleType]
) -> None:
    engine_class = fake_engine_core(fake_modules)
    assert hooks.install_engine_core_loop(fx.context)
    wrapped = engine_class._process_input_queue
    assert hooks.install_engine_core_loop(fx.context)
    assert engine_class._process_input_queue is wrapped
    fake_modules("vllm_omni.engine.orchestrator")
    assert not hooks.install_omni030_orchestrator(fx.context)


def stage_client(name: str | None, inputs: list[int], final_output: bool = False) -> Any:
    """What vLLM-Omni 0.30's StageEngineCoreClient says of its stage."""
    return types.SimpleNamespace(
        model_stage=name, engine_input_source=inputs, final_output=final_output
    )


def stage_pool(replicas: int, client: Any) -> Any:
    """A StagePool: its replica slots (evicted ones included) and its first live client."""
    return types.SimpleNamespace(num_replicas=replicas, stage_client=client)


def fake_orchestrator(register: Callable[[str], types.ModuleType]) -> type[Any]:
    module = register("vllm_omni.engine.orchestrator")

    @dataclass
    class OrchestratorRequestState:
        request_id: str
        stage_submit_ts: dict[int, float] = field(default_factory=dict)

    class OrchestratorBase:
        def __init__(self) -> None:
            self.request_states: dict[str, OrchestratorRequestState] = {}
            self.routed: list[Any] = []
            self.stage_pools = [stage_pool(replicas=1, client=stage_client("thinker", []))]

        async def run(self) -> None:
            await asyncio.sleep(0)

        async def _handle_processed_outputs(
            self, stage_id: int, replica_id: int, outputs: list[Any]
        ) -> None:
            for output in outputs:
                self.routed.append(output)
                if output.error is not None:
                    await self._cleanup_request_ids([output.request_id], abort=True)
                elif output.finished:
                    await self._cleanup_request_ids([output.request_id])

        async def _cleanup_request_ids(
            self, request_ids: list[str], *, abort: bool = False, release_owners: bool = False
        ) -> list[Any]:
            for request_id in request_ids:
                self.request_states.pop(request_id, None)
            return []

    class Orchestrator(OrchestratorBase):
        async def _handle_add_request(self, msg: Any) -> None:
            state = OrchestratorRequestState(msg.request_id)
            state.stage_submit_ts[0] = 10.0
            self.request_states[msg.request_id] = state

    module.OrchestratorBase = OrchestratorBase  # type: ignore[attr-defined]
    module.Orchestrator = Orchestrator  # type: ignore[attr-defined]
    return Orchestrator


@dataclass
class Output:
    request_id: str
    finished: bool
    error: str | None = None


def test_omni030_orchestrator_spans(
    fx: Fixture, fake_modules: Callable[[str], types.ModuleType]
) -> None:
    orchestrator_class = fake_orchestrator(fake_modules)
    assert hooks.install_omni030_orchestrator(fx.context)
    orchestrator = orchestrator_class()
    fx.clock.now = 12.5

    async def scenario() -> None:
        await orchestrator.run()
        for request_id in ("ok", "bad", "gone", "quiet"):
            msg = types.SimpleNamespace(request_id=request_id, final_stage_id=2)
            await orchestrator._handle_add_request(msg)
        await orchestrator._handle_processed_outputs(0, 1, [Output("ok", finished=False)])
        await orchestrator._handle_processed_outputs(
            0, 1, [Output("ok", finished=True), Output("bad", False, "boom")]
        )
        # The client of "gone" went away: vLLM-Omni aborts it on every stage.
        await orchestrator._cleanup_request_ids(["gone"], abort=True)
        # The last stage of "quiet" ended without a processed output (a raw terminal):
        # vLLM-Omni finishes it with no stage output the plugin could report.
        await orchestrator._cleanup_request_ids(["quiet"])

    asyncio.run(scenario())
    telemetry = fx.made[ProcessIdentity("orchestrator")]
    assert telemetry.admitted == [
        ("ok", [0, 1, 2]),
        ("bad", [0, 1, 2]),
        ("gone", [0, 1, 2]),
        ("quiet", [0, 1, 2]),
    ]
    start, end = 10 * 10**9, int(12.5 * 1e9)
    assert telemetry.stage_requests == [
        {"id": "ok", "start": start, "end": end, "error": None, "stage_id": 0, "replica": 1},
        {"id": "bad", "start": start, "end": end, "error": "boom", "stage_id": 0, "replica": 1},
    ]
    # A failed or aborted request is abandoned; one done, with its last stage's output or
    # without, is finished: either way no stage owes a span for it any more.
    assert telemetry.abandoned == ["bad", "gone"]
    assert telemetry.finished == ["ok", "quiet"]
    assert orchestrator.request_states == {}
    assert len(telemetry.loops) == 1
    assert len(orchestrator.routed) == 3
    assert telemetry.topologies == [(Stage(0, "thinker", replicas=1),)]


def test_pipeline_stages_read_the_stage_pools_and_remember_evicted_stages() -> None:
    talker = stage_client("talker", [0])
    orchestrator = types.SimpleNamespace(
        stage_pools=[
            stage_pool(1, stage_client("thinker", [], final_output=True)),
            stage_pool(2, talker),
            stage_pool(0, None),  # served from another host, none joined yet
            stage_pool(1, stage_client(None, [1], final_output=True)),
        ]
    )
    known: dict[int, Stage] = {}
    assert pipeline_stages(orchestrator, known) == (
        Stage(0, "thinker", replicas=1, final_output=True),
        Stage(1, "talker", replicas=2, upstream=(0,)),
        Stage(2, "stage2", replicas=1),
        Stage(3, "stage3", replicas=1, upstream=(1,), final_output=True),
    )
    # Every talker replica evicted: the pool keeps its slots, and the report its name.
    orchestrator.stage_pools[1] = stage_pool(2, None)
    assert pipeline_stages(orchestrator, known)[1] == Stage(1, "talker", replicas=2, upstream=(0,))


def test_a_broken_orchestrator_still_runs(
    fx: Fixture, fake_modules: Callable[[str], types.ModuleType]
) -> None:
    orchestrator_class = fake_orchestrator(fake_modules)
    assert hooks.install_omni030_orchestrator(fx.context)
    orchestrator = orchestrator_class()
    orchestrator.stage_pools = None  # not what 0.30 has: reading it raises

    asyncio.run(orchestrator.run())
    assert fx.made[ProcessIdentity("orchestrator")].topologies == []


def fake_omni011_stage(register: Callable[[str], types.ModuleType]) -> types.ModuleType:
    module = register("vllm_omni.entrypoints.omni_stage")

    async def _stage_worker_async(
        omni_stage: Any, model: str, stage_payload: dict[str, Any], batch_timeout: int = 10
    ) -> None:
        stage_id = stage_payload["stage_id"]
        in_q, out_q = omni_stage._in_q, omni_stage._out_q
        while True:
            task = in_q.get()
            if task is None:
                break
            rid = task["request_id"]
            if rid == "bad":
                out_q.put({"request_id": rid, "stage_id": stage_id, "error": "engine dead"})
            else:
                out_q.put({"request_id": rid, "stage_id": stage_id, "engine_outputs": [rid]})

    def _stage_worker_async_entry(omni_stage: Any, model: str, payload: Any) -> None:
        asyncio.run(module._stage_worker_async(omni_stage, model, payload))

    module._stage_worker_async = _stage_worker_async  # type: ignore[attr-defined]
    module._stage_worker_async_entry = _stage_worker_async_entry  # type: ignore[attr-defined]
    return module


def omni_stage_with(*tasks: Any) -> Any:
    stage = types.SimpleNamespace(_in_q=queue.Queue(), _out_q=queue.Queue())
    for task in tasks:
        stage._in_q.put(task)
    return stage


def test_omni011_stage_worker_wrapped_before_it_runs(
    fx: Fixture, fake_modules: Callable[[str], types.ModuleType]
) -> None:
    module = fake_omni011_stage(fake_modules)
    assert hooks.install_omni011_stage_worker(fx.context, process=None)
    stage = omni_stage_with({"request_id": "ok"}, {"request_id": "bad"}, None)
    module._stage_worker_async_entry(stage, "model", {"stage_id": 1})
    telemetry = fx.made[ProcessIdentity("stage", 1, 0)]
    assert [(r["id"], r["error"]) for r in telemetry.stage_requests] == [
        ("ok", None),
        ("bad", "engine dead"),
    ]
    assert stage._out_q.qsize() == 2
    assert len(telemetry.loops) == 1
    assert fx.environ[hooks.STAGE_ID_ENV] == "1"


def test_omni011_stage_worker_already_running_is_instrumented(
    fx: Fixture, fake_modules: Callable[[str], types.ModuleType]
) -> None:
    module = fake_omni011_stage(fake_modules)
    stage = omni_stage_with({"request_id": "ok"}, None)
    process = types.SimpleNamespace(
        _target=module._stage_worker_async_entry, _args=(stage, "model", {"stage_id": 2})
    )
    original = module._stage_worker_async
    hooks.install_omni011_stage_worker(fx.context, process)
    asyncio.run(original(stage, "model", {"stage_id": 2}))
    telemetry = fx.made[ProcessIdentity("stage", 2, 0)]
    assert [r["id"] for r in telemetry.stage_requests] == ["ok"]


@pytest.mark.parametrize(
    ("admits", "admitted", "abandoned"),
    [
        (True, [("r1", [0, 1, 2]), ("r2", [0, 1, 2])], ["r2"]),
        # vLLM-Omni 0.30: the orchestrator admits each request under its own id; here
        # only the API loop's heartbeat starts.
        (False, [], []),
    ],
)
def test_omni011_api_admits_each_request_and_abandons_the_unfinished(
    fx: Fixture,
    fake_modules: Callable[[str], types.ModuleType],
    admits: bool,
    admitted: list[tuple[str, list[int]]],
    abandoned: list[str],
) -> None:
    module = fake_modules("vllm_omni.entrypoints.async_omni")

    class AsyncOmni:
        stage_list = ["thinker", "talker", "code2wav"]

        async def generate(self, prompt: str, request_id: str) -> Any:
            for stage in self.stage_list:
                yield f"{request_id}:{stage}"

    module.AsyncOmni = AsyncOmni  # type: ignore[attr-defined]
    assert hooks.install_omni011_api(fx.context, admits=admits)

    async def collect() -> list[str]:
        return [output async for output in AsyncOmni().generate("hi", "r1")]

    async def go_away_after_the_first_stage() -> None:
        outputs = AsyncOmni().generate("hi", request_id="r2")
        assert await anext(outputs) == "r2:thinker"
        await outputs.aclose()

    assert asyncio.run(collect()) == ["r1:thinker", "r1:talker", "r1:code2wav"]
    asyncio.run(go_away_after_the_first_stage())
    telemetry = fx.made[ProcessIdentity("api")]
    assert telemetry.admitted == admitted
    assert telemetry.abandoned == abandoned
    # Each of the two event loops the requests ran on got its heartbeat.
    assert len(telemetry.loops) == 2


def test_build_app_gets_the_route(
    fake_modules: Callable[[str], types.ModuleType],
) -> None:
    module = fake_modules("vllm.entrypoints.openai.api_server")
    module.build_app = lambda args: {"args": args}  # type: ignore[attr-defined]
    added: list[Any] = []
    assert hooks.install_build_app_route(added.append)
    assert module.build_app("argv") == {"args": "argv"}
    assert added == [{"args": "argv"}]


@pytest.mark.parametrize(
    ("title", "environ", "expected"),
    [
        ("VLLM::StageEngineCoreProc_stage2_replica1_DP0", {}, ProcessIdentity("stage", 2, 1)),
        ("VLLM::StageEngineCoreProc_stage0", {"VLLM_OMNI_REPLICA_ID": "3"}, ("stage", 0, 3)),
        ("VLLM::EngineCore", {}, ProcessIdentity("engine", 0, 0)),
        ("VLLM::EngineCore", {hooks.STAGE_ID_ENV: "1"}, ProcessIdentity("engine", 1, 0)),
        ("VLLM::Worker", {}, ProcessIdentity("worker", 0, 0)),
        ("python -m vllm.entrypoints.openai.api_server", {}, ProcessIdentity("api")),
    ],
)
def test_identify_process(title: str, environ: dict[str, str], expected: Any) -> None:
    identity = plugin.identify_process(title, None, environ)
    assert identity == (ProcessIdentity(*expected) if isinstance(expected, tuple) else expected)


def test_identify_omni011_stage_worker_from_its_process_target() -> None:
    def _stage_worker_async_entry() -> None: ...

    process = types.SimpleNamespace(
        _target=_stage_worker_async_entry, _args=(None, "model", {"stage_id": 1})
    )
    assert plugin.identify_process("python", process, {}) == ProcessIdentity("stage", 1, 0)


def test_register_general_never_raises_and_is_idempotent(
    fake_modules: Callable[[str], types.ModuleType],
) -> None:
    engine_class = fake_engine_core(fake_modules)
    made: list[Any] = []
    stage_plugin = plugin.Plugin(
        environ={},
        process_title=lambda: "VLLM::StageEngineCoreProc_stage1_replica0_DP0",
        current_process=lambda: None,
        make_telemetry=cast(MakeTelemetry, lambda **kwargs: made.append(kwargs)),
        at_exit=lambda function: None,
    )
    assert stage_plugin.register_general() == ["engine_core_loop"]
    wrapped = engine_class._process_input_queue
    assert stage_plugin.register_general() == ["engine_core_loop"]
    assert engine_class._process_input_queue is wrapped
    plugin.register_general()
    plugin.register_general()


def test_register_general_in_a_worker_installs_nothing() -> None:
    def refuse(**kwargs: Any) -> Any:
        raise AssertionError("a worker makes no telemetry")

    worker_plugin = plugin.Plugin(
        environ={},
        process_title=lambda: "VLLM::Worker",
        current_process=lambda: None,
        make_telemetry=refuse,
    )
    assert worker_plugin.register_general() == []


def test_endpoint_plugin_adds_the_admin_route_once() -> None:
    fastapi = pytest.importorskip("fastapi", reason="FastAPI is not installed")
    endpoint = plugin.register_endpoints()
    assert endpoint.name == "omni_watchdog"
    assert endpoint.required_tasks is None
    app = fastapi.FastAPI()
    endpoint.attach_router(app)
    endpoint.attach_router(app)
    assert [route.path for route in app.routes].count("/admin/shutdown") == 1


def test_omni030_build_openai_app_gets_the_route(
    fake_modules: Callable[[str], types.ModuleType],
) -> None:
    # vLLM-Omni 0.30 imports vLLM's build_app under another name and never calls an
    # endpoint plugin's init_state: the route comes from the general plugin.
    module = fake_modules("vllm_omni.entrypoints.openai.api_server")
    module.build_openai_app = lambda args, tasks: {"args": args}  # type: ignore[attr-defined]
    added: list[Any] = []
    assert hooks.install_build_app_route(added.append)
    assert module.build_openai_app("argv", ("generate",)) == {"args": "argv"}
    assert added == [{"args": "argv"}]


@pytest.mark.parametrize(
    ("has_endpoint_plugins", "environ", "route_hooked"),
    [
        (False, {}, True),
        (True, {}, False),
        (True, {"OMNI_WATCHDOG_ADMIN_TOKEN": "secret"}, True),
        (True, {"OMNI_WATCHDOG_ADMIN_TOKEN": "  "}, False),
    ],
)
def test_api_server_gets_the_route_where_asked_for(
    fake_modules: Callable[[str], types.ModuleType],
    monkeypatch: pytest.MonkeyPatch,
    has_endpoint_plugins: bool,
    environ: dict[str, str],
    route_hooked: bool,
) -> None:
    module = fake_modules("vllm_omni.entrypoints.openai.api_server")
    module.build_openai_app = lambda args, tasks: {"args": args}  # type: ignore[attr-defined]
    monkeypatch.setattr(plugin, "_has_endpoint_plugins", lambda: has_endpoint_plugins)
    monkeypatch.setattr(plugin, "_importable", lambda name: False)
    api_plugin = plugin.Plugin(
        environ=environ,
        process_title=lambda: "vllm serve",
        current_process=lambda: None,
        make_telemetry=cast(MakeTelemetry, lambda **kwargs: None),
        at_exit=lambda function: None,
    )
    assert ("build_app_route" in api_plugin.register_general()) is route_hooked


class FakeDiT:
    """A module that runs forward pre-hooks as `torch.nn.Module` does; after each call
    `after_step` runs (the test's look from the telling thread)."""

    def __init__(self, clock: FakeClock, step_seconds: float) -> None:
        self._clock = clock
        self._step_seconds = step_seconds
        self._before: list[Callable[..., None]] = []
        self.after_step: Callable[[], None] = lambda: None

    def register_forward_pre_hook(self, hook: Callable[..., None]) -> None:
        self._before.append(hook)

    def __call__(self) -> None:
        for hook in self._before:
            hook(self, ())
        self._clock.now += self._step_seconds
        self.after_step()


def fake_runner(
    register: Callable[[str], types.ModuleType], clock: FakeClock, step_seconds: float
) -> type[Any]:
    class Pipeline:
        def __init__(self) -> None:
            self.transformer = FakeDiT(clock, step_seconds)
            self.fail = False

        def forward(self, requests: list[Any]) -> None:
            clock.now += 0.5  # encode the prompt
            for _ in range(requests[0].sampling_params.num_inference_steps):
                self.transformer()
                if self.fail:
                    raise RuntimeError("fault injected into a denoising step")
            clock.now += 0.25  # decode the latents

    class DiffusionModelRunner:
        def __init__(self) -> None:
            self.od_config = types.SimpleNamespace(stage_id=1)
            self.pipeline = Pipeline()

        def _execute_request_list(self, reqs: list[Any], *, od_config: Any) -> str:
            self.pipeline.forward(reqs)
            return "outputs"

    module = register("vllm_omni.diffusion.worker.diffusion_model_runner")
    module.DiffusionModelRunner = DiffusionModelRunner  # type: ignore[attr-defined]
    return DiffusionModelRunner


def image_request(request_id: str, steps: int) -> Any:
    return types.SimpleNamespace(
        request_id=request_id, sampling_params=types.SimpleNamespace(num_inference_steps=steps)
    )


def looking_every(fx: Fixture, runner: Any, interval: float) -> None:
    """After each DiT call, the telling thread's look once `interval` has passed."""
    due = [fx.clock.now + interval]

    def after_step() -> None:
        if fx.clock.now >= due[0]:
            due[0] = fx.clock.now + interval
            getattr(runner, diffusion.DENOISING_ATTRIBUTE).look()

    runner.pipeline.transformer.after_step = after_step


def test_a_denoising_step_is_told_at_a_look_only_when_one_began_since(fx: Fixture) -> None:
    telemetry = FakeTelemetry(ProcessIdentity("stage", 1, 0))
    progress = diffusion.DenoisingProgress(cast(StageTelemetry, telemetry), fx.context)
    progress.begin([("img-1", 4)])
    progress.look()
    assert telemetry.steps == []  # no step yet
    fx.clock.now = 0.5
    progress.count_step()
    fx.clock.now = 1.0
    progress.look()
    fx.clock.now = 2.0
    progress.look()  # the step goes on: nothing new to tell
    fx.clock.now = 3.5
    progress.count_step()
    fx.clock.now = 4.0
    progress.look()
    assert telemetry.steps == [("img-1", 1, 4, None), ("img-1", 2, 4, 3.0)]
    fx.clock.now = 4.5
    progress.count_step()
    progress.end(None)
    progress.look()  # after its request span, never a step of it
    assert len(telemetry.steps) == 2
    (request,) = telemetry.diffusion_requests
    assert request["steps"] == (3, 4)
    # The telling thread, asked for once in this process.
    progress.begin([("img-2", 4)])
    assert fx.threads == ["omni-watchdog-denoising"]


def test_denoising_steps_are_counted_by_the_dit_pre_hook_and_told_at_most_once_a_look(
    fx: Fixture, fake_modules: Callable[[str], types.ModuleType]
) -> None:
    runner_class = fake_runner(fake_modules, fx.clock, step_seconds=0.01)
    assert diffusion.install_diffusion_runner(fx.context)
    runner = runner_class()
    assert runner._execute_request_list([image_request("img-0", 2)], od_config=None) == "outputs"
    looking_every(fx, runner, 0.03)
    assert runner._execute_request_list([image_request("img-1", 10)], od_config=None) == "outputs"
    telemetry = fx.made[ProcessIdentity("stage", 1, 0)]
    # 10 steps of 10 ms, a look every 30 ms: the first look after the first step (the
    # prompt's encoding outlasted the interval), then one every third step.
    assert [step for _, step, _, _ in telemetry.steps] == [1, 4, 7, 10]
    assert all(steps == 10 for _, _, steps, _ in telemetry.steps)
    assert telemetry.steps[0][3] is None
    assert telemetry.steps[1][3] == pytest.approx(0.01)
    first, second = telemetry.diffusion_requests
    assert first["steps"] == (2, 2) and second["steps"] == (10, 10)
    assert second["error"] is None
    # The last step's end estimated by the step before it.
    assert second["phases"] == pytest.approx((500.0, 100.0, 250.0))
    assert fx.threads == ["omni-watchdog-denoising"]


def test_a_denoising_step_that_raises_is_told_and_the_error_goes_on(
    fx: Fixture, fake_modules: Callable[[str], types.ModuleType]
) -> None:
    runner_class = fake_runner(fake_modules, fx.clock, step_seconds=1.0)
    diffusion.install_diffusion_runner(fx.context)
    runner = runner_class()
    runner.pipeline.fail = True
    with pytest.raises(RuntimeError, match="fault injected"):
        runner._execute_request_list([image_request("img-2", 4)], od_config=None)
    telemetry = fx.made[ProcessIdentity("stage", 1, 0)]
    (request,) = telemetry.diffusion_requests
    assert request["steps"] == (1, 4)
    assert isinstance(request["error"], RuntimeError)


def test_a_pipeline_calling_its_dit_more_often_than_its_steps_tells_an_unknown_count(
    fx: Fixture, fake_modules: Callable[[str], types.ModuleType]
) -> None:
    runner_class = fake_runner(fake_modules, fx.clock, step_seconds=1.0)
    diffusion.install_diffusion_runner(fx.context)
    runner = runner_class()
    runner._execute_request_list([image_request("img-0", 1)], od_config=None)
    looking_every(fx, runner, 1.0)
    original = runner.pipeline.forward

    def with_guidance(requests: list[Any]) -> None:
        # Classifier-free guidance run as two DiT calls a step.
        original(requests)
        runner.pipeline.transformer()

    runner.pipeline.forward = with_guidance
    runner._execute_request_list([image_request("img-3", 2)], od_config=None)
    telemetry = fx.made[ProcessIdentity("stage", 1, 0)]
    assert [(step, steps) for _, step, steps, _ in telemetry.steps] == [(1, 2), (2, 2), (3, 0)]


def test_the_telling_thread_tells_a_step_of_a_real_denoising_loop() -> None:
    """The thread the plugin starts looks by itself, once a heartbeat interval."""
    telemetry = FakeTelemetry(ProcessIdentity("stage", 0, 0), interval=0.01)
    context = HookContext(
        lambda identity: cast(StageTelemetry, telemetry), lambda: ProcessIdentity("stage", 0, 0)
    )
    progress = diffusion.DenoisingProgress(cast(StageTelemetry, telemetry), context)
    progress.begin([("img-1", 50)])
    progress.count_step()
    wait_until(lambda: telemetry.steps, 10.0, "a step told", 0.01)
    progress.end(None)
    assert telemetry.steps[:1] == [("img-1", 1, 50, None)]


def test_the_diffusion_engine_loop_beats_from_its_own_thread_only(
    fx: Fixture, fake_modules: Callable[[str], types.ModuleType]
) -> None:
    class DiffusionEngine:
        def __init__(self) -> None:
            self.od_config = types.SimpleNamespace(stage_id=0)
            self._cv = threading.Condition()
            self.stop = threading.Event()

        def _process_aborts_queue(self) -> None:
            pass

        def _busy_loop(self) -> None:
            while not self.stop.is_set():
                self._process_aborts_queue()
                with self._cv:
                    self._cv.wait(0.001)

    module = fake_modules("vllm_omni.diffusion.diffusion_engine")
    module.DiffusionEngine = DiffusionEngine  # type: ignore[attr-defined]
    assert diffusion.install_diffusion_engine_loop(fx.context)
    engine = DiffusionEngine()
    # The start-up warm-up drains the queues on the caller's thread, before the loop runs.
    engine._process_aborts_queue()
    telemetry = fx.made[ProcessIdentity("stage", 0, 0)]
    assert telemetry.heartbeats == 1
    loop = threading.Thread(target=engine._busy_loop)
    loop.start()
    try:
        for _ in range(3):
            beats = telemetry.heartbeats
            fx.clock.now += 1.0

            def beat(beats: int = beats) -> bool:
                return telemetry.heartbeats != beats

            wait_until(beat, 2.0, "a heartbeat", 0.01)
            assert telemetry.heartbeats == beats + 1
        # Once the loop runs, another thread's pass or wait beats nothing.
        fx.clock.now += 1.0
        engine.stop.set()
        loop.join(5)
        beats = telemetry.heartbeats
        fx.clock.now += 1.0
        engine._process_aborts_queue()
        with engine._cv:
            engine._cv.wait(0.001)
        assert telemetry.heartbeats == beats
    finally:
        engine.stop.set()
        loop.join(5)


@pytest.mark.parametrize(
    ("title", "target", "arguments", "keywords", "identity"),
    [
        # A multi-stage pipeline's diffusion subprocess, before its title is set.
        (
            "python",
            "run_diffusion_proc",
            (),
            {"omni_stage_id": 1, "omni_replica_id": 2},
            ProcessIdentity("stage", 1, 2),
        ),
        # The mp executor's worker, titled before the plugin loads.
        (
            "vLLM-Omni::DiffusionWorker",
            "worker_main",
            (0, types.SimpleNamespace(stage_id=1)),
            {},
            ProcessIdentity("worker", 1, 0),
        ),
        # A one-stage pipeline's API server, once its inline engine renamed it.
        ("vLLM-Omni::DiffusionWorker", "", (), {}, ProcessIdentity("api")),
        # An autoregressive stage's worker stays what it was.
        ("VLLM::Worker", "", (), {}, ProcessIdentity("worker", 0, 0)),
    ],
    ids=["diffusion proc", "mp worker", "inline api", "ar worker"],
)
def test_diffusion_processes_are_identified(
    title: str,
    target: str,
    arguments: tuple[Any, ...],
    keywords: dict[str, Any],
    identity: ProcessIdentity,
) -> None:
    def entry() -> None:
        pass

    entry.__name__ = target or "run"
    process = types.SimpleNamespace(_target=entry, _args=arguments, _kwargs=keywords)
    assert plugin.identify_process(title, process, {}) == identity
