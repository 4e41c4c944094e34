"""Incident traces: one `omni.incident` span per closed incident, a child per ladder step.

Spans are built after the fact with the real wall times the policy recorded, on a private
TracerProvider (the instrument plugin or the host may own the global one), and exported
over OTLP/HTTP protobuf by a BatchSpanProcessor: its own thread does the network I/O, so
`export` never waits on the collector, and a failure is logged, never raised.
"""

from __future__ import annotations

import logging

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Status, StatusCode

from omni_watchdog import __version__, semconv
from omni_watchdog.log import log_event
from omni_watchdog.types import Incident, IncidentOutcome, StepOutcome, StepResult, WatchdogState

logger = logging.getLogger("omni_watchdog.exporters.traces")

SERVICE_NAME = "omni-watchdog"
# Incidents that end like this need a person: their spans are marked as errors.
FAILED_INCIDENTS = (IncidentOutcome.LEAKED, IncidentOutcome.FAILED)
FAILED_STEPS = (StepOutcome.FAILED, StepOutcome.TIMEOUT, StepOutcome.NOT_RECOVERED)
EXPORT_TIMEOUT_SECONDS = 5.0


def _nanos(wall_seconds: float) -> int:
    return int(wall_seconds * 1e9)


class IncidentTraces:
    """Exports each closed incident as a trace to an OTLP/HTTP traces endpoint."""

    def __init__(self, endpoint: str, timeout: float = EXPORT_TIMEOUT_SECONDS) -> None:
        self.endpoint = endpoint
        resource = Resource.create({semconv.SERVICE_NAME: SERVICE_NAME})
        self._provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        exporter = OTLPSpanExporter(endpoint=endpoint, timeout=timeout)
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("omni_watchdog.incidents", __version__)

    def export(self, state: WatchdogState) -> None:
        """Export the incidents that closed in the evaluation that made `state`."""
        for incident in state.remediation.closed_now:
            self.export_incident(incident)

    def export_incident(self, incident: Incident) -> None:
        """Queue the incident's spans for export; never raises into the watchdog."""
        try:
            self._record(incident)
        except Exception as error:  # a tracing failure must never reach the policy
            log_event(
                logger,
                "incident_trace_failed",
                logging.WARNING,
                id=incident.incident_id,
                reason=str(error) or type(error).__name__,
            )

    def flush(self, timeout_seconds: float = EXPORT_TIMEOUT_SECONDS) -> bool:
        """Wait for queued spans to be exported (blocking: call it from a thread)."""
        return self._provider.force_flush(int(timeout_seconds * 1000))

    def shutdown(self) -> None:
        """Export what is queued and stop the export thread (blocking: call it from a thread)."""
        self._provider.shutdown()

    def _record(self, incident: Incident) -> None:
        closed = incident.closed if incident.closed is not None else incident.opened
        ends = [step.started + step.duration for step in incident.steps]
        # The incident span must cover its steps even if the clock stepped back meanwhile.
        end = max([closed, *ends])
        root = self._tracer.start_span(
            semconv.INCIDENT_SPAN,
            context=trace.set_span_in_context(trace.INVALID_SPAN),
            start_time=_nanos(min([incident.opened, *(s.started for s in incident.steps)])),
            attributes={
                semconv.INCIDENT_ID: incident.incident_id,
                semconv.INCIDENT_TARGET: incident.target,
                semconv.INCIDENT_CAUSE: incident.cause,
                semconv.INCIDENT_MODE: incident.mode.value,
                semconv.INCIDENT_OUTCOME: incident.outcome.value,
                semconv.INCIDENT_STAGES: sorted({str(v.stage) for v in incident.verdicts}),
                semconv.INCIDENT_EVIDENCE: sorted(
                    {e.kind.value for v in incident.verdicts for e in v.evidence}
                ),
            },
        )
        if incident.outcome in FAILED_INCIDENTS:
            root.set_status(Status(StatusCode.ERROR, f"incident {incident.outcome.value}"))
        parent = trace.set_span_in_context(root)
        for step in incident.steps:
            self._record_step(step, parent)
        root.end(end_time=_nanos(end))

    def _record_step(self, step: StepResult, parent: Context) -> None:
        span = self._tracer.start_span(
            semconv.LADDER_STEP_SPAN_PREFIX + step.step.value,
            context=parent,
            start_time=_nanos(step.started),
            attributes={
                semconv.LADDER_STEP: step.step.value,
                semconv.LADDER_OUTCOME: step.outcome.value,
                semconv.LADDER_DETAIL: step.detail,
                semconv.LADDER_TARGETS: list(step.targets),
            },
        )
        if step.outcome in FAILED_STEPS:
            span.set_status(Status(StatusCode.ERROR, step.outcome.value))
        span.end(end_time=_nanos(step.started + step.duration))
