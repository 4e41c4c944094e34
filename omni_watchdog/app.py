"""The watchdog process: probes feed the detector, the detector feeds the policy, and
each evaluation's state goes out to the exporters.

`factory.build_watchdog` makes every component; `Watchdog` only runs the loops. Everything
runs on one event loop. Each probe has its own periodic task, so a probe that hangs or
fails only delays itself; the evaluation task judges every `EVALUATE_EVERY`, and at once
on news that may settle a verdict (an exit, a failed /health or canary) or when a timeout
runs out, and pushes a new `WatchdogState` to every exporter. A stage process's exit also
sends the /health probe at once, and every `ASKING_EVERY` for `confirm_timeout`, so that
the server's own word follows the exit. Every loop survives its own errors: each is logged
once with its traceback, counted by loop, and the loop goes on; /healthz fails once
evaluations stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Coroutine, Sequence
from typing import Any

import aiohttp
from aiohttp import web

from omni_watchdog.config import WatchdogConfig, split_host_port
from omni_watchdog.detector import Detector
from omni_watchdog.exporters.api import JsonApi
from omni_watchdog.exporters.traces import IncidentTraces
from omni_watchdog.log import log_event
from omni_watchdog.operator import OperatorActions
from omni_watchdog.policy.core import Policy
from omni_watchdog.probes.activity import ActivityProbe
from omni_watchdog.probes.gpu import GpuProbe
from omni_watchdog.probes.health import HealthProbe
from omni_watchdog.probes.processes import ProcessTracker
from omni_watchdog.probes.span_store import SpanStore
from omni_watchdog.probes.spans import SpanReceiver
from omni_watchdog.self_health import (
    SIGHT_AT_REST,
    SIGHT_EVERY,
    InternalErrors,
    LoopSight,
    ProbeBoard,
)
from omni_watchdog.serving import (
    Listener,
    ListenerLimits,
    RateLimitedLog,
    install_loop_error_handler,
)
from omni_watchdog.state import StateAssembler
from omni_watchdog.stats import WatchdogStats
from omni_watchdog.target import TargetWatch
from omni_watchdog.tasks import end_tasks
from omni_watchdog.topology import TopologySenders, replaces, with_remote_stages
from omni_watchdog.types import (
    Clock,
    DetectorReport,
    Exporter,
    HealthOutcome,
    Observation,
    ObservationKind,
    Probe,
    ProcessStatus,
    RestingProbe,
    Topology,
    WatchdogState,
)

logger = logging.getLogger("omni_watchdog.app")

EVALUATE_EVERY = 0.25
# While the server is idle and well (`DetectorReport.at_rest`) only news can change a verdict:
# a timeout running out (`next_due`), an exit or a failed answer, or observations that end
# the rest, and each of them wakes the evaluation.
EVALUATE_AT_REST = 1.0
# Probes that look this many times less often while the server is at rest, and at once
# when the rest ends: the activity probe reads only silent stages, and at rest none is;
# the process scan finds what an idle server does not do (a new process, a stopped one),
# and whatever it finds that is not routine ends the rest.
AT_REST_STRETCH = 4
LOOK_LESS_AT_REST = frozenset({ActivityProbe.name, ProcessTracker.name})
# What an idle, well server sends all the time; anything else (a request, an error, a
# change of pipeline, a process stopped or gone: `routine_at_rest`) is judged at once.
ROUTINE_AT_REST = frozenset(
    {
        ObservationKind.HEARTBEAT,
        ObservationKind.PROGRESS,
        ObservationKind.LOAD,
        ObservationKind.HEALTH,
        ObservationKind.CANARY,
        ObservationKind.PROCESS,
        ObservationKind.PROCESS_STAGE,
        ObservationKind.GPU_PROCESS,
        ObservationKind.GPU_DEVICE,
        ObservationKind.ACTIVITY,
    }
)
UNROUTINE_STATUSES = frozenset(
    {ProcessStatus.STOPPED, ProcessStatus.DISK_SLEEP, ProcessStatus.ZOMBIE, ProcessStatus.EXITED}
)
# How long `stop` waits for the loops to end before it gives up on them.
STOP_PATIENCE = 5.0
# After a stage process exits, /health is asked this often until the exit alone would
# confirm the death: a server may answer once more before its loop stops for good.
ASKING_EVERY = 0.25
# Judged this long after a timeout runs out, so that it has run out when judged.
DUE_SLACK = 0.005
SPANS_EVERY = 0.1
CANARY_CHECK_EVERY = 0.25


class Watchdog:
    """One watchdog attached to one target server: its loops and its two listeners.

    What it knows is read from `state`, the last evaluation's snapshot, as every exporter
    reads it; its components stay its own.
    """

    def __init__(
        self,
        *,
        config: WatchdogConfig,
        clock: Clock,
        session: aiohttp.ClientSession,
        topology: Topology,
        detector: Detector,
        tracker: ProcessTracker,
        senders: TopologySenders | None,
        receiver: SpanReceiver,
        store: SpanStore,
        periodic: tuple[tuple[Probe, float], ...],
        target: TargetWatch,
        policy: Policy,
        stats: WatchdogStats,
        probes: ProbeBoard,
        errors: InternalErrors,
        assembler: StateAssembler,
        sight: LoopSight,
        listeners: dict[str, Listener],
        api: JsonApi,
        operator: OperatorActions,
        exporters: tuple[Exporter, ...],
        traces: IncidentTraces | None,
    ) -> None:
        """`senders` is the topology the receiver trusts spans against when no process
        table is in view (None when the tracker is that judge); `listeners` is filled as
        they bind, and the assembler reads it."""
        self._config = config
        self._clock = clock
        self._topology = topology
        self._detector = detector
        self._tracker = tracker
        self._receiver = receiver
        self._store = store
        self._target = target
        self._policy = policy
        self._stats = stats
        self._listeners = listeners
        self._session = session
        self._senders = senders
        self._periodic = periodic
        self._probes = probes
        self._errors = errors
        self._assembler = assembler
        self._sight = sight
        self._api = api
        self._operator = operator
        self._exporters = exporters
        self._traces = traces
        self.state: WatchdogState = assembler.make(topology, None, None)
        self._last_evaluation: float | None = None
        self._last_report: DetectorReport | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._look_now = {probe.name: asyncio.Event() for probe, _ in periodic}
        self._judge_now = asyncio.Event()
        self._sight_now = asyncio.Event()
        self._at_rest = False
        self._asking_until = 0.0
        self._generation = 0
        self.api_port: int | None = None
        self.otlp_port: int | None = None

    # ---- life cycle ---------------------------------------------------------------

    async def start(self) -> None:
        """Bind both listeners, then start the loops; a listener that cannot bind raises
        OSError before any loop runs."""
        config = self._config
        listener_errors = RateLimitedLog(lambda: self._errors.count("listener"))
        install_loop_error_handler(asyncio.get_running_loop(), listener_errors)
        self.otlp_port = await self._serve(
            self._receiver.app(), config.spans.otlp_listen, "otlp", listener_errors
        )
        self.api_port = await self._serve(self.api_app(), config.listen, "api", listener_errors)
        for probe, every in self._periodic:
            self._spawn(self._probe_loop(probe, every), f"{probe.name} probe")
        self._spawn(self._evaluate_loop(), "evaluation")
        self._spawn(self._sight_loop(), "sight")
        await self._policy.resume(self._target.snapshot_of_entry)
        log_event(
            logger,
            "watchdog_started",
            target=self._target.url,
            mode=config.mode.value,
            api_port=self.api_port,
            otlp_port=self.otlp_port,
            stages=[s.name for s in self._topology.stages],
            probes=[probe.name for probe, _ in self._periodic],
        )

    async def stop(self) -> None:
        """End the loops, the listeners and a running climb, each in bounded time: a
        watchdog that cannot stop keeps its ports and its target lock."""
        stuck = await end_tasks(self._tasks, STOP_PATIENCE)
        if stuck:
            log_event(
                logger,
                "loops_not_stopped",
                logging.ERROR,
                loops=[task.get_name() for task in stuck],
                patience=STOP_PATIENCE,
            )
        self._tracker.close()
        for listener in self._listeners.values():
            await listener.close()
        await self._policy.close()
        await self._session.close()
        if self._traces is not None:
            await asyncio.to_thread(self._traces.shutdown)

    async def run_until(self, stop: asyncio.Event) -> None:
        await stop.wait()
        await self.stop()

    def api_app(self) -> web.Application:
        """The routes of `--listen`, the operator's actions among them, as `start` serves
        them; a test may serve them in-process before the loops run."""
        app = self._api.app()
        self._operator.add_routes(app, self._republish)
        return app

    @property
    def spans(self) -> SpanStore:
        """The spans kept per stage. The state carries none of them (too many to copy at
        every evaluation): a test of what a server sends reads them here."""
        return self._store

    # ---- loops --------------------------------------------------------------------

    def _spawn(self, coroutine: Coroutine[Any, Any, None], loop_name: str) -> None:
        self._tasks.append(asyncio.get_running_loop().create_task(coroutine, name=loop_name))

    async def _serve(
        self, app: web.Application, listen: str, which: str, errors: RateLimitedLog
    ) -> int:
        host, port = split_host_port(listen, which)
        limits = ListenerLimits(self._config.header_timeout, self._config.max_connections)
        listener = Listener(app, which, limits, errors)
        bound = await listener.start(host, port)
        self._listeners[which] = listener
        return bound

    async def _probe_loop(self, probe: Probe, every: float) -> None:
        while True:
            begun = self._clock.monotonic()
            try:
                observations = await probe.collect()
            except asyncio.CancelledError:
                raise
            except Exception as error:
                took = self._clock.monotonic() - begun
                self._probes.failed(probe.name, str(error) or type(error).__name__, took)
            else:
                took = self._clock.monotonic() - begun
                self._probes.succeeded(probe.name, took)
                try:
                    self._take(probe, observations)
                except Exception as error:
                    self._errors.record("ingest", error)
            period = (
                every * AT_REST_STRETCH
                if self._at_rest and probe.name in LOOK_LESS_AT_REST
                else every
            )
            if probe.name == HealthProbe.name and self._clock.monotonic() < self._asking_until:
                period = min(every, ASKING_EVERY)
            rest = max(0.0, period - took)
            if isinstance(probe, RestingProbe):
                await probe.rest(rest)
            else:
                await _rest_unless(self._look_now[probe.name], rest)

    def _take(self, probe: Probe, observations: Sequence[Observation]) -> None:
        # Before anything that came in after a blind spell is judged, the spell is known.
        self._sight.look()
        for obs in observations:
            if obs.kind is ObservationKind.TOPOLOGY and obs.topology is not None:
                try:
                    self._offer_topology(obs.topology)
                except Exception as error:  # one bad report must not cost the others
                    self._errors.record("ingest", error)
            elif (
                obs.kind is ObservationKind.PROCESS_STAGE
                and obs.pid is not None
                and obs.stage is not None
            ):
                self._tracker.learn_stage(obs.pid, obs.stage, obs.detail)
        self._target.observe(observations)
        exits = self._detector.stage_exits
        self._detector.observe(observations)
        self._stats.observe(observations)
        exited = self._detector.stage_exits != exits
        if exited and HealthProbe.name in self._look_now:
            self._look_now[HealthProbe.name].set()
            self._asking_until = self._clock.monotonic() + self._config.detection.confirm_timeout
        if exited and GpuProbe.name in self._look_now:
            # Whether the device let go of the exited process's memory confirms its death.
            self._look_now[GpuProbe.name].set()
        if exited or _failed_answer(observations):
            self._judge_now.set()
        if self._at_rest and not all(routine_at_rest(obs) for obs in observations):
            self._end_rest()
            self._judge_now.set()
        if probe is self._tracker and self._tracker.generation != self._generation:
            self._reattach()

    def _end_rest(self) -> None:
        """The server is no longer at rest: the probes that looked less often look now."""
        self._at_rest = False
        self._sight.pace(SIGHT_EVERY)
        self._sight_now.set()
        for name in LOOK_LESS_AT_REST & self._look_now.keys():
            self._look_now[name].set()
        self._tracker.wake()

    def _offer_topology(self, offered: Topology) -> None:
        """Use a topology learned from the server when it is better informed than the one
        in use (`topology.replaces`), everywhere at once, keeping the detector's state of
        the stages that stay. A re-attach keeps it too: a restarted server almost always
        runs the same pipeline, and whatever it runs now is learned again."""
        offered = with_remote_stages(offered, self._config.remote_stages)
        if not replaces(self._topology, offered):
            return
        self._topology = offered
        self._detector.set_topology(offered, self._clock.monotonic())
        self._tracker.set_topology(offered)
        if self._senders is not None:
            self._senders.set_topology(offered)
        log_event(
            logger,
            "topology_changed",
            source=offered.source,
            stages=[f"{s.stage_id}:{s.name}x{s.replicas}" for s in offered.stages],
        )

    def _reattach(self) -> None:
        """A new server answers on the target: judge the old one's exit, then start afresh."""
        previous = self._tracker.previous_generation()
        if self._generation > 0:
            report = self._detector.evaluate(self._clock.monotonic())
            self._stats.count_verdicts(report.verdicts)
            self._policy.on_report(report, lambda: self._target.snapshot(previous))
        first = self._generation == 0
        self._generation = self._tracker.generation
        self._target.reattached()
        if first:
            # What was heard on the target before its processes were found came from this
            # server: a first scan slower than the warm-up must not start the warm-up over
            # (a server broken meanwhile would answer healthy never again).
            self._detector.attached(self._clock.monotonic())
        else:
            self._detector.reset(self._topology, self._clock.monotonic())
        root = self._tracker.root
        self._policy.on_attach(root.identity if root else None)
        log_event(
            logger,
            "attached",
            generation=self._generation,
            pid=root.pid if root else None,
            processes=len(self._tracker.recorded()),
        )

    async def _sight_loop(self) -> None:
        while True:
            self._sight.look()
            if self._at_rest:
                await _rest_unless(self._sight_now, self._sight.period)
            else:
                await asyncio.sleep(self._sight.period)

    async def _evaluate_loop(self) -> None:
        while True:
            try:
                self._evaluate()
            except Exception as error:
                self._errors.record("evaluate", error)
                self._publish_self_health()
            await _rest_unless(self._judge_now, self._until_due())

    def _until_due(self) -> float:
        """Seconds until the next evaluation: the tick, or sooner when a timeout runs out."""
        now = self._clock.monotonic()
        try:
            due = self._detector.next_due(now)
        except Exception as error:  # the loop goes on at its tick
            self._errors.record("evaluate", error)
            return EVALUATE_EVERY
        tick = EVALUATE_AT_REST if self._at_rest else EVALUATE_EVERY
        return tick if due is None else min(tick, due - now + DUE_SLACK)

    def _evaluate(self) -> None:
        """Judge the stages once, hand the report to the policy, and publish the state."""
        self._sight.look()
        report = self._detector.evaluate(self._clock.monotonic())
        _log_report(report)
        self._stats.count_verdicts(report.verdicts)
        self._policy.on_report(report, self._target.snapshot)
        closed = tuple(self._stats.count_incidents(self._policy.incidents()))
        self._last_evaluation = self._clock.monotonic()
        self._last_report = report
        if self._at_rest and not (report.at_rest and not self._policy.busy):
            self._end_rest()
        else:
            self._at_rest = report.at_rest and not self._policy.busy
            self._sight.pace(SIGHT_AT_REST if self._at_rest else SIGHT_EVERY)
        self._publish(self._assembler.make(self._topology, report, self._last_evaluation, closed))

    def _republish(self) -> None:
        """An operator's action shows in the very next answer of the API (a pause in
        `status`), not only after the next evaluation, a second away at rest: the state
        is made again around the last report."""
        try:
            self._publish(
                self._assembler.make(self._topology, self._last_report, self._last_evaluation)
            )
        except Exception as error:
            self._errors.record("evaluate", error)

    def _publish_self_health(self) -> None:
        """After a failed evaluation the last state stands, with the failure counted in
        it: the error counters move while /healthz ages towards failing."""
        try:
            health = self._assembler.self_health(self._last_evaluation)
            self._publish(dataclasses.replace(self.state, self_health=health))
        except Exception as error:
            self._errors.record("evaluate", error)

    def _publish(self, state: WatchdogState) -> None:
        self.state = state
        for exporter in self._exporters:
            try:
                exporter.export(state)
            except Exception as error:  # one exporter's bug must not starve the others
                self._errors.record("evaluate", error)


async def _rest_unless(wake: asyncio.Event, seconds: float) -> None:
    """Sleep `seconds`, or until `wake` is set; it is cleared for the next rest."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(wake.wait(), seconds)
    wake.clear()


def routine_at_rest(obs: Observation) -> bool:
    """Whether an idle, well server sends this all the time (see `ROUTINE_AT_REST`)."""
    if obs.kind is ObservationKind.PROCESS:
        return obs.outcome not in UNROUTINE_STATUSES
    return obs.kind in ROUTINE_AT_REST


def _failed_answer(observations: Sequence[Observation]) -> bool:
    """Whether /health or the canary failed: news that may confirm a verdict."""
    return any(
        obs.kind in (ObservationKind.HEALTH, ObservationKind.CANARY)
        and obs.outcome is not HealthOutcome.OK
        for obs in observations
    )


def _log_report(report: DetectorReport) -> None:
    for verdict in report.verdicts:
        log_event(
            logger,
            "verdict",
            stage=str(verdict.stage),
            state=verdict.state.value,
            evidence=[f"{e.kind.value}: {e.detail}" for e in verdict.evidence],
        )
    if report.target_exit is not None:
        log_event(
            logger,
            "target_exited",
            crashed=report.target_exit.crashed,
            reasons=list(report.target_exit.reasons),
        )
