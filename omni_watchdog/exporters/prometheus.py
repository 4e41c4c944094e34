"""The watchdog's own `/metrics`, computed from its state at scrape time.

Counters and histograms that need history (stage span durations, verdicts, incidents,
ladder steps, verdict -> release) live in `WatchdogStats`, which the app feeds as events
happen; everything else is read from the watchdog when Prometheus scrapes. Every series
exists from the start, zeroed, for every known stage replica, state, step, outcome, probe,
rejection reason and evidence kind.

The text is written here rather than through a prometheus_client registry: building and
formatting its sample objects costs about 50 ms for the ~3,500 series of 64 stages and
512 GPU pids, against a 20 ms budget for the whole scrape.
"""

from __future__ import annotations

import bisect
import math
import platform
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from omni_watchdog import __version__
from omni_watchdog.exporters.api import target_health
from omni_watchdog.serving import CLOSE_REASONS
from omni_watchdog.types import (
    EvidenceKind,
    HealthOutcome,
    Incident,
    IncidentOutcome,
    Observation,
    ObservationKind,
    ProcessRole,
    ProcessStatus,
    StageRef,
    StageState,
    StepName,
    StepOutcome,
    StepResult,
    Verdict,
)

if TYPE_CHECKING:
    from omni_watchdog.app import Watchdog

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LISTENERS = ("api", "otlp")
PREFIX = "omni_watchdog_"

# Stage spans range from milliseconds (a token) to the 300 s engine timeouts seen upstream.
STAGE_DURATION_BUCKETS = (
    *(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
    *(30.0, 60.0, 120.0, 300.0),
)
# Ladder steps are bounded by their timeouts (seconds to tens of seconds).
LADDER_STEP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# The target for fault -> memory released is 15 s; the buckets resolve around it.
RELEASE_BUCKETS = (1.0, 2.5, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)

VERDICT_STATES = (StageState.STALLED, StageState.DEAD)
CLOSED_OUTCOMES = tuple(o for o in IncidentOutcome if o is not IncidentOutcome.OPEN)
# `processes` counts live processes, so the exited status never has any.
LIVE_STATUSES = tuple(s for s in ProcessStatus if s is not ProcessStatus.EXITED)

# name (after the prefix), type and help of every family.
FAMILIES = (
    ("build_info", "gauge", "The watchdog's version and Python version; always 1."),
    (
        "target_up",
        "gauge",
        "Whether the target server is up: its root process is alive or, without the "
        "process probe, its /health answers.",
    ),
    ("target_warmed_up", "gauge", "Whether the target's start-up grace is over."),
    ("target_health_status", "gauge", "The outcome of the last call to the target's /health."),
    ("target_liveness", "gauge", "Whether /v1/target/health would answer 200 now."),
    ("probe_up", "gauge", "Whether the probe's last run succeeded."),
    ("probe_errors_total", "counter", "Runs of the probe that failed."),
    ("probe_duration_seconds", "gauge", "How long the probe's last run took."),
    ("stage_state", "gauge", "The detector's state of the stage replica, 1 for the current one."),
    (
        "stage_last_progress_timestamp_seconds",
        "gauge",
        "Unix time of the stage replica's last progress, 0 if none was seen.",
    ),
    (
        "stage_heartbeat_age_seconds",
        "gauge",
        "Seconds since the stage replica's last loop heartbeat, NaN if none was ever seen.",
    ),
    (
        "stage_requests_in_flight",
        "gauge",
        "Admitted requests waiting for this stage's span.",
    ),
    (
        "stage_requests_overdue",
        "gauge",
        "Admitted requests waiting for this stage's span past their deadline.",
    ),
    ("stage_duration_seconds", "histogram", "Durations of the stage's request spans."),
    (
        "stage_gpu_memory_bytes",
        "gauge",
        "Device memory held by the stage replica's processes.",
    ),
    ("spans_received_total", "counter", "Spans accepted by the OTLP receiver."),
    (
        "spans_rejected_total",
        "counter",
        "Spans (malformed_id) or request bodies (other reasons) the receiver rejected.",
    ),
    ("gpu_memory_used_bytes", "gauge", "Device memory in use on the GPU."),
    ("gpu_utilization_ratio", "gauge", "Utilization of the GPU from 0 to 1, NaN if unknown."),
    (
        "gpu_process_memory_bytes",
        "gauge",
        "Device memory a process holds on the GPU, with its stage or empty when unmapped.",
    ),
    (
        "processes",
        "gauge",
        "Recorded live processes of the target by role and status, zombies included.",
    ),
    (
        "orphaned_processes",
        "gauge",
        "Recorded processes that left the target's tree and still live.",
    ),
    (
        "verdicts_total",
        "counter",
        "Stalled or dead verdicts, counted once per kind of evidence they carried.",
    ),
    ("incidents_total", "counter", "Closed incidents by outcome."),
    ("incident_open", "gauge", "Whether an incident is open."),
    ("ladder_steps_total", "counter", "Remediation ladder steps by outcome."),
    ("ladder_step_duration_seconds", "histogram", "Durations of performed ladder steps."),
    (
        "verdict_to_release_seconds",
        "histogram",
        "Time from the verdict to the target's GPU memory being back to its baseline.",
    ),
    (
        "remediation_budget_remaining",
        "gauge",
        "Enforced incidents still allowed in the current rolling hour.",
    ),
    (
        "remediation_budget_exhausted_total",
        "counter",
        "Incidents that could not be enforced because the hourly budget was spent.",
    ),
    (
        "internal_errors_total",
        "counter",
        "Exceptions caught in the watchdog's own loops; the loop went on.",
    ),
    (
        "evaluation_age_seconds",
        "gauge",
        "Seconds since the detector last evaluated the stages, NaN before the first.",
    ),
    (
        "state_write_errors_total",
        "counter",
        "Writes to the state directory (journal, bundles) that failed; remediation went on"
        " without them.",
    ),
    (
        "target_lock_conflict",
        "gauge",
        "Whether another watchdog or a foreign file holds this target's lock, so this one"
        " only observes.",
    ),
    (
        "connections_closed_total",
        "counter",
        "Connections a listener closed: over its connection cap, or without a whole request"
        " head in time.",
    ),
)
FAMILY_NAMES = tuple(PREFIX + name for name, _, _ in FAMILIES)


def _header(name: str) -> str:
    kind, text = next((k, t) for n, k, t in FAMILIES if n == name)
    return f"# HELP {PREFIX}{name} {text}\n# TYPE {PREFIX}{name} {kind}"


_HEADERS = {name: _header(name) for name, _, _ in FAMILIES}


def escape(value: str) -> str:
    """A label value as the text format needs it."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def number(value: float) -> str:
    """A sample value in the text format (NaN and +Inf spelled as Prometheus does)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


class Histogram:
    """Bucket counts, a sum and a count for one series; written cumulatively."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        # bisect_left puts a value equal to a bound in that bound's bucket: le means <=.
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value


@dataclass(frozen=True)
class _HistogramLines:
    """The text before the value of each line of one histogram series."""

    buckets: tuple[str, ...]
    sum: str
    count: str

    @classmethod
    def of(cls, name: str, labels: str, bounds: Sequence[float]) -> _HistogramLines:
        les = (*(f'le="{number(b)}"' for b in bounds), 'le="+Inf"')
        before = f"{labels}," if labels else ""
        braces = f"{{{labels}}}" if labels else ""
        return cls(
            tuple(f"{PREFIX}{name}_bucket{{{before}{le}}} " for le in les),
            f"{PREFIX}{name}_sum{braces} ",
            f"{PREFIX}{name}_count{braces} ",
        )

    def write(self, out: list[str], histogram: Histogram) -> None:
        running = 0
        for prefix, count in zip(self.buckets, histogram.counts, strict=True):
            running += count
            out.append(prefix + str(running))
        out.append(self.sum + number(histogram.total))
        out.append(self.count + str(running))


@dataclass(frozen=True)
class _ReplicaLines:
    """Label text of one stage replica, and its stage_state lines, made once."""

    labels: str
    states: tuple[tuple[StageState, str], ...]


@dataclass(frozen=True)
class _StageLines:
    """Label text of one stage, and its verdict and duration lines, made once."""

    labels: str
    verdicts: tuple[tuple[tuple[int, StageState, EvidenceKind], str], ...]
    durations: _HistogramLines


@dataclass(frozen=True)
class GpuProcessReading:
    """Device memory one pid held on one GPU at the GPU probe's last run."""

    gpu: int
    pid: int
    used_bytes: float
    stage: StageRef | None


@dataclass
class WatchdogStats:
    """What the exposition needs history for, fed by the app as things happen."""

    stage_durations: dict[int, Histogram] = field(default_factory=dict)
    verdicts: dict[tuple[int, StageState, EvidenceKind], int] = field(default_factory=dict)
    incidents: dict[IncidentOutcome, int] = field(default_factory=dict)
    ladder_steps: dict[tuple[StepName, StepOutcome], int] = field(default_factory=dict)
    step_durations: dict[StepName, Histogram] = field(default_factory=dict)
    verdict_to_release: Histogram = field(default_factory=lambda: Histogram(RELEASE_BUCKETS))
    gpu_devices: dict[int, tuple[float, float | None]] = field(default_factory=dict)
    gpu_processes: list[GpuProcessReading] = field(default_factory=list)
    _counted: set[str] = field(default_factory=set)
    _steps_counted: dict[str, int] = field(default_factory=dict)

    def observe(self, observations: Iterable[Observation]) -> None:
        """Stage span durations, and the GPU probe's latest reading (one probe run)."""
        new_reading = False
        for obs in observations:
            kind = obs.kind
            if kind is ObservationKind.STAGE_SPAN and obs.stage is not None:
                stage_id = obs.stage.stage_id
                histogram = self.stage_durations.get(stage_id)
                if histogram is None:
                    histogram = self.stage_durations[stage_id] = Histogram(STAGE_DURATION_BUCKETS)
                histogram.observe(obs.value)
            elif kind is ObservationKind.GPU_DEVICE and obs.gpu is not None:
                if not new_reading:
                    # A run reports every device: the previous reading is replaced, not merged.
                    new_reading = True
                    self.gpu_devices = {}
                    self.gpu_processes = []
                self.gpu_devices[obs.gpu] = (obs.value, obs.utilization)
            elif (
                kind is ObservationKind.GPU_PROCESS and obs.gpu is not None and obs.pid is not None
            ):
                self.gpu_processes.append(GpuProcessReading(obs.gpu, obs.pid, obs.value, obs.stage))

    def count_verdicts(self, verdicts: Iterable[Verdict]) -> None:
        """One increment per verdict and kind of evidence it carries."""
        for verdict in verdicts:
            for kind in {e.kind for e in verdict.evidence}:
                key = (verdict.stage.stage_id, verdict.state, kind)
                self.verdicts[key] = self.verdicts.get(key, 0) + 1

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
            self.incidents[incident.outcome] = self.incidents.get(incident.outcome, 0) + 1
            timeline = incident.timeline
            begun = timeline.get("verdict", timeline.get("opened"))
            released = timeline.get("released")
            if begun is not None and released is not None:
                self.verdict_to_release.observe(max(0.0, released - begun))
        return closed

    def _count_step(self, step: StepResult) -> None:
        key = (step.step, step.outcome)
        self.ladder_steps[key] = self.ladder_steps.get(key, 0) + 1
        # A planned step did nothing; its zero duration would only flatten the buckets.
        if step.outcome is not StepOutcome.PLANNED:
            histogram = self.step_durations.get(step.step)
            if histogram is None:
                histogram = self.step_durations[step.step] = Histogram(LADDER_STEP_BUCKETS)
            histogram.observe(step.duration)


class MetricsExposition:
    """Renders the watchdog's state and stats in the Prometheus text format."""

    content_type = CONTENT_TYPE

    def __init__(self, watchdog: Watchdog, stats: WatchdogStats) -> None:
        self._watchdog = watchdog
        self._stats = stats
        # Label text is made once per stage: formatting it on every scrape was most of the cost.
        self._replica_lines: dict[StageRef, _ReplicaLines] = {}
        self._stage_lines: dict[int, _StageLines] = {}
        # The topology those labels were made for: a stage learned later may be renamed.
        self._labelled_topology = watchdog.topology
        self._empty_durations = Histogram(STAGE_DURATION_BUCKETS)
        self._empty_steps = Histogram(LADDER_STEP_BUCKETS)
        self._step_lines = {
            step: _HistogramLines.of(
                "ladder_step_duration_seconds", f'step="{step.value}"', LADDER_STEP_BUCKETS
            )
            for step in StepName
        }
        self._release_lines = _HistogramLines.of("verdict_to_release_seconds", "", RELEASE_BUCKETS)
        self._build_info = (
            f'{PREFIX}build_info{{version="{escape(__version__)}",'
            f'python_version="{escape(platform.python_version())}"}} 1'
        )

    def render(self) -> bytes:
        """The whole exposition, as the body of a scrape."""
        if self._watchdog.topology is not self._labelled_topology:
            self._labelled_topology = self._watchdog.topology
            self._stage_lines.clear()
            self._replica_lines.clear()
        out: list[str] = []
        self._target(out)
        self._probes(out)
        self._stages(out)
        self._spans(out)
        self._gpus(out)
        self._processes(out)
        self._remediation(out)
        self._self_health(out)
        out.append("")
        return "\n".join(out).encode()

    # ---- labels -------------------------------------------------------------------

    def _stage_name(self, stage_id: int) -> str:
        stage = self._watchdog.topology.stage(stage_id)
        return stage.name if stage else f"stage{stage_id}"

    def _stage(self, stage_id: int) -> _StageLines:
        lines = self._stage_lines.get(stage_id)
        if lines is None:
            labels = f'stage="{stage_id}",stage_name="{escape(self._stage_name(stage_id))}"'
            verdicts = tuple(
                (
                    (stage_id, state, kind),
                    f'{PREFIX}verdicts_total{{{labels},state="{state.value}",'
                    f'evidence="{kind.value}"}} ',
                )
                for state in VERDICT_STATES
                for kind in EvidenceKind
            )
            durations = _HistogramLines.of("stage_duration_seconds", labels, STAGE_DURATION_BUCKETS)
            lines = self._stage_lines[stage_id] = _StageLines(labels, verdicts, durations)
        return lines

    def _replica(self, ref: StageRef) -> _ReplicaLines:
        lines = self._replica_lines.get(ref)
        if lines is None:
            labels = f'{self._stage(ref.stage_id).labels},replica="{ref.replica}"'
            states = tuple(
                (state, f'{PREFIX}stage_state{{{labels},state="{state.value}"}} ')
                for state in StageState
            )
            lines = self._replica_lines[ref] = _ReplicaLines(labels, states)
        return lines

    def _refs(self) -> list[StageRef]:
        """Every stage replica of the topology, and any the detector found beyond it."""
        watchdog = self._watchdog
        refs = set(watchdog.topology.refs())
        if watchdog.last_report is not None:
            refs.update(status.stage for status in watchdog.last_report.statuses)
        return sorted(refs)

    # ---- families -----------------------------------------------------------------

    def _target(self, out: list[str]) -> None:
        watchdog = self._watchdog
        report = watchdog.last_report
        health = watchdog.last_health
        out += (_HEADERS["build_info"], self._build_info)
        out += (_HEADERS["target_up"], f"{PREFIX}target_up {int(watchdog.target_up)}")
        warm = int(report is not None and report.warmed_up)
        out += (_HEADERS["target_warmed_up"], f"{PREFIX}target_warmed_up {warm}")
        out.append(_HEADERS["target_health_status"])
        current = health.outcome if health is not None else None
        for outcome in HealthOutcome:
            value = int(outcome.value == current)
            out.append(f'{PREFIX}target_health_status{{outcome="{outcome.value}"}} {value}')
        live = int(target_health(watchdog)[0] == 200)
        out += (_HEADERS["target_liveness"], f"{PREFIX}target_liveness {live}")

    def _probes(self, out: list[str]) -> None:
        watchdog = self._watchdog
        health = watchdog.probe_health
        names = sorted({*watchdog.config.probes.enabled, *health})
        # A probe that is enabled but not running (the watchdog not started) reports down.
        rows = [
            (name, (int(h.up), h.errors_total, h.last_duration) if h else (0, 0, 0.0))
            for name in names
            for h in (health.get(name),)
        ]
        out.append(_HEADERS["probe_up"])
        out += (f'{PREFIX}probe_up{{probe="{name}"}} {up}' for name, (up, _, _) in rows)
        out.append(_HEADERS["probe_errors_total"])
        out += (f'{PREFIX}probe_errors_total{{probe="{name}"}} {e}' for name, (_, e, _) in rows)
        out.append(_HEADERS["probe_duration_seconds"])
        out += (
            f'{PREFIX}probe_duration_seconds{{probe="{name}"}} {number(d)}'
            for name, (_, _, d) in rows
        )

    def _stages(self, out: list[str]) -> None:
        watchdog = self._watchdog
        detector = watchdog.detector
        clock = watchdog.clock
        now = clock.monotonic()
        wall_offset = clock.wall() - now
        refs = self._refs()
        report = watchdog.last_report
        states = {s.stage: s.state for s in report.statuses} if report is not None else {}

        out.append(_HEADERS["stage_state"])
        for ref in refs:
            # Before the first evaluation every stage is starting, as the detector begins.
            current = states.get(ref, StageState.STARTING)
            out += (
                f"{prefix}{int(state is current)}" for state, prefix in self._replica(ref).states
            )

        out.append(_HEADERS["stage_last_progress_timestamp_seconds"])
        for ref in refs:
            progress = detector.last_progress_of(ref)
            stamp = 0.0 if progress is None else progress + wall_offset
            out.append(
                f"{PREFIX}stage_last_progress_timestamp_seconds{{{self._replica(ref).labels}}}"
                f" {number(stamp)}"
            )

        out.append(_HEADERS["stage_heartbeat_age_seconds"])
        for ref in refs:
            beat = detector.last_heartbeat(ref)
            age = math.nan if beat is None else now - beat
            out.append(
                f"{PREFIX}stage_heartbeat_age_seconds{{{self._replica(ref).labels}}} {number(age)}"
            )

        stage_ids = sorted({ref.stage_id for ref in refs})
        out.append(_HEADERS["stage_requests_in_flight"])
        out += (
            f"{PREFIX}stage_requests_in_flight{{{self._stage(s).labels}}} {detector.in_flight(s)}"
            for s in stage_ids
        )
        out.append(_HEADERS["stage_requests_overdue"])
        out += (
            f"{PREFIX}stage_requests_overdue{{{self._stage(s).labels}}}"
            f" {detector.overdue_count(s, now)}"
            for s in stage_ids
        )

        out.append(_HEADERS["stage_duration_seconds"])
        durations = self._stats.stage_durations
        for stage_id in stage_ids:
            histogram = durations.get(stage_id, self._empty_durations)
            self._stage(stage_id).durations.write(out, histogram)

        held: dict[StageRef, float] = dict.fromkeys(refs, 0.0)
        for reading in self._stats.gpu_processes:
            if reading.stage is not None:
                held[reading.stage] = held.get(reading.stage, 0.0) + reading.used_bytes
        out.append(_HEADERS["stage_gpu_memory_bytes"])
        out += (
            f"{PREFIX}stage_gpu_memory_bytes{{{self._replica(ref).labels}}} {number(held[ref])}"
            for ref in sorted(held)
        )

        out.append(_HEADERS["verdicts_total"])
        verdicts = self._stats.verdicts
        for stage_id in stage_ids:
            out += (
                f"{prefix}{verdicts.get(key, 0)}" for key, prefix in self._stage(stage_id).verdicts
            )

    def _spans(self, out: list[str]) -> None:
        stats = self._watchdog.receiver.stats
        out += (
            _HEADERS["spans_received_total"],
            f"{PREFIX}spans_received_total {stats.spans_accepted}",
            _HEADERS["spans_rejected_total"],
        )
        out += (
            f'{PREFIX}spans_rejected_total{{reason="{escape(reason)}"}} {count}'
            for reason, count in sorted(stats.spans_rejected.items())
        )

    def _gpus(self, out: list[str]) -> None:
        stats = self._stats
        devices = sorted(stats.gpu_devices.items())
        out.append(_HEADERS["gpu_memory_used_bytes"])
        out += (
            f'{PREFIX}gpu_memory_used_bytes{{gpu="{gpu}"}} {number(used)}'
            for gpu, (used, _) in devices
        )
        out.append(_HEADERS["gpu_utilization_ratio"])
        out += (
            f'{PREFIX}gpu_utilization_ratio{{gpu="{gpu}"}}'
            f" {number(math.nan if utilization is None else utilization)}"
            for gpu, (_, utilization) in devices
        )
        out.append(_HEADERS["gpu_process_memory_bytes"])
        out += (
            f'{PREFIX}gpu_process_memory_bytes{{gpu="{r.gpu}",pid="{r.pid}",'
            f'stage="{"" if r.stage is None else r.stage.stage_id}"}} {number(r.used_bytes)}'
            for r in stats.gpu_processes
        )

    def _processes(self, out: list[str]) -> None:
        counts: dict[tuple[ProcessRole, ProcessStatus], int] = {}
        orphaned = 0
        for info in self._watchdog.tracker.live():
            key = (info.role, info.status)
            counts[key] = counts.get(key, 0) + 1
            orphaned += info.orphaned
        out.append(_HEADERS["processes"])
        for role in ProcessRole:
            for status in LIVE_STATUSES:
                count = counts.get((role, status), 0)
                out.append(
                    f'{PREFIX}processes{{role="{role.value}",status="{status.value}"}} {count}'
                )
        out += (_HEADERS["orphaned_processes"], f"{PREFIX}orphaned_processes {orphaned}")

    def _remediation(self, out: list[str]) -> None:
        stats = self._stats
        policy = self._watchdog.policy
        out.append(_HEADERS["incidents_total"])
        out += (
            f'{PREFIX}incidents_total{{outcome="{o.value}"}} {stats.incidents.get(o, 0)}'
            for o in CLOSED_OUTCOMES
        )
        out += (_HEADERS["incident_open"], f"{PREFIX}incident_open {int(policy.busy)}")
        out.append(_HEADERS["ladder_steps_total"])
        out += (
            f'{PREFIX}ladder_steps_total{{step="{step.value}",outcome="{outcome.value}"}}'
            f" {stats.ladder_steps.get((step, outcome), 0)}"
            for step in StepName
            for outcome in StepOutcome
        )
        out.append(_HEADERS["ladder_step_duration_seconds"])
        for step, lines in self._step_lines.items():
            lines.write(out, stats.step_durations.get(step, self._empty_steps))
        out.append(_HEADERS["verdict_to_release_seconds"])
        self._release_lines.write(out, stats.verdict_to_release)
        out += (
            _HEADERS["remediation_budget_remaining"],
            f"{PREFIX}remediation_budget_remaining {policy.budget_remaining()}",
            _HEADERS["remediation_budget_exhausted_total"],
            f"{PREFIX}remediation_budget_exhausted_total {policy.budget_exhausted_total}",
        )

    def _self_health(self, out: list[str]) -> None:
        watchdog = self._watchdog
        out.append(_HEADERS["internal_errors_total"])
        out += (
            f'{PREFIX}internal_errors_total{{loop="{loop}"}} {count}'
            for loop, count in watchdog.internal_errors.items()
        )
        age = watchdog.evaluation_age()
        out += (
            _HEADERS["evaluation_age_seconds"],
            f"{PREFIX}evaluation_age_seconds {number(math.nan if age is None else age)}",
        )
        out += (
            _HEADERS["state_write_errors_total"],
            f"{PREFIX}state_write_errors_total {watchdog.write_errors.total}",
            _HEADERS["target_lock_conflict"],
            f"{PREFIX}target_lock_conflict {int(bool(watchdog.policy.lock_status().conflict))}",
        )
        out.append(_HEADERS["connections_closed_total"])
        for listener in LISTENERS:
            running = watchdog.listeners.get(listener)
            closed = running.closed if running is not None else {}
            out += (
                f'{PREFIX}connections_closed_total{{listener="{listener}",reason="{reason}"}}'
                f" {closed.get(reason, 0)}"
                for reason in CLOSE_REASONS
            )
