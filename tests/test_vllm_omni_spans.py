"""vLLM-Omni's own tracing spans (its open PR #4670) read beside the plugin's.

The bodies are those vLLM-Omni's API server process would export for one request through
three LLM stages, and through an LLM stage and a diffusion stage (see the fixtures'
README): `llm_processing` and `diffusion_request` count as a stage's work, `omni_request`
as the request's end, both only where the plugin does not already say as much.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from fakes import FakeSenders
from listening import listening
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Status
from otlp_bodies import batch, key_value

from omni_watchdog.clock import FakeClock
from omni_watchdog.config import SpansConfig
from omni_watchdog.probes.otlp_decode import JSON, PROTOBUF, decode_body
from omni_watchdog.probes.span_map import PLUGIN_PRESENCE_SECONDS
from omni_watchdog.probes.span_store import SpanStore
from omni_watchdog.probes.span_trust import UNKNOWN_STAGE_GRACE_SECONDS
from omni_watchdog.probes.spans import SpanReceiver
from omni_watchdog.semconv import (
    GEN_AI_REQUEST_ID,
    HEARTBEAT_SPAN,
    HOST_BOOT_ID,
    PROCESS_KIND,
    PROCESS_PID,
    PROCESS_START_TICKS,
    REQUEST_ID,
    SERVICE_NAME,
    STAGE_ID,
    STAGE_REPLICA,
    STAGE_REQUEST_SPAN,
    VLLM_INSTRUMENTING_MODULE,
    VLLM_OMNI_DIFFUSION_EXEC_MS,
    VLLM_OMNI_DIFFUSION_STAGE_SPAN,
    VLLM_OMNI_INSTRUMENTING_MODULE,
    VLLM_OMNI_LLM_STAGE_SPAN,
    VLLM_OMNI_PIPELINE_TIMINGS,
    VLLM_OMNI_REQUEST_SPAN,
    VLLM_OMNI_SERVICE_NAME,
    VLLM_OMNI_STAGE_ID,
    VLLM_OMNI_STAGE_NAME,
    VLLM_OMNI_STAGE_REPLICA,
    VLLM_PROCESS_ID,
    VLLM_REQUEST_SPAN,
)
from omni_watchdog.types import Observation, ObservationKind, SpanOutcome, StageRef

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "vllm_omni_spans"
THREE_STAGES = "qwen3-omni-three-stages"
AR_THEN_DIFFUSION = "ar-then-diffusion"
ENCODINGS = {PROTOBUF: "binpb", JSON: "json"}

S0, S1, S2 = StageRef(0), StageRef(1), StageRef(2)
DIFFUSION = StageRef(1, 1)
# What each recorded body's stage spans give: stage, seconds, in the body's order.
STAGE_WORK = {
    THREE_STAGES: [(S0, 0.610), (S1, 1.749), (S2, 1.795)],
    AR_THEN_DIFFUSION: [(S0, 0.383), (DIFFUSION, 2.36975)],
}
REQUEST_IDS = {THREE_STAGES: "chatcmpl-8c7e0d6f3a2b4c19", AR_THEN_DIFFUSION: "img-2f9d7c1e5a8b4d60"}
EVERY_STAGE = {S0, S1, S2, DIFFUSION}
STAGE_WORK_SPANS = {VLLM_OMNI_LLM_STAGE_SPAN, VLLM_OMNI_DIFFUSION_STAGE_SPAN}

BOOT = "boot-of-this-host"
# The plugin in the orchestrator, which times every stage's work on a request.
PLUGIN_ORCHESTRATOR = {PROCESS_PID: 30, PROCESS_START_TICKS: 700, PROCESS_KIND: "orchestrator"}


def stage_request(stage: StageRef, request_id: str = "r1") -> tuple[str, dict[str, object]]:
    """The plugin's `omni.stage.request` span of `stage`, sent by the orchestrator."""
    attributes = {STAGE_ID: stage.stage_id, STAGE_REPLICA: stage.replica, REQUEST_ID: request_id}
    return STAGE_REQUEST_SPAN, attributes


def receiver_for(
    senders: FakeSenders | None = None, clock: FakeClock | None = None
) -> SpanReceiver:
    """A receiver whose stages are the recorded pipelines', every sender the target's."""
    config = SpansConfig()
    return SpanReceiver(
        config,
        clock or FakeClock(),
        SpanStore(config.ring_size),
        senders=senders or FakeSenders(stages=EVERY_STAGE, mapped=EVERY_STAGE),
        boot_id=BOOT,
    )


def recorded(stem: str) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    request.ParseFromString((FIXTURES / f"{stem}.binpb").read_bytes())
    return request


def body_of(stem: str, media_type: str) -> bytes:
    return (FIXTURES / f"{stem}.{ENCODINGS[media_type]}").read_bytes()


def spans_of(request: ExportTraceServiceRequest) -> Iterator[Any]:
    for resource_spans in request.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            yield from scope_spans.spans


def attribute(span: Any, key: str) -> Any:
    return next(kv.value for kv in span.attributes if kv.key == key)


def set_attribute(span: Any, key: str, value: object) -> None:
    """Give `span`'s attribute `key` another value, of whatever kind `value` is."""
    (kv,) = [kv for kv in span.attributes if kv.key == key]
    kv.value.CopyFrom(key_value(key, value).value)


def ingested(receiver: SpanReceiver, body: bytes, media_type: str = PROTOBUF) -> list[Observation]:
    result = receiver.ingest(body, media_type)
    assert result.rejected == 0
    return asyncio.run(receiver.collect())


def past_the_unknown_stage_grace(receiver: SpanReceiver, clock: FakeClock) -> list[Observation]:
    """What the receiver gives once the spans naming stages it does not know are refused."""
    clock.advance(UNKNOWN_STAGE_GRACE_SECONDS + 0.1)
    return asyncio.run(receiver.collect())


def stage_spans(observations: list[Observation]) -> list[tuple[StageRef | None, float]]:
    return [
        (o.stage, round(o.value, 5)) for o in observations if o.kind is ObservationKind.STAGE_SPAN
    ]


def refused(receiver: SpanReceiver) -> dict[str, int]:
    return {reason: n for reason, n in receiver.stats.spans_rejected.items() if n}


# --- the recorded shapes -------------------------------------------------------------------


@pytest.mark.parametrize("stem", [THREE_STAGES, AR_THEN_DIFFUSION])
def test_the_two_encodings_of_a_recording_are_one_export(stem: str) -> None:
    assert decode_body(body_of(stem, JSON), JSON) == recorded(stem)


def test_the_recordings_have_the_pull_requests_shapes() -> None:
    """What the fixtures stand for, so that a change of them is a change of this test."""
    for stem in (THREE_STAGES, AR_THEN_DIFFUSION):
        request = recorded(stem)
        (resource_spans,) = request.resource_spans
        resource = {kv.key: kv.value.string_value for kv in resource_spans.resource.attributes}
        assert resource[VLLM_INSTRUMENTING_MODULE] == VLLM_OMNI_INSTRUMENTING_MODULE
        assert resource[SERVICE_NAME] == VLLM_OMNI_SERVICE_NAME
        assert resource[VLLM_PROCESS_ID].isdigit()
        spans = list(spans_of(request))
        (root,) = [s for s in spans if s.name == VLLM_OMNI_REQUEST_SPAN]
        assert root.kind == 2 and not root.parent_span_id  # SERVER, the trace's root
        assert attribute(root, GEN_AI_REQUEST_ID).string_value == REQUEST_IDS[stem]
        assert set(json.loads(attribute(root, VLLM_OMNI_PIPELINE_TIMINGS).string_value)) == {
            "queue_wait_ms",
            "preprocess_ms",
            "ar2diffusion_ms",
        }
        for span in spans:
            assert span.trace_id == root.trace_id
            assert span.status.code == 0  # the pull request never sets a status
            if span is root:
                continue
            assert span.parent_span_id == root.span_id
            if span.name in STAGE_WORK_SPANS:
                assert span.kind == 1  # INTERNAL
                assert attribute(span, VLLM_OMNI_STAGE_ID).WhichOneof("value") == "int_value"
                assert attribute(span, VLLM_OMNI_STAGE_REPLICA).WhichOneof("value") == "int_value"
                assert attribute(span, VLLM_OMNI_STAGE_NAME).string_value
                assert all(kv.key != GEN_AI_REQUEST_ID for kv in span.attributes)
            else:
                assert span.name == VLLM_REQUEST_SPAN
                assert attribute(span, GEN_AI_REQUEST_ID).string_value == REQUEST_IDS[stem]
    (diffusion,) = [
        s for s in spans_of(recorded(AR_THEN_DIFFUSION)) if s.name == VLLM_OMNI_DIFFUSION_STAGE_SPAN
    ]
    assert attribute(diffusion, VLLM_OMNI_DIFFUSION_EXEC_MS).double_value == 2310.0


# --- without the plugin: they count ---------------------------------------------------------


@pytest.mark.parametrize("media_type", [PROTOBUF, JSON])
@pytest.mark.parametrize("stem", [THREE_STAGES, AR_THEN_DIFFUSION])
def test_each_stage_span_is_its_stage_replicas_work(stem: str, media_type: str) -> None:
    receiver = receiver_for()
    observations = ingested(receiver, body_of(stem, media_type), media_type)
    work = STAGE_WORK[stem]
    assert [stage for stage, _ in stage_spans(observations)] == [stage for stage, _ in work]
    assert [s for _, s in stage_spans(observations)] == pytest.approx([s for _, s in work])
    for observation in observations:
        if observation.kind is ObservationKind.STAGE_SPAN:
            assert observation.outcome is SpanOutcome.OK and observation.detail == ""
            assert observation.request_id == ""  # the pull request's stage spans carry none
    # The request span ends the request, by vLLM-Omni's request id; it names no stage.
    assert observations[-1].kind is ObservationKind.REQUEST_FINISHED
    assert observations[-1].request_id == REQUEST_IDS[stem]
    assert observations[-1].stage is None
    assert len(observations) == len(STAGE_WORK[stem]) + 1
    # Every span is kept: the stage ones under their stage, the others under none.
    assert receiver.stats.spans_accepted == len(list(spans_of(recorded(stem))))
    for stage, _ in STAGE_WORK[stem]:
        (record,) = receiver.store.recent(stage)
        assert record.name in STAGE_WORK_SPANS and record.stage == stage
    unstaged = [s.name for s in spans_of(recorded(stem)) if s.name not in STAGE_WORK_SPANS]
    assert sorted(r.name for r in receiver.store.recent(None)) == sorted(unstaged)
    # vLLM-Omni's processes name no stage on their resource: no pid learns one, and vLLM's
    # `llm_request` beside each stage span is neither counted nor taken for stage 0.
    assert receiver.store.pid_stages() == {}
    assert refused(receiver) == {}


def test_a_failed_stage_span_is_an_error_with_its_message() -> None:
    request = recorded(AR_THEN_DIFFUSION)
    for span in spans_of(request):
        if span.name == VLLM_OMNI_DIFFUSION_STAGE_SPAN:
            span.status.code = Status.STATUS_CODE_ERROR
            span.status.message = "RuntimeError: CUDA out of memory"
    receiver = receiver_for()
    observations = ingested(receiver, request.SerializeToString())
    (failed,) = [o for o in observations if o.outcome is SpanOutcome.ERROR]
    assert failed.kind is ObservationKind.STAGE_SPAN and failed.stage == DIFFUSION
    assert failed.detail == "RuntimeError: CUDA out of memory"
    assert [o.stage for o in observations if o.outcome is SpanOutcome.OK] == [S0]


def test_a_failed_request_span_abandons_the_request() -> None:
    request = recorded(THREE_STAGES)
    for span in spans_of(request):
        if span.name == VLLM_OMNI_REQUEST_SPAN:
            span.status.code = Status.STATUS_CODE_ERROR
    observations = ingested(receiver_for(), request.SerializeToString())
    assert observations[-1].kind is ObservationKind.REQUEST_ABANDONED
    assert observations[-1].request_id == REQUEST_IDS[THREE_STAGES]


# --- with the plugin: kept, not counted twice ------------------------------------------------


def test_with_the_plugins_spans_of_a_stage_they_add_no_observation() -> None:
    clock = FakeClock()
    receiver = receiver_for(clock=clock)
    plugin = ingested(receiver, batch(PLUGIN_ORCHESTRATOR, [stage_request(S1)]))
    assert [(o.kind, o.stage) for o in plugin] == [(ObservationKind.STAGE_SPAN, S1)]
    observations = ingested(receiver, body_of(THREE_STAGES, PROTOBUF))
    # The plugin counts the talker's work: vLLM-Omni's span of it is only kept, the other
    # stages' count; the plugin speaks for the pipeline, so it ends requests itself.
    assert [stage for stage, _ in stage_spans(observations)] == [S0, S2]
    assert [o.kind for o in observations] == [ObservationKind.STAGE_SPAN] * 2
    assert [r.name for r in receiver.store.recent(S1)] == [
        STAGE_REQUEST_SPAN,
        VLLM_OMNI_LLM_STAGE_SPAN,
    ]
    assert VLLM_OMNI_REQUEST_SPAN in [r.name for r in receiver.store.recent(None)]
    # Once the plugin has been silent that long, vLLM-Omni's spans count again.
    clock.advance(PLUGIN_PRESENCE_SECONDS)
    observations = ingested(receiver, body_of(THREE_STAGES, JSON), JSON)
    assert [stage for stage, _ in stage_spans(observations)] == [S0, S1, S2]
    assert observations[-1].kind is ObservationKind.REQUEST_FINISHED


def test_a_stage_process_beating_speaks_for_its_stage() -> None:
    stage_process = {PROCESS_PID: 41, PROCESS_START_TICKS: 901, STAGE_ID: 1, STAGE_REPLICA: 1}
    receiver = receiver_for()
    ingested(receiver, batch(stage_process, [(HEARTBEAT_SPAN, {})]))
    observations = ingested(receiver, body_of(AR_THEN_DIFFUSION, PROTOBUF))
    assert [stage for stage, _ in stage_spans(observations)] == [S0]
    assert [o.kind for o in observations] == [ObservationKind.STAGE_SPAN]


def test_an_unrecorded_plugin_speaks_for_its_stage_once_recorded() -> None:
    clock = FakeClock()
    senders = FakeSenders(owned=set(), stages=EVERY_STAGE, mapped=EVERY_STAGE)
    receiver = receiver_for(senders, clock)
    orchestrator = {**PLUGIN_ORCHESTRATOR, HOST_BOOT_ID: BOOT}
    assert ingested(receiver, batch(orchestrator, [stage_request(S0)])) == []
    # Not believed yet: vLLM-Omni's spans of the stage still count.
    counted = ingested(receiver, body_of(AR_THEN_DIFFUSION, PROTOBUF))
    assert [stage for stage, _ in stage_spans(counted)] == [S0, DIFFUSION]
    clock.advance(1.0)
    senders.owned = {(30, 700)}  # the tracker's next scan records the orchestrator
    assert [o.stage for o in asyncio.run(receiver.collect())] == [S0]
    observations = ingested(receiver, body_of(AR_THEN_DIFFUSION, PROTOBUF))
    assert [stage for stage, _ in stage_spans(observations)] == [DIFFUSION]
    assert ObservationKind.REQUEST_FINISHED not in [o.kind for o in observations]


# --- believed only as far as the plugin's ----------------------------------------------------


def test_unknown_stages_are_refused_as_the_plugins_are() -> None:
    request = recorded(THREE_STAGES)
    stage_spans_of = [s for s in spans_of(request) if s.name == VLLM_OMNI_LLM_STAGE_SPAN]
    set_attribute(stage_spans_of[1], VLLM_OMNI_STAGE_ID, 7)  # no stage 7
    set_attribute(stage_spans_of[2], VLLM_OMNI_STAGE_REPLICA, 3)  # stage 2 has one replica
    clock = FakeClock()
    receiver = receiver_for(clock=clock)
    observations = ingested(receiver, request.SerializeToString())
    assert [stage for stage, _ in stage_spans(observations)] == [S0]
    assert past_the_unknown_stage_grace(receiver, clock) == []
    assert refused(receiver) == {"unknown_stage": 2}
    assert receiver.store.recent(StageRef(7)) == [] and receiver.store.stages() == [S0]
    # The plugin's span naming the same stages is refused for the same reason.
    ingested(receiver, batch(PLUGIN_ORCHESTRATOR, [stage_request(StageRef(7))]))
    assert past_the_unknown_stage_grace(receiver, clock) == []
    assert refused(receiver) == {"unknown_stage": 3}


def test_without_a_start_time_they_speak_only_for_stages_the_tree_maps() -> None:
    """With the process table in view, vLLM-Omni's resource (a pid, no start time) is
    believed as vLLM's is: progress of a mapped stage, never liveness."""
    senders = FakeSenders(owned=set(), stages={S0, S1, S2}, mapped={S0, S2})
    request = recorded(THREE_STAGES)
    (scope_spans, _) = request.resource_spans[0].scope_spans
    scope_spans.spans.add(
        name="Initialize stages", trace_id=b"\x01" * 16, span_id=b"\x02" * 8
    )  # a start-up span of the same process
    receiver = receiver_for(senders)
    observations = ingested(receiver, request.SerializeToString())
    assert [stage for stage, _ in stage_spans(observations)] == [S0, S2]
    assert ObservationKind.HEARTBEAT not in [o.kind for o in observations]
    assert observations[-1].kind is ObservationKind.REQUEST_FINISHED
    assert refused(receiver) == {"unknown_sender": 2}  # the talker's span, the start-up one
    assert receiver.store.recent(S1) == []


@pytest.mark.parametrize(
    ("stage_id", "counted"),
    [
        pytest.param("2", True, id="a-number-as-text"),
        pytest.param(2.0, True, id="a-whole-double"),
        pytest.param("code2wav", False, id="a-name"),
        pytest.param(2.5, False, id="a-fraction"),
        pytest.param(True, False, id="a-bool"),
        pytest.param([2], False, id="an-array"),
        pytest.param(-1, False, id="negative"),
        pytest.param(2**63 - 1, False, id="huge"),
    ],
)
def test_a_malformed_stage_attribute_is_ignored(stage_id: object, counted: bool) -> None:
    request = recorded(THREE_STAGES)
    stage_work = [s for s in spans_of(request) if s.name == VLLM_OMNI_LLM_STAGE_SPAN]
    set_attribute(stage_work[2], VLLM_OMNI_STAGE_ID, stage_id)
    set_attribute(stage_work[1], VLLM_OMNI_STAGE_REPLICA, "first")  # replica 0
    clock = FakeClock()
    receiver = receiver_for(clock=clock)
    observations = ingested(receiver, request.SerializeToString())
    expected = [S0, S1, S2] if counted else [S0, S1]
    assert [stage for stage, _ in stage_spans(observations)] == expected
    assert observations[-1].kind is ObservationKind.REQUEST_FINISHED
    assert past_the_unknown_stage_grace(receiver, clock) == []
    assert receiver.stats.spans_accepted + sum(refused(receiver).values()) == 7


def test_malformed_attribute_types_are_answered_200() -> None:
    """Through the HTTP handler: odd value kinds on every key the receiver reads."""
    document = json.loads(body_of(THREE_STAGES, JSON))
    odd_values = iter(
        [
            {"kvlistValue": {"values": [{"key": "id", "value": {"intValue": "1"}}]}},
            {"arrayValue": {"values": [{"stringValue": "talker"}]}},
            {"bytesValue": "3q0="},
        ]
    )
    for scope_spans in document["resourceSpans"][0]["scopeSpans"]:
        for span in scope_spans["spans"]:
            if span["name"] == VLLM_OMNI_LLM_STAGE_SPAN:
                odd = next(odd_values)
                for kv in span["attributes"]:
                    if kv["key"] in (VLLM_OMNI_STAGE_ID, VLLM_OMNI_STAGE_REPLICA):
                        kv["value"] = odd
            for kv in span["attributes"]:
                if kv["key"] == GEN_AI_REQUEST_ID:
                    kv["value"] = {}  # no value at all
    body = json.dumps(document).encode()
    receiver = receiver_for()

    async def post() -> int:
        async with listening(receiver.app()) as listener:
            url = f"http://127.0.0.1:{listener.port}/v1/traces"
            async with (
                aiohttp.ClientSession() as session,
                session.post(url, data=body, headers={"Content-Type": JSON}) as response,
            ):
                await response.read()
                return response.status

    assert asyncio.run(post()) == 200
    observations = asyncio.run(receiver.collect())
    # No stage span names a stage any more; the request still ends, with no id.
    assert stage_spans(observations) == []
    assert [(o.kind, o.request_id) for o in observations] == [
        (ObservationKind.REQUEST_FINISHED, "")
    ]
    assert refused(receiver) == {}
    assert receiver.stats.spans_accepted == 7
