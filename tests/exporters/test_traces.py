"""Incident traces over real OTLP/HTTP protobuf, into a capture server on loopback."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time

import pytest
from exporters.otlp_capture import CaptureServer, attributes
from exporters.watchdog_state import scripted_state
from ports import free_port

from omni_watchdog.exporters.traces import IncidentTraces
from omni_watchdog.semconv import (
    INCIDENT_CAUSE,
    INCIDENT_EVIDENCE,
    INCIDENT_ID,
    INCIDENT_MODE,
    INCIDENT_OUTCOME,
    INCIDENT_SPAN,
    INCIDENT_STAGES,
    INCIDENT_TARGET,
    LADDER_DETAIL,
    LADDER_OUTCOME,
    LADDER_STEP,
    LADDER_STEP_SPAN_PREFIX,
    LADDER_TARGETS,
    SERVICE_NAME,
)
from omni_watchdog.types import (
    Evidence,
    EvidenceKind,
    Incident,
    IncidentOutcome,
    Mode,
    StageRef,
    StageState,
    StepName,
    StepOutcome,
    StepResult,
    Verdict,
)

OPENED = 1_700_000_015.0


def captured(*incidents: Incident) -> CaptureServer:
    """Export a state in which the incidents just closed to a fresh capture server, and
    wait until they arrived."""
    state = scripted_state().state
    remediation = dataclasses.replace(state.remediation, closed_now=incidents)
    closing = dataclasses.replace(state, remediation=remediation)

    async def scenario() -> CaptureServer:
        server = CaptureServer()
        await server.start()
        traces = IncidentTraces(server.url)
        try:
            traces.export(closing)
            assert await asyncio.to_thread(traces.flush)
        finally:
            await asyncio.to_thread(traces.shutdown)
            await server.stop()
        return server

    return asyncio.run(scenario())


def incident() -> Incident:
    ref = StageRef(1)
    verdict = Verdict(
        ref,
        StageState.STALLED,
        10.0,
        (
            Evidence(EvidenceKind.HEARTBEAT_LOST, ref, 5.0, "no loop heartbeat for 4.0s"),
            Evidence(EvidenceKind.SPAN_OVERDUE, ref, 6.0, "3 request(s) past the deadline"),
        ),
    )
    return Incident(
        incident_id="20231114T221335Z-a1b2c3",
        target="http://127.0.0.1:8000",
        mode=Mode.ENFORCE,
        opened=OPENED,
        cause="stage 1.0 stalled",
        verdicts=(verdict,),
        steps=(
            StepResult(StepName.CAPTURE, StepOutcome.OK, OPENED, 0.75, "4 stacks"),
            StepResult(StepName.TERMINATE, StepOutcome.TIMEOUT, OPENED + 0.75, 3.0, "", (100,)),
            StepResult(StepName.KILL, StepOutcome.RECOVERED, OPENED + 3.75, 0.5, "", (100, 101)),
            StepResult(StepName.VERIFY, StepOutcome.NOT_RECOVERED, OPENED + 4.25, 10.0, "held"),
        ),
        outcome=IncidentOutcome.LEAKED,
        closed=OPENED + 14.25,
    )


def test_an_incident_is_one_trace_with_a_child_per_step() -> None:
    capture = captured(incident())
    assert capture.content_types == ["application/x-protobuf"]
    resource = capture.requests[0].resource_spans[0].resource
    assert attributes(resource)[SERVICE_NAME] == "omni-watchdog"
    spans = capture.spans()
    assert [s.name for s in spans].count(INCIDENT_SPAN) == 1
    root = next(s for s in spans if s.name == INCIDENT_SPAN)
    children = [s for s in spans if s is not root]
    assert [s.name for s in children] == [
        LADDER_STEP_SPAN_PREFIX + step for step in ("capture", "terminate", "kill", "verify")
    ]
    assert attributes(root) == {
        INCIDENT_ID: "20231114T221335Z-a1b2c3",
        INCIDENT_TARGET: "http://127.0.0.1:8000",
        INCIDENT_CAUSE: "stage 1.0 stalled",
        INCIDENT_MODE: "enforce",
        INCIDENT_OUTCOME: "leaked",
        INCIDENT_STAGES: ["1.0"],
        INCIDENT_EVIDENCE: ["heartbeat_lost", "span_overdue"],
    }
    assert root.status.code == 2  # STATUS_CODE_ERROR: a leak needs a person
    assert root.start_time_unix_nano == int(OPENED * 1e9)
    assert root.end_time_unix_nano == int((OPENED + 14.25) * 1e9)
    for child in children:
        assert child.trace_id == root.trace_id
        assert child.parent_span_id == root.span_id
    kill = attributes(children[2])
    assert kill == {
        LADDER_STEP: "kill",
        LADDER_OUTCOME: "recovered",
        LADDER_DETAIL: "",
        LADDER_TARGETS: [100, 101],
    }
    assert children[2].start_time_unix_nano == int((OPENED + 3.75) * 1e9)
    assert children[2].end_time_unix_nano == int((OPENED + 4.25) * 1e9)
    assert children[2].status.code == 0
    assert children[1].status.code == 2  # the terminate step timed out


def test_two_incidents_are_two_traces() -> None:
    first = incident()
    capture = captured(first, dataclasses.replace(first, incident_id="second", steps=()))
    roots = [s for s in capture.spans() if s.name == INCIDENT_SPAN]
    assert len({s.trace_id for s in roots}) == 2
    assert all(not s.parent_span_id for s in roots)


def test_an_unreachable_endpoint_never_blocks_nor_raises() -> None:
    traces = IncidentTraces(f"http://127.0.0.1:{free_port()}/v1/traces", timeout=0.5)
    try:
        begun = time.monotonic()
        traces.export_incident(incident())
        assert time.monotonic() - begun < 0.1
    finally:
        begun = time.monotonic()
        traces.shutdown()
        # The failed export is the SDK's to log; shutting down stays bounded by the timeout.
        assert time.monotonic() - begun < 3.0


def test_an_incident_that_cannot_be_traced_is_logged_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    traces = IncidentTraces(f"http://127.0.0.1:{free_port()}/v1/traces", timeout=0.5)
    broken = dataclasses.replace(
        incident(), steps=(StepResult(StepName.CAPTURE, StepOutcome.OK, math.nan, 1.0),)
    )
    try:
        traces.export_incident(broken)
    finally:
        traces.shutdown()
    assert any(r.getMessage() == "incident_trace_failed" for r in caplog.records)
