"""The watchdog's own blindness is not the server's silence.

Measured on two cores: a watchdog starved of CPU by the server it watches stops for up to
3 s at a time; heartbeats wait in its socket and a /health answer is read after its timer
fired. These tables replay that with a fake clock: the detector may judge a hang later by
the time it could not look, never sooner, and never judges a healthy server for it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pytest

from omni_watchdog.clock import FakeClock
from omni_watchdog.config import DetectionConfig
from omni_watchdog.detector import Detector
from omni_watchdog.detector.expectations import BlindSpells
from omni_watchdog.self_health import LATE_ALLOWED, SIGHT_AT_REST, SIGHT_EVERY, LoopSight
from omni_watchdog.types import (
    DetectorReport,
    EvidenceKind,
    HealthOutcome,
    Observation,
    ObservationKind,
    ProcessInfo,
    ProcessRole,
    ProcessStatus,
    Stage,
    StageRef,
    StageState,
    Topology,
)

# The end-to-end tests' fast settings, where a stall needs little to be confirmed.
CONFIG = DetectionConfig(
    heartbeat_timeout=2.0,
    progress_timeout=3.0,
    health_failures=2,
    confirm_timeout=6.0,
    startup_grace=1.0,
)
STEP = 0.05
BEAT_TICKS = 20  # a beat every second
CALL_TICKS = 10  # a /health call every half second
HEALTH_LATENCY = 0.1
HEALTH_TIMEOUT = 0.5
PIPELINE = Topology((Stage(0, "thinker", downstream=(1,)), Stage(1, "talker", upstream=(0,))))
STAGES = (StageRef(0), StageRef(1))
ROOT = ProcessInfo(100, 1.0, 1, 100, 100, "api", ProcessStatus.SLEEPING, 1.0, ProcessRole.API)


@dataclass
class Replay:
    """A server that beats and answers /health, watched by a loop that is sometimes blind.

    While the loop is blind nothing of it runs: heartbeats wait and are read when it wakes,
    after an evaluation that has not read them yet (the worst order), no /health call
    starts, and one that was waiting for its answer ends as a timeout if its timer had
    run out by then, whatever the answer."""

    blind: list[tuple[float, float]]
    hang_at: float | None = None
    answer_while_hung: HealthOutcome = HealthOutcome.TIMEOUT
    account_for_blindness: bool = True
    reports: list[DetectorReport] = field(default_factory=list)

    def run(self, until: float) -> Detector:
        detector = Detector(CONFIG, PIPELINE, 0.0)
        detector.observe([Observation(ObservationKind.PROCESS, 0.0, process=ROOT)])
        waiting = 0
        call_started: float | None = None
        blind_since: float | None = None
        for tick in range(1, round(until / STEP) + 1):
            now = round(tick * STEP, 2)
            hung = self.hang_at is not None and now >= self.hang_at
            if tick % BEAT_TICKS == 0 and not hung:
                waiting += 1
            if any(start <= now < end for start, end in self.blind):
                blind_since = now if blind_since is None else blind_since
                continue
            if blind_since is not None:
                if self.account_for_blindness:
                    detector.blind(blind_since, now)
                self.reports.append(detector.evaluate(now))
                blind_since = None
            observed = [Observation(ObservationKind.HEARTBEAT, now, s) for s in STAGES] * waiting
            waiting = 0
            if call_started is None and tick % CALL_TICKS == 0:
                call_started = now
            if call_started is not None:
                took = now - call_started
                answer = self.answer_while_hung if hung else HealthOutcome.OK
                if took >= (HEALTH_TIMEOUT if answer is HealthOutcome.TIMEOUT else HEALTH_LATENCY):
                    outcome = HealthOutcome.TIMEOUT if took > HEALTH_TIMEOUT else answer
                    observed.append(
                        Observation(ObservationKind.HEALTH, now, value=took, outcome=outcome)
                    )
                    call_started = None
            detector.observe(observed)
            self.reports.append(detector.evaluate(now))
        return detector

    def worst(self) -> set[StageState]:
        return {s.state for report in self.reports for s in report.statuses}

    def stalled_at(self) -> float | None:
        return next(
            (
                report.time
                for report in self.reports
                for verdict in report.verdicts
                if verdict.state is StageState.STALLED
            ),
            None,
        )


# Blind 2.5 s of every 3 s from the 10th second on, as measured next to a decoding server,
# each spell starting while a /health call waits for its answer.
STARVED = [(10.05 + 3 * k, 12.55 + 3 * k) for k in range(10)]


@pytest.mark.parametrize(
    "blind",
    [
        pytest.param([(10.05, 13.05)], id="one 3 s spell"),
        pytest.param(STARVED, id="starved for 30 s"),
    ],
)
def test_a_blind_watchdog_never_judges_a_healthy_server(blind: list[tuple[float, float]]) -> None:
    replay = Replay(blind)
    detector = replay.run(45.0)
    assert replay.worst() <= {StageState.STARTING, StageState.HEALTHY, StageState.DEGRADED}
    assert detector.set_aside[ObservationKind.HEALTH] >= len(blind)


def test_without_its_account_the_same_blindness_would_stall_the_server() -> None:
    """The replay is able to fail: the same starvation, not set aside, is a verdict."""
    replay = Replay(STARVED, account_for_blindness=False)
    replay.run(45.0)
    assert replay.stalled_at() is not None


LAST_BEAT = 19.0
HANG_AT = 20.0


@pytest.mark.parametrize(
    ("blind", "seen_at_most"),
    [
        # Beats missed for the timeout, and /health failed twice: 2.5 s after the last beat.
        pytest.param([], 2.5, id="never blind"),
        # Blind 1 s in every 4: the same, in the time the watchdog could look.
        pytest.param([(21.05 + 4 * k, 22.05 + 4 * k) for k in range(10)], 3.0, id="blind 1 s in 4"),
        # Every /health timeout straddles a spell and is set aside: the lost beats alone
        # confirm the verdict, or /health once the watchdog sees again.
        pytest.param(
            STARVED, CONFIG.heartbeat_timeout + CONFIG.confirm_timeout, id="blind 2.5 s in 3"
        ),
    ],
)
def test_a_real_hang_is_judged_however_often_the_watchdog_is_blind(
    blind: list[tuple[float, float]], seen_at_most: float
) -> None:
    replay = Replay(blind, hang_at=HANG_AT)
    replay.run(45.0)
    stalled = replay.stalled_at()
    assert stalled is not None
    spells = BlindSpells()
    for start, end in blind:
        spells.add(start, end)
    seen = spells.seen(LAST_BEAT, stalled)
    # Never sooner than the heartbeat timeout of seen time, and no later than the bound.
    assert CONFIG.heartbeat_timeout < seen <= seen_at_most, (stalled, seen)


@pytest.mark.parametrize(
    ("outcome", "counted"),
    [
        # A 503 says the server is unhealthy whenever the watchdog reads it.
        pytest.param(HealthOutcome.UNHEALTHY, True, id="503"),
        # A timeout that straddled the spell may be the watchdog's; the next one is not.
        pytest.param(HealthOutcome.TIMEOUT, False, id="timeout"),
    ],
)
def test_only_a_timeout_is_set_aside(outcome: HealthOutcome, counted: bool) -> None:
    detector = Detector(CONFIG, PIPELINE, 0.0)
    detector.observe(
        [
            Observation(ObservationKind.PROCESS, 0.0, process=ROOT),
            Observation(ObservationKind.HEALTH, 0.0, value=0.01, outcome=HealthOutcome.OK),
        ]
        + [Observation(ObservationKind.HEARTBEAT, 0.0, s) for s in STAGES]
    )
    detector.blind(1.0, 3.0)
    detector.observe(
        [
            Observation(ObservationKind.HEALTH, 3.0, value=2.5, outcome=outcome),
            Observation(ObservationKind.HEALTH, 3.5, value=0.4, outcome=outcome),
        ]
    )
    kinds = {e.kind for e in detector.evaluate(5.5).statuses[0].evidence}
    assert EvidenceKind.HEARTBEAT_LOST in kinds
    assert (EvidenceKind.HEALTH_FAILED in kinds) is counted
    assert detector.set_aside[ObservationKind.HEALTH] == (0 if counted else 1)


def test_evidence_says_how_long_the_watchdog_could_not_look() -> None:
    detector = Detector(CONFIG, PIPELINE, 0.0)
    detector.observe(
        [
            Observation(ObservationKind.PROCESS, 0.0, process=ROOT),
            Observation(ObservationKind.HEALTH, 0.0, value=0.01, outcome=HealthOutcome.OK),
        ]
        + [Observation(ObservationKind.HEARTBEAT, 10.0, s) for s in STAGES]
    )
    detector.blind(11.0, 12.0)
    status = detector.evaluate(14.5).statuses[0]
    (lost,) = [e for e in status.evidence if e.kind is EvidenceKind.HEARTBEAT_LOST]
    assert lost.detail == "no loop heartbeat for 3.5s (and 1.0s the watchdog itself could not look)"
    # Held from when 2 s of seen silence had passed: 13.0, not 12.0.
    assert lost.since == pytest.approx(13.0)


def test_an_overdue_request_waits_in_seen_time() -> None:
    detector = Detector(CONFIG, PIPELINE, 0.0)
    detector.observe(
        [Observation(ObservationKind.REQUEST_ADMITTED, 0.0, request_id="r1", path=(0, 1))]
    )
    deadline = detector.deadline(0)
    assert detector.overdue_count(0, deadline + 1.0) == 1
    detector.blind(1.0, 3.0)
    assert detector.overdue_count(0, deadline + 1.0) == 0
    assert detector.overdue_count(0, deadline + 2.5) == 1


def test_blind_spells_merge_and_stay_bounded() -> None:
    spells = BlindSpells(kept=3)
    spells.add(1.0, 2.0)
    spells.add(1.5, 3.0)  # overlaps: one spell 1..3
    spells.add(5.0, 5.0)  # empty: nothing
    assert spells.within(0.0, 10.0) == 2.0 and spells.total == 2.0
    assert spells.seen(0.0, 10.0) == 8.0
    assert spells.within(2.5, 2.75) == 0.25
    for start in (10.0, 20.0, 30.0):
        spells.add(start, start + 1.0)
    # The oldest went: less is set aside, never more.
    assert spells.within(0.0, 40.0) == 3.0


def test_loop_sight_counts_only_gaps_longer_than_its_slack(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock(0.0)
    spells: list[tuple[float, float]] = []
    sight = LoopSight(clock, lambda start, end: spells.append((start, end)))
    sight.look()
    for _ in range(10):
        clock.advance(SIGHT_EVERY)
        sight.look()
    clock.advance(SIGHT_EVERY + LATE_ALLOWED - 0.01)  # late, but within the slack
    sight.look()
    assert spells == [] and sight.blind_spells == 0
    lasts = []
    with caplog.at_level(logging.WARNING, "omni_watchdog.app"):
        for _ in range(3):
            lasts.append(clock.monotonic())
            clock.advance(2.0)
            sight.look()
    assert [time for spell in spells for time in spell] == pytest.approx(
        [time for last in lasts for time in (last + SIGHT_EVERY, last + 2.0)]
    )
    assert sight.blind_spells == 3
    assert sight.blind_seconds == pytest.approx(3 * (2.0 - SIGHT_EVERY))
    # A long spell is logged once a minute at most, not once per spell.
    assert sum("watchdog_blind" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize(
    ("paces", "gaps", "spells"),
    [
        # At rest the loop looks every SIGHT_AT_REST: a gap of that is no spell.
        ((SIGHT_AT_REST,), (SIGHT_AT_REST + LATE_ALLOWED - 0.01,), []),
        ((SIGHT_AT_REST,), (2.0,), [(SIGHT_AT_REST, 2.0)]),
        # Rest ends: the look already due after the long period is not late at the short one.
        ((SIGHT_AT_REST, SIGHT_EVERY), (0.45, 0.15), []),
        ((SIGHT_AT_REST, SIGHT_EVERY), (0.45, 0.3), [(0.45 + SIGHT_EVERY, 0.75)]),
        # Rest begins: the next look is still due one short period after the last.
        ((SIGHT_EVERY, SIGHT_AT_REST), (0.3, 0.5), [(SIGHT_EVERY, 0.3)]),
    ],
)
def test_loop_sight_allows_the_gap_of_the_pace_the_last_look_was_made_at(
    paces: tuple[float, ...], gaps: tuple[float, ...], spells: list[tuple[float, float]]
) -> None:
    clock = FakeClock(0.0)
    seen: list[tuple[float, float]] = []
    sight = LoopSight(clock, lambda start, end: seen.append((start, end)))
    for period, gap in zip(paces, gaps, strict=True):
        sight.pace(period)
        sight.look()
        clock.advance(gap)
    sight.look()
    assert [t for spell in seen for t in spell] == pytest.approx(
        [t for spell in spells for t in spell]
    )
