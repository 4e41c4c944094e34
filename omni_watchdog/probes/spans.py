"""The spans probe: an OTLP/HTTP traces receiver that turns spans into observations.

It speaks the OTLP/HTTP protocol as a collector does (`POST /v1/traces`, protobuf or JSON,
gzip), maps the instrument plugin's `omni.*` spans, vLLM's `llm_request` spans and
vLLM-Omni's own stage spans to observations, keeps the last spans of every stage in a
`SpanStore`, and can hand every accepted body to a `SpanForwarder` for an upstream
collector.
"""

from __future__ import annotations

import asyncio
import base64
import enum
import json
import logging
import weakref
import zlib
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from google.rpc import status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from omni_watchdog import pipeline_report
from omni_watchdog.bearer import bearer_matches
from omni_watchdog.config import SpansConfig
from omni_watchdog.log import log_event
from omni_watchdog.probes.peers import SocketOwners, is_loopback
from omni_watchdog.probes.span_store import (
    EMPTY_RESOURCE,
    MAX_ATTRIBUTES,
    MAX_SPAN_BYTES,
    STATUS_CODE_ERROR,
    ResourceInfo,
    SpanStore,
    as_float,
    as_int,
    attribute_value,
    bounded_attributes,
    compact_span,
    stage_of,
)
from omni_watchdog.semconv import (
    DENOISE_STEP_COUNT,
    DENOISE_STEP_INDEX,
    DENOISE_STEP_SECONDS,
    DENOISE_STEP_SPAN,
    DIFFUSION_DENOISE_MS,
    DIFFUSION_REQUEST_SPAN,
    EXCEPTION_EVENT,
    EXCEPTION_MESSAGE,
    GEN_AI_REQUEST_ID,
    HEARTBEAT_SPAN,
    HOST_NAME,
    REQUEST_ABANDONED_SPAN,
    REQUEST_ADMITTED_SPAN,
    REQUEST_FINISHED_SPAN,
    REQUEST_ID,
    REQUEST_STAGE_PATH,
    STAGE_ID,
    STAGE_REPLICA,
    STAGE_REQUEST_SPAN,
    TOPOLOGY_REPORT_INTERVAL_SECONDS,
    TOPOLOGY_SPAN,
    VLLM_INSTRUMENTING_MODULE,
    VLLM_OMNI_DIFFUSION_STAGE_SPAN,
    VLLM_OMNI_INSTRUMENTING_MODULE,
    VLLM_OMNI_LLM_STAGE_SPAN,
    VLLM_OMNI_REQUEST_SPAN,
    VLLM_OMNI_STAGE_ID,
    VLLM_OMNI_STAGE_REPLICA,
    VLLM_REQUEST_SPAN,
)
from omni_watchdog.topology import MAX_STAGES, TopologyError, reported_topology
from omni_watchdog.types import (
    Clock,
    Observation,
    ObservationKind,
    ReceiverStats,
    SpanOutcome,
    SpanSenders,
    StageRef,
    Topology,
)

log = logging.getLogger(__name__)

TRACES_PATH = "/v1/traces"
PROTOBUF = "application/x-protobuf"
JSON = "application/json"

_STAGE_SPAN_NAMES = frozenset({STAGE_REQUEST_SPAN, VLLM_REQUEST_SPAN})
_REQUEST_END_KINDS = {
    REQUEST_ABANDONED_SPAN: ObservationKind.REQUEST_ABANDONED,
    REQUEST_FINISHED_SPAN: ObservationKind.REQUEST_FINISHED,
}
# vLLM-Omni's own spans of one stage's work on a request (see semconv).
_VLLM_OMNI_STAGE_SPANS = frozenset({VLLM_OMNI_LLM_STAGE_SPAN, VLLM_OMNI_DIFFUSION_STAGE_SPAN})
# What a sender without a start time may send: vLLM's and vLLM-Omni's spans of a mapped
# stage, and those of vLLM-Omni's that name no stage (the request, its `llm_request`s).
_ANONYMOUS_STAGE_SPANS = _VLLM_OMNI_STAGE_SPANS | {VLLM_REQUEST_SPAN}
_ANONYMOUS_UNSTAGED_SPANS = frozenset({VLLM_OMNI_REQUEST_SPAN, VLLM_REQUEST_SPAN})
# The plugin's spans, each with whether it shows the plugin at work on the stage it
# names. While they come, vLLM-Omni's own spans of that stage (of the pipeline, for its
# request span) would count the same work twice: they are only kept.
_PLUGIN_SPANS = {
    HEARTBEAT_SPAN: True,
    STAGE_REQUEST_SPAN: True,
    DENOISE_STEP_SPAN: True,
    DIFFUSION_REQUEST_SPAN: True,
    REQUEST_ADMITTED_SPAN: False,
    REQUEST_ABANDONED_SPAN: False,
    REQUEST_FINISHED_SPAN: False,
    TOPOLOGY_SPAN: False,
}
# The plugin's loops beat every second and it reports the topology every ten. vLLM-Omni's
# spans count again this long after the plugin's last span of their stage (its last span
# at all, for the request span).
PLUGIN_PRESENCE_SECONDS = 30.0

# Plain vLLM sets no stage attributes: it is one stage.
VLLM_DEFAULT_STAGE = StageRef(0, 0)

REJECTION_REASONS = (
    "malformed_id",
    "decode_error",
    "too_large",
    "unsupported_media_type",
    "queue_full",
    "unauthorized",
    "unknown_sender",
    "unproven_sender",
    "unknown_stage",
    "body_timeout",
    "body_incomplete",
    "malformed_topology",
)
RESPONSE_STATUSES = (200, 400, 401, 404, 405, 408, 413, 415, 503)
RETRY_AFTER_SECONDS = 1

# google.rpc.Code values for the Status body of a failed export.
_GRPC_INVALID_ARGUMENT = 3
_GRPC_RESOURCE_EXHAUSTED = 8
_GRPC_UNAVAILABLE = 14

_ZERO_TRACE_ID = bytes(16)
_ZERO_SPAN_ID = bytes(8)
_READ_CHUNK = 64 * 1024
_INFLATE_CHUNK = 256 * 1024
_GZIP_WBITS = 16 + zlib.MAX_WBITS

# The only span attributes read on ingestion; the rest are read when a record is built.
_WANTED_KEYS = frozenset(
    {
        STAGE_ID,
        STAGE_REPLICA,
        REQUEST_ID,
        REQUEST_STAGE_PATH,
        GEN_AI_REQUEST_ID,
        VLLM_OMNI_STAGE_ID,
        VLLM_OMNI_STAGE_REPLICA,
        DENOISE_STEP_INDEX,
        DENOISE_STEP_COUNT,
        DENOISE_STEP_SECONDS,
        DIFFUSION_DENOISE_MS,
    }
)
_WANTED_KEY_BYTES = tuple((key, key.encode()) for key in sorted(_WANTED_KEYS))
_NOTHING: dict[str, Any] = {}
# Distinct stage attribute values remembered; senders use a handful, a hostile one more.
_STAGE_CACHE_SIZE = 4096
# Only short attribute values are remembered as cache keys, so a key never holds a body.
_CACHEABLE_TEXT = 32
# Request ids past this length are cut: an id names a request, it does not carry one.
MAX_REQUEST_ID = 256
MAX_STAGE_PATH = 64
# Spans of a process the tracker has not recorded yet (it scans every probes.interval)
# wait this long, at most this many, before they count as from a stranger.
SENDER_GRACE_SECONDS = 2.0
MAX_WAITING_SPANS = 10_000
# A span of the target's that names a stage the watchdog does not know yet waits this long,
# among the waiting spans: the tracker maps a stage's process from its own spans at its next
# scan, and the plugin tells the pipeline again every TOPOLOGY_REPORT_INTERVAL_SECONDS.
UNKNOWN_STAGE_GRACE_SECONDS = TOPOLOGY_REPORT_INTERVAL_SECONDS + SENDER_GRACE_SECONDS


# A host name as a label value: longer ones are cut (DNS names are at most 253 bytes).
MAX_HOST_NAME = 253


class _Trust(enum.Enum):
    """How far the process behind one resource of an export may be believed."""

    TARGET = "target"  # a live recorded process of the target
    UNRECORDED = "unrecorded"  # names itself by pid and start, but is not recorded (yet)
    ANONYMOUS = "anonymous"  # no start time: vLLM's own spans, or a client of its own
    FOREIGN = "foreign"  # another host or another boot
    IMPOSTOR = "impostor"  # not the process whose connection it came on
    REMOTE = "remote"  # a remote stage's process, on another host, known by the token


@dataclass
class _Waiting:
    """The spans of one resource whose sender is not recorded yet, held for its grace."""

    received: float
    pid: int
    start_ticks: int
    count: int
    observations: list[Observation]
    kept: list[tuple[StageRef | None, bytes]]
    resource: ResourceInfo
    # The stages (None: the pipeline) its plugin spans spoke for.
    heard: tuple[StageRef | None, ...]


@dataclass
class _Unplaced:
    """Spans of one resource that name stages not known yet, held for their grace."""

    received: float
    request: ExportTraceServiceRequest
    resource: ResourceInfo
    stages: frozenset[StageRef]
    count: int


# Pids one connection may be asked to have come from: an exporter speaks for its process.
MAX_CLAIMS_CHECKED = 16
# How often one connection's sender is looked for again among the target's processes when
# it was not found: the tracker records new processes, a forger's posts cost a scan each.
TARGET_RECHECK_SECONDS = 1.0


class _Sender:
    """The process end of one connection from this host, known by its socket's inode
    (None: a loopback peer whose socket is in no table, which nothing holds): which
    processes hold it, asked of /proc once per pid (and per second for the whole tree).
    A process whose descriptors the watchdog may not read cannot be checked: it is
    believed, as without the check, and `cannot_check` is called."""

    def __init__(
        self, inode: int | None, owners: SocketOwners, cannot_check: Callable[[str], None]
    ) -> None:
        self._inode = inode
        self._owners = owners
        self._cannot_check = cannot_check
        self._claims: dict[int, bool] = {}
        self._in_target = False
        self._target_checked = -TARGET_RECHECK_SECONDS

    def holds(self, pid: int) -> bool:
        """`pid`'s descriptor table holds this connection's socket."""
        known = self._claims.get(pid)
        if known is None:
            if self._inode is None or len(self._claims) >= MAX_CLAIMS_CHECKED:
                return False
            holding, unreadable = self._owners.holders(self._inode, (pid,))
            known = bool(holding or unreadable)
            if unreadable:
                self._cannot_check(f"the descriptors of pid {pid} cannot be read")
            self._claims[pid] = known
        return known

    def in_target(self, pids: Callable[[], list[int]], now: float) -> bool:
        """One of the target's recorded processes holds the socket."""
        if self._inode is None:
            return False
        if not self._in_target and now - self._target_checked >= TARGET_RECHECK_SECONDS:
            self._target_checked = now
            holding, unreadable = self._owners.holders(self._inode, pids())
            self._in_target = bool(holding or unreadable)
            if unreadable and not holding:
                self._cannot_check(f"the descriptors of pids {sorted(unreadable)} cannot be read")
        return self._in_target


class OtlpError(Exception):
    """An export request refused as a whole, with its HTTP status and rejection reason."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class IngestResult:
    """What one export request gave: spans accepted and rejected, and why some were."""

    accepted: int
    rejected: int
    error_message: str = ""


class SpanForwarder:
    """Posts every accepted body to an upstream OTLP/HTTP endpoint from a background task.

    `submit` never waits: when the queue is full the body is dropped and counted, and a
    failing or slow upstream only fills the queue.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        endpoint: str,
        queue_size: int = 1000,
        timeout: float = 5.0,
    ) -> None:
        self._session = session
        self.endpoint = endpoint
        self._queue: asyncio.Queue[tuple[bytes, str, str]] = asyncio.Queue(maxsize=queue_size)
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._task: asyncio.Task[None] | None = None
        self.forwarded = 0
        self.dropped = 0
        self._bug_logged = False

    def start(self) -> None:
        """Start the background task; call from the running event loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def submit(self, body: bytes, content_type: str, content_encoding: str) -> None:
        """Queue one body as received, or drop and count it when the queue is full."""
        try:
            self._queue.put_nowait((body, content_type, content_encoding))
        except asyncio.QueueFull:
            self.dropped += 1

    async def close(self) -> None:
        """Stop the background task; bodies still queued are dropped and counted."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self.dropped += self._queue.qsize()
        while not self._queue.empty():
            self._queue.get_nowait()

    async def _run(self) -> None:
        while True:
            body, content_type, content_encoding = await self._queue.get()
            headers = {"Content-Type": content_type}
            if content_encoding:
                headers["Content-Encoding"] = content_encoding
            try:
                async with self._session.post(
                    self.endpoint, data=body, headers=headers, timeout=self._timeout
                ) as response:
                    await response.read()
                    ok = 200 <= response.status < 300
            except (aiohttp.ClientError, asyncio.TimeoutError) as error:
                log.debug("forwarding to %s failed: %s", self.endpoint, error)
                ok = False
            except Exception:  # the loop must outlive a bug; the body is dropped, counted
                if not self._bug_logged:
                    log.exception("forwarding to %s failed unexpectedly", self.endpoint)
                    self._bug_logged = True
                ok = False
            if ok:
                self.forwarded += 1
            else:
                self.dropped += 1


def gunzip(data: bytes, limit: int) -> bytes:
    """Inflate a gzip body, refusing (413) as soon as the output would pass `limit` bytes."""
    if not data:
        raise OtlpError(400, "decode_error", "bad gzip body: empty")
    parts: list[bytes] = []
    size = 0
    pending = data
    while pending:
        inflater = zlib.decompressobj(_GZIP_WBITS)
        while not inflater.eof:
            try:
                chunk = inflater.decompress(pending, min(_INFLATE_CHUNK, limit - size + 1))
            except zlib.error as error:
                raise OtlpError(400, "decode_error", f"bad gzip body: {error}") from None
            size += len(chunk)
            if size > limit:
                raise OtlpError(413, "too_large", f"body is over {limit} bytes once decompressed")
            parts.append(chunk)
            pending = inflater.unconsumed_tail
            if not pending and not chunk and not inflater.eof:
                raise OtlpError(400, "decode_error", "bad gzip body: truncated stream")
        # Concatenated gzip members are one body.
        pending = inflater.unused_data
    return b"".join(parts)


def _hex_id_as_base64(value: object) -> str:
    """An OTLP JSON id (hex) in the base64 form protobuf's JSON parser wants; "" if malformed."""
    if not isinstance(value, str):
        return ""
    try:
        return base64.b64encode(bytes.fromhex(value)).decode("ascii")
    except ValueError:
        return ""


def _fix_ids(message: object, keys: tuple[str, ...]) -> None:
    if isinstance(message, dict):
        for key in keys:
            if key in message:
                message[key] = _hex_id_as_base64(message[key])


def _children(message: object, key: str) -> list[Any]:
    children = message.get(key) if isinstance(message, dict) else None
    return children if isinstance(children, list) else []


def decode_json(body: bytes) -> ExportTraceServiceRequest:
    """An OTLP JSON body (hex ids, lowerCamelCase names) as the protobuf request."""
    document = json.loads(body)
    if not isinstance(document, dict):
        raise ValueError("the body is not a JSON object")
    for resource_spans in _children(document, "resourceSpans"):
        for scope_spans in _children(resource_spans, "scopeSpans"):
            for span in _children(scope_spans, "spans"):
                _fix_ids(span, ("traceId", "spanId", "parentSpanId"))
                for link in _children(span, "links"):
                    _fix_ids(link, ("traceId", "spanId"))
    request = ExportTraceServiceRequest()
    json_format.ParseDict(document, request, ignore_unknown_fields=True)
    return request


def decode_body(body: bytes, media_type: str) -> ExportTraceServiceRequest:
    """The export request in `body`, or OtlpError(400) when it cannot be decoded."""
    try:
        if media_type == PROTOBUF:
            return ExportTraceServiceRequest.FromString(body)
        return decode_json(body)
    except (DecodeError, json_format.ParseError, ValueError, RecursionError) as error:
        kind = "protobuf" if media_type == PROTOBUF else "JSON"
        raise OtlpError(400, "decode_error", f"undecodable {kind} body: {error}") from None


def _stage_path(value: object) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_STAGE_PATH:
        return ()
    path = tuple(stage for stage in (as_int(item) for item in value) if stage is not None)
    return path if len(path) == len(value) else ()


def _request_id(found: Mapping[str, Any], key: str, fallback: str = "") -> str:
    value = found.get(key)
    if value is None and fallback:
        value = found.get(fallback)
    if type(value) is str:
        return value if len(value) <= MAX_REQUEST_ID else value[:MAX_REQUEST_ID]
    return "" if value is None else str(value)[:MAX_REQUEST_ID]


def _vllm_omni_request_end(span: Any, found: Mapping[str, Any], now: float) -> Observation:
    """The end of the request an `omni_request` span covers: finished, or abandoned when
    the span failed (vLLM-Omni sends it only for a finished request, so far)."""
    failed = span.status.code == STATUS_CODE_ERROR
    return Observation(
        ObservationKind.REQUEST_ABANDONED if failed else ObservationKind.REQUEST_FINISHED,
        now,
        request_id=_request_id(found, GEN_AI_REQUEST_ID),
    )


def _stage_span(span: Any, stage: StageRef, found: Mapping[str, Any], now: float) -> Observation:
    """The STAGE_SPAN observation of an `omni.stage.request` or `llm_request` span."""
    failed = span.status.code == STATUS_CODE_ERROR
    return Observation(
        ObservationKind.STAGE_SPAN,
        now,
        stage=stage,
        value=max(0, span.end_time_unix_nano - span.start_time_unix_nano) / 1e9,
        outcome=SpanOutcome.ERROR if failed else SpanOutcome.OK,
        detail=_error_detail(span)[:MAX_REQUEST_ID] if failed else "",
        request_id=_request_id(found, REQUEST_ID, GEN_AI_REQUEST_ID),
    )


def _denoise_done(stage: StageRef, found: Mapping[str, Any], now: float) -> Observation:
    """The DENOISE_DONE observation of an `omni.diffusion.request` span, with the seconds
    its steps took on average where it says how many ran and how long they took: an image
    done within a heartbeat interval tells no step of its own."""
    steps = as_int(found.get(DENOISE_STEP_INDEX))
    denoise_ms = as_float(found.get(DIFFUSION_DENOISE_MS))
    seconds = 0.0
    if steps is not None and 1 <= steps <= MAX_DENOISE_STEPS and denoise_ms is not None:
        mean = denoise_ms / 1e3 / steps
        seconds = mean if 0.0 <= mean < float("inf") else 0.0
    return Observation(
        ObservationKind.DENOISE_DONE,
        now,
        stage=stage,
        request_id=_request_id(found, REQUEST_ID),
        value=seconds,
    )


# A denoising loop of more steps than this is not one a server runs.
MAX_DENOISE_STEPS = 100_000


def _denoise_step(stage: StageRef, found: Mapping[str, Any], now: float) -> Observation | None:
    """The DENOISE_STEP observation of an `omni.diffusion.step` span; None when its step
    numbers are missing or make no sense (step 0, or past a count; a count of 0 is one the
    sender does not know)."""
    step = as_int(found.get(DENOISE_STEP_INDEX))
    steps = as_int(found.get(DENOISE_STEP_COUNT))
    if step is None or steps is None or not 1 <= step <= MAX_DENOISE_STEPS:
        return None
    if not (steps == 0 or step <= steps <= MAX_DENOISE_STEPS):
        return None
    previous = found.get(DENOISE_STEP_SECONDS)
    seconds = float(previous) if isinstance(previous, (int, float)) else 0.0
    return Observation(
        ObservationKind.DENOISE_STEP,
        now,
        stage=stage,
        request_id=_request_id(found, REQUEST_ID),
        value=seconds if 0.0 <= seconds < float("inf") else 0.0,
        step=step,
        steps=steps,
    )


_SCALAR_KINDS = frozenset({"string_value", "int_value", "bool_value"})


def _reported_topology(span: Any) -> Topology | None:
    """The topology an `omni.pipeline.topology` span reports, or None when it is malformed:
    a list longer than `MAX_STAGES` is refused before a value of it is read."""
    values: dict[str, object] = {}
    for kv in span.attributes[:MAX_ATTRIBUTES]:
        if kv.key not in pipeline_report.KEYS:
            continue
        if kv.value.WhichOneof("value") != "array_value":
            return None
        items = kv.value.array_value.values
        if len(items) > MAX_STAGES:
            return None
        values[kv.key] = [
            attribute_value(item) if item.WhichOneof("value") in _SCALAR_KINDS else None
            for item in items
        ]
    try:
        return reported_topology(values)
    except TopologyError as error:
        log.debug("topology report refused: %s", error)
        return None


def _error_detail(span: Any) -> str:
    """The status message, else the message of the span's exception event."""
    if span.status.message:
        return str(span.status.message)
    for event in span.events:
        if event.name == EXCEPTION_EVENT:
            for kv in event.attributes:
                if kv.key == EXCEPTION_MESSAGE:
                    return str(attribute_value(kv.value))
    return ""


def _compacted(
    kept: list[tuple[StageRef | None, Any]], per_stage: int | None = None
) -> list[tuple[StageRef | None, bytes]]:
    """The spans as bounded bytes, only the last `per_stage` of each stage: the ring would
    drop the others at once, and serializing is most of what keeping a span costs."""
    if per_stage is not None and len(kept) > per_stage:
        # Keyed by identity: the receiver shares one StageRef per stage, and hashing the
        # dataclass is most of this loop's cost.
        left: dict[int, int] = {}
        tail: list[tuple[StageRef | None, Any]] = []
        for stage, span in reversed(kept):
            room = left.get(id(stage), per_stage)
            if room:
                left[id(stage)] = room - 1
                tail.append((stage, span))
        kept = tail[::-1]
    compacted = []
    for stage, span in kept:
        data = span.SerializeToString()
        compacted.append((stage, data if len(data) <= MAX_SPAN_BYTES else compact_span(span)))
    return compacted


def _asked(
    question: Callable[[StageRef], bool], stage: StageRef, answers: dict[StageRef, bool]
) -> bool:
    """`question(stage)`, asked once per stage and body: the tracker walks its records."""
    answer = answers.get(stage)
    if answer is None:
        answer = answers[stage] = question(stage)
    return answer


def _cacheable(value: object) -> bool:
    return (
        value is None
        or isinstance(value, int)
        or (isinstance(value, str) and len(value) <= _CACHEABLE_TEXT)
    )


class SpanReceiver:
    """OTLP/HTTP `/v1/traces`: decodes, maps to observations, stores, optionally forwards.

    Only spans from the target are evidence. A resource that names its process by pid and
    start (the instrument plugin does) is believed when `senders` owns that process; one
    the tracker has not recorded yet waits up to `sender_grace` for its next scan. vLLM's
    own spans name no start: they count only as `llm_request` progress of a stage the
    tree already maps. Every span names a known stage or none. The rest is counted in
    `spans_rejected` by reason and never reaches the detector or the store.

    The plugin's `omni.pipeline.topology` span becomes a TOPOLOGY observation only from
    such a believed sender (a waiting one's once it is recorded), and only when it is
    well-formed and within the topology bounds; else it is counted as
    `malformed_topology`. Without a process table in view every sender is believed, as
    for heartbeats: there the OTLP token is what keeps strangers out.

    vLLM-Omni's own spans (`llm_processing`, `diffusion_request`, `omni_request`: its
    tracing, still an open pull request) are read beside the plugin's. A stage span of
    theirs counts as vLLM's `llm_request` does, except for a stage the plugin's spans
    spoke for in the last `PLUGIN_PRESENCE_SECONDS`: the plugin counts that work
    already, and theirs is only kept. Their request span ends a request only while no
    plugin span comes at all. vLLM-Omni's tracer also sends vLLM's `llm_request` for
    every LLM stage, naming none: that one is kept, never counted, never stage 0.
    """

    name = "spans"

    def __init__(
        self,
        config: SpansConfig,
        clock: Clock,
        store: SpanStore,
        forwarder: SpanForwarder | None = None,
        *,
        senders: SpanSenders,
        token: str = "",
        boot_id: str = "",
        sender_grace: float = SENDER_GRACE_SECONDS,
        remote_stages: frozenset[int] = frozenset(),
        owners: SocketOwners | None = None,
    ) -> None:
        """`remote_stages`: stage ids on other hosts, whose spans come from processes this
        host cannot check; they are taken only with the token, and only for those stages.
        `owners`: where a loopback connection's process is looked up (None: nowhere, as
        for a body given to `ingest` directly)."""
        if remote_stages and not token:
            raise ValueError("spans of remote stages need the receiver's token")
        self._remote = remote_stages
        # The host each remote stage's spans last named (`host.name`), by stage id.
        self.remote_hosts: dict[int, str] = {}
        self._config = config
        self._clock = clock
        self.store = store
        self._forwarder = forwarder
        self._senders = senders
        self._token = token.encode() if token else None
        self._boot_id = boot_id
        self._sender_grace = sender_grace
        self._owners = owners
        # Each open connection's sender (None: not on this host, or not to be checked).
        self._connections: weakref.WeakKeyDictionary[object, _Sender | None] = (
            weakref.WeakKeyDictionary()
        )
        self._sender_check_failed = False
        self._batches: deque[list[Observation]] = deque()
        self._waiting: deque[_Waiting] = deque()
        self._unplaced: deque[_Unplaced] = deque()
        self._waiting_spans = 0
        self._accepted = 0
        self._rejected = dict.fromkeys(REJECTION_REASONS, 0)
        self._requests = dict.fromkeys(RESPONSE_STATUSES, 0)
        self._stage_refs: dict[tuple[object, object], StageRef | None] = {}
        # When the plugin's spans last spoke for a stage (None: for the pipeline).
        self._plugin_heard: dict[StageRef | None, float] = {}
        self._empty_response = {
            PROTOBUF: ExportTraceServiceResponse().SerializeToString(),
            JSON: b"{}",
        }

    @property
    def stats(self) -> ReceiverStats:
        """A snapshot of the counters, every key present from the start."""
        forwarder = self._forwarder
        return ReceiverStats(
            spans_accepted=self._accepted,
            spans_rejected=dict(self._rejected),
            requests=dict(self._requests),
            forwarded=forwarder.forwarded if forwarder else 0,
            forward_dropped=forwarder.dropped if forwarder else 0,
            queue_depth=len(self._batches),
        )

    async def collect(self) -> list[Observation]:
        """The observations decoded since the last call, oldest first, with those of
        waiting senders the tracker has recorded since."""
        self._settle_waiting()
        observations: list[Observation] = []
        batches = self._batches
        while batches:
            observations.extend(batches.popleft())
        return observations

    def app(self) -> web.Application:
        """The aiohttp application serving `POST /v1/traces`; serve it with
        `omni_watchdog.serving.Listener`, which leaves gzip to the handler so that the size
        cap holds while inflating."""
        app = web.Application(
            middlewares=[self._count_status], client_max_size=self._config.max_body_bytes
        )
        app.router.add_post(TRACES_PATH, self._handle_traces)
        if self._forwarder is not None:
            forwarder = self._forwarder

            async def start_forwarder(_: web.Application) -> None:
                forwarder.start()

            async def stop_forwarder(_: web.Application) -> None:
                await forwarder.close()

            app.on_startup.append(start_forwarder)
            app.on_cleanup.append(stop_forwarder)
        return app

    def check_authorized(self, authorization: str | None) -> None:
        """Refuse (401) an export without the configured bearer token."""
        if self._token is None:
            return
        if not bearer_matches(authorization, self._token):
            raise OtlpError(401, "unauthorized", "missing or wrong bearer token")

    def check_acceptable(self, media_type: str, content_encoding: str) -> None:
        """Refuse what will not be decoded before reading a byte of the body."""
        if media_type not in (PROTOBUF, JSON):
            raise OtlpError(
                415,
                "unsupported_media_type",
                f"unsupported content type {media_type!r}: use {PROTOBUF} or {JSON}",
            )
        if content_encoding not in ("", "identity", "gzip"):
            raise OtlpError(
                415,
                "unsupported_media_type",
                f"unsupported content encoding {content_encoding!r}: use gzip or none",
            )
        if len(self._batches) >= self._config.queue_size:
            raise OtlpError(503, "queue_full", "the receiver's queue is full, retry later")

    def ingest(
        self,
        body: bytes,
        media_type: str,
        content_encoding: str = "",
        sender: _Sender | None = None,
    ) -> IngestResult:
        """Decode, map and store one export request body, exactly as the HTTP handler does;
        `sender`: the process end of the connection it came on, where it can be known."""
        self.check_acceptable(media_type, content_encoding)
        raw = body
        if content_encoding == "gzip":
            body = gunzip(body, self._config.max_body_bytes)
        elif len(body) > self._config.max_body_bytes:
            raise OtlpError(413, "too_large", f"body is over {self._config.max_body_bytes} bytes")
        request = decode_body(body, media_type)
        if media_type == PROTOBUF:
            # Protobuf keeps keys as raw UTF-8, so a key absent from the body is on no span;
            # JSON may escape characters, so there every key is looked for.
            wanted = frozenset(key for key, raw_key in _WANTED_KEY_BYTES if raw_key in body)
        else:
            wanted = _WANTED_KEYS
        observations: list[Observation] = []
        well_formed, malformed = self._map(request, wanted, observations, sender)
        if observations:
            self._batches.append(observations)
        self._rejected["malformed_id"] += malformed
        # Upstream gets all the server's spans, not only those that are evidence here.
        if self._forwarder is not None and well_formed:
            self._forwarder.submit(raw, media_type, content_encoding)
        if not malformed:
            return IngestResult(well_formed, 0)
        return IngestResult(
            well_formed,
            malformed,
            f"{malformed} span(s) rejected: a trace id must be 16 bytes and a span id 8 bytes, "
            "not all zero",
        )

    def _map(
        self,
        request: Any,
        wanted: frozenset[str],
        observations: list[Observation],
        sender: _Sender | None = None,
        *,
        received: float | None = None,
        hold_unplaced: bool = True,
    ) -> tuple[int, int]:
        """File every valid span in the store and append its observations; (well-formed,
        malformed). A span refused for its sender or stage is well-formed, so the exporter
        is not told to fix it: it is counted under its own reason instead. A span of the
        target's that names a stage not known yet is held for `UNKNOWN_STAGE_GRACE_SECONDS`
        unless `hold_unplaced` is off (it is when the held ones are mapped again).

        Of span attributes only the `wanted` keys are read here; records read the rest later.
        `received`: when the body came, when not now.
        """
        now = self._clock.monotonic() if received is None else received
        wanted_count = len(wanted)
        single_key = wanted_count == 1
        hint = 0
        stage_ref = self._stage_ref
        senders = self._senders
        known: dict[StageRef, bool] = {}
        mapped: dict[StageRef, bool] = {}
        well_formed = malformed = 0
        # Consecutive spans name the same stage object: ask about it once in a row.
        checked: StageRef | None = None
        checked_known, checked_mapped = True, False
        for resource_spans in request.resource_spans:
            resource, trust = self._resource(resource_spans, sender)
            if trust is _Trust.FOREIGN or trust is _Trust.IMPOSTOR:
                count = sum(len(scope.spans) for scope in resource_spans.scope_spans)
                reason = "unknown_sender" if trust is _Trust.FOREIGN else "unproven_sender"
                self._rejected[reason] += count
                well_formed += count
                continue
            resource_stage = resource.stage
            resource_id = resource.attributes.get(STAGE_ID)
            # vLLM-Omni's tracer: its `llm_request`s repeat its `llm_processing` spans.
            omni_tracer = (
                resource.attributes.get(VLLM_INSTRUMENTING_MODULE) == VLLM_OMNI_INSTRUMENTING_MODULE
            )
            # Where plugin spans are noted; held back with them while unrecorded.
            heard: dict[StageRef | None, float] = (
                {} if trust is _Trust.UNRECORDED else self._plugin_heard
            )
            spoke = False
            noted: StageRef | None = None
            # What the resource's spans give, held back while its sender is unrecorded.
            gathered = [] if trust is _Trust.UNRECORDED else observations
            kept: list[tuple[StageRef | None, Any]] = []
            # Spans that name a stage not known yet, and those stages.
            unplaced: list[Any] = []
            unplaced_stages: set[StageRef] = set()
            beating: set[StageRef] = set()
            counted = 0
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    trace_id = span.trace_id
                    span_id = span.span_id
                    if (
                        len(trace_id) != 16
                        or len(span_id) != 8
                        or trace_id == _ZERO_TRACE_ID
                        or span_id == _ZERO_SPAN_ID
                    ):
                        malformed += 1
                        continue
                    well_formed += 1
                    key_values = span.attributes
                    found = _NOTHING
                    if wanted and key_values:
                        found = {}
                        if single_key and len(key_values) > hint:
                            # Senders set attributes in one order: look where it was last.
                            kv = key_values[hint]
                            if kv.key in wanted:
                                found[kv.key] = attribute_value(kv.value)
                        if not found:
                            for index, kv in enumerate(key_values):
                                key = kv.key
                                if key in wanted:
                                    found[key] = attribute_value(kv.value)
                                    if len(found) == wanted_count:
                                        hint = index
                                        break
                    # The span's own stage attributes (ours, else vLLM-Omni's) win over its
                    # resource's; a replica belongs to the stage id it came with.
                    if STAGE_ID in found:
                        stage = stage_ref(found[STAGE_ID], found.get(STAGE_REPLICA))
                    elif STAGE_REPLICA in found:
                        stage = stage_ref(resource_id, found[STAGE_REPLICA])
                    elif VLLM_OMNI_STAGE_ID in found:
                        stage = stage_ref(
                            found[VLLM_OMNI_STAGE_ID], found.get(VLLM_OMNI_STAGE_REPLICA)
                        )
                    else:
                        stage = resource_stage
                    name = span.name
                    if stage is None and name == VLLM_REQUEST_SPAN and not omni_tracer:
                        stage = VLLM_DEFAULT_STAGE
                    if stage is not checked:
                        checked = stage
                        checked_known = stage is None or _asked(senders.knows, stage, known)
                        checked_mapped = stage is not None and _asked(senders.maps, stage, mapped)
                    if trust is _Trust.REMOTE:
                        if stage is None or stage.stage_id not in self._remote:
                            # A remote sender speaks for its remote stage, never a local one.
                            self._rejected["unknown_sender"] += 1
                            continue
                    elif not checked_known:
                        if hold_unplaced and trust is not _Trust.ANONYMOUS and stage is not None:
                            # The target's own process names it: the stage may be one the
                            # watchdog learns of in a moment (a diffusion stage's process,
                            # whose title names no stage, is mapped from its own spans).
                            unplaced.append(span)
                            unplaced_stages.add(stage)
                            continue
                        self._rejected["unknown_stage"] += 1
                        continue
                    if trust is _Trust.ANONYMOUS and not (
                        checked_mapped and name in _ANONYMOUS_STAGE_SPANS
                        if stage is not None
                        else name in _ANONYMOUS_UNSTAGED_SPANS
                    ):
                        # No start time: such a span may show a mapped stage's progress,
                        # never a process's liveness or the requests it owes (vLLM-Omni's
                        # request end counts only while no plugin span comes: none owed).
                        self._rejected["unknown_sender"] += 1
                        continue
                    if name == TOPOLOGY_SPAN:
                        topology = _reported_topology(span)
                        if topology is None:
                            self._rejected["malformed_topology"] += 1
                            continue
                        gathered.append(
                            Observation(ObservationKind.TOPOLOGY, now, topology=topology)
                        )
                    counted += 1
                    kept.append((stage, span))
                    plugin = _PLUGIN_SPANS.get(name)
                    if plugin is not None:
                        spoke = True
                        # Once per run of one stage: hashing a StageRef costs.
                        if plugin and stage is not None and stage is not noted:
                            noted = stage
                            if len(heard) >= _STAGE_CACHE_SIZE:  # a remote stage's replicas
                                heard.clear()
                            heard[stage] = now
                    if name in (HEARTBEAT_SPAN, DENOISE_STEP_SPAN):
                        # Heartbeats of one stage in one body say the same thing at `now`;
                        # a denoising step is a beat of the loop that runs it.
                        if stage is not None and stage not in beating:
                            beating.add(stage)
                            gathered.append(
                                Observation(ObservationKind.HEARTBEAT, now, stage=stage)
                            )
                        if name == DENOISE_STEP_SPAN and stage is not None:
                            step = _denoise_step(stage, found, now)
                            if step is not None:
                                gathered.append(step)
                    elif name == DIFFUSION_REQUEST_SPAN:
                        # Its failure is counted from the orchestrator's stage span, once.
                        if stage is not None:
                            gathered.append(_denoise_done(stage, found, now))
                    elif name in _STAGE_SPAN_NAMES:
                        if stage is not None and not (omni_tracer and name == VLLM_REQUEST_SPAN):
                            gathered.append(_stage_span(span, stage, found, now))
                    elif name == REQUEST_ADMITTED_SPAN:
                        gathered.append(
                            Observation(
                                ObservationKind.REQUEST_ADMITTED,
                                now,
                                stage=stage,
                                request_id=_request_id(found, REQUEST_ID),
                                path=_stage_path(found.get(REQUEST_STAGE_PATH)),
                            )
                        )
                    elif name in _REQUEST_END_KINDS:
                        gathered.append(
                            Observation(
                                _REQUEST_END_KINDS[name],
                                now,
                                stage=stage,
                                request_id=_request_id(found, REQUEST_ID),
                            )
                        )
                    elif name in _VLLM_OMNI_STAGE_SPANS:
                        # Counted as `llm_request` is, unless the plugin speaks for the
                        # stage: its `omni.stage.request` counts the same work.
                        if stage is not None and not self._plugin_spoke(stage, now):
                            gathered.append(_stage_span(span, stage, found, now))
                    elif name == VLLM_OMNI_REQUEST_SPAN and not self._plugin_spoke(None, now):
                        gathered.append(_vllm_omni_request_end(span, found, now))
            if spoke:
                heard[None] = now
            if unplaced:
                self._hold_unplaced(now, resource_spans, resource, unplaced, unplaced_stages)
            if trust is _Trust.UNRECORDED and counted:
                self._wait(now, resource, counted, gathered, _compacted(kept), tuple(heard))
            elif counted:
                remote = trust is _Trust.REMOTE
                if remote and resource_stage is not None:
                    self._note_host(resource_stage.stage_id, resource)
                self._file(
                    resource, counted, _compacted(kept, self.store.ring_size), learn=not remote
                )
        return well_formed, malformed

    def _plugin_spoke(self, stage: StageRef | None, now: float) -> bool:
        """The plugin's spans spoke for `stage` (None: for the pipeline) lately."""
        heard = self._plugin_heard.get(stage)
        return heard is not None and now - heard < PLUGIN_PRESENCE_SECONDS

    def _note_host(self, stage_id: int, resource: ResourceInfo) -> None:
        host = str(resource.attributes.get(HOST_NAME, ""))[:MAX_HOST_NAME]
        if host.isprintable():
            self.remote_hosts[stage_id] = host

    def _file(
        self,
        resource: ResourceInfo,
        count: int,
        kept: list[tuple[StageRef | None, bytes]],
        learn: bool = True,
    ) -> None:
        """File one resource's spans (`count` of them, `kept` the ones the rings will hold),
        and, when `learn`, its pid's stage: its sender is the target's (a remote sender's
        pid is another host's and names nothing here)."""
        self._accepted += count
        store = self.store
        filed_stage: StageRef | None = None
        ring = store.ring(None)
        for stage, data in kept:
            if stage is not filed_stage:
                filed_stage, ring = stage, store.ring(stage)
            ring.append((data, resource, stage))
        if learn and resource.pid is not None and resource.stage is not None:
            store.learn_pid(resource.pid, resource.stage, resource.process_kind)

    def _wait(
        self,
        now: float,
        resource: ResourceInfo,
        count: int,
        observations: list[Observation],
        kept: list[tuple[StageRef | None, bytes]],
        heard: tuple[StageRef | None, ...],
    ) -> None:
        if self._waiting_spans + count > MAX_WAITING_SPANS:
            self._rejected["unknown_sender"] += count
            return
        assert resource.pid is not None and resource.start_ticks is not None
        self._waiting.append(
            _Waiting(
                now, resource.pid, resource.start_ticks, count, observations, kept, resource, heard
            )
        )
        self._waiting_spans += count

    def _hold_unplaced(
        self,
        now: float,
        resource_spans: Any,
        resource: ResourceInfo,
        spans: list[Any],
        stages: set[StageRef],
    ) -> None:
        """Hold `spans` (of `stages`, none known yet) until their stages are known or their
        grace is over, then map them again."""
        count = len(spans)
        if (
            self._waiting_spans + count > MAX_WAITING_SPANS
            or resource_spans.resource.ByteSize() > MAX_SPAN_BYTES  # the plugin's: 300 bytes
        ):
            self._rejected["unknown_stage"] += count
            return
        held = ExportTraceServiceRequest()
        copied = held.resource_spans.add()
        copied.resource.CopyFrom(resource_spans.resource)
        held_spans = copied.scope_spans.add().spans
        for span in spans:
            # Held as the store keeps them: what waits is bounded in bytes, not only count.
            if span.ByteSize() <= MAX_SPAN_BYTES:
                held_spans.append(span)
            else:
                held_spans.add().ParseFromString(compact_span(span))
        self._unplaced.append(_Unplaced(now, held, resource, frozenset(stages), count))
        self._waiting_spans += count

    def _settle_unplaced(self, now: float) -> None:
        """Map again the held spans whose stages are all known now, or whose grace is over
        (those that still name an unknown stage are refused then).

        A held resource of a recorded process names that process's own stage: it is learned
        here, the tracker maps the process from it at its next scan, and its stage is known
        then (the spans a process sends of its own stage vouch for it, as filed ones do)."""
        known: dict[StageRef, bool] = {}
        still: deque[_Unplaced] = deque()
        for held in self._unplaced:
            if now - held.received <= UNKNOWN_STAGE_GRACE_SECONDS and not all(
                _asked(self._senders.knows, stage, known) for stage in held.stages
            ):
                resource = held.resource
                if (
                    resource.stage in held.stages
                    and resource.pid is not None
                    and self._senders.owns(resource.pid, resource.start_ticks)
                ):
                    self.store.learn_pid(resource.pid, resource.stage, resource.process_kind)
                still.append(held)
                continue
            self._waiting_spans -= held.count
            observations: list[Observation] = []
            self._map(
                held.request,
                _WANTED_KEYS,
                observations,
                received=held.received,
                hold_unplaced=False,
            )
            if observations:
                self._batches.append(observations)
        self._unplaced = still

    def _settle_waiting(self) -> None:
        """Release the spans of senders recorded since and of stages known since; refuse
        those past their grace."""
        now = self._clock.monotonic()
        if self._unplaced:
            self._settle_unplaced(now)
        if not self._waiting:
            return
        still: deque[_Waiting] = deque()
        for waiting in self._waiting:
            if self._senders.owns(waiting.pid, waiting.start_ticks):
                self._file(waiting.resource, waiting.count, waiting.kept)
                self._plugin_heard.update(dict.fromkeys(waiting.heard, now))
                if waiting.observations:
                    self._batches.append(waiting.observations)
            elif now - waiting.received > self._sender_grace:
                self._rejected["unknown_sender"] += waiting.count
            else:
                still.append(waiting)
                continue
            self._waiting_spans -= waiting.count
        self._waiting = still

    def _stage_ref(self, stage_id: object, replica: object) -> StageRef | None:
        """The stage these attribute values name, one shared object per stage."""
        key = (stage_id, replica)
        try:
            return self._stage_refs[key]
        except KeyError:
            pass
        except TypeError:  # an unhashable value (a list) names no stage anyway
            return stage_of({STAGE_ID: stage_id, STAGE_REPLICA: replica})
        stage = stage_of({STAGE_ID: stage_id, STAGE_REPLICA: replica})
        if not (_cacheable(stage_id) and _cacheable(replica)):
            return stage
        if len(self._stage_refs) >= _STAGE_CACHE_SIZE:
            self._stage_refs.clear()
        self._stage_refs[key] = stage
        return stage

    def _resource(self, resource_spans: Any, sender: _Sender | None) -> tuple[ResourceInfo, _Trust]:
        if not resource_spans.HasField("resource"):
            return EMPTY_RESOURCE, self._trust(EMPTY_RESOURCE, sender)
        attributes = bounded_attributes(resource_spans.resource.attributes)
        stage = self._stage_ref(attributes.get(STAGE_ID), attributes.get(STAGE_REPLICA))
        resource = ResourceInfo.from_attributes(attributes, stage)
        return resource, self._trust(resource, sender)

    def _trust(self, resource: ResourceInfo, sender: _Sender | None = None) -> _Trust:
        # Only an export that carried the token reaches here when one is configured.
        if resource.stage is not None and resource.stage.stage_id in self._remote:
            return _Trust.REMOTE
        if resource.boot_id and self._boot_id and resource.boot_id != self._boot_id:
            return _Trust.FOREIGN
        if sender is not None:
            # A connection from this host: the process it came from must be the one the
            # resource names, or, where it names none, one of the target's.
            if resource.pid is not None:
                if not sender.holds(resource.pid):
                    return _Trust.IMPOSTOR
            elif not sender.in_target(self._senders.live_pids, self._clock.monotonic()):
                return _Trust.IMPOSTOR
        if self._senders.owns(resource.pid, resource.start_ticks):
            return _Trust.TARGET
        if resource.pid is not None and resource.start_ticks is not None:
            return _Trust.UNRECORDED
        return _Trust.ANONYMOUS

    async def _read_body(self, request: web.Request) -> bytes:
        """The request body, refused (413) as soon as it passes the configured cap."""
        limit = self._config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise OtlpError(413, "too_large", f"body is over {limit} bytes")
        parts: list[bytes] = []
        size = 0
        async for chunk in request.content.iter_chunked(_READ_CHUNK):
            size += len(chunk)
            if size > limit:
                raise OtlpError(413, "too_large", f"body is over {limit} bytes")
            parts.append(chunk)
        return b"".join(parts)

    async def _read_body_in_time(self, request: web.Request) -> bytes:
        timeout = self._config.body_timeout
        try:
            return await asyncio.wait_for(self._read_body(request), timeout)
        except asyncio.TimeoutError:
            raise OtlpError(
                408, "body_timeout", f"the body did not arrive within {timeout:g}s"
            ) from None
        except ConnectionResetError:
            # An exporter that gave up waiting (its own timeout) closes mid-body: a client
            # going away, counted, not an error of the watchdog's.
            raise OtlpError(
                400, "body_incomplete", "the connection closed before the body ended"
            ) from None

    async def _handle_traces(self, request: web.Request) -> web.Response:
        media_type = request.content_type
        encoding = request.headers.get("Content-Encoding", "").strip().lower()
        try:
            self.check_authorized(request.headers.get("Authorization"))
            self.check_acceptable(media_type, encoding)
            # Looked up while the connection is surely open: a sender gone by the time its
            # body is read must not slip past the check.
            sender = self._sender_of(request)
            body = await self._read_body_in_time(request)
            result = self.ingest(body, media_type, encoding, sender)
        except OtlpError as error:
            self._rejected[error.reason] += 1
            return self._error_response(error, media_type)
        if not result.rejected:
            return web.Response(body=self._empty_response[media_type], content_type=media_type)
        response = ExportTraceServiceResponse()
        response.partial_success.rejected_spans = result.rejected
        response.partial_success.error_message = result.error_message
        return self._message_response(200, response, media_type)

    def _sender_of(self, request: web.Request) -> _Sender | None:
        """The process end of the request's connection, looked up once per connection;
        None where it is not on this host (the token speaks for it) or cannot be read.
        OtlpError: the connection is gone already."""
        if self._owners is None:
            return None
        transport = request.transport
        if transport is None:
            raise OtlpError(400, "body_incomplete", "the connection closed before the body ended")
        try:
            return self._connections[transport]
        except KeyError:
            pass
        sender = None
        peer, local = transport.get_extra_info("peername"), transport.get_extra_info("sockname")
        if isinstance(peer, tuple) and isinstance(local, tuple):
            try:
                inode = self._owners.peer_inode((peer[0], peer[1]), (local[0], local[1]))
            except (OSError, ValueError) as error:
                self._cannot_check(f"the socket table cannot be read: {error}")
            else:
                # Found here, or on loopback, where every peer is of this host: checked.
                if inode is not None or is_loopback(str(peer[0])):
                    sender = _Sender(inode, self._owners, self._cannot_check)
        self._connections[transport] = sender
        return sender

    def _cannot_check(self, why: str) -> None:
        """Said once: the sender check is off where /proc hides what it needs."""
        if not self._sender_check_failed:
            self._sender_check_failed = True
            log_event(
                log,
                "otlp_sender_check_unavailable",
                logging.WARNING,
                reason=why,
                consequence="spans are taken by their pid and start alone: set a token",
            )

    def _error_response(self, error: OtlpError, media_type: str) -> web.Response:
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if error.status == 503 else None
        if media_type not in (PROTOBUF, JSON):
            return web.Response(status=error.status, text=error.message, headers=headers)
        code = {413: _GRPC_RESOURCE_EXHAUSTED, 503: _GRPC_UNAVAILABLE}.get(
            error.status, _GRPC_INVALID_ARGUMENT
        )
        status = status_pb2.Status(code=code, message=error.message)
        return self._message_response(error.status, status, media_type, headers)

    @staticmethod
    def _message_response(
        status: int, message: Any, media_type: str, headers: Mapping[str, str] | None = None
    ) -> web.Response:
        if media_type == PROTOBUF:
            body = message.SerializeToString()
        else:
            body = json_format.MessageToJson(message, indent=None).encode()
        return web.Response(status=status, body=body, content_type=media_type, headers=headers)

    @web.middleware
    async def _count_status(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            response = await handler(request)
        except web.HTTPException as error:
            self._requests[error.status] = self._requests.get(error.status, 0) + 1
            raise
        self._requests[response.status] = self._requests.get(response.status, 0) + 1
        return response
