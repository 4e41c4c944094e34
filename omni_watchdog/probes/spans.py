"""The spans probe: an OTLP/HTTP traces receiver that turns spans into observations.

It speaks the OTLP/HTTP protocol as a collector does (`POST /v1/traces`, protobuf or JSON,
gzip), maps the instrument plugin's `omni.*` spans, vLLM's `llm_request` spans and
vLLM-Omni's own stage spans to observations, keeps the last spans of every stage in a
`SpanStore`, and can hand every accepted body to a `SpanForwarder` for an upstream
collector. A body goes one way: `otlp_transport` reads it, `otlp_decode` decodes it,
`span_trust` and `span_map` judge and map its spans, and the store keeps them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

from aiohttp import web

from omni_watchdog.config import SpansConfig
from omni_watchdog.probes.otlp_decode import OtlpError, check_decodable, decode_export
from omni_watchdog.probes.otlp_transport import IngestResult, TracesEndpoint
from omni_watchdog.probes.span_forward import SpanForwarder
from omni_watchdog.probes.span_map import SpanMapper
from omni_watchdog.probes.span_store import SpanStore
from omni_watchdog.probes.span_trust import (
    SENDER_GRACE_SECONDS,
    ConnectionSender,
    ConnectionSenders,
    HeldSpans,
    SenderTrust,
)
from omni_watchdog.types import Clock, Observation, ReceiverStats, SocketHolders, SpanSenders

# The longest a receiver with nothing new rests: it is woken by news, so this only bounds
# what a missed wake-up could cost.
QUIET_REST = 1.0
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
    tracing, still an open pull request) are read beside the plugin's, as `SpanMapper`
    says. A pid's stage that a believed local resource names becomes a PROCESS_STAGE
    observation when it is news, for the tracker to map the process by.
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
        owners: SocketHolders | None = None,
    ) -> None:
        """`remote_stages`: stage ids on other hosts, whose spans come from processes this
        host cannot check; they are taken only with the token, and only for those stages.
        `owners`: where a loopback connection's process is looked up (None: nowhere, as
        for a body given to `ingest` directly)."""
        if remote_stages and not token:
            raise ValueError("spans of remote stages need the receiver's token")
        self._config = config
        self.store = store
        self._forwarder = forwarder
        self._batches: deque[list[Observation]] = deque()
        self._news = asyncio.Event()
        self._rejected = dict.fromkeys(REJECTION_REASONS, 0)
        self._trust = SenderTrust(senders, clock, boot_id=boot_id, remote_stages=remote_stages)
        self._mapper = SpanMapper(
            clock, store, self._trust, HeldSpans(self._rejected, sender_grace), self._rejected
        )
        self._endpoint = TracesEndpoint(
            config,
            self,
            self._rejected,
            token=token,
            connections=None if owners is None else ConnectionSenders(owners),
        )

    @property
    def remote_hosts(self) -> dict[int, str]:
        """The host each remote stage's spans last named (`host.name`), by stage id."""
        return self._trust.remote_hosts

    @property
    def stats(self) -> ReceiverStats:
        """A snapshot of the counters, every key present from the start."""
        forwarder = self._forwarder
        return ReceiverStats(
            spans_accepted=self._mapper.accepted,
            spans_rejected=dict(self._rejected),
            requests=dict(self._endpoint.requests),
            forwarded=forwarder.forwarded if forwarder else 0,
            forward_dropped=forwarder.dropped if forwarder else 0,
            queue_depth=len(self._batches),
        )

    async def collect(self) -> list[Observation]:
        """The observations decoded since the last call, oldest first, with those of
        waiting senders the tracker has recorded since."""
        self._news.clear()
        settled = self._mapper.settle()
        if settled:
            self._batches.append(settled)
        observations: list[Observation] = []
        batches = self._batches
        while batches:
            observations.extend(batches.popleft())
        return observations

    async def rest(self, seconds: float) -> None:
        """Wait `seconds`, then for a body that brings observations: a receiver with
        nothing new is not collected at all. While spans are held for their sender or
        stage, every `seconds`: they are settled only when collected. `QUIET_REST` bounds
        the wait all the same."""
        await asyncio.sleep(seconds)
        if self._news.is_set() or self._mapper.holds_spans:
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._news.wait(), max(0.0, QUIET_REST - seconds))

    def app(self) -> web.Application:
        """The aiohttp application serving `POST /v1/traces`; serve it with
        `omni_watchdog.serving.Listener`, which leaves gzip to the handler so that the size
        cap holds while inflating."""
        app = self._endpoint.app()
        if self._forwarder is not None:
            forwarder = self._forwarder

            async def start_forwarder(_: web.Application) -> None:
                forwarder.start()

            async def stop_forwarder(_: web.Application) -> None:
                await forwarder.close()

            app.on_startup.append(start_forwarder)
            app.on_cleanup.append(stop_forwarder)
        return app

    def check_acceptable(self, media_type: str, content_encoding: str) -> None:
        """Refuse what will not be decoded, or what the queue has no room for, before
        reading a byte of the body."""
        check_decodable(media_type, content_encoding)
        if len(self._batches) >= self._config.queue_size:
            raise OtlpError(503, "queue_full", "the receiver's queue is full, retry later")

    def ingest(
        self,
        body: bytes,
        media_type: str,
        content_encoding: str = "",
        sender: ConnectionSender | None = None,
    ) -> IngestResult:
        """Decode, map and store one export request body, exactly as the HTTP handler does;
        `sender`: the process end of the connection it came on, where it can be known."""
        self.check_acceptable(media_type, content_encoding)
        export = decode_export(body, media_type, content_encoding, self._config.max_body_bytes)
        observations: list[Observation] = []
        well_formed, malformed = self._mapper.map(
            export.request, export.wanted, observations, sender
        )
        if observations:
            self._batches.append(observations)
            self._news.set()
        self._rejected["malformed_id"] += malformed
        # Upstream gets all the server's spans, not only those that are evidence here.
        if self._forwarder is not None and well_formed:
            self._forwarder.submit(body, media_type, content_encoding)
        if not malformed:
            return IngestResult(well_formed, 0)
        return IngestResult(
            well_formed,
            malformed,
            f"{malformed} span(s) rejected: a trace id must be 16 bytes and a span id 8 bytes, "
            "not all zero",
        )
