"""Mapping believed spans to observations: what each span name gives, and a pid's stage
told to the tracker once, when it is news."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest
from fakes import FakeSenders
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from otlp_bodies import batch

from omni_watchdog.clock import FakeClock
from omni_watchdog.probes.otlp_decode import WANTED_KEYS
from omni_watchdog.probes.span_map import SpanMapper
from omni_watchdog.probes.span_store import SpanStore
from omni_watchdog.probes.span_trust import HeldSpans, SenderTrust
from omni_watchdog.probes.spans import REJECTION_REASONS
from omni_watchdog.semconv import (
    DENOISE_STEP_COUNT,
    DENOISE_STEP_INDEX,
    DENOISE_STEP_SPAN,
    DIFFUSION_DENOISE_MS,
    DIFFUSION_REQUEST_SPAN,
    GEN_AI_REQUEST_ID,
    HEARTBEAT_SPAN,
    PROCESS_KIND,
    PROCESS_PID,
    PROCESS_START_TICKS,
    REQUEST_ABANDONED_SPAN,
    REQUEST_ADMITTED_SPAN,
    REQUEST_FINISHED_SPAN,
    REQUEST_ID,
    STAGE_ID,
    STAGE_REQUEST_SPAN,
    VLLM_OMNI_LLM_STAGE_SPAN,
    VLLM_OMNI_REQUEST_SPAN,
    VLLM_REQUEST_SPAN,
)
from omni_watchdog.types import Observation, ObservationKind, StageRef

S1 = StageRef(1)
WORKER = {PROCESS_PID: 40, PROCESS_START_TICKS: 900, PROCESS_KIND: "stage"}
HEARTBEAT: tuple[str, dict[str, object]] = (HEARTBEAT_SPAN, {})
Spans = Sequence[tuple[str, Mapping[str, object]]]


class Harness:
    """A mapper over a store, trusting `senders`, on a fake clock."""

    def __init__(
        self, senders: FakeSenders | None = None, remote_stages: frozenset[int] = frozenset()
    ) -> None:
        self.clock = FakeClock()
        self.rejected = dict.fromkeys(REJECTION_REASONS, 0)
        self.store = SpanStore(16)
        sender_trust = SenderTrust(
            senders or FakeSenders(), self.clock, remote_stages=remote_stages
        )
        self.mapper = SpanMapper(
            self.clock, self.store, sender_trust, HeldSpans(self.rejected, 2.0), self.rejected
        )

    def map(self, resource: Mapping[str, object], spans: Spans) -> list[Observation]:
        observations: list[Observation] = []
        request = ExportTraceServiceRequest.FromString(batch(resource, spans))
        self.mapper.map(request, WANTED_KEYS, observations)
        return observations


def news(observations: Sequence[Observation]) -> list[tuple[int | None, StageRef | None, str]]:
    return [
        (obs.pid, obs.stage, obs.detail)
        for obs in observations
        if obs.kind is ObservationKind.PROCESS_STAGE
    ]


def test_a_pid_s_stage_is_told_once_and_again_only_when_it_changes() -> None:
    harness = Harness()
    assert news(harness.map({**WORKER, STAGE_ID: 1}, [HEARTBEAT, HEARTBEAT])) == [(40, S1, "stage")]
    assert news(harness.map({**WORKER, STAGE_ID: 1}, [HEARTBEAT])) == []
    assert news(harness.map({**WORKER, STAGE_ID: 2}, [HEARTBEAT])) == [(40, StageRef(2), "stage")]
    assert news(harness.map({**WORKER, STAGE_ID: 2, PROCESS_KIND: "engine"}, [HEARTBEAT])) == [
        (40, StageRef(2), "engine")
    ]
    # Another process behind the same pid (another start) is news though its stage is not.
    reused = {**WORKER, STAGE_ID: 2, PROCESS_KIND: "engine", PROCESS_START_TICKS: 950}
    assert news(harness.map(reused, [HEARTBEAT])) == [(40, StageRef(2), "engine")]
    assert harness.store.pid_stages() == {40: (StageRef(2), "engine")}


def test_a_resource_naming_no_pid_or_no_stage_tells_nothing() -> None:
    harness = Harness()
    assert news(harness.map({STAGE_ID: 1}, [HEARTBEAT])) == []
    assert news(harness.map(WORKER, [(HEARTBEAT_SPAN, {STAGE_ID: 1})])) == []
    assert harness.store.pid_stages() == {}


def test_an_unrecorded_sender_s_stage_is_told_once_it_is_recorded() -> None:
    senders = FakeSenders(owned=set())
    harness = Harness(senders)
    assert harness.map({**WORKER, STAGE_ID: 1}, [HEARTBEAT]) == []
    assert harness.mapper.settle() == []
    senders.owned = {(40, 900)}
    settled = harness.mapper.settle()
    assert [obs.kind for obs in settled] == [
        ObservationKind.HEARTBEAT,
        ObservationKind.PROCESS_STAGE,
    ]
    assert news(settled) == [(40, S1, "stage")]


def test_a_remote_sender_s_pid_names_nothing_here() -> None:
    harness = Harness(remote_stages=frozenset({1}))
    assert [obs.kind for obs in harness.map({**WORKER, STAGE_ID: 1}, [HEARTBEAT])] == [
        ObservationKind.HEARTBEAT
    ]
    assert harness.store.pid_stages() == {}


@pytest.mark.parametrize(
    ("spans", "kinds"),
    [
        ([HEARTBEAT, HEARTBEAT], [ObservationKind.HEARTBEAT]),
        (
            [(DENOISE_STEP_SPAN, {REQUEST_ID: "r", DENOISE_STEP_INDEX: 2, DENOISE_STEP_COUNT: 4})],
            [ObservationKind.HEARTBEAT, ObservationKind.DENOISE_STEP],
        ),
        ([(DENOISE_STEP_SPAN, {DENOISE_STEP_INDEX: 0})], [ObservationKind.HEARTBEAT]),
        (
            [(DIFFUSION_REQUEST_SPAN, {DENOISE_STEP_INDEX: 4, DIFFUSION_DENOISE_MS: 100.0})],
            [ObservationKind.DENOISE_DONE],
        ),
        ([(STAGE_REQUEST_SPAN, {REQUEST_ID: "r"})], [ObservationKind.STAGE_SPAN]),
        ([(VLLM_REQUEST_SPAN, {GEN_AI_REQUEST_ID: "r"})], [ObservationKind.STAGE_SPAN]),
        ([(REQUEST_ADMITTED_SPAN, {REQUEST_ID: "r"})], [ObservationKind.REQUEST_ADMITTED]),
        ([(REQUEST_ABANDONED_SPAN, {REQUEST_ID: "r"})], [ObservationKind.REQUEST_ABANDONED]),
        ([(REQUEST_FINISHED_SPAN, {REQUEST_ID: "r"})], [ObservationKind.REQUEST_FINISHED]),
        ([(VLLM_OMNI_LLM_STAGE_SPAN, {})], [ObservationKind.STAGE_SPAN]),
        ([(VLLM_OMNI_REQUEST_SPAN, {GEN_AI_REQUEST_ID: "r"})], [ObservationKind.REQUEST_FINISHED]),
        ([(HEARTBEAT_SPAN, {}), (VLLM_OMNI_LLM_STAGE_SPAN, {})], [ObservationKind.HEARTBEAT]),
        ([("Worker init", {})], []),
    ],
)
def test_each_span_name_gives_its_observations(spans: Spans, kinds: list[ObservationKind]) -> None:
    harness = Harness()
    assert [obs.kind for obs in harness.map({STAGE_ID: 1}, spans)] == kinds
    assert len(harness.store.recent(S1)) == len(spans)
    assert sum(harness.rejected.values()) == 0
