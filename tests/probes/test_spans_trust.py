"""The receiver believes only the target: senders, stages, the token, and bounded storage."""

from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import Mapping
from typing import Any

import aiohttp
import pytest
from deadline import wait_for
from fakes import FakeSenders
from google.protobuf import json_format
from listening import listening
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from otlp_bodies import batch
from span_evidence import evidence

from omni_watchdog.clock import FakeClock
from omni_watchdog.config import SpansConfig
from omni_watchdog.probes import span_trust
from omni_watchdog.probes.otlp_decode import JSON, PROTOBUF, StageRefs
from omni_watchdog.probes.span_store import MAX_SPAN_BYTES, SpanStore
from omni_watchdog.probes.span_trust import (
    UNKNOWN_STAGE_GRACE_SECONDS,
    HeldSpans,
    SenderTrust,
    Trust,
    Verdict,
)
from omni_watchdog.probes.spans import SpanReceiver
from omni_watchdog.semconv import (
    GEN_AI_REQUEST_ID,
    HEARTBEAT_SPAN,
    HOST_BOOT_ID,
    PIPELINE_STAGE_FINAL_OUTPUT,
    PIPELINE_STAGE_IDS,
    PIPELINE_STAGE_INPUTS,
    PIPELINE_STAGE_NAMES,
    PIPELINE_STAGE_REPLICAS,
    PROCESS_KIND,
    PROCESS_PID,
    PROCESS_START_TICKS,
    REQUEST_ADMITTED_SPAN,
    REQUEST_ID,
    REQUEST_STAGE_PATH,
    STAGE_ID,
    STAGE_REPLICA,
    STAGE_REQUEST_SPAN,
    TOPOLOGY_SPAN,
    VLLM_PROCESS_ID,
    VLLM_REQUEST_SPAN,
)
from omni_watchdog.topology import MAX_STAGES
from omni_watchdog.types import ObservationKind, StageRef, Topology, TopologyOrigin

BOOT = "boot-of-this-host"
STAGE_PROCESS = {PROCESS_PID: 40, PROCESS_START_TICKS: 900, HOST_BOOT_ID: BOOT}
STAGE_ONE = {STAGE_ID: 1, STAGE_REPLICA: 0}
S0, S1 = StageRef(0), StageRef(1)
TREE = FakeSenders(owned={(40, 900)}, stages={S0, S1}, mapped={S0, S1})
HEARTBEAT: tuple[str, dict[str, object]] = (HEARTBEAT_SPAN, {})
STAGE_SPAN = (STAGE_REQUEST_SPAN, {REQUEST_ID: "r1"})
ADMITTED = (REQUEST_ADMITTED_SPAN, {REQUEST_ID: "r1", REQUEST_STAGE_PATH: [0, 1]})
LLM_REQUEST = (VLLM_REQUEST_SPAN, {GEN_AI_REQUEST_ID: "cmpl-1"})


def receiver_for(
    senders: FakeSenders = TREE, clock: FakeClock | None = None, **config: Any
) -> SpanReceiver:
    spans_config = SpansConfig(**config)
    return SpanReceiver(
        spans_config,
        clock or FakeClock(),
        SpanStore(spans_config.ring_size),
        senders=senders,
        token=config.pop("token", "") if "token" in config else "",
        boot_id=BOOT,
        sender_grace=2.0,
    )


def taken(receiver: SpanReceiver) -> list[ObservationKind]:
    return [obs.kind for obs in evidence(asyncio.run(receiver.collect()))]


def refused(receiver: SpanReceiver) -> dict[str, int]:
    return {reason: n for reason, n in receiver.stats.spans_rejected.items() if n}


@pytest.mark.parametrize(
    ("name", "resource", "spans", "kinds", "rejected"),
    [
        (
            "the target's stage process",
            {**STAGE_PROCESS, **STAGE_ONE},
            [HEARTBEAT, STAGE_SPAN],
            [ObservationKind.HEARTBEAT, ObservationKind.STAGE_SPAN],
            {},
        ),
        (
            "another host's boot",
            {**STAGE_PROCESS, **STAGE_ONE, HOST_BOOT_ID: "another-boot"},
            [HEARTBEAT, STAGE_SPAN],
            [],
            {"unknown_sender": 2},
        ),
        (
            "a stage the topology and the tree do not have",
            {**STAGE_PROCESS, STAGE_ID: 7},
            [HEARTBEAT, STAGE_SPAN],
            [],
            {"unknown_stage": 2},
        ),
        (
            "a span's own stage attribute names an unknown replica",
            {**STAGE_PROCESS, **STAGE_ONE},
            [(HEARTBEAT_SPAN, {STAGE_ID: 1, STAGE_REPLICA: 9}), HEARTBEAT],
            [ObservationKind.HEARTBEAT],
            {"unknown_stage": 1},
        ),
        (
            "no start time: heartbeats and admissions are a stranger's",
            {PROCESS_PID: 40, **STAGE_ONE},
            [HEARTBEAT, ADMITTED, STAGE_SPAN],
            [],
            {"unknown_sender": 3},
        ),
        (
            "vLLM's own llm_request of a stage the tree maps counts as progress",
            {VLLM_PROCESS_ID: "40"},
            [LLM_REQUEST, ("Worker init", {})],
            [ObservationKind.STAGE_SPAN],
            {"unknown_sender": 1},
        ),
    ],
)
def test_only_the_target_speaks_for_its_stages(
    name: str,
    resource: Mapping[str, Any],
    spans: list[tuple[str, Mapping[str, Any]]],
    kinds: list[ObservationKind],
    rejected: dict[str, int],
) -> None:
    clock = FakeClock()
    receiver = receiver_for(clock=clock)
    result = receiver.ingest(batch(resource, spans), PROTOBUF)
    # Refusing a span for its sender is not the exporter's fault: no partial success.
    assert result.rejected == 0, name
    assert taken(receiver) == kinds, name
    # A span of the target's naming an unknown stage is refused once its grace is over.
    clock.advance(UNKNOWN_STAGE_GRACE_SECONDS + 0.1)
    assert taken(receiver) == [], name
    assert refused(receiver) == rejected, name
    assert receiver.stats.spans_accepted == len(kinds), name


def test_vllm_spans_of_an_unmapped_stage_are_refused() -> None:
    receiver = receiver_for(FakeSenders(owned=set(), stages={S0}, mapped=set()))
    receiver.ingest(batch({VLLM_PROCESS_ID: "40"}, [LLM_REQUEST]), PROTOBUF)
    assert taken(receiver) == []
    assert refused(receiver) == {"unknown_sender": 1}


def test_an_unrecorded_sender_waits_for_the_tracker_then_counts() -> None:
    clock = FakeClock()
    senders = FakeSenders(owned=set(), stages={S1}, mapped={S1})
    receiver = receiver_for(senders, clock)
    receiver.ingest(batch({**STAGE_PROCESS, **STAGE_ONE}, [HEARTBEAT, STAGE_SPAN]), PROTOBUF)
    assert taken(receiver) == []
    assert receiver.store.recent(S1) == []
    clock.advance(1.0)
    senders.owned = {(40, 900)}  # the tracker's next scan records the new process
    assert taken(receiver) == [ObservationKind.HEARTBEAT, ObservationKind.STAGE_SPAN]
    assert [record.name for record in receiver.store.recent(S1)] == [
        HEARTBEAT_SPAN,
        STAGE_REQUEST_SPAN,
    ]
    assert receiver.store.pid_stages() == {40: (S1, "")}
    assert refused(receiver) == {}


def test_a_sender_never_recorded_is_refused_after_its_grace() -> None:
    clock = FakeClock()
    receiver = receiver_for(FakeSenders(owned=set(), stages={S1}, mapped={S1}), clock)
    receiver.ingest(batch({**STAGE_PROCESS, **STAGE_ONE}, [HEARTBEAT, STAGE_SPAN]), PROTOBUF)
    clock.advance(1.9)
    assert taken(receiver) == []
    assert refused(receiver) == {}
    clock.advance(0.2)
    assert taken(receiver) == []
    assert refused(receiver) == {"unknown_sender": 2}
    assert receiver.store.pid_stages() == {}


def test_a_stage_s_own_process_is_heard_before_the_watchdog_knows_its_stage() -> None:
    """A diffusion stage's process (its title names no stage) beats before any topology
    names its stage: its spans wait, its stage is learned from them, and once the tracker
    maps it they count, at the time they came."""
    clock = FakeClock()
    senders = FakeSenders(owned={(40, 900)}, stages={S0}, mapped={S0})
    receiver = receiver_for(senders, clock)
    came = clock.monotonic()
    receiver.ingest(batch({**STAGE_PROCESS, **STAGE_ONE}, [HEARTBEAT, STAGE_SPAN]), PROTOBUF)
    assert taken(receiver) == []
    assert receiver.store.pid_stages() == {40: (S1, "")}
    clock.advance(0.5)
    senders.stages = {S0, S1}  # the tracker's next scan maps the process to its stage
    observations = asyncio.run(receiver.collect())
    assert [(o.kind, o.stage, o.time) for o in observations] == [
        (ObservationKind.HEARTBEAT, S1, came),
        (ObservationKind.STAGE_SPAN, S1, came),
    ]
    assert [record.name for record in receiver.store.recent(S1)] == [
        HEARTBEAT_SPAN,
        STAGE_REQUEST_SPAN,
    ]
    assert refused(receiver) == {} and receiver.stats.spans_accepted == 2


def test_a_new_stage_process_waits_for_the_tracker_to_record_it_then_to_map_it() -> None:
    clock = FakeClock()
    senders = FakeSenders(owned=set(), stages={S0}, mapped={S0})
    receiver = receiver_for(senders, clock)
    receiver.ingest(batch({**STAGE_PROCESS, **STAGE_ONE}, [HEARTBEAT]), PROTOBUF)
    assert taken(receiver) == [] and receiver.store.pid_stages() == {}
    clock.advance(0.5)
    senders.owned = {(40, 900)}  # recorded: its own stage is believed now
    assert taken(receiver) == [] and receiver.store.pid_stages() == {40: (S1, "")}
    clock.advance(0.5)
    senders.stages = {S0, S1}  # and mapped
    assert taken(receiver) == [ObservationKind.HEARTBEAT]
    assert refused(receiver) == {}


def test_the_orchestrator_s_span_of_a_stage_not_known_yet_waits_for_the_topology() -> None:
    """The API server's span of a request that failed in stage 1, sent before the watchdog
    learned the pipeline, counts once the topology names stage 1; its other spans at once."""
    clock = FakeClock()
    senders = FakeSenders(owned={(30, 700)}, stages={S0}, mapped={S0})
    receiver = receiver_for(senders, clock)
    orchestrator = {PROCESS_PID: 30, PROCESS_START_TICKS: 700, HOST_BOOT_ID: BOOT}
    stage_one_span = (STAGE_REQUEST_SPAN, {REQUEST_ID: "r1", **STAGE_ONE})
    receiver.ingest(batch(orchestrator, [ADMITTED, stage_one_span]), PROTOBUF)
    assert taken(receiver) == [ObservationKind.REQUEST_ADMITTED]
    clock.advance(UNKNOWN_STAGE_GRACE_SECONDS - 1.0)
    assert taken(receiver) == []
    assert receiver.store.pid_stages() == {}  # the orchestrator serves no stage of its own
    senders.stages = {S0, S1}  # the plugin's topology report came
    assert [(o.kind, o.stage) for o in asyncio.run(receiver.collect())] == [
        (ObservationKind.STAGE_SPAN, S1)
    ]
    assert refused(receiver) == {}


def test_a_stage_never_known_is_refused_after_its_grace_and_never_kept() -> None:
    clock = FakeClock()
    receiver = receiver_for(FakeSenders(owned={(40, 900)}, stages={S0}, mapped={S0}), clock)
    receiver.ingest(batch({**STAGE_PROCESS, STAGE_ID: 7}, [HEARTBEAT, STAGE_SPAN]), PROTOBUF)
    clock.advance(UNKNOWN_STAGE_GRACE_SECONDS)
    assert taken(receiver) == [] and refused(receiver) == {}
    clock.advance(0.1)
    assert taken(receiver) == []
    assert refused(receiver) == {"unknown_stage": 2}
    assert receiver.store.recent(StageRef(7)) == [] and receiver.store.stages() == []


def test_spans_of_unknown_stages_wait_only_within_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(span_trust, "MAX_WAITING_SPANS", 3)
    clock = FakeClock()
    receiver = receiver_for(FakeSenders(owned={(40, 900)}, stages={S0}, mapped={S0}), clock)
    for _ in range(2):
        receiver.ingest(batch({**STAGE_PROCESS, **STAGE_ONE}, [HEARTBEAT, HEARTBEAT]), PROTOBUF)
    # The second body would be the fourth span waiting: refused at once, the first waits.
    assert taken(receiver) == []
    assert refused(receiver) == {"unknown_stage": 2}
    clock.advance(UNKNOWN_STAGE_GRACE_SECONDS + 0.1)
    assert taken(receiver) == []
    assert refused(receiver) == {"unknown_stage": 4}


def test_what_waits_for_its_stage_is_bounded_in_bytes() -> None:
    """A span waiting for its stage is held cut as the store keeps it; a resource far
    larger than the plugin's is not held at all."""
    clock = FakeClock()
    senders = FakeSenders(owned={(40, 900)}, stages={S0}, mapped={S0})
    receiver = receiver_for(senders, clock)
    huge = {REQUEST_ID: "r1", "prompt": "x" * 1_000_000}
    receiver.ingest(batch({**STAGE_PROCESS, **STAGE_ONE}, [(STAGE_REQUEST_SPAN, huge)]), PROTOBUF)
    bloated = {**STAGE_PROCESS, **STAGE_ONE, "notes": "y" * 100_000}
    receiver.ingest(batch(bloated, [HEARTBEAT]), PROTOBUF)
    assert refused(receiver) == {"unknown_stage": 1}
    senders.stages = {S0, S1}
    (observation,) = evidence(asyncio.run(receiver.collect()))
    assert observation.kind is ObservationKind.STAGE_SPAN and observation.request_id == "r1"
    (record,) = receiver.store.recent(S1)
    assert record.request_id == "r1"


def test_a_span_held_for_its_stage_is_held_cut_as_the_store_keeps_it() -> None:
    held = HeldSpans(dict.fromkeys(("unknown_sender", "unknown_stage"), 0), sender_grace=2.0)
    huge = {REQUEST_ID: "r1", "prompt": "x" * 1_000_000}
    body = batch({**STAGE_PROCESS, **STAGE_ONE}, [(STAGE_REQUEST_SPAN, huge)])
    (resource_spans,) = ExportTraceServiceRequest.FromString(body).resource_spans
    resource = StageRefs().resource(resource_spans)
    held.hold_unplaced(
        0.0, resource_spans, resource, list(resource_spans.scope_spans[0].spans), {S1}
    )
    (unplaced,) = held.unplaced
    assert unplaced.request.ByteSize() <= MAX_SPAN_BYTES * 2


def test_a_huge_attribute_is_cut_before_it_is_kept() -> None:
    receiver = receiver_for()
    huge = {REQUEST_ID: "r1", "prompt": "x" * 1_000_000, "list": list(range(5000))}
    receiver.ingest(batch({**STAGE_PROCESS, **STAGE_ONE}, [(STAGE_REQUEST_SPAN, huge)]), PROTOBUF)
    ((data, _, _),) = receiver.store.ring(S1)
    assert len(data) <= MAX_SPAN_BYTES + 512
    (record,) = receiver.store.recent(S1)
    assert record.request_id == "r1"
    assert len(str(record.attributes["prompt"])) <= 256


def test_a_huge_resource_is_cut_before_it_is_kept() -> None:
    receiver = receiver_for()
    resource = {**STAGE_PROCESS, **STAGE_ONE, **{f"k{n}": "v" * 10_000 for n in range(500)}}
    receiver.ingest(batch(resource, [HEARTBEAT]), PROTOBUF)
    ((_, kept_resource, _),) = receiver.store.ring(S1)
    assert len(kept_resource.attributes) <= 64
    assert max(len(str(value)) for value in kept_resource.attributes.values()) <= 256


async def post(url: str, data: bytes, headers: Mapping[str, str]) -> int:
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, data=data, headers=dict(headers)) as response,
    ):
        await response.read()
        return response.status


async def raw_post(port: int | None, head: bytes, sent_body: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + sent_body)
    await writer.drain()
    answer = await reader.read()
    writer.close()
    return answer.split(b"\r\n", 1)[0]


def test_the_token_is_required_and_checked() -> None:
    receiver = SpanReceiver(
        SpansConfig(), FakeClock(), SpanStore(8), senders=TREE, token="s3cret", boot_id=BOOT
    )
    spans = batch({**STAGE_PROCESS, **STAGE_ONE}, [HEARTBEAT])
    plain = {"Content-Type": PROTOBUF}

    async def scenario() -> tuple[list[int], bytes]:
        async with listening(receiver.app()) as listener:
            url = f"http://127.0.0.1:{listener.port}/v1/traces"
            statuses = [
                await post(url, spans, plain),
                await post(url, spans, {**plain, "Authorization": "Bearer wrong"}),
                await post(url, spans, {**plain, "Authorization": "Basic s3cret"}),
                await post(url, spans, {**plain, "Authorization": "Bearer s3cret"}),
            ]
            malformed = await raw_post(
                listener.port,
                b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Authorization: Bearer \xff\xfe\r\nContent-Length: 2\r\n"
                b"Connection: close\r\n\r\n",
                b"{}",
            )
        return statuses, malformed

    statuses, malformed = asyncio.run(scenario())
    assert statuses == [401, 401, 401, 200]
    assert malformed == b"HTTP/1.1 401 Unauthorized"
    assert receiver.stats.spans_rejected["unauthorized"] == 4
    assert taken(receiver) == [ObservationKind.HEARTBEAT]


@pytest.mark.parametrize("media_type", [PROTOBUF, JSON])
def test_a_body_labelled_gzip_that_is_not_gzip_is_400(media_type: str) -> None:
    receiver = receiver_for()

    async def scenario() -> tuple[int, int]:
        async with listening(receiver.app()) as listener:
            url = f"http://127.0.0.1:{listener.port}/v1/traces"
            headers = {"Content-Type": media_type, "Content-Encoding": "gzip"}
            bad = await post(url, b"not gzip at all", headers)
            good = await post(url, gzip.compress(b"{}" if media_type == JSON else b""), headers)
        return bad, good

    assert asyncio.run(scenario()) == (400, 200)
    assert receiver.stats.spans_rejected["decode_error"] == 1


def test_a_body_that_does_not_arrive_in_time_is_408() -> None:
    receiver = receiver_for(body_timeout=0.2)

    async def scenario() -> bytes:
        async with listening(receiver.app()) as listener:
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            writer.write(
                b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                b"Content-Length: 1000\r\n\r\n" + b"\x0a" * 10
            )
            await writer.drain()
            answer = await asyncio.wait_for(reader.readline(), 5.0)
            writer.close()
        return answer.strip()

    assert asyncio.run(scenario()) == b"HTTP/1.1 408 Request Timeout"
    assert receiver.stats.spans_rejected["body_timeout"] == 1


def test_a_client_gone_mid_body_is_counted_not_an_error_of_the_watchdog() -> None:
    receiver = receiver_for()
    errors: list[None] = []

    async def scenario() -> None:
        async with listening(receiver.app(), errors=errors) as listener:
            _, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            writer.write(
                b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                b"Content-Length: 1000\r\n\r\n" + b"\x0a" * 10
            )
            await writer.drain()
            writer.close()
            await wait_for(lambda: receiver.stats.spans_rejected["body_incomplete"] == 1, 5)

    asyncio.run(scenario())
    assert errors == []


# ---- the plugin's topology report ---------------------------------------------------------

API_PROCESS = {
    PROCESS_PID: 40,
    PROCESS_START_TICKS: 900,
    HOST_BOOT_ID: BOOT,
    PROCESS_KIND: "api",
}
THREE_STAGES = {
    PIPELINE_STAGE_IDS: [0, 1, 2],
    PIPELINE_STAGE_NAMES: ["thinker", "talker", "code2wav"],
    PIPELINE_STAGE_REPLICAS: [1, 2, 1],
    PIPELINE_STAGE_INPUTS: ["", "0", "1"],
    PIPELINE_STAGE_FINAL_OUTPUT: [True, False, True],
}


def reported(receiver: SpanReceiver) -> list[Topology]:
    return [o.topology for o in asyncio.run(receiver.collect()) if o.topology is not None]


@pytest.mark.parametrize(
    ("name", "resource", "report", "stages", "rejected"),
    [
        ("the target's API process", API_PROCESS, THREE_STAGES, [1, 2, 1], {}),
        (
            "a sender with no start time",
            {PROCESS_PID: 40},
            THREE_STAGES,
            None,
            {"unknown_sender": 1},
        ),
        (
            "another host",
            {**API_PROCESS, HOST_BOOT_ID: "another-boot"},
            THREE_STAGES,
            None,
            {"unknown_sender": 1},
        ),
        (
            "an input from no stage",
            API_PROCESS,
            {**THREE_STAGES, PIPELINE_STAGE_INPUTS: ["", "0", "9"]},
            None,
            {"malformed_topology": 1},
        ),
        (
            "lists of different lengths",
            API_PROCESS,
            {**THREE_STAGES, PIPELINE_STAGE_NAMES: ["thinker"]},
            None,
            {"malformed_topology": 1},
        ),
        (
            "a list past the stage bound",
            API_PROCESS,
            {
                PIPELINE_STAGE_IDS: list(range(MAX_STAGES + 1)),
                PIPELINE_STAGE_NAMES: ["s"] * (MAX_STAGES + 1),
                PIPELINE_STAGE_REPLICAS: [1] * (MAX_STAGES + 1),
                PIPELINE_STAGE_INPUTS: [""] * (MAX_STAGES + 1),
                PIPELINE_STAGE_FINAL_OUTPUT: [True] * (MAX_STAGES + 1),
            },
            None,
            {"malformed_topology": 1},
        ),
        (
            "a scalar where a list belongs",
            API_PROCESS,
            {**THREE_STAGES, PIPELINE_STAGE_IDS: 0},
            None,
            {"malformed_topology": 1},
        ),
        ("no report at all", API_PROCESS, {}, None, {"malformed_topology": 1}),
    ],
)
def test_only_the_targets_well_formed_report_defines_the_topology(
    name: str,
    resource: dict[str, object],
    report: dict[str, object],
    stages: list[int] | None,
    rejected: dict[str, int],
) -> None:
    receiver = receiver_for(FakeSenders(owned={(40, 900)}))
    receiver.ingest(batch(resource, [(TOPOLOGY_SPAN, report)]), PROTOBUF)
    topologies = reported(receiver)
    if stages is None:
        assert topologies == []
    else:
        assert [s.replicas for s in topologies[0].stages] == stages
        assert (topologies[0].source, topologies[0].origin) == ("plugin", TopologyOrigin.PLUGIN)
    assert refused(receiver) == rejected


def test_a_report_of_an_unrecorded_sender_counts_once_the_tracker_records_it() -> None:
    clock = FakeClock()
    senders = FakeSenders(owned=set())
    receiver = receiver_for(senders, clock)
    receiver.ingest(batch(API_PROCESS, [(TOPOLOGY_SPAN, THREE_STAGES)]), PROTOBUF)
    assert reported(receiver) == []
    clock.advance(1.0)
    senders.owned = {(40, 900)}
    assert [s.name for s in reported(receiver)[0].stages] == ["thinker", "talker", "code2wav"]
    assert refused(receiver) == {}


def test_a_report_in_json_is_read_the_same() -> None:
    receiver = receiver_for(FakeSenders(owned={(40, 900)}))
    body = batch(API_PROCESS, [(TOPOLOGY_SPAN, THREE_STAGES)])
    request = ExportTraceServiceRequest.FromString(body)
    as_json = json_format.MessageToJson(request).encode()
    # OTLP JSON writes ids in hex, protobuf's JSON in base64.
    document = json.loads(as_json)
    span = document["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    span["traceId"] = bytes(request.resource_spans[0].scope_spans[0].spans[0].trace_id).hex()
    span["spanId"] = bytes(request.resource_spans[0].scope_spans[0].spans[0].span_id).hex()
    receiver.ingest(json.dumps(document).encode(), JSON)
    assert [s.replicas for s in reported(receiver)[0].stages] == [1, 2, 1]


def judged(resource: Mapping[str, object], remote_stages: frozenset[int] = frozenset()) -> Trust:
    trust = SenderTrust(TREE, FakeClock(), boot_id=BOOT, remote_stages=remote_stages)
    (resource_spans,) = ExportTraceServiceRequest.FromString(batch(resource, [])).resource_spans
    return trust.judge(StageRefs().resource(resource_spans))


def test_a_resource_is_judged_by_what_it_names() -> None:
    assert judged({**STAGE_PROCESS, **STAGE_ONE}) is Trust.TARGET
    assert judged({**STAGE_PROCESS, PROCESS_START_TICKS: 901}) is Trust.UNRECORDED
    assert judged({PROCESS_PID: 40}) is Trust.ANONYMOUS
    assert judged({**STAGE_PROCESS, HOST_BOOT_ID: "another-boot"}) is Trust.FOREIGN
    assert judged({**STAGE_PROCESS, STAGE_ID: 2}, frozenset({2})) is Trust.REMOTE


@pytest.mark.parametrize(
    ("trust", "stage", "name", "may_hold", "verdict"),
    [
        (Trust.TARGET, S1, HEARTBEAT_SPAN, True, Verdict.TAKEN),
        (Trust.TARGET, None, REQUEST_ADMITTED_SPAN, True, Verdict.TAKEN),
        (Trust.TARGET, StageRef(7), HEARTBEAT_SPAN, True, Verdict.HELD),
        (Trust.TARGET, StageRef(7), HEARTBEAT_SPAN, False, Verdict.UNKNOWN_STAGE),
        (Trust.ANONYMOUS, StageRef(7), VLLM_REQUEST_SPAN, True, Verdict.UNKNOWN_STAGE),
        (Trust.ANONYMOUS, S1, VLLM_REQUEST_SPAN, True, Verdict.TAKEN),
        (Trust.ANONYMOUS, S1, HEARTBEAT_SPAN, True, Verdict.UNKNOWN_SENDER),
        (Trust.ANONYMOUS, None, VLLM_REQUEST_SPAN, True, Verdict.TAKEN),
        (Trust.ANONYMOUS, None, REQUEST_ADMITTED_SPAN, True, Verdict.UNKNOWN_SENDER),
        (Trust.REMOTE, StageRef(2), HEARTBEAT_SPAN, True, Verdict.TAKEN),
        (Trust.REMOTE, S1, HEARTBEAT_SPAN, True, Verdict.UNKNOWN_SENDER),
        (Trust.REMOTE, None, REQUEST_ADMITTED_SPAN, True, Verdict.UNKNOWN_SENDER),
    ],
)
def test_the_verdict_on_each_span(
    trust: Trust, stage: StageRef | None, name: str, may_hold: bool, verdict: Verdict
) -> None:
    senders = FakeSenders(owned={(40, 900)}, stages={S0, S1, StageRef(2)}, mapped={S0, S1})
    verdicts = SenderTrust(senders, FakeClock(), remote_stages=frozenset({2})).verdicts()
    assert verdicts.of(trust, stage, name, may_hold) is verdict
