"""Probes that rest until they have something to read, instead of being polled.

The span receiver is collected when a body brings observations (or while spans wait for
their sender, at its period); the canary probe looks again when a canary can next be due;
the process tracker's long rest while the server is at rest ends when it is woken.
What each waits for is read from the `asyncio.sleep` and wake-ups it asks for, so no test
waits out a timer.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fakes import FakePsutil, FakeSenders
from otlp_bodies import batch

from omni_watchdog.app import routine_at_rest
from omni_watchdog.clock import FakeClock
from omni_watchdog.config import ProbesConfig, SpansConfig
from omni_watchdog.probes import spans as spans_module
from omni_watchdog.probes.canary import CanaryProbe
from omni_watchdog.probes.otlp_decode import PROTOBUF
from omni_watchdog.probes.processes import ProcessTracker
from omni_watchdog.probes.span_store import SpanStore
from omni_watchdog.probes.spans import SpanReceiver
from omni_watchdog.semconv import HEARTBEAT_SPAN, PROCESS_PID, PROCESS_START_TICKS, STAGE_ID
from omni_watchdog.types import (
    CanaryPlan,
    HealthOutcome,
    Observation,
    ObservationKind,
    ProcessStatus,
    Stage,
    StageRef,
    Topology,
)

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


def test_a_resting_tracker_scans_as_soon_as_it_is_woken() -> None:
    async def scenario() -> bool:
        table = FakePsutil(port=9)
        tracker = ProcessTracker(
            table,
            FakeClock(),
            own_pid=50,
            target_port=9,
            pid=None,
            topology=Topology((Stage(0, "engine"),)),
            start_time=table.start_time,
        )
        resting = asyncio.create_task(tracker.rest(NEVER))
        for _ in range(5):
            await asyncio.sleep(0)
        asleep = not resting.done()
        tracker.wake()
        await asyncio.wait_for(resting, 5.0)
        # A wake is spent by the rest it ended: the next rest is a whole one.
        again = asyncio.create_task(tracker.rest(NEVER))
        for _ in range(5):
            await asyncio.sleep(0)
        spent = not again.done()
        again.cancel()
        return asleep and spent

    assert asyncio.run(scenario())


def process(status: ProcessStatus) -> Observation:
    return Observation(ObservationKind.PROCESS, 10.0, StageRef(0), outcome=status)


ROUTINE_ROWS = {
    "a heartbeat": (Observation(ObservationKind.HEARTBEAT, 10.0, StageRef(0)), True),
    "/health answering": (
        Observation(ObservationKind.HEALTH, 10.0, outcome=HealthOutcome.OK),
        True,
    ),
    "a process asleep": (process(ProcessStatus.SLEEPING), True),
    "a process running": (process(ProcessStatus.RUNNING), True),
    "a process stopped": (process(ProcessStatus.STOPPED), False),
    "a process in D state": (process(ProcessStatus.DISK_SLEEP), False),
    "a process gone": (process(ProcessStatus.EXITED), False),
    "a request admitted": (
        Observation(ObservationKind.REQUEST_ADMITTED, 10.0, request_id="r", path=(0,)),
        False,
    ),
    "a stage span": (Observation(ObservationKind.STAGE_SPAN, 10.0, StageRef(0), 0.5), False),
    "a denoising step": (Observation(ObservationKind.DENOISE_STEP, 10.0, StageRef(0)), False),
}


@pytest.mark.parametrize(
    ("observation", "routine"), ROUTINE_ROWS.values(), ids=list(ROUTINE_ROWS.keys())
)
def test_only_what_an_idle_server_sends_all_the_time_keeps_the_rest(
    observation: Observation, routine: bool
) -> None:
    assert routine_at_rest(observation) is routine
