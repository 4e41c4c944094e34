"""Table tests: a request waiting at a stage whose step counters do not move.

vLLM-Omni 0.30 leaves a stage's load gauges at the counts of its last batch, so the
metrics probe drops a labelled stage's gauges when its counters did not move: an idle
stage and a stalled one look alike to them. What tells them apart is a request still owed
the stage's span. These tables drive the detector with no LOAD at all, as the probe sends
for such a stage, and check that a stall is judged within `progress_timeout` of its last
step while an idle stage, a slow one, and one whose request was lost track of are not.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

from omni_watchdog.clock import FakeClock
from omni_watchdog.config import DetectionConfig
from omni_watchdog.detector import Detector
from omni_watchdog.types import (
    STEP_COUNTERS,
    DetectorReport,
    EvidenceKind,
    HealthOutcome,
    Observation,
    ObservationKind,
    ProcessInfo,
    ProcessRole,
    ProcessStatus,
    SpanOutcome,
    Stage,
    StageRef,
    StageState,
    Topology,
)

CONFIG = DetectionConfig()
S0, S1, S2 = StageRef(0), StageRef(1), StageRef(2)
PIPELINE = Topology(
    (
        Stage(0, "thinker", downstream=(1,)),
        Stage(1, "talker", upstream=(0,), downstream=(2,)),
        Stage(2, "code2wav", upstream=(1,), final_output=True),
    )
)
TWO_TALKERS = Topology(
    (
        Stage(0, "thinker", downstream=(1,)),
        Stage(1, "talker", upstream=(0,), downstream=(2,), replicas=2),
        Stage(2, "code2wav", upstream=(1,), final_output=True),
    )
)
ROOT = ProcessInfo(100, 1.0, 1, 100, 100, "api", ProcessStatus.SLEEPING, 1.0, ProcessRole.API)
ENGINE = ProcessInfo(
    201, 2.0, 100, 100, 100, "engine", ProcessStatus.SLEEPING, 1.0, ProcessRole.ENGINE, S1
)
STEP = 0.25
ADMITTED_AT = 8.0  # warm from 5 s (first healthy /health at 0 s + 5 s grace)
AT_TALKER = 9.0  # the thinker's span: the request now waits at the talker


@dataclass
class Talker:
    """What the talker does once the request reaches it; the other stages stay idle."""

    beats: bool = True
    frozen: bool = False
    # Runnable but given no CPU from this moment (since arrival): neighbours' load.
    starved_from: float | None = None
    # Its step counters move at these moments (seconds since the request reached it).
    steps_at: tuple[float, ...] = ()
    steps_every: float | None = None
    step_counters: bool = True
    scraped_until: float = 1e9
    # When its span arrives, after the request reached it; never, unless given.
    span_after: float | None = None
    replicas: tuple[StageRef, ...] = (S1,)
    # Each second, successful spans of other requests in its name (a holder of the OTLP
    # token can send them; so can a stage that serves others while this request waits).
    other_successes: bool = False
    # The canary, sent every 2 s once the request reached it, times out from this moment.
    canary_fails_from: float | None = None
    # A canary passes at this moment (seconds since the request reached the talker).
    canary_passes_at: float | None = None
    history: list[DetectorReport] = field(default_factory=list)

    def steps(self, since_arrival: float) -> int:
        moved = sum(1 for t in self.steps_at if t <= since_arrival)
        if self.steps_every is not None and since_arrival >= 0:
            moved += int(since_arrival / self.steps_every)
        return moved


def drive(talker: Talker, seconds: float, topology: Topology = PIPELINE) -> list[DetectorReport]:
    clock = FakeClock()
    start = clock.monotonic()
    detector = Detector(CONFIG, topology, start)
    for tick in range(int(seconds / STEP) + 1):
        now = clock.monotonic()
        # Seconds since the start, exact in binary at these steps.
        elapsed = now - start
        since = elapsed - AT_TALKER
        out = [Observation(ObservationKind.PROCESS, now, process=ROOT, outcome=ROOT.status)]
        if tick % 4 == 0:  # each second: /health, heartbeats, a scrape
            out.append(Observation(ObservationKind.HEALTH, now, outcome=HealthOutcome.OK))
            for ref in (S0, S2, *talker.replicas):
                if ref not in talker.replicas or talker.beats or since < 0:
                    out.append(Observation(ObservationKind.HEARTBEAT, now, stage=ref))
            if elapsed <= talker.scraped_until:
                detail = STEP_COUNTERS if talker.step_counters else ""
                for ref in (S0, S2, *talker.replicas):
                    value = 10.0 + (talker.steps(since) if ref in talker.replicas else 0)
                    out.append(
                        Observation(ObservationKind.PROGRESS, now, ref, value, detail=detail)
                    )
            if talker.other_successes and since >= 0:
                out.append(
                    Observation(
                        ObservationKind.STAGE_SPAN,
                        now,
                        S1,
                        0.5,
                        SpanOutcome.OK,
                        request_id=f"other-{tick}",
                    )
                )
        if tick % 8 == 0 and talker.canary_fails_from is not None:
            canary = HealthOutcome.TIMEOUT if since >= talker.canary_fails_from else None
            out.append(
                Observation(
                    ObservationKind.CANARY, now, value=2.0, outcome=canary or HealthOutcome.OK
                )
            )
        if talker.canary_passes_at is not None and since == talker.canary_passes_at:
            out.append(
                Observation(ObservationKind.CANARY, now, value=0.2, outcome=HealthOutcome.OK)
            )
        status = ProcessStatus.SLEEPING
        if talker.frozen and since >= 0:
            status = ProcessStatus.STOPPED
        elif talker.starved_from is not None and since >= talker.starved_from:
            status = ProcessStatus.RUNNING
        engine = dataclasses.replace(ENGINE, status=status)
        out.append(Observation(ObservationKind.PROCESS, now, process=engine, outcome=status))
        if elapsed == ADMITTED_AT:
            out.append(
                Observation(ObservationKind.REQUEST_ADMITTED, now, request_id="r1", path=(0, 1, 2))
            )
        done_at = None if talker.span_after is None else AT_TALKER + talker.span_after
        # The thinker's span sends the request to the talker; the talker's and the
        # code2wav's, together, end it.
        for ref, at in ((S0, AT_TALKER), (S1, done_at), (S2, done_at)):
            if elapsed == at:
                out.append(
                    Observation(
                        ObservationKind.STAGE_SPAN, now, ref, 0.5, SpanOutcome.OK, request_id="r1"
                    )
                )
        detector.observe(out)
        talker.history.append(dataclasses.replace(detector.evaluate(now), time=elapsed))
        clock.advance(STEP)
    return talker.history


def talker_states(reports: list[DetectorReport]) -> list[StageState]:
    return [s.state for r in reports if r.warmed_up for s in r.statuses if s.stage == S1]


def verdict_at(reports: list[DetectorReport]) -> tuple[float, set[EvidenceKind]] | None:
    for report in reports:
        for verdict in report.verdicts:
            return report.time, {e.kind for e in verdict.evidence} - {EvidenceKind.GPU_HELD}
    return None


def overdue_before(reports: list[DetectorReport], moment: float) -> bool:
    return any(
        e.kind is EvidenceKind.SPAN_OVERDUE
        for r in reports
        if r.time < moment
        for s in r.statuses
        for e in s.evidence
    )


# name, talker, judged within (s after its last step), evidence the verdict names
STALLS = [
    (
        "its loop deadlocked after one step: silent, counters flat",
        Talker(beats=False, steps_at=(0.5,)),
        # 0.30 shows no load gauges: a silent loop whose processes use no CPU is stuck.
        {EvidenceKind.HEARTBEAT_LOST, EvidenceKind.SPAN_OVERDUE, EvidenceKind.PROCESS_STUCK},
    ),
    (
        "its engine stopped (T) while its loop beats on",
        Talker(frozen=True, steps_at=(0.5,)),
        {EvidenceKind.PROCESS_STUCK, EvidenceKind.SPAN_OVERDUE},
    ),
    (
        # Beats and successes in its name, forged by a holder of the OTLP token: its own
        # counters, flat while the request waits, and the failing canary outweigh them.
        "its loop beats and successful spans come in its name, its counters stay flat",
        Talker(steps_at=(0.5,), other_successes=True, canary_fails_from=1.0),
        {EvidenceKind.SPAN_OVERDUE, EvidenceKind.CANARY_FAILED},
    ),
]


@pytest.mark.parametrize(("talker", "kinds"), [s[1:] for s in STALLS], ids=[s[0] for s in STALLS])
def test_a_stage_that_stops_working_on_a_waiting_request_is_stalled_soon(
    talker: Talker, kinds: set[EvidenceKind]
) -> None:
    last_step = AT_TALKER + 0.5
    found = verdict_at(drive(talker, 30.0))
    assert found is not None
    moment, named = found
    assert named == kinds
    # The scrape that shows the last step comes within a second of it.
    assert moment <= last_step + 1.0 + CONFIG.progress_timeout + STEP


# name, talker, topology: none of these is ever overdue before the span deadline floor
NOT_EARLY = [
    ("a slow stage: a step every 2.5 s", Talker(steps_every=2.5), PIPELINE),
    (
        "its first step comes 2.5 s after the request",
        Talker(steps_at=(2.5, 3.0, 3.5), span_after=4.0),
        PIPELINE,
    ),
    (
        "counters that move only when a request completes",
        Talker(beats=False, step_counters=False),
        PIPELINE,
    ),
    ("its counters are no longer scraped", Talker(beats=False, scraped_until=AT_TALKER), PIPELINE),
    (
        "a stage of two replicas: the span does not say which one has the request",
        Talker(replicas=(S1, StageRef(1, 1))),
        TWO_TALKERS,
    ),
    (
        "a stage starved of CPU by its neighbours: runnable, silent, its counters flat",
        Talker(beats=False, steps_at=(0.5,), starved_from=0.75),
        PIPELINE,
    ),
]


@pytest.mark.parametrize(
    ("talker", "topology"), [s[1:] for s in NOT_EARLY], ids=[s[0] for s in NOT_EARLY]
)
def test_flat_counters_alone_make_no_early_overdue_unless_they_must_move(
    talker: Talker, topology: Topology
) -> None:
    reports = drive(talker, AT_TALKER + CONFIG.overdue_floor - STEP, topology)
    assert not overdue_before(reports, AT_TALKER + CONFIG.overdue_floor)


def test_a_stage_that_finished_its_request_is_idle_not_stalled() -> None:
    """0.30's idle stage: its request done, its counters flat for good, no load known."""
    talker = Talker(steps_at=(0.5, 1.0), span_after=1.0)
    reports = drive(talker, 40.0)
    assert not overdue_before(reports, 40.0)
    assert set(talker_states(reports)[-100:]) == {StageState.HEALTHY}


def test_a_lost_span_at_a_live_stage_is_only_degraded_by_flat_counters() -> None:
    """The request's span never comes (its abandonment was not heard) and the stage beats;
    a canary's steps move its counters every 4 s. The early overdue comes and goes with
    them, and no second kind joins it. Past the deadline floor the request is overdue for
    good, and that alone confirms nothing, however long it stands."""
    talker = Talker(steps_every=4.0)
    until = AT_TALKER + CONFIG.overdue_floor + 3 * CONFIG.confirm_timeout
    reports = drive(talker, until)
    assert overdue_before(reports, AT_TALKER + CONFIG.overdue_floor)
    assert verdict_at(reports) is None
    assert set(talker_states(reports)) <= {StageState.HEALTHY, StageState.DEGRADED}


def test_a_lost_span_at_an_idle_beating_stage_is_never_a_verdict() -> None:
    """CI: a healthy, idle real vLLM-Omni stage, beating, one request overdue at it (its
    span late or lost), was judged stalled on that alone once it stood `confirm_timeout`,
    and the server was ended. The stage finished its steps and went idle; nothing but the
    missing span says anything is wrong."""
    talker = Talker(steps_at=(0.5, 1.0))
    until = AT_TALKER + CONFIG.overdue_floor + 3 * CONFIG.confirm_timeout
    reports = drive(talker, until)
    # Overdue from 2 confirm timeouts before the end, and still at the end.
    assert overdue_before(reports, until - 2 * CONFIG.confirm_timeout)
    assert overdue_before(reports[-1:], until + STEP)
    assert verdict_at(reports) is None
    assert set(talker_states(reports)) <= {StageState.HEALTHY, StageState.DEGRADED}


def test_a_stage_whose_counters_move_does_not_answer_for_a_failing_canary() -> None:
    """The canary fails, but the talker's counters move and its spans come: it works, and
    is not blamed for a failure that is not its own (nothing else is judged here)."""
    talker = Talker(steps_every=0.5, other_successes=True, canary_fails_from=1.0)
    reports = drive(talker, AT_TALKER + 3 * CONFIG.confirm_timeout)
    assert verdict_at(reports) is None
    assert StageState.STALLED not in talker_states(reports)


def test_only_counters_on_the_servers_metrics_hold_the_canary_back() -> None:
    """The canary goes out once nothing has moved for its interval. Successful spans and
    denoising steps do not count: a holder of the OTLP token could send them in a stalled
    stage's name, and they held every canary back from a deadlocked server."""
    clock = FakeClock()
    detector = Detector(CONFIG, PIPELINE, clock.monotonic())
    spans = [
        Observation(ObservationKind.STAGE_SPAN, 1.0, S1, 0.5, SpanOutcome.OK, request_id="r"),
        Observation(ObservationKind.DENOISE_STEP, 2.0, S1, 0.5, request_id="r", step=1, steps=9),
    ]
    detector.observe(spans)
    assert detector.last_progress() is None
    counters = [
        Observation(ObservationKind.PROGRESS, at, S1, value, detail=STEP_COUNTERS)
        for at, value in ((3.0, 10.0), (4.0, 11.0))
    ]
    detector.observe(counters)
    assert detector.last_progress() == 4.0


def test_a_request_that_reached_a_stage_before_a_canary_passed_is_not_waited_on() -> None:
    """Its span was lost; the stage went idle, its counters flat for good. A canary that
    passed since went through the stage: the request was not in its way. It makes no early
    overdue, and the idle stage is not read for it for good."""
    talker = Talker(steps_at=(0.5, 1.0), canary_passes_at=2.0)
    reports = drive(talker, AT_TALKER + CONFIG.overdue_floor - STEP)
    assert not overdue_before(reports, AT_TALKER + CONFIG.overdue_floor)
    unwatched = Talker(steps_at=(0.5, 1.0))
    assert overdue_before(drive(unwatched, AT_TALKER + CONFIG.overdue_floor - STEP), 1e9)
