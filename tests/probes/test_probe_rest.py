"""Probes that rest until they have something to read, instead of being polled.

The span receiver is collected when a body brings observations (or while spans wait for
their sender, at its period); the canary probe looks again when a canary can next be due.
What each waits for is read from the `asyncio.sleep` and wake-ups it asks for, so no test
waits out a timer.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fakes import FakeSenders
from otlp_bodies import batch

from omni_watchdog.clock import FakeClock
from omni_watchdog.config import ProbesConfig, SpansConfig
from omni_watchdog.probes import spans as spans_module
from omni_watchdog.probes.canary import CanaryProbe
from omni_watchdog.probes.otlp_decode import PROTOBUF
from omni_watchdog.probes.span_store import SpanStore
from omni_watchdog.probes.spans import SpanReceiver
from omni_watchdog.semconv import HEARTBEAT_SPAN, PROCESS_PID, PROCESS_START_TICKS, STAGE_ID
from omni_watchdog.types import CanaryPlan

SENDER = {PROCESS_PID: 4242, PROCESS_START_TICKS: 777}
BEAT = batch({**SENDER, STAGE_ID: 0}, [(HEARTBEAT_SPAN, {})])
# Long enough that a rest which waited it out could not pass the bounded waits below.
NEVER = 3600.0


def receiver(senders: FakeSenders | None = None) -> SpanReceiver:
    config = SpansConfig()
    return SpanReceiver(
        config,
        FakeClock(start=500.0),
        SpanStore(config.ring_size),
        senders=senders or FakeSenders(),
    )


def test_a_receiver_with_nothing_new_rests_until_a_body_brings_news(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(spans_module, "QUIET_REST", NEVER)

    async def scenario() -> list[Any]:
        spans = receiver()
        resting = asyncio.create_task(spans.rest(0.0))
        for _ in range(5):
            await asyncio.sleep(0)
        asleep = not resting.done()
        spans.ingest(BEAT, PROTOBUF)
        await asyncio.wait_for(resting, 5.0)
        return [asleep, await spans.collect()]

    asleep, collected = asyncio.run(scenario())
    assert asleep
    assert collected, "the body's heartbeat is collected once the rest ends"


def test_news_that_came_before_the_rest_ends_it_after_the_period(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(spans_module, "QUIET_REST", NEVER)

    async def scenario() -> None:
        spans = receiver()
        spans.ingest(BEAT, PROTOBUF)
        await asyncio.wait_for(spans.rest(0.0), 5.0)

    asyncio.run(scenario())


def test_a_collected_receiver_waits_for_newer_news(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spans_module, "QUIET_REST", NEVER)

    async def scenario() -> bool:
        spans = receiver()
        spans.ingest(BEAT, PROTOBUF)
        await spans.collect()
        resting = asyncio.create_task(spans.rest(0.0))
        for _ in range(5):
            await asyncio.sleep(0)
        done = resting.done()
        resting.cancel()
        return done

    assert not asyncio.run(scenario())


def test_while_spans_wait_for_their_sender_the_receiver_is_collected_at_its_period(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(spans_module, "QUIET_REST", NEVER)

    async def scenario() -> None:
        # Nobody is recorded yet: the beat waits for the tracker to record its sender.
        spans = receiver(FakeSenders(owned=set()))
        spans.ingest(batch({**SENDER, STAGE_ID: 0}, [(HEARTBEAT_SPAN, {})]), PROTOBUF)
        assert not await spans.collect()
        await asyncio.wait_for(spans.rest(0.0), 5.0)

    asyncio.run(scenario())


def test_the_bound_ends_a_rest_without_news(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spans_module, "QUIET_REST", 0.01)
    asyncio.run(asyncio.wait_for(receiver().rest(0.0), 5.0))


class Sleeps:
    """`asyncio.sleep` as the canary probe calls it, recorded instead of waited."""

    def __init__(self) -> None:
        self.asked: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.asked.append(seconds)


INTERVAL = ProbesConfig().canary_interval
CHECK = 0.25
NOW = 100.0

CANARY_ROWS = {
    "nothing moved yet: due now, asked again at its period": (None, CHECK),
    "counters moved a second ago": (NOW - 1.0, INTERVAL - 1.0),
    "counters moved just now": (NOW, INTERVAL),
    "counters moved long ago: due, the plan asked at its period": (NOW - 10 * INTERVAL, CHECK),
}


@pytest.mark.parametrize(
    ("last_progress", "rest"), CANARY_ROWS.values(), ids=list(CANARY_ROWS.keys())
)
def test_the_canary_probe_rests_until_a_canary_can_be_due(
    monkeypatch: pytest.MonkeyPatch, last_progress: float | None, rest: float
) -> None:
    sleeps = Sleeps()
    monkeypatch.setattr(asyncio, "sleep", sleeps)
    probe = CanaryProbe(
        None,  # type: ignore[arg-type]  # resting sends nothing
        "http://127.0.0.1:9",
        ProbesConfig(),
        FakeClock(start=NOW),
        lambda: last_progress,
        lambda now: CanaryPlan.NONE,
    )
    asyncio.run(probe.rest(CHECK))
    assert sleeps.asked == [pytest.approx(rest)]
    assert probe.due() is (rest == CHECK)
