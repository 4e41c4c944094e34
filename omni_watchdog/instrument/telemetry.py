"""Stage spans and loop heartbeats, exported over OTLP/HTTP from inside a served process.

Everything here runs inside the server being watched, so no method lets an exception out,
nothing blocks on the network (spans go to a bounded queue drained by the SDK's export
thread), and a collector that is down costs dropped spans, counted, never a slower server.

A headless stage's processes (vLLM-Omni 0.30 `--headless`, on another host than the API)
send every span to two watchdogs: the one beside them, which acts on them, and the head's,
which judges the pipeline's remote stages from those spans alone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
import traceback as traceback_module
import types
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from urllib.parse import urlsplit

from opentelemetry.context import _SUPPRESS_INSTRUMENTATION_KEY, attach, set_value
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, Status, StatusCode, TraceFlags, get_current_span
from opentelemetry.util.types import AttributeValue

from omni_watchdog import __version__, pipeline_report, process_start
from omni_watchdog.instrument.export import WatchdogSpanExporter
from omni_watchdog.semconv import (
    DENOISE_STEP_COUNT,
    DENOISE_STEP_INDEX,
    DENOISE_STEP_SECONDS,
    DENOISE_STEP_SPAN,
    DIFFUSION_DENOISE_MS,
    DIFFUSION_POSTPROCESS_MS,
    DIFFUSION_PREPROCESS_MS,
    DIFFUSION_REQUEST_SPAN,
    EXCEPTION_ESCAPED,
    EXCEPTION_EVENT,
    EXCEPTION_MESSAGE,
    EXCEPTION_STACKTRACE,
    EXCEPTION_TYPE,
    HEARTBEAT_SPAN,
    HOST_NAME,
    PROCESS_KIND,
    PROCESS_PID,
    REQUEST_ABANDONED_SPAN,
    REQUEST_ADMITTED_SPAN,
    REQUEST_FINISHED_SPAN,
    REQUEST_ID,
    REQUEST_STAGE_PATH,
    SERVICE_NAME,
    STAGE_ID,
    STAGE_NAME,
    STAGE_REPLICA,
    STAGE_REQUEST_SPAN,
    TOPOLOGY_REPORT_INTERVAL_SECONDS,
    TOPOLOGY_SPAN,
)
from omni_watchdog.types import Stage

logger = logging.getLogger(__name__)

ENDPOINT_ENV = "OMNI_WATCHDOG_OTLP_ENDPOINT"
TOKEN_ENV = "OMNI_WATCHDOG_OTLP_TOKEN"
HEAD_ENDPOINT_ENV = "OMNI_WATCHDOG_HEAD_OTLP_ENDPOINT"
HEAD_TOKEN_ENV = "OMNI_WATCHDOG_HEAD_OTLP_TOKEN"
HOST_ENV = "OMNI_WATCHDOG_HOST"
STANDARD_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
HEARTBEAT_INTERVAL_ENV = "OMNI_WATCHDOG_HEARTBEAT_INTERVAL"
SERVICE_NAME_ENV = "OTEL_SERVICE_NAME"
DEFAULT_SERVICE_NAME = "omni-watchdog-instrument"
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
TRACES_PATH = "/v1/traces"
PROCESS_KINDS = frozenset({"api", "stage", "engine", "worker", "orchestrator"})

_SCOPE = InstrumentationScope("omni_watchdog.instrument", __version__)
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_UNSET = Status(StatusCode.UNSET)

# A heartbeat reaches the watchdog at most this long after the beat, which keeps the gap
# between two arrivals (interval + delay) well inside the default 3 s heartbeat timeout.
# Every wake-up that finds spans costs one export taken from the watched process, so it is
# no shorter than that margin needs.
SCHEDULE_DELAY_S = 0.5
# Bounded memory when the collector is down; about a minute of a busy stage's spans.
MAX_QUEUE_SIZE = 2048
MAX_EXPORT_BATCH_SIZE = 512
# Short enough that the SDK's exporter never retries with back-off (its first back-off is
# 1 s and it does not retry past its deadline), so one dead collector costs 0.5 s a batch.
EXPORT_TIMEOUT_S = 0.5
# The watchdog's receiver answers in milliseconds, but a loaded host can hold it up: under
# three real vLLM-Omni stages on two cores it took over 0.5 s, and a batch that times out
# is lost with the stage spans and request ends in it, which the watchdog then waits for
# in vain. One batch in flight at a time, on the exporter's own thread, whatever it costs.
WATCHDOG_EXPORT_TIMEOUT_S = 5.0


class _SpanLedger:
    """Counts spans accepted into the queue, settled by an export, and dropped."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._lock = threading.Lock()
        self._in_flight = 0
        self.dropped = 0

    def admit(self, count: int = 1) -> bool:
        """Reserve queue slots for `count` spans; False (and counted as dropped) when full."""
        with self._lock:
            if self._in_flight + count > self._capacity:
                self.dropped += count
                return False
            self._in_flight += count
            return True

    def settle(self, count: int, delivered: bool) -> None:
        with self._lock:
            self._in_flight -= count
            if not delivered:
                self.dropped += count


class _CountingExporter(SpanExporter):
    """Delegates to the real exporter and books every batch as delivered or dropped."""

    def __init__(self, exporter: SpanExporter, ledger: _SpanLedger) -> None:
        self._exporter = exporter
        self._ledger = ledger

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        result = SpanExportResult.FAILURE
        try:
            result = self._exporter.export(spans)
        except Exception:
            logger.debug("span export raised", exc_info=True)
        self._ledger.settle(len(spans), delivered=result is SpanExportResult.SUCCESS)
        return result

    def shutdown(self) -> None:
        self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._exporter.force_flush(timeout_millis)


class _ExportLane:
    """One destination of the fanned-out batches: its own thread, backlog and ledger.

    The watchdog beside a headless stage and the head's watchdog across the network fail
    apart. Exported one after the other, a head that hangs for its whole timeout (5 s) would
    hold back the heartbeats the local watchdog judges the stage by (3 s); so each waits
    only for its own exports, and a destination that stays down loses its own spans,
    counted, once `capacity` of them are waiting, and costs the other nothing.
    """

    def __init__(self, name: str, exporter: SpanExporter, capacity: int) -> None:
        self.ledger = _SpanLedger(capacity)
        self._exporter = _CountingExporter(exporter, self.ledger)
        self._backlog: deque[Sequence[ReadableSpan]] = deque()
        self._changed = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(
            target=self._drain, name=f"omni-watchdog-export-{name}", daemon=True
        )
        self._thread.start()

    def offer(self, spans: Sequence[ReadableSpan]) -> None:
        """Queue one batch for this destination; refused and counted when its backlog is full."""
        if not self.ledger.admit(len(spans)):
            return
        with self._changed:
            self._backlog.append(spans)
            self._changed.notify()

    def _drain(self) -> None:
        # As on the SDK's export thread: an instrumented HTTP client must not trace the
        # exports themselves. The thread's context lives as long as the thread.
        attach(set_value(_SUPPRESS_INSTRUMENTATION_KEY, True))
        while True:
            with self._changed:
                self._changed.wait_for(lambda: bool(self._backlog) or self._closed)
                if not self._backlog:
                    return
                spans = self._backlog.popleft()
            self._exporter.export(spans)

    def close(self) -> None:
        """Export what is queued, then stop and close the exporter."""
        with self._changed:
            self._closed = True
            self._changed.notify()
        self._thread.join()
        self._exporter.shutdown()


class _FanOutExporter(SpanExporter):
    """Hands each batch to every destination's lane and returns without waiting for any."""

    def __init__(self, lanes: Sequence[_ExportLane]) -> None:
        self._lanes = tuple(lanes)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        for lane in self._lanes:
            lane.offer(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        # Every lane drains on its own thread meanwhile: the waits overlap.
        for lane in self._lanes:
            lane.close()


class _BoundedProcessor(SpanProcessor):
    """Refuses spans beyond the queue's capacity itself, so that every drop is counted."""

    def __init__(self, batch: SpanProcessor, ledger: _SpanLedger) -> None:
        self._batch = batch
        self._ledger = ledger

    def on_end(self, span: ReadableSpan) -> None:
        if self._ledger.admit():
            self._batch.on_end(span)

    def shutdown(self) -> None:
        self._batch.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._batch.force_flush(timeout_millis)


class _StageRequestSpan(AbstractContextManager[None]):
    """One `omni.stage.request` span around a block; an exception marks it and goes on."""

    def __init__(self, telemetry: StageTelemetry, request_id: str) -> None:
        self._telemetry = telemetry
        self._request_id = request_id
        self._start_ns = 0

    def __enter__(self) -> None:
        self._start_ns = time.time_ns()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: types.TracebackType | None,
    ) -> None:
        end_ns = time.time_ns()
        try:
            failure = None
            if exc is not None:
                failure = (f"{type(exc).__name__}: {exc}", _exception_event(exc, end_ns))
            self._telemetry.emit(
                STAGE_REQUEST_SPAN,
                self._telemetry.span_attributes(self._request_id),
                self._start_ns,
                end_ns,
                failure=failure,
            )
        except Exception:
            logger.debug("could not record a stage span", exc_info=True)


def _exception_event(exc: BaseException, timestamp_ns: int) -> Event:
    """The semantic-convention `exception` event, as the SDK's `record_exception` writes it."""
    module, name = type(exc).__module__, type(exc).__qualname__
    return Event(
        EXCEPTION_EVENT,
        {
            EXCEPTION_TYPE: f"{module}.{name}" if module and module != "builtins" else name,
            EXCEPTION_MESSAGE: str(exc),
            EXCEPTION_STACKTRACE: "".join(traceback_module.format_exception(exc)),
            EXCEPTION_ESCAPED: "False",
        },
        timestamp=timestamp_ns,
    )


class StageTelemetry:
    """Emits the spans of one process of a served pipeline (a stage, engine, API, ...)."""

    def __init__(
        self,
        exporter: SpanExporter | None,
        *,
        head_exporter: SpanExporter | None = None,
        process_kind: str,
        stage_id: int | None = None,
        stage_name: str | None = None,
        replica: int | None = None,
        service_name: str = DEFAULT_SERVICE_NAME,
        pid: int | None = None,
        host_name: str | None = None,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL_S,
        max_queue_size: int = MAX_QUEUE_SIZE,
        schedule_delay_s: float = SCHEDULE_DELAY_S,
    ) -> None:
        self.process_kind = process_kind
        self.stage_id = stage_id
        self.stage_name = stage_name
        self.replica = replica
        self.heartbeat_interval = heartbeat_interval
        self._ledger = _SpanLedger(max_queue_size)
        self._stage_attributes: dict[str, AttributeValue] = {}
        if stage_id is not None:
            self._stage_attributes[STAGE_ID] = stage_id
        if replica is not None:
            self._stage_attributes[STAGE_REPLICA] = replica
        self._shutdown_lock = threading.Lock()
        self._processor: SpanProcessor | None = None
        self._ids = RandomIdGenerator()
        self._own_lane: _ExportLane | None = None
        self._head_lane: _ExportLane | None = None
        if exporter is None:
            return
        sender = os.getpid() if pid is None else pid
        resource: dict[str, AttributeValue] = {
            SERVICE_NAME: service_name,
            PROCESS_KIND: process_kind,
            PROCESS_PID: sender,
            # The watchdog takes a span as evidence only from a process of the target's
            # tree: pid and start together name this process for life on this host.
            **process_start.sender_attributes(sender),
            # And only on this host: the head's watchdog tells a remote stage's spans by it.
            HOST_NAME: host_name or socket.gethostname(),
        }
        if stage_name is not None:
            resource[STAGE_NAME] = stage_name
        resource.update(self._stage_attributes)
        if head_exporter is not None:
            self._own_lane = _ExportLane("own", exporter, max_queue_size)
            self._head_lane = _ExportLane("head", head_exporter, max_queue_size)
            exporter = _FanOutExporter((self._own_lane, self._head_lane))
        batch = BatchSpanProcessor(
            _CountingExporter(exporter, self._ledger),
            max_queue_size=max_queue_size,
            schedule_delay_millis=schedule_delay_s * 1000,
            max_export_batch_size=min(MAX_EXPORT_BATCH_SIZE, max_queue_size),
            export_timeout_millis=EXPORT_TIMEOUT_S * 1000,
        )
        self._resource = Resource(resource)
        self._processor = _BoundedProcessor(batch, self._ledger)

    @classmethod
    def from_environment(
        cls,
        *,
        process_kind: str,
        stage_id: int | None = None,
        stage_name: str | None = None,
        replica: int | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> StageTelemetry:
        """Configured from `OMNI_WATCHDOG_*`/`OTEL_*` variables; disabled without an endpoint."""
        env = os.environ if environ is None else environ
        if process_kind not in PROCESS_KINDS:
            logger.warning("omni-watchdog: unknown process kind %r", process_kind)
        exporter: SpanExporter | None = None
        head: SpanExporter | None = None
        try:
            exporter = _exporter(env)
        except Exception:
            logger.warning("omni-watchdog: no OTLP exporter, spans disabled", exc_info=True)
        try:
            head = _head_exporter(env)
        except Exception:
            logger.warning("omni-watchdog: no export to the head's watchdog", exc_info=True)
        if exporter is None:
            exporter, head = head, None
        try:
            return cls(
                exporter,
                head_exporter=head,
                process_kind=process_kind,
                stage_id=stage_id,
                stage_name=stage_name,
                replica=replica,
                service_name=env.get(SERVICE_NAME_ENV) or DEFAULT_SERVICE_NAME,
                host_name=env.get(HOST_ENV, "").strip() or None,
                heartbeat_interval=heartbeat_interval(env),
            )
        except Exception:
            logger.warning("omni-watchdog: telemetry setup failed, spans disabled", exc_info=True)
            return cls(None, process_kind=process_kind, stage_id=stage_id, replica=replica)

    @property
    def enabled(self) -> bool:
        return self._processor is not None

    @property
    def dropped_spans(self) -> int:
        """Spans its (local) endpoint never got: refused by a full queue or lost in export."""
        own = self._own_lane.ledger.dropped if self._own_lane is not None else 0
        return self._ledger.dropped + own

    @property
    def head_dropped_spans(self) -> int:
        """The same for the head's watchdog; 0 where spans go to no head."""
        if self._head_lane is None:
            return 0
        return self._ledger.dropped + self._head_lane.ledger.dropped

    def span_attributes(self, request_id: str | None = None) -> dict[str, AttributeValue]:
        """The stage's own attributes, plus the request id when there is one."""
        attributes = dict(self._stage_attributes)
        if request_id is not None:
            attributes[REQUEST_ID] = request_id
        return attributes

    def emit(
        self,
        name: str,
        attributes: dict[str, AttributeValue],
        start_ns: int,
        end_ns: int,
        *,
        root: bool = False,
        failure: tuple[str, Event] | None = None,
    ) -> None:
        """Queue one finished span; a child of the current span unless `root`; `failure`
        (a description and its `exception` event) marks it as an error.

        The spans are built here rather than through a Tracer: they are the watchdog's
        health signals, so the host's sampler (`OTEL_TRACES_SAMPLER`) and kill switch
        (`OTEL_SDK_DISABLED`), which a Tracer obeys, must not thin them out, and the watched
        loop pays a few microseconds a span instead of the Tracer's fifty.
        """
        processor = self._processor
        if processor is None:
            return
        parent: SpanContext | None = None
        if not root:
            current = get_current_span().get_span_context()
            parent = current if current.is_valid else None
        context = SpanContext(
            parent.trace_id if parent is not None else self._ids.generate_trace_id(),
            self._ids.generate_span_id(),
            is_remote=False,
            trace_flags=_SAMPLED,
            trace_state=parent.trace_state if parent is not None else None,
        )
        status: Status = _UNSET
        events: tuple[Event, ...] = ()
        if failure is not None:
            status, events = Status(StatusCode.ERROR, failure[0]), (failure[1],)
        processor.on_end(
            ReadableSpan(
                name,
                context,
                parent,
                self._resource,
                attributes,
                events,
                status=status,
                start_time=start_ns,
                end_time=end_ns,
                instrumentation_scope=_SCOPE,
            )
        )

    def request_admitted(self, request_id: str, stage_path: Sequence[int]) -> None:
        """A request entered the pipeline and is expected to visit these stages in order."""
        if self._processor is None:
            return
        try:
            attributes = self.span_attributes(request_id)
            attributes[REQUEST_STAGE_PATH] = [int(stage) for stage in stage_path]
            now = time.time_ns()
            self.emit(REQUEST_ADMITTED_SPAN, attributes, now, now)
        except Exception:
            logger.debug("could not emit an admitted span", exc_info=True)

    def request_abandoned(self, request_id: str) -> None:
        """The pipeline stopped working on a request before its last stage.

        The client went away, a stage failed or a replica was lost: no stage will send a
        span for it any more, and the watchdog must stop waiting for one.
        """
        if self._processor is None:
            return
        try:
            now = time.time_ns()
            self.emit(REQUEST_ABANDONED_SPAN, self.span_attributes(request_id), now, now)
        except Exception:
            logger.debug("could not emit an abandoned span", exc_info=True)

    def request_finished(self, request_id: str) -> None:
        """The pipeline is done with a request: no stage owes a span for it any more.

        vLLM-Omni 0.30 can finish a request's last stage without a processed output (a
        "raw terminal"), which no stage span reports; without this the watchdog would wait
        for that stage's span, and judge the stage stalled once the wait ran out.
        """
        if self._processor is None:
            return
        try:
            now = time.time_ns()
            self.emit(REQUEST_FINISHED_SPAN, self.span_attributes(request_id), now, now)
        except Exception:
            logger.debug("could not emit a finished span", exc_info=True)

    def stage_request(self, request_id: str) -> AbstractContextManager[None]:
        """A span around this stage's work on one request."""
        if self._processor is None:
            return nullcontext()
        return _StageRequestSpan(self, request_id)

    def record_stage_request(
        self,
        request_id: str,
        start_time_ns: int,
        end_time_ns: int,
        error: str | None = None,
        *,
        stage_id: int | None = None,
        replica: int | None = None,
    ) -> None:
        """The same span as `stage_request`, timed by a caller that cannot wrap the work.

        `stage_id` and `replica` name the stage when the caller (an orchestrator) is not it.
        """
        if self._processor is None:
            return
        try:
            attributes = self.span_attributes(request_id)
            if stage_id is not None:
                attributes[STAGE_ID] = stage_id
            if replica is not None:
                attributes[STAGE_REPLICA] = replica
            failure = None
            if error is not None:
                event = Event(
                    EXCEPTION_EVENT,
                    {EXCEPTION_TYPE: "StageError", EXCEPTION_MESSAGE: error},
                    timestamp=end_time_ns,
                )
                failure = (error, event)
            self.emit(STAGE_REQUEST_SPAN, attributes, start_time_ns, end_time_ns, failure=failure)
        except Exception:
            logger.debug("could not record a stage span", exc_info=True)

    def denoise_step(
        self, request_id: str, step: int, steps: int, previous_seconds: float | None
    ) -> None:
        """One `omni.diffusion.step` span now: the loop running this request's denoising is
        at step `step` of `steps`; the step before took `previous_seconds`."""
        if self._processor is None:
            return
        try:
            attributes = self.span_attributes(request_id)
            attributes[DENOISE_STEP_INDEX] = step
            attributes[DENOISE_STEP_COUNT] = steps
            if previous_seconds is not None:
                attributes[DENOISE_STEP_SECONDS] = previous_seconds
            now = time.time_ns()
            self.emit(DENOISE_STEP_SPAN, attributes, now, now, root=True)
        except Exception:
            logger.debug("could not emit a denoising step", exc_info=True)

    def diffusion_request(
        self,
        request_id: str,
        start_ns: int,
        end_ns: int,
        phases_ms: tuple[float, float, float],
        steps: tuple[int, int],
        error: BaseException | None = None,
    ) -> None:
        """One `omni.diffusion.request` span: a diffusion stage's work on one request, its
        phases (preprocess, denoise, postprocess, in ms) and the steps it ran of its count."""
        if self._processor is None:
            return
        try:
            attributes = self.span_attributes(request_id)
            attributes[DIFFUSION_PREPROCESS_MS] = phases_ms[0]
            attributes[DIFFUSION_DENOISE_MS] = phases_ms[1]
            attributes[DIFFUSION_POSTPROCESS_MS] = phases_ms[2]
            attributes[DENOISE_STEP_INDEX], attributes[DENOISE_STEP_COUNT] = steps
            failure = None
            if error is not None:
                failure = (f"{type(error).__name__}: {error}", _exception_event(error, end_ns))
            self.emit(
                DIFFUSION_REQUEST_SPAN, attributes, start_ns, end_ns, root=True, failure=failure
            )
        except Exception:
            logger.debug("could not record a diffusion request", exc_info=True)

    def heartbeat(self) -> None:
        """One `omni.stage.loop` span now: the loop that calls this is alive."""
        if self._processor is None:
            return
        try:
            # A root span: a beat belongs to no request, whatever context the loop runs in.
            now = time.time_ns()
            self.emit(HEARTBEAT_SPAN, self.span_attributes(), now, now, root=True)
        except Exception:
            logger.debug("could not emit a heartbeat", exc_info=True)

    def report_topology(self, stages: Sequence[Stage]) -> None:
        """One `omni.pipeline.topology` span now: the stage graph this process runs."""
        if self._processor is None:
            return
        try:
            attributes: dict[str, AttributeValue] = dict(pipeline_report.encode_report(stages))
            now = time.time_ns()
            self.emit(TOPOLOGY_SPAN, attributes, now, now, root=True)
        except Exception:
            logger.debug("could not report the topology", exc_info=True)

    async def topology_loop(
        self,
        read_stages: Callable[[], Sequence[Stage]],
        interval: float = TOPOLOGY_REPORT_INTERVAL_SECONDS,
    ) -> None:
        """Report the stages `read_stages` finds now and every `interval`, forever; a read
        that fails or finds none reports nothing that time."""
        if self._processor is None:
            return
        while True:
            stages: Sequence[Stage] = ()
            try:
                stages = read_stages()
            except Exception:
                logger.debug("could not read the pipeline's stages", exc_info=True)
            if stages:
                self.report_topology(stages)
            await asyncio.sleep(interval)

    async def heartbeat_loop(self, interval: float | None = None) -> None:
        """Beat forever on the running event loop, so the beats stop exactly when it blocks."""
        if self._processor is None:
            return
        period = self.heartbeat_interval if interval is None else interval
        while True:
            self.heartbeat()
            await asyncio.sleep(period)

    def shutdown(self, timeout_s: float = 1.0) -> None:
        """Flush what is queued and stop, waiting at most `timeout_s`; safe to call twice."""
        with self._shutdown_lock:
            processor, self._processor = self._processor, None
        if processor is None:
            return
        # The SDK's own shutdown waits up to 30 s for a collector that does not answer.
        stopper = threading.Thread(
            target=processor.shutdown, name="omni-watchdog-telemetry-shutdown", daemon=True
        )
        try:
            stopper.start()
            stopper.join(timeout_s)
        except Exception:
            logger.debug("telemetry shutdown failed", exc_info=True)


def _watchdog_endpoint(environ: Mapping[str, str], variable: str) -> str | None:
    """A watchdog's receiver URL from `variable`; a URL without a path gets /v1/traces."""
    url = environ.get(variable, "").strip()
    if not url:
        return None
    return url if urlsplit(url).path not in ("", "/") else url.rstrip("/") + TRACES_PATH


def traces_endpoint(environ: Mapping[str, str]) -> str | None:
    """The OTLP/HTTP traces URL to export to, or None when none is configured."""
    own = _watchdog_endpoint(environ, ENDPOINT_ENV)
    return own or environ.get(STANDARD_ENDPOINT_ENV, "").strip() or None


def _exporter(environ: Mapping[str, str]) -> SpanExporter | None:
    """The watchdog's own lean exporter for its endpoint; the SDK's for a general collector."""
    own = _watchdog_endpoint(environ, ENDPOINT_ENV)
    if own is not None:
        token = environ.get(TOKEN_ENV, "").strip()
        return WatchdogSpanExporter(own, timeout_s=WATCHDOG_EXPORT_TIMEOUT_S, token=token)
    standard = traces_endpoint(environ)
    if standard is None:
        return None
    # The SDK's exporter reads the rest of `OTEL_EXPORTER_OTLP_*` (headers, TLS, compression).
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=standard, timeout=EXPORT_TIMEOUT_S)


def _head_exporter(environ: Mapping[str, str]) -> SpanExporter | None:
    """The lean exporter for the head's watchdog, or None when there is no head or no token."""
    head = _watchdog_endpoint(environ, HEAD_ENDPOINT_ENV)
    if head is None:
        return None
    token = environ.get(HEAD_TOKEN_ENV, "").strip()
    if not token:
        # The head's receiver refuses a remote sender without its token, every batch.
        logger.warning(
            "omni-watchdog: %s is set but %s is not: no spans go to the head's watchdog",
            HEAD_ENDPOINT_ENV,
            HEAD_TOKEN_ENV,
        )
        return None
    return WatchdogSpanExporter(head, timeout_s=WATCHDOG_EXPORT_TIMEOUT_S, token=token)


def heartbeat_interval(environ: Mapping[str, str]) -> float:
    """Seconds between heartbeats from `OMNI_WATCHDOG_HEARTBEAT_INTERVAL`, default 1."""
    text = environ.get(HEARTBEAT_INTERVAL_ENV, "").strip()
    if not text:
        return DEFAULT_HEARTBEAT_INTERVAL_S
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if value > 0:
        return value
    logger.warning("omni-watchdog: ignoring %s=%r", HEARTBEAT_INTERVAL_ENV, text)
    return DEFAULT_HEARTBEAT_INTERVAL_S
