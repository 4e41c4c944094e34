"""Whose spans are believed: the sender a resource names, proven where it can be.

A resource names its process by pid and start (the instrument plugin's), by pid alone
(vLLM's), or not at all. On a connection from this host the process holding its socket
must be the one named (else `unproven_sender`); the tracker's records then say whether
that process is the target's. Spans of a process it has not recorded yet, and spans that
name a stage not known yet, are held for a grace, bounded, then judged again. What is
refused is counted under its reason and goes no further.
"""

from __future__ import annotations

import enum
import logging
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from omni_watchdog.log import log_event
from omni_watchdog.probes.otlp_decode import ResourceInfo
from omni_watchdog.probes.peers import is_loopback
from omni_watchdog.probes.span_store import MAX_SPAN_BYTES, compact_span
from omni_watchdog.semconv import (
    HOST_NAME,
    TOPOLOGY_REPORT_INTERVAL_SECONDS,
    VLLM_OMNI_DIFFUSION_STAGE_SPAN,
    VLLM_OMNI_LLM_STAGE_SPAN,
    VLLM_OMNI_REQUEST_SPAN,
    VLLM_REQUEST_SPAN,
)
from omni_watchdog.types import Clock, Observation, SocketHolders, SpanSenders, StageRef

log = logging.getLogger(__name__)

# What a sender without a start time may send: vLLM's and vLLM-Omni's spans of a mapped
# stage, and those of vLLM-Omni's that name no stage (the request, its `llm_request`s).
_ANONYMOUS_STAGE_SPANS = frozenset(
    {VLLM_OMNI_LLM_STAGE_SPAN, VLLM_OMNI_DIFFUSION_STAGE_SPAN, VLLM_REQUEST_SPAN}
)
_ANONYMOUS_UNSTAGED_SPANS = frozenset({VLLM_OMNI_REQUEST_SPAN, VLLM_REQUEST_SPAN})

# Pids one connection may be asked to have come from: an exporter speaks for its process.
MAX_CLAIMS_CHECKED = 16
# How often one connection's sender is looked for again among the target's processes when
# it was not found: the tracker records new processes, a forger's posts cost a scan each.
TARGET_RECHECK_SECONDS = 1.0
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


class Trust(enum.Enum):
    """How far the process behind one resource of an export may be believed."""

    TARGET = "target"  # a live recorded process of the target
    UNRECORDED = "unrecorded"  # names itself by pid and start, but is not recorded (yet)
    ANONYMOUS = "anonymous"  # no start time: vLLM's own spans, or a client of its own
    FOREIGN = "foreign"  # another host or another boot
    IMPOSTOR = "impostor"  # not the process whose connection it came on
    REMOTE = "remote"  # a remote stage's process, on another host, known by the token


class Verdict(enum.Enum):
    """What becomes of one span of a believed resource."""

    TAKEN = "taken"
    HELD = "held"  # it names a stage not known yet: held for its grace
    UNKNOWN_SENDER = "unknown_sender"
    UNKNOWN_STAGE = "unknown_stage"


class ConnectionSender:
    """The process end of one connection from this host, known by its socket's inode
    (None: a loopback peer whose socket is in no table, which nothing holds): which
    processes hold it, asked of /proc once per pid (and per second for the whole tree).
    A process whose descriptors the watchdog may not read cannot be checked: it is
    believed, as without the check, and `cannot_check` is called."""

    def __init__(
        self, inode: int | None, owners: SocketHolders, cannot_check: Callable[[str], None]
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


class ConnectionSenders:
    """The process end of each open connection, looked up once per connection in the
    socket tables and /proc (`owners`)."""

    def __init__(self, owners: SocketHolders) -> None:
        self._owners = owners
        # Each open connection's sender (None: not on this host, or not to be checked).
        self._connections: weakref.WeakKeyDictionary[object, ConnectionSender | None] = (
            weakref.WeakKeyDictionary()
        )
        self._check_failed = False

    def of(self, transport: Any) -> ConnectionSender | None:
        """The sender at the other end of `transport` (an asyncio transport); None where it
        is not on this host (the token speaks for it) or cannot be read."""
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
                    sender = ConnectionSender(inode, self._owners, self._cannot_check)
        self._connections[transport] = sender
        return sender

    def _cannot_check(self, why: str) -> None:
        """Said once: the sender check is off where /proc hides what it needs."""
        if not self._check_failed:
            self._check_failed = True
            log_event(
                log,
                "otlp_sender_check_unavailable",
                logging.WARNING,
                reason=why,
                consequence="spans are taken by their pid and start alone: set a token",
            )


class SenderTrust:
    """Judges each resource of an export by what it names and the connection it came on,
    against the target's recorded processes and stages (`senders`).

    `remote_stages`: stage ids on other hosts, whose spans come from processes this host
    cannot check; only an export that carried the token reaches here when one is set.
    """

    def __init__(
        self,
        senders: SpanSenders,
        clock: Clock,
        *,
        boot_id: str = "",
        remote_stages: frozenset[int] = frozenset(),
    ) -> None:
        self._senders = senders
        self._clock = clock
        self._boot_id = boot_id
        self._remote = remote_stages
        # The host each remote stage's spans last named (`host.name`), by stage id.
        self.remote_hosts: dict[int, str] = {}

    def judge(self, resource: ResourceInfo, sender: ConnectionSender | None = None) -> Trust:
        """How far the process behind `resource` may be believed; `sender`: the process end
        of the connection it came on, where that can be known."""
        if resource.stage is not None and resource.stage.stage_id in self._remote:
            return Trust.REMOTE
        if resource.boot_id and self._boot_id and resource.boot_id != self._boot_id:
            return Trust.FOREIGN
        if sender is not None:
            # A connection from this host: the process it came from must be the one the
            # resource names, or, where it names none, one of the target's.
            if resource.pid is not None:
                if not sender.holds(resource.pid):
                    return Trust.IMPOSTOR
            elif not sender.in_target(self._senders.live_pids, self._clock.monotonic()):
                return Trust.IMPOSTOR
        if self._senders.owns(resource.pid, resource.start_ticks):
            return Trust.TARGET
        if resource.pid is not None and resource.start_ticks is not None:
            return Trust.UNRECORDED
        return Trust.ANONYMOUS

    def owns(self, resource: ResourceInfo) -> bool:
        """The process `resource` names is a live recorded process of the target."""
        return self._senders.owns(resource.pid, resource.start_ticks)

    def knows(self, stage: StageRef) -> bool:
        """The stage is one of the topology's or one the target's processes serve."""
        return self._senders.knows(stage)

    def verdicts(self) -> SpanVerdicts:
        """The judge of one body's spans."""
        return SpanVerdicts(self._senders, self._remote)

    def note_host(self, stage_id: int, resource: ResourceInfo) -> None:
        """Remember the host a remote stage's resource names, where it is printable."""
        host = str(resource.attributes.get(HOST_NAME, ""))[:MAX_HOST_NAME]
        if host.isprintable():
            self.remote_hosts[stage_id] = host


def _asked(
    question: Callable[[StageRef], bool], stage: StageRef, answers: dict[StageRef, bool]
) -> bool:
    """`question(stage)`, asked once per stage and body: the tracker walks its records."""
    answer = answers.get(stage)
    if answer is None:
        answer = answers[stage] = question(stage)
    return answer


class SpanVerdicts:
    """Whether each span of one body may count, by its resource's trust, the stage it names
    and its name. Every span names a known stage or none; a remote sender speaks only for
    its remote stages; a sender without a start time only for stages the tree maps."""

    def __init__(self, senders: SpanSenders, remote: frozenset[int]) -> None:
        self._senders = senders
        self._remote = remote
        self._known: dict[StageRef, bool] = {}
        self._mapped: dict[StageRef, bool] = {}
        # Consecutive spans name the same stage object: ask about it once in a row.
        self._checked: StageRef | None = None
        self._checked_known, self._checked_mapped = True, False

    def of(self, trust: Trust, stage: StageRef | None, name: str, may_hold: bool) -> Verdict:
        """The verdict on one span named `name` that names `stage`, from a resource judged
        `trust`; a span of the target's own that names a stage not known yet is held when
        `may_hold`."""
        if stage is not self._checked:
            self._checked = stage
            self._checked_known = stage is None or _asked(self._senders.knows, stage, self._known)
            self._checked_mapped = stage is not None and _asked(
                self._senders.maps, stage, self._mapped
            )
        if trust is Trust.REMOTE:
            if stage is None or stage.stage_id not in self._remote:
                # A remote sender speaks for its remote stage, never a local one.
                return Verdict.UNKNOWN_SENDER
        elif not self._checked_known:
            if may_hold and trust is not Trust.ANONYMOUS and stage is not None:
                # The target's own process names it: the stage may be one the watchdog
                # learns of in a moment (a diffusion stage's process, whose title names no
                # stage, is mapped from its own spans).
                return Verdict.HELD
            return Verdict.UNKNOWN_STAGE
        if trust is Trust.ANONYMOUS and not (
            self._checked_mapped and name in _ANONYMOUS_STAGE_SPANS
            if stage is not None
            else name in _ANONYMOUS_UNSTAGED_SPANS
        ):
            # No start time: such a span may show a mapped stage's progress, never a
            # process's liveness or the requests it owes (vLLM-Omni's request end counts
            # only while no plugin span comes: none owed).
            return Verdict.UNKNOWN_SENDER
        return Verdict.TAKEN


@dataclass
class WaitingSpans:
    """The spans of one resource whose sender is not recorded yet, held for its grace."""

    received: float
    count: int
    observations: list[Observation]
    kept: list[tuple[StageRef | None, bytes]]
    resource: ResourceInfo
    # The stages (None: the pipeline) its plugin spans spoke for.
    heard: tuple[StageRef | None, ...]


@dataclass
class UnplacedSpans:
    """Spans of one resource that name stages not known yet, held for their grace."""

    received: float
    request: ExportTraceServiceRequest
    resource: ResourceInfo
    stages: frozenset[StageRef]
    count: int

    def vouched(self, trust: SenderTrust) -> bool:
        """Its resource is a recorded process of the target that names, as its own, a stage
        these spans name: the spans a process sends of its own stage vouch for it."""
        resource = self.resource
        return resource.stage in self.stages and resource.pid is not None and trust.owns(resource)


class HeldSpans:
    """Spans held back until their sender is recorded (`wait`) or their stage known
    (`hold_unplaced`), at most `MAX_WAITING_SPANS` in all; what is refused is counted in
    `rejected`."""

    def __init__(self, rejected: dict[str, int], sender_grace: float) -> None:
        self._rejected = rejected
        self._sender_grace = sender_grace
        self.waiting: deque[WaitingSpans] = deque()
        self.unplaced: deque[UnplacedSpans] = deque()
        self._count = 0

    def wait(
        self,
        now: float,
        resource: ResourceInfo,
        count: int,
        observations: list[Observation],
        kept: list[tuple[StageRef | None, bytes]],
        heard: tuple[StageRef | None, ...],
    ) -> None:
        """Hold the spans of an unrecorded sender (`count` of them, `kept` the bytes to
        file, `observations` what they gave) until it is recorded or its grace is over."""
        if self._count + count > MAX_WAITING_SPANS:
            self._rejected["unknown_sender"] += count
            return
        self.waiting.append(WaitingSpans(now, count, observations, kept, resource, heard))
        self._count += count

    def hold_unplaced(
        self,
        now: float,
        resource_spans: Any,
        resource: ResourceInfo,
        spans: list[Any],
        stages: set[StageRef],
    ) -> None:
        """Hold `spans` (of `stages`, none known yet) until their stages are known or their
        grace is over, to be mapped again then."""
        count = len(spans)
        if (
            self._count + count > MAX_WAITING_SPANS
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
        self.unplaced.append(UnplacedSpans(now, held, resource, frozenset(stages), count))
        self._count += count

    def settle_unplaced(
        self, now: float, trust: SenderTrust
    ) -> Iterator[tuple[UnplacedSpans, bool]]:
        """Each held body of unplaced spans, in order, with whether it is due: its stages
        are all known now, or its grace is over (those that still name an unknown stage
        are refused then). A due one is let go as it is yielded, and may be mapped again
        at once; walk this to its end, which keeps the others."""
        known: dict[StageRef, bool] = {}
        still: deque[UnplacedSpans] = deque()
        for held in self.unplaced:
            if now - held.received <= UNKNOWN_STAGE_GRACE_SECONDS and not all(
                _asked(trust.knows, stage, known) for stage in held.stages
            ):
                still.append(held)
                yield held, False
                continue
            self._count -= held.count
            yield held, True
        self.unplaced = still

    @property
    def any(self) -> bool:
        """Whether spans are held: they are settled only when the receiver is collected."""
        return bool(self.waiting or self.unplaced)

    def settle_waiting(self, now: float, trust: SenderTrust) -> list[WaitingSpans]:
        """The held spans of senders recorded since, let go; those past their grace are
        refused, the others stay."""
        released: list[WaitingSpans] = []
        still: deque[WaitingSpans] = deque()
        for waiting in self.waiting:
            if trust.owns(waiting.resource):
                released.append(waiting)
            elif now - waiting.received > self._sender_grace:
                self._rejected["unknown_sender"] += waiting.count
            else:
                still.append(waiting)
                continue
            self._count -= waiting.count
        self.waiting = still
        return released
