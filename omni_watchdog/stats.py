"""What the exporters need history for, counted as it happens.

Stage span durations, verdicts, incidents, ladder steps and verdict -> release cannot be
read off the present; the evaluation loop feeds them here, and each `WatchdogState`
carries a frozen copy (`counters`).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

from omni_watchdog.types import (
    Counters,
    EvidenceKind,
    HistogramCounts,
    Incident,
    IncidentOutcome,
    Observation,
    ObservationKind,
    StageState,
    StepName,
    StepOutcome,
    StepResult,
    Verdict,
)

# Stage spans range from milliseconds (a token) to the 300 s engine timeouts seen upstream.
STAGE_DURATION_BUCKETS = (
    *(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
    *(30.0, 60.0, 120.0, 300.0),
)
# Ladder steps are bounded by their timeouts (seconds to tens of seconds).
LADDER_STEP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# The target for fault -> memory released is 15 s; the buckets resolve around it.
RELEASE_BUCKETS = (1.0, 2.5, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)


class Histogram:
    """Bucket counts and a sum for one series."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        # bisect_left puts a value equal to a bound in that bound's bucket: le means <=.
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def frozen(self) -> HistogramCounts:
        return HistogramCounts(self.bounds, tuple(self.counts), self.total)


def empty_histogram(bounds: Sequence[float]) -> HistogramCounts:
    return Histogram(bounds).frozen()


class WatchdogStats:
    """Counts as things happen; `counters()` is the frozen copy a state carries."""

    def __init__(self) -> None:
        self._stage_durations: dict[int, Histogram] = {}
        self._verdicts: dict[tuple[int, StageState, EvidenceKind], int] = {}
        self._incidents: dict[IncidentOutcome, int] = {}
        self._ladder_steps: dict[tuple[StepName, StepOutcome], int] = {}
        self._step_durations: dict[StepName, Histogram] = {}
        self._verdict_to_release = Histogram(RELEASE_BUCKETS)
        self._counted: set[str] = set()
        self._steps_counted: dict[str, int] = {}

    def observe(self, observations: Iterable[Observation]) -> None:
        """Stage span durations."""
        for obs in observations:
            if obs.kind is ObservationKind.STAGE_SPAN and obs.stage is not None:
                stage_id = obs.stage.stage_id
                histogram = self._stage_durations.get(stage_id)
                if histogram is None:
                    histogram = self._stage_durations[stage_id] = Histogram(STAGE_DURATION_BUCKETS)
                histogram.observe(obs.value)

    def count_verdicts(self, verdicts: Iterable[Verdict]) -> None:
        """One increment per verdict and kind of evidence it carries."""
        for verdict in verdicts:
            for kind in {e.kind for e in verdict.evidence}:
                key = (verdict.stage.stage_id, verdict.state, kind)
                self._verdicts[key] = self._verdicts.get(key, 0) + 1

    def ignore_closed(self, incidents: Iterable[Incident]) -> None:
        """Incidents a previous watchdog closed (from the journal) are not counted again."""
        for incident in incidents:
            if incident.closed is not None:
                self._counted.add(incident.incident_id)
                self._steps_counted[incident.incident_id] = len(incident.steps)

    def count_incidents(self, incidents: Iterable[Incident]) -> list[Incident]:
        """Count each ladder step as it ends and each incident as it closes.

        Steps are counted while their incident is still open, so that a ladder that is
        stuck or slow shows in `ladder_steps_total` before it finishes. Returns the
        incidents that closed since the last call.
        """
        closed = []
        for incident in incidents:
            counted = self._steps_counted.get(incident.incident_id, 0)
            for step in incident.steps[counted:]:
                self._count_step(step)
            self._steps_counted[incident.incident_id] = len(incident.steps)
            if incident.closed is None or incident.incident_id in self._counted:
                continue
            closed.append(incident)
            self._counted.add(incident.incident_id)
            self._incidents[incident.outcome] = self._incidents.get(incident.outcome, 0) + 1
            timeline = incident.timeline
            begun = timeline.get("verdict", timeline.get("opened"))
            released = timeline.get("released")
            if begun is not None and released is not None:
                # An operator's pause is not the watchdog's time to release.
                held = timeline.get("unheld", 0.0) - timeline.get("held", 0.0)
                self._verdict_to_release.observe(max(0.0, released - begun - max(0.0, held)))
        return closed

    def counters(self) -> Counters:
        return Counters(
            stage_durations={s: h.frozen() for s, h in self._stage_durations.items()},
            verdicts=dict(self._verdicts),
            incidents=dict(self._incidents),
            ladder_steps=dict(self._ladder_steps),
            step_durations={s: h.frozen() for s, h in self._step_durations.items()},
            verdict_to_release=self._verdict_to_release.frozen(),
        )

    def _count_step(self, step: StepResult) -> None:
        key = (step.step, step.outcome)
        self._ladder_steps[key] = self._ladder_steps.get(key, 0) + 1
        # A planned step did nothing; its zero duration would only flatten the buckets.
        if step.outcome is not StepOutcome.PLANNED:
            histogram = self._step_durations.get(step.step)
            if histogram is None:
                histogram = self._step_durations[step.step] = Histogram(LADDER_STEP_BUCKETS)
            histogram.observe(step.duration)
