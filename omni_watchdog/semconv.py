"""Every span name and attribute key the watchdog sends or reads, defined once.

The instrument plugin emits these names inside the served process, the OTLP receiver
parses them in the watchdog, the incident exporter sends its own, and the tests check
all of them: one definition shared by all keeps the two ends of the wire in step, which
string literals on either side would not. The plugin loads this module inside vLLM's
processes, so it imports nothing but `typing`.
"""

from typing import Final

# --- Ours: the instrument plugin's spans ------------------------------------------------

# A served loop is alive: a root span per beat, about once a second.
HEARTBEAT_SPAN: Final = "omni.stage.loop"
# A stage's work on one request, marked as an error when it failed.
STAGE_REQUEST_SPAN: Final = "omni.stage.request"
# A request entered the pipeline, with the stages it will visit.
REQUEST_ADMITTED_SPAN: Final = "omni.request.admitted"
# The pipeline stopped working on a request before its last stage.
REQUEST_ABANDONED_SPAN: Final = "omni.request.abandoned"
# The pipeline is done with a request, whether or not its last stage sent a span.
REQUEST_FINISHED_SPAN: Final = "omni.request.finished"
# The stage graph the served pipeline runs (see pipeline_report).
TOPOLOGY_SPAN: Final = "omni.pipeline.topology"
# How often the plugin sends it: a watchdog that starts (or restarts) after the server
# learns the pipeline within this time, and a replica the server adds shows within it.
TOPOLOGY_REPORT_INTERVAL_SECONDS: Final = 10.0
# A diffusion stage started a denoising step of a request: its loop is alive and working.
# Sent for the first and last step and at most once a heartbeat interval between them.
DENOISE_STEP_SPAN: Final = "omni.diffusion.step"
# A diffusion stage's work on a batch of requests, with its phases; an error when it raised.
DIFFUSION_REQUEST_SPAN: Final = "omni.diffusion.request"

# --- Ours: span attributes (the stage ones also sit on a stage process's resource) ------

STAGE_ID: Final = "omni.stage.id"
STAGE_REPLICA: Final = "omni.stage.replica"
REQUEST_ID: Final = "omni.request.id"
# The stage ids an admitted request will visit, in order.
REQUEST_STAGE_PATH: Final = "omni.request.stage_path"
# A denoising step: its 1-based index, the request's step count, and how long the step
# before it took (absent on the first).
DENOISE_STEP_INDEX: Final = "omni.diffusion.step.index"
DENOISE_STEP_COUNT: Final = "omni.diffusion.step.count"
DENOISE_STEP_SECONDS: Final = "omni.diffusion.step.previous_seconds"
# A diffusion request's phases, in milliseconds: up to its first denoising step, the steps,
# and after its last.
DIFFUSION_PREPROCESS_MS: Final = "omni.diffusion.preprocess_ms"
DIFFUSION_DENOISE_MS: Final = "omni.diffusion.denoise_ms"
DIFFUSION_POSTPROCESS_MS: Final = "omni.diffusion.postprocess_ms"

# The topology span's attributes: parallel lists, one item per stage, in stage order.
PIPELINE_STAGE_IDS: Final = "omni.pipeline.stage_ids"
PIPELINE_STAGE_NAMES: Final = "omni.pipeline.stage_names"
PIPELINE_STAGE_REPLICAS: Final = "omni.pipeline.stage_replicas"
PIPELINE_STAGE_INPUTS: Final = "omni.pipeline.stage_inputs"
PIPELINE_STAGE_FINAL_OUTPUT: Final = "omni.pipeline.stage_final_output"
# What runs each stage: "llm" or "diffusion", as vLLM-Omni's stage clients say ("" unsaid).
PIPELINE_STAGE_TYPES: Final = "omni.pipeline.stage_types"

# --- Ours: resource attributes of the plugin's processes ---------------------------------

STAGE_NAME: Final = "omni.stage.name"
# api, stage, engine, worker or orchestrator.
PROCESS_KIND: Final = "omni.process.kind"
# With `process.pid`, these name the sending process for life on its host, so that the
# watchdog believes only the target's processes.
PROCESS_START_TICKS: Final = "omni.process.start_ticks"
HOST_BOOT_ID: Final = "omni.host.boot_id"
# OpenTelemetry's: the host a process runs on, so a remote stage's spans say where it is.
HOST_NAME: Final = "host.name"

# --- Ours: the watchdog's incident traces ------------------------------------------------

INCIDENT_SPAN: Final = "omni.incident"
INCIDENT_ID: Final = "omni.incident.id"
INCIDENT_TARGET: Final = "omni.incident.target"
INCIDENT_CAUSE: Final = "omni.incident.cause"
INCIDENT_MODE: Final = "omni.incident.mode"
INCIDENT_OUTCOME: Final = "omni.incident.outcome"
INCIDENT_STAGES: Final = "omni.incident.stages"
INCIDENT_EVIDENCE: Final = "omni.incident.evidence"
# A child span per ladder step, named this prefix and the step ("omni.ladder.kill").
LADDER_STEP_SPAN_PREFIX: Final = "omni.ladder."
LADDER_STEP: Final = "omni.ladder.step"
LADDER_OUTCOME: Final = "omni.ladder.outcome"
LADDER_DETAIL: Final = "omni.ladder.detail"
LADDER_TARGETS: Final = "omni.ladder.targets"

# --- OpenTelemetry semantic conventions --------------------------------------------------

# Resource attributes.
SERVICE_NAME: Final = "service.name"
PROCESS_PID: Final = "process.pid"
# The event that records an exception on a span, and its attributes.
EXCEPTION_EVENT: Final = "exception"
EXCEPTION_TYPE: Final = "exception.type"
EXCEPTION_MESSAGE: Final = "exception.message"
EXCEPTION_STACKTRACE: Final = "exception.stacktrace"
EXCEPTION_ESCAPED: Final = "exception.escaped"

# --- vLLM's own tracing ------------------------------------------------------------------

# vLLM's span per finished request, sent when it runs with `--otlp-traces-endpoint`.
VLLM_REQUEST_SPAN: Final = "llm_request"
# Resource attributes vLLM sets on its processes' spans.
VLLM_PROCESS_ID: Final = "vllm.process_id"
VLLM_PROCESS_KIND: Final = "vllm.process_kind"
# Attributes of `llm_request`, as vLLM names them (its `SpanAttributes`): the usage keys
# follow an early draft of the OpenTelemetry GenAI conventions, the request id and the
# latencies are vLLM's own.
GEN_AI_REQUEST_ID: Final = "gen_ai.request.id"
GEN_AI_USAGE_PROMPT_TOKENS: Final = "gen_ai.usage.prompt_tokens"
GEN_AI_USAGE_COMPLETION_TOKENS: Final = "gen_ai.usage.completion_tokens"
GEN_AI_LATENCY_E2E: Final = "gen_ai.latency.e2e"
GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: Final = "gen_ai.latency.time_to_first_token"
GEN_AI_LATENCY_TIME_IN_QUEUE: Final = "gen_ai.latency.time_in_queue"

# --- vLLM-Omni's own tracing (open PR #4670, unreleased: kept here in one place) ---------

# With `--otlp-traces-endpoint`, vLLM-Omni's API server process sends one trace per request
# through vLLM's tracer. `omni_request` (SERVER) runs from the request's submission to its
# last stage's finished output and carries `gen_ai.request.id`; it is sent only then, never
# for an aborted or failed request. Its children (INTERNAL) name their stage by the
# attributes below and carry no request id: `llm_processing`, one per LLM stage (from the
# first input the stage got, for its scheduled-to-last-token time), and `diffusion_request`,
# one per diffusion stage. vLLM's own `llm_request` comes beside each `llm_processing`,
# naming no stage. None of them sets an error status.
VLLM_OMNI_REQUEST_SPAN: Final = "omni_request"
VLLM_OMNI_LLM_STAGE_SPAN: Final = "llm_processing"
VLLM_OMNI_DIFFUSION_STAGE_SPAN: Final = "diffusion_request"
# Span attributes (its `OmniSpanAttributes`): stage id and replica as ints (an LLM stage's
# replica is always 0 there), the stage name as text ("diffusion" on `diffusion_request`).
VLLM_OMNI_STAGE_ID: Final = "vllm_omni.stage.id"
VLLM_OMNI_STAGE_NAME: Final = "vllm_omni.stage.name"
VLLM_OMNI_STAGE_REPLICA: Final = "vllm_omni.stage.replica_id"
# On `omni_request`: the orchestrator's timings (queue wait, preprocess, AR to diffusion)
# in milliseconds, as a JSON text.
VLLM_OMNI_PIPELINE_TIMINGS: Final = "vllm_omni.pipeline.timings"
# On `diffusion_request`: its phases and their total, in milliseconds (doubles).
VLLM_OMNI_DIFFUSION_PREPROCESS_MS: Final = "vllm_omni.diffusion.preprocess_ms"
VLLM_OMNI_DIFFUSION_EXEC_MS: Final = "vllm_omni.diffusion.exec_ms"
VLLM_OMNI_DIFFUSION_POSTPROCESS_MS: Final = "vllm_omni.diffusion.postprocess_ms"
VLLM_OMNI_DIFFUSION_TOTAL_MS: Final = "vllm_omni.diffusion.total_ms"
# The resource attribute vLLM's tracer sets to the name it was started with, the name
# vLLM-Omni starts it with, and the service name it gives; the resource names no stage,
# and its only process identity is `vllm.process_id` (no start time).
VLLM_INSTRUMENTING_MODULE: Final = "vllm.instrumenting_module_name"
VLLM_OMNI_INSTRUMENTING_MODULE: Final = "vllm_omni"
VLLM_OMNI_SERVICE_NAME: Final = "vllm-omni"
