"""A diffusion stage's spans, as the plugin's telemetry sends them, read by the receiver.

A denoising step span is a beat of the stage and its step; one with step numbers that make
no sense still beats, and tells no step.
"""

from __future__ import annotations

import asyncio

import pytest
from fakes import FakeSenders
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from span_evidence import evidence

from omni_watchdog.clock import FakeClock
from omni_watchdog.config import SpansConfig
from omni_watchdog.instrument.telemetry import StageTelemetry
from omni_watchdog.probes.otlp_decode import PROTOBUF
from omni_watchdog.probes.span_store import SpanStore
from omni_watchdog.probes.spans import SpanReceiver
from omni_watchdog.types import Observation, ObservationKind, StageRef

DIT = StageRef(1, 0)


def observations_of(send: list[tuple[str, int, int, float | None]]) -> list[Observation]:
    """What the receiver makes of `denoise_step(request, step, steps, previous)` calls and
    one failed diffusion request, sent by stage 1's telemetry."""
    captured = InMemorySpanExporter()
    telemetry = StageTelemetry(captured, process_kind="stage", stage_id=1, replica=0)
    for request_id, step, steps, previous in send:
        telemetry.denoise_step(request_id, step, steps, previous)
    telemetry.diffusion_request(
        "img-1", 1_000, 2_000_000, (1.0, 0.5, 0.25), (2, 4), RuntimeError("injected")
    )
    telemetry.shutdown()
    body = encode_spans(captured.get_finished_spans()).SerializeToString()
    config = SpansConfig()
    receiver = SpanReceiver(
        config, FakeClock(start=500.0), SpanStore(config.ring_size), senders=FakeSenders()
    )
    result = receiver.ingest(body, PROTOBUF)
    assert result.rejected == 0
    return evidence(asyncio.run(receiver.collect()))


def test_a_step_span_is_a_beat_and_the_step_of_its_request() -> None:
    found = observations_of([("img-1", 1, 4, None), ("img-1", 2, 4, 0.75)])
    beats = [o for o in found if o.kind is ObservationKind.HEARTBEAT]
    steps = [o for o in found if o.kind is ObservationKind.DENOISE_STEP]
    # Beats of one stage in one body say the same thing once.
    assert [o.stage for o in beats] == [DIT]
    assert [(o.stage, o.request_id, o.step, o.steps, o.value) for o in steps] == [
        (DIT, "img-1", 1, 4, 0.0),
        (DIT, "img-1", 2, 4, 0.75),
    ]
    # The diffusion request's span ends its denoising; its failure is counted from the
    # orchestrator's stage span, once.
    assert not [o for o in found if o.kind is ObservationKind.STAGE_SPAN]
    assert [(o.kind, o.stage, o.request_id) for o in found[-1:]] == [
        (ObservationKind.DENOISE_DONE, DIT, "img-1")
    ]
    # Its 2 steps took 0.5 ms: what an image done between two looks teaches of its steps.
    assert found[-1].value == pytest.approx(0.25e-3)


def test_steps_that_make_no_sense_beat_and_tell_no_step() -> None:
    found = observations_of([("img-1", 0, 4, None), ("img-1", 5, 4, 1.0)])
    assert [o.kind for o in found] == [ObservationKind.HEARTBEAT, ObservationKind.DENOISE_DONE]


def test_a_step_of_an_unknown_count_is_a_step() -> None:
    # A pipeline that calls its DiT twice a step outruns its count; the plugin then sends 0.
    found = observations_of([("img-1", 9, 0, 1.0)])
    assert [(o.kind, o.step, o.steps) for o in found] == [
        (ObservationKind.HEARTBEAT, 0, 0),
        (ObservationKind.DENOISE_STEP, 9, 0),
        (ObservationKind.DENOISE_DONE, 0, 0),
    ]
