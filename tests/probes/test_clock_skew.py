"""No verdict depends on a remote host's wall clock. A headless stage on another host stamps
its spans with that host's clock, which may be hours off the head's; the head's watchdog
must stamp what it learns with its own monotonic clock at receipt, and take a span's
duration from its own two ends only. One remote stage's spans (heartbeats, stage spans,
a failure, denoising steps, then silence) go through the real receiver three times, with
the sender's clock right, an hour fast and an hour slow: the observations, and the
detector's reports over them, must be the same, and the silence must still be judged."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import count

import pytest
from fakes import FakeSenders
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from otlp_bodies import key_value

from omni_watchdog.clock import FakeClock
from omni_watchdog.config import DetectionConfig, SpansConfig
from omni_watchdog.detector import Detector
from omni_watchdog.probes.otlp_decode import PROTOBUF
from omni_watchdog.probes.span_store import SpanStore
from omni_watchdog.probes.spans import SpanReceiver
from omni_watchdog.semconv import (
    DENOISE_STEP_COUNT,
    DENOISE_STEP_INDEX,
    DENOISE_STEP_SECONDS,
    DENOISE_STEP_SPAN,
    DIFFUSION_DENOISE_MS,
    DIFFUSION_REQUEST_SPAN,
    EXCEPTION_EVENT,
    EXCEPTION_MESSAGE,
    HEARTBEAT_SPAN,
    HOST_BOOT_ID,
    HOST_NAME,
    PROCESS_PID,
    PROCESS_START_TICKS,
    REQUEST_ID,
    STAGE_ID,
    STAGE_REPLICA,
    STAGE_REQUEST_SPAN,
)
from omni_watchdog.types import (
    STAGE_TYPE_DIFFUSION,
    STAGE_TYPE_LLM,
    DetectorReport,
    EvidenceKind,
    HealthOutcome,
    Observation,
    ObservationKind,
    ProcessInfo,
    ProcessRole,
    ProcessStatus,
    SilenceCause,
    SpanOutcome,
    Stage,
    StageRef,
    StageState,
    Topology,
)

LOCAL, REMOTE = StageRef(0), StageRef(1)
TOPOLOGY = Topology(
    (
        Stage(0, "thinker", downstream=(1,), stage_type=STAGE_TYPE_LLM),
        Stage(1, "dit", upstream=(0,), final_output=True, stage_type=STAGE_TYPE_DIFFUSION),
    )
)
# As test_spans_remote builds the head: pid 40 serves stage 0 here; stage 1 is remote.
HEAD_TREE = FakeSenders(owned={(40, 900)}, stages={LOCAL, REMOTE}, mapped={LOCAL})
REMOTE_RESOURCE: dict[str, object] = {
    PROCESS_PID: 40,
    PROCESS_START_TICKS: 123,
    HOST_BOOT_ID: "stage-host-boot",
    HOST_NAME: "gpu-node-b",
    STAGE_ID: 1,
    STAGE_REPLICA: 0,
}
ROOT = ProcessInfo(100, 1.0, 1, 100, 100, "vllm", ProcessStatus.SLEEPING, 1.0, ProcessRole.API)

HOUR = 3600
SKEWS = (0, HOUR, -HOUR)
# The remote host's clock when the head's monotonic clock reads `WATCHDOG_START` and its
# own clock is right: any instant well after the epoch, so an hour slow stays positive.
SENDER_ORIGIN_NS = 1_796_221_666_000_000_000
WATCHDOG_START = 1000.0
TICK = 0.5
TICK_NS = 500_000_000
BEATING_TICKS = 40  # 20 s of heartbeats, one every TICK
SILENT_TICKS = 80  # then 40 s without a span from the remote stage
MS = 1_000_000


@dataclass(frozen=True)
class SenderSpan:
    """A span as the remote stage ends it: `duration_ns` before the tick it is sent at."""

    name: str
    attributes: Mapping[str, object] = field(default_factory=dict)
    duration_ns: int = MS
    error: str = ""


def stage_request(request: str, duration_ns: int, error: str = "") -> SenderSpan:
    return SenderSpan(STAGE_REQUEST_SPAN, {STAGE_ID: 1, REQUEST_ID: request}, duration_ns, error)


def denoise_step(step: int, previous_ns: int) -> SenderSpan:
    attributes = {
        STAGE_ID: 1,
        REQUEST_ID: "img-1",
        DENOISE_STEP_INDEX: step,
        DENOISE_STEP_COUNT: 4,
        DENOISE_STEP_SECONDS: previous_ns / 1e9,
    }
    return SenderSpan(DENOISE_STEP_SPAN, attributes, TICK_NS)


# Besides a heartbeat at every beating tick, the spans the remote stage ends at that tick.
SCRIPT: dict[int, list[SenderSpan]] = {
    4: [stage_request("req-1", 250 * MS)],
    10: [stage_request("req-2", 1500 * MS)],
    16: [stage_request("req-3", 750 * MS)],
    22: [stage_request("req-4", 2000 * MS, error="EngineDeadError: engine core died")],
    26: [denoise_step(1, 0)],
    27: [denoise_step(2, TICK_NS)],
    28: [denoise_step(3, TICK_NS)],
    29: [denoise_step(4, TICK_NS)],
    30: [
        SenderSpan(
            DIFFUSION_REQUEST_SPAN,
            {STAGE_ID: 1, REQUEST_ID: "img-1", DENOISE_STEP_INDEX: 4, DIFFUSION_DENOISE_MS: 2000.0},
            2000 * MS,
        ),
        stage_request("img-1", 2000 * MS),
    ],
}
EXPECTED_STAGE_SPANS = [
    ("req-1", 0.25, SpanOutcome.OK),
    ("req-2", 1.5, SpanOutcome.OK),
    ("req-3", 0.75, SpanOutcome.OK),
    ("req-4", 2.0, SpanOutcome.ERROR),
    ("img-1", 2.0, SpanOutcome.OK),
]


def export_body(spans: Sequence[SenderSpan], sent_at_ns: int, ids: count[int]) -> bytes:
    """One OTLP/HTTP protobuf export of the remote stage, every span ending at `sent_at_ns`
    of the sender's clock; a failed span carries its exception as an event, as the OTel
    SDK records it."""
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    resource_spans.resource.attributes.extend(key_value(k, v) for k, v in REMOTE_RESOURCE.items())
    scope_spans = resource_spans.scope_spans.add()
    for sender_span in spans:
        span_id = next(ids)
        span = scope_spans.spans.add(
            name=sender_span.name,
            trace_id=span_id.to_bytes(16, "big"),
            span_id=span_id.to_bytes(8, "big"),
            start_time_unix_nano=sent_at_ns - sender_span.duration_ns,
            end_time_unix_nano=sent_at_ns,
        )
        span.attributes.extend(key_value(k, v) for k, v in sender_span.attributes.items())
        if sender_span.error:
            span.status.code = span.status.STATUS_CODE_ERROR
            event = span.events.add(name=EXCEPTION_EVENT, time_unix_nano=sent_at_ns - MS)
            event.attributes.append(key_value(EXCEPTION_MESSAGE, sender_span.error))
    return request.SerializeToString()


def head_observations(now: float, tick: int) -> list[Observation]:
    """What the head sees of itself at `tick`: its local stage beating throughout, and
    /health failing once the remote stage falls silent (the server has no live replica of
    it). Without that failure a remote stage's silence is only `unknown`, never judged."""
    silent = tick >= BEATING_TICKS
    health = HealthOutcome.UNHEALTHY if silent else HealthOutcome.OK
    engine = ProcessInfo(
        200, 2.0, 100, 100, 100, "engine", ProcessStatus.SLEEPING, tick, ProcessRole.ENGINE, LOCAL
    )
    return [
        Observation(ObservationKind.HEALTH, now, outcome=health, detail="503" if silent else "200"),
        Observation(ObservationKind.PROCESS, now, process=ROOT, outcome=ProcessStatus.SLEEPING),
        Observation(ObservationKind.PROCESS, now, process=engine, outcome=ProcessStatus.SLEEPING),
        Observation(ObservationKind.HEARTBEAT, now, stage=LOCAL),
    ]


@dataclass
class Run:
    """One pass of the script: what the receiver gave at each tick, what the detector
    reported after it, and the span store the receiver filed into."""

    received: list[list[Observation]]
    reports: list[DetectorReport]
    store: SpanStore


async def run_script(skew_seconds: int) -> Run:
    """The script with the remote host's clock `skew_seconds` off; the watchdog's clock
    moves the same in every run."""
    clock = FakeClock(start=WATCHDOG_START)
    spans_config = SpansConfig()
    receiver = SpanReceiver(
        spans_config,
        clock,
        SpanStore(spans_config.ring_size),
        senders=HEAD_TREE,
        token="s3cret",
        boot_id="head-boot",
        remote_stages=frozenset({1}),
    )
    detector = Detector(DetectionConfig(), TOPOLOGY, clock.monotonic(), remote_stages=(1,))
    ids = count(1)
    run = Run([], [], receiver.store)
    for tick in range(BEATING_TICKS + SILENT_TICKS):
        now = clock.monotonic()
        if tick < BEATING_TICKS:
            sent_at_ns = SENDER_ORIGIN_NS + tick * TICK_NS + skew_seconds * 1_000_000_000
            spans = [SenderSpan(HEARTBEAT_SPAN, {STAGE_ID: 1}), *SCRIPT.get(tick, [])]
            receiver.ingest(export_body(spans, sent_at_ns, ids), PROTOBUF)
        received = await receiver.collect()
        run.received.append(received)
        detector.observe([*head_observations(now, tick), *received])
        run.reports.append(detector.evaluate(now))
        clock.advance(TICK)
    return run


def run_with_skew(skew_seconds: int) -> Run:
    return asyncio.run(run_script(skew_seconds))


def judgements(
    reports: Sequence[DetectorReport],
) -> list[tuple[float, StageRef, StageState, SilenceCause | None, tuple[EvidenceKind, ...]]]:
    """Every verdict, by when it came, what it says and the kinds of evidence behind it."""
    return [
        (
            verdict.time,
            verdict.stage,
            verdict.state,
            None if verdict.cause is None else verdict.cause.cause,
            tuple(evidence.kind for evidence in verdict.evidence),
        )
        for report in reports
        for verdict in report.verdicts
    ]


def stage_states(reports: Sequence[DetectorReport]) -> list[dict[StageRef, StageState]]:
    return [{status.stage: status.state for status in report.statuses} for report in reports]


@pytest.mark.parametrize("skew_seconds", [HOUR, -HOUR], ids=["an hour fast", "an hour slow"])
def test_a_skewed_sender_clock_changes_no_observation(skew_seconds: int) -> None:
    right, skewed = run_with_skew(0), run_with_skew(skew_seconds)
    # Every field of an Observation is the watchdog's own (`time` is its monotonic clock at
    # receipt); none copies the sender's wall clock, so the whole observation compares.
    assert skewed.received == right.received
    # The skew did reach the receiver: the kept spans carry the sender's times, and only
    # their ends moved, never their lengths.
    right_spans = [r for ref in right.store.stages() for r in right.store.recent(ref)]
    skewed_spans = [r for ref in skewed.store.stages() for r in skewed.store.recent(ref)]
    assert len(skewed_spans) == len(right_spans) > 0
    for right_span, skewed_span in zip(right_spans, skewed_spans, strict=True):
        assert skewed_span.start_unix_nano - right_span.start_unix_nano == skew_seconds * 10**9
        assert skewed_span.duration == right_span.duration


@pytest.mark.parametrize("skew_seconds", [HOUR, -HOUR], ids=["an hour fast", "an hour slow"])
def test_a_skewed_sender_clock_changes_no_verdict(skew_seconds: int) -> None:
    right, skewed = run_with_skew(0), run_with_skew(skew_seconds)
    assert judgements(skewed.reports) == judgements(right.reports)
    assert stage_states(skewed.reports) == stage_states(right.reports)
    # Nothing else in a report may differ either: its times are all the watchdog's.
    assert skewed.reports == right.reports


@pytest.mark.parametrize("skew_seconds", SKEWS, ids=["right", "an hour fast", "an hour slow"])
def test_the_remote_stage_is_read_and_its_silence_judged_whatever_its_clock(
    skew_seconds: int,
) -> None:
    """Guards the comparisons above against agreeing on nothing: the remote stage's spans
    do become observations with their own lengths, and its silence does become a verdict."""
    run = run_with_skew(skew_seconds)
    observed = [obs for batch in run.received for obs in batch]
    kinds = {obs.kind for obs in observed}
    assert {
        ObservationKind.HEARTBEAT,
        ObservationKind.STAGE_SPAN,
        ObservationKind.DENOISE_STEP,
        ObservationKind.DENOISE_DONE,
    } <= kinds
    assert all(obs.stage == REMOTE for obs in observed)
    # Stamped at receipt on the watchdog's clock, whatever the sender's says.
    beats = [obs.time for obs in observed if obs.kind is ObservationKind.HEARTBEAT]
    assert beats == [WATCHDOG_START + tick * TICK for tick in range(BEATING_TICKS)]
    # Each length is the span's own end less its own start, both on the sender's clock.
    stage_spans = [obs for obs in observed if obs.kind is ObservationKind.STAGE_SPAN]
    assert [(obs.request_id, obs.outcome) for obs in stage_spans] == [
        (request, outcome) for request, _, outcome in EXPECTED_STAGE_SPANS
    ]
    assert [obs.value for obs in stage_spans] == pytest.approx(
        [seconds for _, seconds, _ in EXPECTED_STAGE_SPANS]
    )
    steps = [obs.step for obs in observed if obs.kind is ObservationKind.DENOISE_STEP]
    assert steps == [1, 2, 3, 4]

    beating = stage_states(run.reports[:BEATING_TICKS])
    assert beating[-1] == {LOCAL: StageState.HEALTHY, REMOTE: StageState.HEALTHY}
    silent_verdicts = [
        verdict
        for report in run.reports[BEATING_TICKS:]
        for verdict in report.verdicts
        if verdict.stage == REMOTE
    ]
    assert silent_verdicts, "the silent remote stage was never judged"
    assert all(verdict.remote for verdict in silent_verdicts)
    first = silent_verdicts[0]
    assert first.state is StageState.DEAD
    # Its heartbeat timeout ran out on the watchdog's clock, from the last beat's receipt.
    assert EvidenceKind.HEARTBEAT_LOST in {evidence.kind for evidence in first.evidence}
    assert stage_states(run.reports)[-1][REMOTE] is not StageState.HEALTHY
