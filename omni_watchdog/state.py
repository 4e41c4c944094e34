"""Making a `WatchdogState`: one frozen picture of every component, taken by the loop."""

from __future__ import annotations

from collections.abc import Mapping

from omni_watchdog.detector import Detector
from omni_watchdog.operator import OperatorActions
from omni_watchdog.policy.core import Policy
from omni_watchdog.policy.incidents import StateWriteErrors
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
    ) -> None:
        """`listeners` is read at each state: the watchdog fills it as it binds them."""
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
            report=report,
            processes=tracker.recorded(),
            gpu=self._target.last_gpu(),
            probes=self._probes.snapshot(),
            receiver=self._receiver.stats,
            remediation=RemediationView(
                mode=policy.mode,
                busy=policy.busy,
                budget_remaining=policy.budget_remaining(),
                budget_exhausted_total=policy.budget_exhausted_total,
                lock=policy.lock_status(),
                incidents=tuple(policy.incidents()),
                closed_now=closed_now,
                pause=policy.window.current(),
                operator_actions=dict(self._operator.counts),
            ),
            counters=self._stats.counters(),
            self_health=self.self_health(last_evaluation),
        )

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
        )
