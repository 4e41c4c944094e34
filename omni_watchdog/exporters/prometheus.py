"""The watchdog's own `/metrics`, rendered from the latest `WatchdogState`.

The evaluation loop pushes each new state here (`export`); a scrape renders the latest
one. Ages (heartbeat, evaluation) are measured at the scrape. Every series exists from
the start, zeroed, for every known stage replica, state, step, outcome, probe, rejection
reason and evidence kind.

Every series of a stage carries the `host` it runs on, so that one Prometheus shows the
stages of every host (a vLLM-Omni 0.30 headless stage runs on another host than its head,
and both hosts' watchdogs report it).

The text is written here rather than through a prometheus_client registry: building and
formatting its sample objects costs about 50 ms for the ~3,500 series of 64 stages and
512 GPU pids, against a 20 ms budget for the whole scrape.
"""

from __future__ import annotations

import math
import platform
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from omni_watchdog import __version__
from omni_watchdog.exporters.views import stage_host, target_health
from omni_watchdog.serving import CLOSE_REASONS
from omni_watchdog.stats import (
    LADDER_STEP_BUCKETS,
    RELEASE_BUCKETS,
    STAGE_DURATION_BUCKETS,
    empty_histogram,
)
from omni_watchdog.types import (
    ACTION_OUTCOMES,
    OPERATOR_ACTIONS,
    PIPELINE,
    Clock,
    EvidenceKind,
    HealthOutcome,
    HistogramCounts,
    IncidentOutcome,
    ProcessRole,
    ProcessStatus,
    SilenceCause,
    StageRef,
    StageState,
    StageStatus,
    StepName,
    StepOutcome,
    Topology,
    WatchdogState,
)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LISTENERS = ("api", "otlp")
PREFIX = "omni_watchdog_"

VERDICT_STATES = (StageState.STALLED, StageState.DEAD)
CLOSED_OUTCOMES = tuple(o for o in IncidentOutcome if o is not IncidentOutcome.OPEN)
# `processes` counts live processes, so the exited status never has any.
LIVE_STATUSES = tuple(s for s in ProcessStatus if s is not ProcessStatus.EXITED)
# The `host` of a stage no span has placed yet (or of a watchdog not told its own). Not "":
# Prometheus drops an empty label, so the series would carry no host at all, an alert would
# name none, and `by (host)` would lump it with series that never had one.
UNKNOWN_HOST = "unknown"
# `role` of `host_info`: a watchdog with a master link watches a headless stage.
ROLE_SERVER = "server"
ROLE_HEADLESS_STAGE = "headless_stage"

# name (after the prefix), type and help of every family.
FAMILIES = (
    ("build_info", "gauge", "The watchdog's version and Python version; always 1."),
    (
        "host_info",
        "gauge",
        "The host this watchdog runs on and its role (beside a server, or beside a headless"
        " stage); always 1.",
    ),
    (
        "master_link_up",
        "gauge",
        "Whether this headless stage's link to its master is up; only beside a headless stage.",
    ),
    (
        "master_link_last_change_timestamp_seconds",
        "gauge",
        "Unix time the headless stage's master link last went up or down.",
    ),
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
    (
        "probe_stack_sample_errors_total",
        "counter",
        "Python stack samples (py-spy) the probe could not take; its runs went on with the"
        " kernel's view of the threads only.",
    ),
    ("probe_duration_seconds", "gauge", "How long the probe's last run took."),
    ("stage_state", "gauge", "The detector's state of the stage replica, 1 for the current one."),
    (
        "stage_remote",
        "gauge",
        "1 for a stage replica on another host: judged from its spans, never signalled by"
        " this watchdog.",
    ),
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
        "stage_silence_seconds",
        "gauge",
        "Seconds a silent stage replica has been doing what `cause` names (compiling,"
        " waiting_on_child, spinning, ...); no series while it is not silent.",
    ),
    (
        "stage_work_seconds",
        "gauge",
        "Seconds a silent stage replica's work has visibly advanced without a break, as"
        " charged against its work budget; `cause` is what it does now. No series while its"
        " work does not advance.",
    ),
    (
        "work_budget_seconds",
        "gauge",
        "How long work of `cause` that visibly advances may keep a stage silent before the"
        " stage can be judged (detection.work_timeout, or its detection.work_timeouts entry).",
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
    (
        "stage_request_errors_total",
        "counter",
        "Requests the stage replica failed (an error span): a failed request, which the"
        " server answers with an error and goes on, not a stopped stage.",
    ),
    (
        "stage_denoising_requests",
        "gauge",
        "Requests in flight at a diffusion stage replica, in their denoising steps.",
    ),
    (
        "stage_denoise_step_seconds",
        "gauge",
        "Median duration of a diffusion stage replica's recent denoising steps.",
    ),
    ("stage_duration_seconds", "histogram", "Durations of the stage's request spans."),
    (
        "stage_gpu_memory_bytes",
        "gauge",
        "Device memory held by the stage replica's processes, NaN for one on another host.",
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
        "remediation_records_exhausted_total",
        "counter",
        "Verdicts that opened no incident: the hourly bound of incidents that act on nothing"
        " (observe, dry-run) was reached.",
    ),
    (
        "remediation_paused",
        "gauge",
        "1 while an operator's maintenance pause holds the watchdog's actions; detection goes on.",
    ),
    (
        "remediation_pause_end_timestamp_seconds",
        "gauge",
        "When the maintenance pause in force ends (Unix time); 0 when none is.",
    ),
    (
        "operator_actions_total",
        "counter",
        "Operator action requests on the API (remediate, pause, resume), by outcome.",
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
        "blind_seconds_total",
        "counter",
        "Seconds the watchdog's own event loop could not run (starved of CPU or blocked);"
        " silence in them is not held against the server.",
    ),
    (
        "blind_spells_total",
        "counter",
        "Times the watchdog's own event loop could not run for longer than 0.2 s.",
    ),
    (
        "probe_timeouts_set_aside_total",
        "counter",
        "/health and canary timeouts not counted as failures: the watchdog itself could not"
        " look for part of their wait.",
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
        "Connections a listener closed: over its connection cap, without a whole request"
        " head in time, or after a malformed one.",
    ),
    (
        "bundle_reads_refused_total",
        "counter",
        "Reads of incident bundles (reports, stacks, files) the API refused with 503: too"
        " many at once.",
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

    def write(self, out: list[str], histogram: HistogramCounts) -> None:
        running = 0
        for prefix, count in zip(self.buckets, histogram.counts, strict=True):
            running += count
            out.append(prefix + str(running))
        out.append(self.sum + number(histogram.total))
        out.append(self.count + str(running))


@dataclass(frozen=True)
class _ReplicaLines:
    """Label text of one stage replica on one host, and its stage_state lines, made once."""

    host: str
    labels: str
    states: tuple[tuple[StageState, str], ...]


@dataclass(frozen=True)
class _StageLines:
    """Label text of one stage on one host, and its verdict and duration lines, made once."""

    host: str
    labels: str
    verdicts: tuple[tuple[tuple[int, StageState, EvidenceKind], str], ...]
    durations: _HistogramLines


class MetricsExposition:
    """Renders the latest `WatchdogState` in the Prometheus text format."""

    content_type = CONTENT_TYPE

    def __init__(
        self,
        clock: Clock,
        state: WatchdogState,
        work_budgets: Mapping[SilenceCause, float],
    ) -> None:
        """`work_budgets`: the configured budget of each cause that can be work advancing."""
        self._clock = clock
        self._state = state
        self._work_budgets = tuple(
            f'{PREFIX}work_budget_seconds{{cause="{cause.value}"}} {number(seconds)}'
            for cause, seconds in work_budgets.items()
        )
        # Label text is made once per stage: formatting it on every scrape was most of the cost.
        # One entry per stage, remade when its host changes, so that a host named anew by
        # each span cannot grow them.
        self._replica_lines: dict[StageRef, _ReplicaLines] = {}
        self._stage_lines: dict[int, _StageLines] = {}
        # The topology those labels were made for: a stage learned later may be renamed.
        self._labelled_topology: Topology = state.topology
        self._empty_durations = empty_histogram(STAGE_DURATION_BUCKETS)
        self._empty_steps = empty_histogram(LADDER_STEP_BUCKETS)
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

    def export(self, state: WatchdogState) -> None:
        self._state = state

    def render(self) -> bytes:
        """The whole exposition of the latest state, as the body of a scrape."""
        state = self._state
        if state.topology is not self._labelled_topology:
            self._labelled_topology = state.topology
            self._stage_lines.clear()
            self._replica_lines.clear()
        now = self._clock.monotonic()
        out: list[str] = []
        self._target(out, state)
        self._host(out, state)
        self._probes(out, state)
        self._stages(out, state, now)
        self._spans(out, state)
        self._gpus(out, state)
        self._processes(out, state)
        self._remediation(out, state)
        self._self_health(out, state, now)
        out.append("")
        return "\n".join(out).encode()

    # ---- labels -------------------------------------------------------------------

    def _stage_name(self, stage_id: int) -> str:
        if StageRef(stage_id).whole_pipeline:
            return str(PIPELINE)
        stage = self._labelled_topology.stage(stage_id)
        return stage.name if stage else f"stage{stage_id}"

    def _stage_labels(self, stage_id: int) -> str:
        # The target as a whole (a verdict no stage could be proved the one for) is
        # stage="pipeline", so an alert on verdicts sees it beside the stages'.
        label = str(PIPELINE) if StageRef(stage_id).whole_pipeline else str(stage_id)
        return f'stage="{label}",stage_name="{escape(self._stage_name(stage_id))}"'

    def _stage(self, stage_id: int, host: str) -> _StageLines:
        lines = self._stage_lines.get(stage_id)
        if lines is None or lines.host != host:
            labels = f'{self._stage_labels(stage_id)},host="{escape(host)}"'
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
            lines = self._stage_lines[stage_id] = _StageLines(host, labels, verdicts, durations)
        return lines

    def _replica(self, ref: StageRef, host: str) -> _ReplicaLines:
        lines = self._replica_lines.get(ref)
        if lines is None or lines.host != host:
            labels = (
                f'{self._stage_labels(ref.stage_id)},replica="{ref.replica}",host="{escape(host)}"'
            )
            states = tuple(
                (state, f'{PREFIX}stage_state{{{labels},state="{state.value}"}} ')
                for state in StageState
            )
            lines = self._replica_lines[ref] = _ReplicaLines(host, labels, states)
        return lines

    # ---- families -----------------------------------------------------------------

    def _target(self, out: list[str], state: WatchdogState) -> None:
        target = state.target
        report = state.report
        out += (_HEADERS["build_info"], self._build_info)
        out += (_HEADERS["target_up"], f"{PREFIX}target_up {int(target.up)}")
        warm = int(report is not None and report.warmed_up)
        out += (_HEADERS["target_warmed_up"], f"{PREFIX}target_warmed_up {warm}")
        out.append(_HEADERS["target_health_status"])
        current = target.health.outcome if target.health is not None else None
        for outcome in HealthOutcome:
            value = int(outcome is current)
            out.append(f'{PREFIX}target_health_status{{outcome="{outcome.value}"}} {value}')
        live = int(target_health(state)[0] == 200)
        out += (_HEADERS["target_liveness"], f"{PREFIX}target_liveness {live}")

    def _host(self, out: list[str], state: WatchdogState) -> None:
        host = escape(state.host or UNKNOWN_HOST)
        link = state.link
        role = ROLE_SERVER if link is None else ROLE_HEADLESS_STAGE
        out += (
            _HEADERS["host_info"],
            f'{PREFIX}host_info{{host="{host}",role="{role}"}} 1',
        )
        up: tuple[str, ...] = ()
        changed: tuple[str, ...] = ()
        if link is not None:
            labels = f'address="{escape(link.address)}",port="{link.port}",host="{host}"'
            up = (f"{PREFIX}master_link_up{{{labels}}} {int(link.up)}",)
            changed = (
                f"{PREFIX}master_link_last_change_timestamp_seconds{{{labels}}}"
                f" {number(state.wall(link.since))}",
            )
        out += (
            _HEADERS["master_link_up"],
            *up,
            _HEADERS["master_link_last_change_timestamp_seconds"],
            *changed,
        )

    def _probes(self, out: list[str], state: WatchdogState) -> None:
        rows = sorted(state.probes, key=lambda h: h.name)
        out.append(_HEADERS["probe_up"])
        out += (f'{PREFIX}probe_up{{probe="{h.name}"}} {int(h.up)}' for h in rows)
        out.append(_HEADERS["probe_errors_total"])
        out += (f'{PREFIX}probe_errors_total{{probe="{h.name}"}} {h.errors_total}' for h in rows)
        out.append(_HEADERS["probe_stack_sample_errors_total"])
        out += (
            f'{PREFIX}probe_stack_sample_errors_total{{probe="{h.name}"}}'
            f" {h.stack_sample_errors_total}"
            for h in rows
            if h.stack_sample_errors_total is not None
        )
        out.append(_HEADERS["probe_duration_seconds"])
        out += (
            f'{PREFIX}probe_duration_seconds{{probe="{h.name}"}} {number(h.last_duration)}'
            for h in rows
        )

    def _stages(self, out: list[str], state: WatchdogState, now: float) -> None:
        wall_offset = state.wall_at - state.made_at
        report = state.report
        statuses = {s.stage: s for s in report.statuses} if report is not None else {}
        # Every stage replica of the topology, and any the detector found beyond it.
        refs = sorted({*state.topology.refs(), *statuses})
        local = state.host or UNKNOWN_HOST
        replicas = {
            ref: self._replica(ref, stage_host(state, statuses.get(ref)) or UNKNOWN_HOST)
            for ref in refs
        }
        # A stage's own series (requests, durations, verdicts) name the host of its first
        # replica: vLLM-Omni 0.30 runs all replicas of a headless stage on one host.
        stages: dict[int, _StageLines] = {}
        for ref in refs:
            if ref.stage_id not in stages:
                stages[ref.stage_id] = self._stage(ref.stage_id, replicas[ref].host)

        out.append(_HEADERS["stage_state"])
        for ref in refs:
            status = statuses.get(ref)
            # Before the first evaluation every stage is starting, as the detector begins.
            current = status.state if status is not None else StageState.STARTING
            out += (f"{prefix}{int(each is current)}" for each, prefix in replicas[ref].states)

        out.append(_HEADERS["stage_remote"])
        out += (
            f"{PREFIX}stage_remote{{{replicas[ref].labels}}} {int(_remote(statuses.get(ref)))}"
            for ref in refs
        )

        out.append(_HEADERS["stage_last_progress_timestamp_seconds"])
        for ref in refs:
            status = statuses.get(ref)
            progress = status.last_progress if status is not None else None
            stamp = 0.0 if progress is None else progress + wall_offset
            out.append(
                f"{PREFIX}stage_last_progress_timestamp_seconds{{{replicas[ref].labels}}}"
                f" {number(stamp)}"
            )

        out.append(_HEADERS["stage_heartbeat_age_seconds"])
        for ref in refs:
            status = statuses.get(ref)
            beat = status.last_heartbeat if status is not None else None
            age = math.nan if beat is None else now - beat
            out.append(
                f"{PREFIX}stage_heartbeat_age_seconds{{{replicas[ref].labels}}} {number(age)}"
            )

        out.append(_HEADERS["stage_silence_seconds"])
        for ref in refs:
            status = statuses.get(ref)
            cause = status.cause if status is not None else None
            if cause is not None:
                out.append(
                    f"{PREFIX}stage_silence_seconds{{{replicas[ref].labels},"
                    f'cause="{cause.cause.value}"}} {number(now - cause.since)}'
                )

        out.append(_HEADERS["stage_work_seconds"])
        for ref in refs:
            status = statuses.get(ref)
            cause = status.cause if status is not None else None
            if cause is not None and cause.working_since is not None:
                out.append(
                    f"{PREFIX}stage_work_seconds{{{replicas[ref].labels},"
                    f'cause="{cause.cause.value}"}} {number(now - cause.working_since)}'
                )
        out.append(_HEADERS["work_budget_seconds"])
        out += self._work_budgets

        requests = report.requests if report is not None else {}
        out.append(_HEADERS["stage_requests_in_flight"])
        out += (
            f"{PREFIX}stage_requests_in_flight{{{lines.labels}}}"
            f" {requests[s].in_flight if s in requests else 0}"
            for s, lines in stages.items()
        )
        out.append(_HEADERS["stage_requests_overdue"])
        out += (
            f"{PREFIX}stage_requests_overdue{{{lines.labels}}}"
            f" {requests[s].overdue if s in requests else 0}"
            for s, lines in stages.items()
        )

        out.append(_HEADERS["stage_request_errors_total"])
        for ref in refs:
            status = statuses.get(ref)
            errors = status.request_errors if status is not None else 0
            out.append(f"{PREFIX}stage_request_errors_total{{{replicas[ref].labels}}} {errors}")

        # Only stages that denoise (their steps told) have these series.
        denoising = [
            (replicas[ref].labels, status)
            for ref in refs
            if (status := statuses.get(ref)) is not None and status.seconds_per_step is not None
        ]
        out.append(_HEADERS["stage_denoising_requests"])
        out += (
            f"{PREFIX}stage_denoising_requests{{{labels}}} {len(status.denoising)}"
            for labels, status in denoising
        )
        out.append(_HEADERS["stage_denoise_step_seconds"])
        out += (
            f"{PREFIX}stage_denoise_step_seconds{{{labels}}}"
            f" {number(status.seconds_per_step or 0.0)}"
            for labels, status in denoising
        )

        out.append(_HEADERS["stage_duration_seconds"])
        durations = state.counters.stage_durations
        for stage_id, lines in stages.items():
            lines.durations.write(out, durations.get(stage_id, self._empty_durations))

        held: dict[StageRef, float] = dict.fromkeys(refs, 0.0)
        for process in state.gpu.processes if state.gpu is not None else ():
            if process.stage is not None:
                held[process.stage] = held.get(process.stage, 0.0) + process.used_bytes
        out.append(_HEADERS["stage_gpu_memory_bytes"])
        for ref in sorted(held):
            # This host's NVML cannot see a remote stage's memory: unknown, not zero.
            used = math.nan if _remote(statuses.get(ref)) else held[ref]
            # A GPU pid is this host's, so a stage known only from one is a local stage.
            replica = replicas.get(ref) or self._replica(ref, local)
            out.append(f"{PREFIX}stage_gpu_memory_bytes{{{replica.labels}}} {number(used)}")

        out.append(_HEADERS["verdicts_total"])
        verdicts = state.counters.verdicts
        for lines in (*stages.values(), self._stage(PIPELINE.stage_id, local)):
            out += (f"{prefix}{verdicts.get(key, 0)}" for key, prefix in lines.verdicts)

    def _spans(self, out: list[str], state: WatchdogState) -> None:
        stats = state.receiver
        out += (
            _HEADERS["spans_received_total"],
            f"{PREFIX}spans_received_total {stats.spans_accepted}",
            _HEADERS["spans_rejected_total"],
        )
        out += (
            f'{PREFIX}spans_rejected_total{{reason="{escape(reason)}"}} {count}'
            for reason, count in sorted(stats.spans_rejected.items())
        )

    def _gpus(self, out: list[str], state: WatchdogState) -> None:
        reading = state.gpu
        devices = sorted(reading.devices, key=lambda d: d.index) if reading is not None else []
        out.append(_HEADERS["gpu_memory_used_bytes"])
        out += (
            f'{PREFIX}gpu_memory_used_bytes{{gpu="{d.index}"}} {number(d.used_bytes)}'
            for d in devices
        )
        out.append(_HEADERS["gpu_utilization_ratio"])
        out += (
            f'{PREFIX}gpu_utilization_ratio{{gpu="{d.index}"}}'
            f" {number(math.nan if d.utilization is None else d.utilization)}"
            for d in devices
        )
        # A pid NVML reports is on this host, whatever stage it serves.
        host = escape(state.host or UNKNOWN_HOST)
        out.append(_HEADERS["gpu_process_memory_bytes"])
        out += (
            f'{PREFIX}gpu_process_memory_bytes{{gpu="{p.gpu}",pid="{p.pid}",'
            f'stage="{"" if p.stage is None else p.stage.stage_id}",host="{host}"}}'
            f" {number(p.used_bytes)}"
            for p in (reading.processes if reading is not None else ())
        )

    def _processes(self, out: list[str], state: WatchdogState) -> None:
        counts: dict[tuple[ProcessRole, ProcessStatus], int] = {}
        orphaned = 0
        for info in state.processes:
            if info.status is ProcessStatus.EXITED:
                continue
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

    def _remediation(self, out: list[str], state: WatchdogState) -> None:
        counters = state.counters
        remediation = state.remediation
        out.append(_HEADERS["incidents_total"])
        out += (
            f'{PREFIX}incidents_total{{outcome="{o.value}"}} {counters.incidents.get(o, 0)}'
            for o in CLOSED_OUTCOMES
        )
        out += (_HEADERS["incident_open"], f"{PREFIX}incident_open {int(remediation.busy)}")
        out.append(_HEADERS["ladder_steps_total"])
        out += (
            f'{PREFIX}ladder_steps_total{{step="{step.value}",outcome="{outcome.value}"}}'
            f" {counters.ladder_steps.get((step, outcome), 0)}"
            for step in StepName
            for outcome in StepOutcome
        )
        out.append(_HEADERS["ladder_step_duration_seconds"])
        for step, lines in self._step_lines.items():
            lines.write(out, counters.step_durations.get(step, self._empty_steps))
        out.append(_HEADERS["verdict_to_release_seconds"])
        self._release_lines.write(out, counters.verdict_to_release)
        out += (
            _HEADERS["remediation_budget_remaining"],
            f"{PREFIX}remediation_budget_remaining {remediation.budget_remaining}",
            _HEADERS["remediation_budget_exhausted_total"],
            f"{PREFIX}remediation_budget_exhausted_total {remediation.budget_exhausted_total}",
            _HEADERS["remediation_records_exhausted_total"],
            f"{PREFIX}remediation_records_exhausted_total {remediation.records_exhausted_total}",
            _HEADERS["remediation_paused"],
            f"{PREFIX}remediation_paused {int(remediation.pause is not None)}",
            _HEADERS["remediation_pause_end_timestamp_seconds"],
            f"{PREFIX}remediation_pause_end_timestamp_seconds"
            f" {number(remediation.pause.until if remediation.pause else 0.0)}",
            _HEADERS["operator_actions_total"],
        )
        out += (
            f'{PREFIX}operator_actions_total{{action="{action}",outcome="{outcome}"}}'
            f" {remediation.operator_actions.get((action, outcome), 0)}"
            for action in OPERATOR_ACTIONS
            for outcome in ACTION_OUTCOMES
        )

    def _self_health(self, out: list[str], state: WatchdogState, now: float) -> None:
        health = state.self_health
        out.append(_HEADERS["internal_errors_total"])
        out += (
            f'{PREFIX}internal_errors_total{{loop="{loop}"}} {count}'
            for loop, count in health.internal_errors.items()
        )
        last = health.last_evaluation
        age = math.nan if last is None else now - last
        out += (
            _HEADERS["evaluation_age_seconds"],
            f"{PREFIX}evaluation_age_seconds {number(age)}",
            _HEADERS["blind_seconds_total"],
            f"{PREFIX}blind_seconds_total {number(health.blind_seconds)}",
            _HEADERS["blind_spells_total"],
            f"{PREFIX}blind_spells_total {health.blind_spells}",
            _HEADERS["probe_timeouts_set_aside_total"],
        )
        out += (
            f'{PREFIX}probe_timeouts_set_aside_total{{probe="{probe}"}} {count}'
            for probe, count in sorted(health.set_aside.items())
        )
        out += (
            _HEADERS["state_write_errors_total"],
            f"{PREFIX}state_write_errors_total {health.state_write_errors}",
            _HEADERS["target_lock_conflict"],
            f"{PREFIX}target_lock_conflict {int(bool(state.remediation.lock.conflict))}",
        )
        out.append(_HEADERS["connections_closed_total"])
        for listener in LISTENERS:
            closed = health.connections_closed.get(listener, {})
            out += (
                f'{PREFIX}connections_closed_total{{listener="{listener}",reason="{reason}"}}'
                f" {closed.get(reason, 0)}"
                for reason in CLOSE_REASONS
            )
        out += (
            _HEADERS["bundle_reads_refused_total"],
            f"{PREFIX}bundle_reads_refused_total {health.bundle_reads_refused}",
        )


def _remote(status: StageStatus | None) -> bool:
    return status is not None and status.remote
