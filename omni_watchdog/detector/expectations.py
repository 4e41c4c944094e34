"""What the detector expects to see: span deadlines learned from each stage's durations,
and the spells in which the watchdog itself could not look."""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

# Blind spells kept. The oldest go first, which only shrinks the time set aside: a hang
# is then judged as early as it would be without the ledger, never later.
BLIND_SPELLS_KEPT = 1024


class BlindSpells:
    """When the watchdog's own event loop could not run (starved of CPU, or blocked).

    What it did not see then is no evidence against the server: a heartbeat that waited
    in a socket, or a /health answer read after its timer had fired. Silence is measured
    in seen time, so a watchdog that is blind a tenth of the time judges a real hang a
    tenth later, and one that sees nothing judges nothing until it sees again.
    """

    def __init__(self, kept: int = BLIND_SPELLS_KEPT) -> None:
        self._spells: deque[tuple[float, float]] = deque(maxlen=kept)
        self.total = 0.0

    def add(self, start: float, end: float) -> None:
        """The loop could not run from `start` to `end`; spells come in time order."""
        if end <= start:
            return
        if self._spells and start <= self._spells[-1][1]:
            first, last = self._spells.pop()
            self.total -= last - first
            start, end = min(first, start), max(last, end)
        self._spells.append((start, end))
        self.total += end - start

    def within(self, since: float, until: float) -> float:
        """Seconds of blindness between `since` and `until`."""
        blind = 0.0
        for start, end in reversed(self._spells):
            if end <= since:
                break
            blind += max(0.0, min(end, until) - max(start, since))
        return blind

    def seen(self, since: float, until: float) -> float:
        """Seconds between `since` and `until` in which the watchdog could look."""
        return until - since - self.within(since, until)


class RollingQuantile:
    """A quantile over the last `window` samples, kept sorted so a read costs nothing."""

    def __init__(self, window: int = 512) -> None:
        self._order: deque[float] = deque()
        self._sorted: list[float] = []
        self._window = window

    def add(self, sample: float) -> None:
        self._order.append(sample)
        bisect.insort(self._sorted, sample)
        if len(self._order) > self._window:
            oldest = self._order.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, oldest)]

    def quantile(self, q: float) -> float | None:
        if not self._sorted:
            return None
        index = min(len(self._sorted) - 1, int(q * len(self._sorted)))
        return self._sorted[index]

    def __len__(self) -> int:
        return len(self._sorted)


@dataclass
class PendingRequest:
    """An admitted request waiting for the span of the stage it is at."""

    request_id: str
    path: tuple[int, ...]
    position: int
    due_since: float

    @property
    def stage_id(self) -> int:
        return self.path[self.position]


# Stage spans kept for requests whose admission has not arrived yet, and per request.
EARLY_REQUESTS = 10_000
EARLY_SPANS_PER_REQUEST = 16


class PendingRequests:
    """Admitted requests by the stage whose span they wait for, oldest first.

    A request enters a stage's queue when it is admitted (first stage) or when the
    previous stage's span arrives, so each queue is ordered by `due_since` and the
    overdue ones are always at its front: checking costs O(overdue), not O(in flight).

    The API process and the stage processes export their spans independently, so a fast
    request's stage spans can arrive before its admission. They are kept, a bounded
    number, and applied when the admission comes: else the request would wait forever
    for spans already seen, and an idle stage would look stalled.

    A request the pipeline abandons (its client went away, a stage failed) leaves every
    queue: the stages it had not reached will never see it.
    """

    def __init__(self, early_requests: int = EARLY_REQUESTS) -> None:
        self._by_stage: dict[int, dict[str, PendingRequest]] = {}
        self._where: dict[str, PendingRequest] = {}
        self._early: dict[str, list[tuple[int, bool]]] = {}
        self._early_requests = early_requests

    def admit(self, request_id: str, path: tuple[int, ...], now: float) -> None:
        if not path or request_id in self._where:
            return
        self._enqueue(PendingRequest(request_id, path, 0, now))
        for stage_id, failed in self._early.pop(request_id, ()):
            self.stage_done(request_id, stage_id, now, failed)

    def stage_done(self, request_id: str, stage_id: int, now: float, failed: bool) -> None:
        """The span of `stage_id` for the request arrived: move it on, or forget it."""
        pending = self._where.get(request_id)
        if pending is None:
            self._keep_early(request_id, stage_id, failed)
            return
        if stage_id not in pending.path[pending.position :]:
            return
        self._dequeue(pending)
        position = pending.path.index(stage_id, pending.position) + 1
        if failed or position >= len(pending.path):
            return
        self._enqueue(PendingRequest(request_id, pending.path, position, now))

    def abandon(self, request_id: str) -> None:
        """The pipeline gave the request up, or is done with it: no stage owes a span for
        it any more."""
        pending = self._where.get(request_id)
        if pending is not None:
            self._dequeue(pending)
        self._early.pop(request_id, None)

    def overdue(
        self, stage_id: int, deadline: float, now: float, blind: BlindSpells
    ) -> list[PendingRequest]:
        """Requests waiting at the stage for more than `deadline` of seen time."""
        late: list[PendingRequest] = []
        for pending in self._by_stage.get(stage_id, {}).values():
            # Seen time shrinks as `due_since` grows, so the first in time stops the scan.
            if blind.seen(pending.due_since, now) <= deadline:
                break
            late.append(pending)
        return late

    def in_flight(self, stage_id: int) -> int:
        return len(self._by_stage.get(stage_id, {}))

    def oldest(self, stage_id: int) -> PendingRequest | None:
        """The request that has waited longest at the stage."""
        return next(iter(self._by_stage.get(stage_id, {}).values()), None)

    def oldest_since(self, stage_id: int, moment: float) -> PendingRequest | None:
        """The request that has waited longest at the stage of those that reached it after
        `moment`."""
        return next(
            (p for p in self._by_stage.get(stage_id, {}).values() if p.due_since > moment),
            None,
        )

    def waits_at(self, request_id: str, stage_id: int) -> bool:
        """The request is owed the span of `stage_id`."""
        pending = self._where.get(request_id)
        return pending is not None and pending.stage_id == stage_id

    def __len__(self) -> int:
        return len(self._where)

    def _keep_early(self, request_id: str, stage_id: int, failed: bool) -> None:
        if not request_id:
            return
        spans = self._early.get(request_id)
        if spans is None:
            if len(self._early) >= self._early_requests:
                # The oldest goes: most likely a request that will never be admitted (its
                # stages finished it after it left the queues, or no admission is sent).
                del self._early[next(iter(self._early))]
            spans = self._early[request_id] = []
        if len(spans) < EARLY_SPANS_PER_REQUEST:
            spans.append((stage_id, failed))

    def _enqueue(self, pending: PendingRequest) -> None:
        self._by_stage.setdefault(pending.stage_id, {})[pending.request_id] = pending
        self._where[pending.request_id] = pending

    def _dequeue(self, pending: PendingRequest) -> None:
        del self._by_stage[pending.stage_id][pending.request_id]
        del self._where[pending.request_id]
