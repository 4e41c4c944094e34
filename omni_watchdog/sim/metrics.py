"""The simulated server's `/metrics`: real vLLM and vLLM-Omni family names, HELP and labels.

Names, HELP texts and label sets are those of the captured pages in the shared
`fixtures/real-vllm/` folder and of vLLM-Omni 0.30's metric definitions; per-stage `vllm:`
series carry `stage` and `replica` the way vLLM-Omni relabels its engines. Every series
exists from start.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from omni_watchdog.sim.pipelines import ExecutionType
from omni_watchdog.types import Topology

ENGINE = "0"
STAGE_LABELS = ("model_name", "engine", "stage", "replica")
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
FAILURE_REASONS = ("client_abort", "client_disconnect", "stage_error", "unknown")
# vLLM-Omni's stage types: autoregressive stages are "llm", the waveform stage "diffusion".
STAGE_TYPES = {"code2wav": "diffusion"}


class SimMetrics:
    """Counters and gauges of the API process, updated from the stages' progress reports."""

    def __init__(
        self,
        topology: Topology,
        model_name: str,
        gauges_follow_batches: bool = False,
        execution_types: Mapping[int, ExecutionType] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        self._model = model_name
        # vLLM-Omni 0.30 sets a stage's running gauge from each output batch's scheduler
        # counts and sends no batch once its last request is done: the gauge keeps the
        # count of that last batch, the finished request included.
        self._gauges_follow_batches = gauges_follow_batches
        self._running: dict[tuple[int, int], int] = {}
        self._stage_types = {s.stage_id: STAGE_TYPES.get(s.name, "llm") for s in topology.stages}
        # A DIFFUSION stage runs no vLLM engine, so it has none of the engines' `vllm:`
        # series: its requests show in the `vllm_omni:` families only.
        self._diffusion = {
            stage_id
            for stage_id, kind in (execution_types or {}).items()
            if kind is ExecutionType.DIFFUSION
        }
        for stage_id in self._diffusion:
            self._stage_types[stage_id] = "diffusion"
        registry = self.registry
        self.running = Gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            STAGE_LABELS,
            registry=registry,
        )
        self.waiting = Gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            STAGE_LABELS,
            registry=registry,
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            STAGE_LABELS,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            STAGE_LABELS,
            registry=registry,
        )
        self.iteration_tokens = Histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            STAGE_LABELS,
            buckets=ITERATION_TOKEN_BUCKETS,
            registry=registry,
        )
        self.pipeline_running = Gauge(
            "vllm_omni:num_requests_running",
            "Number of requests currently running across all pipeline stages.",
            ("model_name",),
            registry=registry,
        )
        self.pipeline_waiting = Gauge(
            "vllm_omni:num_requests_waiting",
            "Number of requests waiting to be scheduled.",
            ("model_name",),
            registry=registry,
        )
        self.stage_gen_time = Histogram(
            "vllm_omni:stage_gen_time_s",
            "Per-stage generation time in seconds for diffusion / image stages.",
            ("model_name", "stage", "stage_type"),
            buckets=SECONDS_BUCKETS,
            registry=registry,
        )
        self.stage_waiting = Gauge(
            "vllm_omni:stage_waiting_requests",
            "Sum of the latest scheduler waiting snapshots across a stage's replicas; "
            "diffusion snapshots update when outputs arrive.",
            ("model_name", "stage"),
            registry=registry,
        )
        self.failed = Counter(
            "vllm_omni:requests_failed",
            "Total requests by failure reason. Pairs with requests_success_total (abort bucket) "
            "to give the full failure surface. Reasons are bounded to client_abort, "
            "client_disconnect, stage_error, and unknown.",
            ("model_name", "reason"),
            registry=registry,
        )
        self.pipeline_running.labels(model_name)
        self.pipeline_waiting.labels(model_name)
        for reason in FAILURE_REASONS:
            self.failed.labels(model_name, reason)
        for stage in topology.stages:
            self.stage_waiting.labels(model_name, str(stage.stage_id))
            self.stage_gen_time.labels(
                model_name, str(stage.stage_id), self._stage_types[stage.stage_id]
            )
            for ref in stage.refs():
                if ref.stage_id in self._diffusion:
                    continue
                labels = self._labels(ref.stage_id, ref.replica)
                for family in (
                    self.running,
                    self.waiting,
                    self.generation_tokens,
                    self.prompt_tokens,
                    self.iteration_tokens,
                ):
                    family.labels(*labels)

    def _labels(self, stage: int, replica: int) -> tuple[str, str, str, str]:
        return (self._model, ENGINE, str(stage), str(replica))

    def queued(self, stage: int, replica: int) -> None:
        """A request was handed to a stage replica."""
        if stage not in self._diffusion:
            self.waiting.labels(*self._labels(stage, replica)).inc()
        self.stage_waiting.labels(self._model, str(stage)).inc()
        self.pipeline_waiting.labels(self._model).inc()

    def started(self, stage: int, replica: int, prompt_tokens: int) -> None:
        """The stage replica began working on a request: like vLLM, prefill counts then."""
        if stage not in self._diffusion:
            self.prompt_tokens.labels(*self._labels(stage, replica)).inc(prompt_tokens)
            self.waiting.labels(*self._labels(stage, replica)).dec()
        self.stage_waiting.labels(self._model, str(stage)).dec()
        self.pipeline_waiting.labels(self._model).dec()
        self._count_running(stage, replica, +1, batch=True)
        self.pipeline_running.labels(self._model).inc()

    def token(self, stage: int, replica: int) -> None:
        """One engine step produced one token."""
        self.generation_tokens.labels(*self._labels(stage, replica)).inc()
        self.iteration_tokens.labels(*self._labels(stage, replica)).observe(1)
        self._count_running(stage, replica, 0, batch=True)

    def finished(self, stage: int, replica: int, seconds: float) -> None:
        """The stage replica finished (or failed) a request it was running."""
        self._count_running(stage, replica, -1, batch=False)
        self.pipeline_running.labels(self._model).dec()
        self.stage_gen_time.labels(self._model, str(stage), self._stage_types[stage]).observe(
            seconds
        )

    def abandoned(self, stage: int, replica: int, was_running: bool) -> None:
        """A request left a replica that died, without finishing."""
        if was_running:
            self._count_running(stage, replica, -1, batch=True)
            self.pipeline_running.labels(self._model).dec()
        else:
            if stage not in self._diffusion:
                self.waiting.labels(*self._labels(stage, replica)).dec()
            self.stage_waiting.labels(self._model, str(stage)).dec()
            self.pipeline_waiting.labels(self._model).dec()

    def _count_running(self, stage: int, replica: int, change: int, batch: bool) -> None:
        count = self._running.get((stage, replica), 0) + change
        self._running[(stage, replica)] = count
        if stage in self._diffusion:
            return
        if batch or not self._gauges_follow_batches:
            self.running.labels(*self._labels(stage, replica)).set(count)

    def request_failed(self, reason: str) -> None:
        self.failed.labels(self._model, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
