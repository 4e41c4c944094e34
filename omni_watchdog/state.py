"""Making a `WatchdogState`: one frozen picture of every component, taken by the loop."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from omni_watchdog.detector import Detector
from omni_watchdog.exporters.api import BundleReads
from omni_watchdog.operator import OperatorActions
from omni_watchdog.policy.core import Policy
from omni_watchdog.policy.incidents import StateWriteErrors
from omni_watchdog.probes.activity import ActivityProbe
from omni_watchdog.probes.link import MasterLinkProbe
from omni_watchdog.probes.processes import ProcessTracker
from omni_watchdog.probes.spans import SpanReceiver
from omni_watchdog.self_health import InternalErrors, LoopSight, ProbeBoard
from omni_watchdog.serving import Listener
from omni_watchdog.stats import WatchdogStats
from omni_watchdog.target import TargetWatch
from omni_watchdog.types import (
    Clock,
    DetectorReport,
    Incident,
    ProbeHealth,
    RemediationView,
    SelfHealth,
    TargetView,
    Topology,
    WatchdogState,
)


class StateAssembler:
    """Reads the components into a `WatchdogState`; holds nothing of its own."""

    def __init__(
        self,
        *,
        clock: Clock,
        target: TargetWatch,
        tracker: ProcessTracker,
        receiver: SpanReceiver,
        policy: Policy,
        stats: WatchdogStats,
        probes: ProbeBoard,
        errors: InternalErrors,
        write_errors: StateWriteErrors,
        listeners: Mapping[str, Listener],
        sight: LoopSight,
        detector: Detector,
        operator: OperatorActions,
        host: str = "",
        link: MasterLinkProbe | None = None,
        activity: ActivityProbe | None = None,
        reads: BundleReads | None = None,
    ) -> None:
        """`listeners` is read at each state: the watchdog fills it as it binds them.
        `host` names this host; `link` is a headless stage's link probe; `activity` the
        activity probe, whose failed stack samples join its health; `reads` the API's
        bundle reads, whose refusals are counted."""
        self._reads = reads
        self._host = host
        self._link = link
        self._activity = activity
        self._clock = clock
        self._target = target
        self._tracker = tracker
        self._receiver = receiver
        self._policy = policy
        self._stats = stats
        self._probes = probes
        self._errors = errors
        self._write_errors = write_errors
        self._listeners = listeners
        self._sight = sight
        self._detector = detector
        self._operator = operator

    def make(
        self,
        topology: Topology,
        report: DetectorReport | None,
        last_evaluation: float | None,
        closed_now: tuple[Incident, ...] = (),
    ) -> WatchdogState:
        tracker = self._tracker
        policy = self._policy
        root = tracker.root
        return WatchdogState(
            made_at=self._clock.monotonic(),
            wall_at=self._clock.wall(),
            target=TargetView(
                url=self._target.url,
                root=root,
                up=self._target.up,
                by_process=self._target.by_process,
                generation=tracker.generation,
                health=self._target.last_health,
            ),
            topology=topology,
            report=self._with_hosts(report),
            processes=tracker.recorded(),
            gpu=self._target.last_gpu(),
            probes=self.probe_health(),
            receiver=self._receiver.stats,
            remediation=RemediationView(
                mode=policy.mode,
                busy=policy.busy,
                budget_remaining=policy.budget_remaining(),
                budget_exhausted_total=policy.budget_exhausted_total,
                records_exhausted_total=policy.records_exhausted_total,
                lock=policy.lock_status(),
                incidents=tuple(policy.incidents()),
                closed_now=closed_now,
                pause=policy.window.current(),
                operator_actions=dict(self._operator.counts),
            ),
            counters=self._stats.counters(),
            self_health=self.self_health(last_evaluation),
            host=self._host,
            link=self._link.state() if self._link is not None else None,
        )

    def probe_health(self) -> tuple[ProbeHealth, ...]:
        """Each probe's runs, and the activity probe's stack samples that failed within
        runs that succeeded (the board sees only whole runs)."""
        health = self._probes.snapshot()
        activity = self._activity
        if activity is None:
            return health
        return tuple(
            dataclasses.replace(
                each,
                stack_sample_errors_total=activity.stack_failures,
                last_stack_sample_error=activity.last_stack_error,
            )
            if each.name == activity.name
            else each
            for each in health
        )

    def _with_hosts(self, report: DetectorReport | None) -> DetectorReport | None:
        """Each stage where it runs: this host, or for a remote one what its spans said."""
        if report is None:
            return None
        remote_hosts = self._receiver.remote_hosts
        statuses = tuple(
            dataclasses.replace(
                status,
                host=remote_hosts.get(status.stage.stage_id, "") if status.remote else self._host,
            )
            for status in report.statuses
        )
        return dataclasses.replace(report, statuses=statuses)

    def self_health(self, last_evaluation: float | None) -> SelfHealth:
        return SelfHealth(
            last_evaluation=last_evaluation,
            internal_errors=self._errors.counts(),
            state_write_errors=self._write_errors.total,
            last_state_write_error=self._write_errors.last,
            connections_closed={
                name: dict(listener.closed) for name, listener in self._listeners.items()
            },
            blind_seconds=self._sight.blind_seconds,
            blind_spells=self._sight.blind_spells,
            set_aside={kind.value: count for kind, count in self._detector.set_aside.items()},
            bundle_reads_refused=self._reads.refused if self._reads is not None else 0,
        )
