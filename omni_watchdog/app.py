"""The watchdog process: probes feed the detector, the detector feeds the policy.

Everything runs on one event loop. Each probe has its own periodic task, so a probe that
hangs or fails only delays itself; the evaluation task judges every `_EVALUATE_EVERY`.
Every loop survives its own errors: each is logged once with its traceback, counted by
loop, and the loop goes on; /healthz fails once evaluations stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any
from urllib.parse import urlparse

import aiohttp
import psutil
from aiohttp import web

from omni_watchdog import process_start
from omni_watchdog.config import WatchdogConfig, split_host_port
from omni_watchdog.detector import Detector, DetectorReport
from omni_watchdog.exporters.prometheus import MetricsExposition, WatchdogStats
from omni_watchdog.exporters.traces import IncidentTraces
from omni_watchdog.log import log_event
from omni_watchdog.policy.actuators import Actuators, SignalGuard, is_alive
from omni_watchdog.policy.capture import Capturer, find_py_spy
from omni_watchdog.policy.core import Policy
from omni_watchdog.policy.incidents import (
    BundleWriter,
    EnforcementBudget,
    IncidentJournal,
    JournalEntry,
    StateWriteErrors,
    TargetLock,
    lock_dir_for,
)
from omni_watchdog.policy.inspect import read_condition
from omni_watchdog.policy.ladder import (
    GpuReading,
    LadderRunner,
    TargetSnapshot,
    gpu_baseline,
    gpu_held,
    ladder_from_config,
)
from omni_watchdog.probes.canary import CanaryProbe
from omni_watchdog.probes.gpu import GpuProbe, load_nvml
from omni_watchdog.probes.health import HealthProbe
from omni_watchdog.probes.metrics import MetricsProbe
from omni_watchdog.probes.processes import ProcessTracker
from omni_watchdog.probes.server_config import ServerConfigReader
from omni_watchdog.probes.span_store import SpanStore
from omni_watchdog.probes.spans import SpanForwarder, SpanReceiver
from omni_watchdog.redact import redact_argv
from omni_watchdog.serving import (
    Listener,
    ListenerLimits,
    RateLimitedLog,
    install_loop_error_handler,
)
from omni_watchdog.topology import TopologySenders, default_topology, load_topology, replaces
from omni_watchdog.types import (
    Clock,
    HealthOutcome,
    Observation,
    ObservationKind,
    Probe,
    ProcessIdentity,
    ProcessInfo,
    ProcessRole,
    ProcessStatus,
    Topology,
)

logger = logging.getLogger("omni_watchdog.app")

_EVALUATE_EVERY = 0.25
INTERNAL_ERROR_LOOPS = ("evaluate", "ingest", "ladder", "listener")
# Distinct internal errors logged with their traceback; repeats are only counted.
_LOGGED_ERRORS_LIMIT = 256
_SPANS_EVERY = 0.1
_CANARY_CHECK_EVERY = 0.25
_ANSWERED = frozenset({HealthOutcome.OK.value, HealthOutcome.UNHEALTHY.value})


@dataclass
class ProbeHealth:
    """How one probe is doing, for /v1/status and the exporter."""

    name: str
    up: bool = True
    errors_total: int = 0
    last_error: str = ""
    last_duration: float = 0.0


def gpu_reading_of(observations: Sequence[Observation]) -> GpuReading:
    by_device: dict[int, float] = {}
    held: dict[tuple[int, int], float] = {}
    for obs in observations:
        if obs.kind is ObservationKind.GPU_DEVICE and obs.gpu is not None:
            by_device[obs.gpu] = obs.value
        elif obs.kind is ObservationKind.GPU_PROCESS and obs.pid is not None:
            held[(obs.gpu or 0, obs.pid)] = obs.value
    return GpuReading(by_device, held)


class Watchdog:
    """One watchdog attached to one target server."""

    def __init__(
        self,
        config: WatchdogConfig,
        clock: Clock,
        psutil_module: ModuleType = psutil,
        nvml_module: ModuleType | None = None,
        topology: Topology | None = None,
        start_time: Callable[[int], float] = process_start.start_time,
        read_server_config: Callable[[int], Topology | None] | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self._psutil = psutil_module
        self._start_time = start_time
        # Without a stage config the server's own stages are learned as it runs
        # (`_offer_topology`); a given one is never replaced.
        self.topology = topology or (
            load_topology(config.stage_config) if config.stage_config else default_topology()
        )
        self._read_server_config = read_server_config or ServerConfigReader().read
        self._topology_senders: TopologySenders | None = None
        self._nvml = (
            nvml_module if nvml_module is not None else load_nvml(config.probes.gpu_backend)
        )
        self.started_wall = clock.wall()
        self.probe_health: dict[str, ProbeHealth] = {}
        self.last_report: DetectorReport | None = None
        self.last_health: Observation | None = None
        # From a 503 to the next 200: vLLM answers 503, then refuses, then exits by itself.
        self._server_reports_failure = False
        self.detector = Detector(config.detection, self.topology, clock.monotonic())
        self.stats = WatchdogStats()
        self.exposition = MetricsExposition(self, self.stats)
        self.traces: IncidentTraces | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.listeners: dict[str, Listener] = {}
        self.internal_errors = dict.fromkeys(INTERNAL_ERROR_LOOPS, 0)
        self._logged_errors: set[tuple[str, str, str]] = set()
        self.last_evaluation: float | None = None
        self.write_errors = StateWriteErrors()
        self._adopted: set[ProcessIdentity] = set()
        self._session: aiohttp.ClientSession | None = None
        self._generation = 0
        self._stopping = asyncio.Event()
        self.api_port: int | None = None
        self.otlp_port: int | None = None

    # ---- life cycle ---------------------------------------------------------------

    async def start(self) -> None:
        config = self.config
        self._session = aiohttp.ClientSession()
        session = self._session
        state_dir = config.resolved_state_dir()
        target = config.target
        port = urlparse(target).port or (443 if target.startswith("https") else 80)

        self.store = SpanStore(config.spans.ring_size)
        forwarder = (
            SpanForwarder(session, config.spans.forward_endpoint)
            if config.spans.forward_endpoint
            else None
        )
        self.tracker = ProcessTracker(
            self._psutil,
            self.clock,
            own_pid=os.getpid(),
            target_port=None if config.pid else port,
            pid=config.pid or None,
            topology=self.topology,
            start_time=self._start_time,
            server_topology=self._read_server_config,
        )
        watching_processes = "processes" in config.probes.enabled
        if not watching_processes:
            self._topology_senders = TopologySenders(self.topology)
        self.receiver = SpanReceiver(
            config.spans,
            self.clock,
            self.store,
            forwarder,
            senders=self._topology_senders or self.tracker,
            token=config.otlp_token,
            boot_id=process_start.boot_id(),
            # A new process's spans wait for the tracker's next scans before they count as
            # a stranger's.
            sender_grace=max(2.0, 4 * config.probes.interval),
        )
        self.gpu = GpuProbe(self._nvml, self.clock, self.tracker.stage_of) if self._nvml else None
        probes = config.probes
        enabled = set(probes.enabled)
        self.metrics = MetricsProbe(session, target, probes, self.clock)
        periodic: list[tuple[Probe, float]] = [
            (self.tracker, probes.interval),
            (HealthProbe(session, target, probes, self.clock), probes.health_interval),
            (self.metrics, probes.metrics_interval),
            (
                CanaryProbe(session, target, probes, self.clock, self.detector_last_progress),
                _CANARY_CHECK_EVERY,
            ),
            (self.receiver, _SPANS_EVERY),
        ]
        if self.gpu is not None:
            periodic.append((self.gpu, probes.interval))
        elif "gpu" in enabled:
            self._probe_failed("gpu", "no NVML backend (gpu_backend none)")
        periodic = [(probe, every) for probe, every in periodic if probe.name in enabled]

        self.bundles = BundleWriter(state_dir / "incidents", self.write_errors)
        guard = SignalGuard(self._psutil, self._is_recorded, start_time=self._start_time)
        self.actuators = Actuators(guard, session)
        capture = Capturer(
            self.actuators,
            session,
            self.bundles,
            self.clock,
            config.ladder.capture_timeout,
            target,
            probes.health_path,
            probes.metrics_path,
            self.store.to_jsonable,
            self.gpu.last_snapshot if self.gpu else dict,
            lambda info: self.alive(info.identity),
            find_py_spy(),
        )
        runner = LadderRunner(
            ladder_from_config(config.ladder),
            config.ladder,
            self.actuators,
            capture,
            self.read_gpu,
            self.alive,
            self.clock,
            config.resolved_admin_url(),
            config.admin_token,
            server_gone=self._server_gone,
            inspect=lambda identity: read_condition(identity, self._psutil),
            report=self.bundles.write_json,
        )
        self.policy = Policy(
            config.mode,
            runner,
            IncidentJournal(state_dir / "journal.jsonl", self.write_errors),
            EnforcementBudget(config.ladder.budget_per_hour),
            TargetLock(lock_dir_for(state_dir, os.environ)),
            self.bundles,
            self.clock,
            self.alive,
            self._internal_error,
        )
        self.stats.ignore_closed(self.policy.incidents())
        if config.otlp_export_endpoint:
            self.traces = IncidentTraces(config.otlp_export_endpoint)

        listener_errors = RateLimitedLog(lambda: self._count_internal_error("listener"))
        install_loop_error_handler(asyncio.get_running_loop(), listener_errors)
        await self._serve(self.receiver.app(), config.spans.otlp_listen, "otlp", listener_errors)
        from omni_watchdog.exporters.api import build_api

        await self._serve(build_api(self), config.listen, "api", listener_errors)
        for probe, every in periodic:
            self.probe_health[probe.name] = ProbeHealth(probe.name)
            self._spawn(self._probe_loop(probe, every))
        self._spawn(self._evaluate_loop())
        await self.policy.resume(self._snapshot_of_entry)
        log_event(
            logger,
            "watchdog_started",
            target=target,
            mode=config.mode.value,
            api_port=self.api_port,
            otlp_port=self.otlp_port,
            stages=[s.name for s in self.topology.stages],
            probes=sorted(self.probe_health),
        )

    async def stop(self) -> None:
        self._stopping.set()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for listener in self.listeners.values():
            await listener.close()
        # A watchdog stopped before start() got that far has no policy to close.
        policy: Policy | None = getattr(self, "policy", None)
        if policy is not None:
            await policy.close()
        if self._session is not None:
            await self._session.close()
        if self.traces is not None:
            await asyncio.to_thread(self.traces.shutdown)

    async def run_until(self, stop: asyncio.Event) -> None:
        await stop.wait()
        await self.stop()

    # ---- what the policy reads ----------------------------------------------------

    def alive(self, identity: ProcessIdentity) -> bool:
        return is_alive(self._psutil, identity, self._start_time)

    async def read_gpu(self) -> GpuReading | None:
        if self.gpu is None:
            return None
        try:
            return gpu_reading_of(await self.gpu.collect())
        except Exception as error:  # a failing NVML must not stop the ladder
            self._probe_failed("gpu", str(error))
            return None

    def detector_last_progress(self) -> float | None:
        return self.detector.last_progress()

    @property
    def target_up(self) -> bool:
        """The server's root process is alive; without the process probe, /health answers.

        Without the server's PID namespace no process is ever visible, and "up" can only
        mean that the server answers at all (a 503 is an answer: its stages are judged
        elsewhere).
        """
        if "processes" in self.config.probes.enabled:
            return self.tracker.target_alive
        health = self.last_health
        return health is not None and health.outcome in _ANSWERED

    def _server_gone(self) -> bool:
        """Nothing listens on the server's port: its last /health call was refused."""
        health = self.last_health
        return health is not None and health.outcome == HealthOutcome.REFUSED.value

    def snapshot(self, processes: tuple[ProcessInfo, ...] | None = None) -> TargetSnapshot:
        recorded = self.tracker.recorded() if processes is None else processes
        root = next((p for p in recorded if p.role is ProcessRole.API and not p.orphaned), None)
        last = self.gpu.last_snapshot() if self.gpu else None
        reading = _reading_of_snapshot(last) if last else None
        return TargetSnapshot(
            self.config.target,
            root.identity if root else None,
            recorded,
            gpu_baseline(reading, recorded),
            self._server_reports_failure,
            gpu_held(reading, recorded),
        )

    def _is_recorded(self, identity: ProcessIdentity) -> bool:
        """A process of the target's tree, as the tracker or a resumed journal recorded it."""
        return identity in self._adopted or self.tracker.is_recorded(identity)

    async def _snapshot_of_entry(self, entry: JournalEntry) -> TargetSnapshot:
        """A journal's processes, as far as they are still the same processes, adopted as
        recorded (the tracker has not scanned yet, and may attach elsewhere), with the GPU
        baseline the incident opened with, or one read now."""
        root = entry.root
        infos = []
        for identity in entry.processes:
            try:
                process = self._psutil.Process(identity.pid)
                title = " ".join(redact_argv(process.cmdline())) or process.name()
                pgid = os.getpgid(identity.pid)
                started = self._start_time(identity.pid)
            except (self._psutil.Error, OSError):
                continue
            if abs(started - identity.create_time) > 0.01:
                continue
            infos.append(
                ProcessInfo(
                    identity.pid,
                    identity.create_time,
                    process.ppid(),
                    pgid,
                    os.getsid(identity.pid),
                    title,
                    ProcessStatus.SLEEPING,
                    0.0,
                    ProcessRole.API if identity == root else ProcessRole.HELPER,
                )
            )
        self._adopted.update(info.identity for info in infos)
        baseline = entry.gpu_baseline
        if baseline is None:
            baseline = gpu_baseline(await self.read_gpu(), tuple(infos))
        return TargetSnapshot(self.config.target, root, tuple(infos), baseline)

    # ---- loops --------------------------------------------------------------------

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        self._tasks.append(asyncio.get_running_loop().create_task(coroutine))

    async def _serve(
        self, app: web.Application, listen: str, which: str, errors: RateLimitedLog
    ) -> None:
        host, port = split_host_port(listen, which)
        limits = ListenerLimits(self.config.header_timeout, self.config.max_connections)
        listener = Listener(app, which, limits, errors)
        bound = await listener.start(host, port)
        self.listeners[which] = listener
        if which == "otlp":
            self.otlp_port = bound
        else:
            self.api_port = bound

    def evaluation_age(self) -> float | None:
        """Seconds since the detector last evaluated; None before the first evaluation."""
        if self.last_evaluation is None:
            return None
        return self.clock.monotonic() - self.last_evaluation

    def _internal_error(self, loop: str, error: Exception) -> None:
        """Log an error of the watchdog's own code once with its traceback; count each."""
        self._count_internal_error(loop)
        key = (loop, type(error).__name__, str(error)[:200])
        if key in self._logged_errors or len(self._logged_errors) >= _LOGGED_ERRORS_LIMIT:
            return
        self._logged_errors.add(key)
        log_event(
            logger, "internal_error", logging.ERROR, exc_info=error, loop=loop, error=repr(error)
        )

    def _count_internal_error(self, loop: str) -> None:
        self.internal_errors[loop] += 1

    async def _probe_loop(self, probe: Probe, every: float) -> None:
        health = self.probe_health[probe.name]
        while True:
            begun = self.clock.monotonic()
            try:
                observations = await probe.collect()
            except asyncio.CancelledError:
                raise
            except Exception as error:
                self._probe_failed(probe.name, str(error) or type(error).__name__)
            else:
                health.up = True
                health.last_error = ""
                try:
                    self._take(probe, observations)
                except Exception as error:
                    self._internal_error("ingest", error)
            health.last_duration = self.clock.monotonic() - begun
            await asyncio.sleep(max(0.0, every - health.last_duration))

    def _probe_failed(self, name: str, reason: str) -> None:
        health = self.probe_health.setdefault(name, ProbeHealth(name))
        if health.up or health.last_error != reason:
            log_event(logger, "probe_failed", logging.WARNING, probe=name, reason=reason)
        health.up = False
        health.errors_total += 1
        health.last_error = reason

    def _take(self, probe: Probe, observations: Sequence[Observation]) -> None:
        for obs in observations:
            if obs.kind is ObservationKind.TOPOLOGY and obs.topology is not None:
                try:
                    self._offer_topology(obs.topology)
                except Exception as error:  # one bad report must not cost the others
                    self._internal_error("ingest", error)
        if probe is self.receiver:
            for pid, (stage, kind) in self.store.pid_stages().items():
                self.tracker.learn_stage(pid, stage, kind)
        for obs in observations:
            if obs.kind is ObservationKind.HEALTH:
                self.last_health = obs
                if obs.outcome == HealthOutcome.UNHEALTHY.value:
                    self._server_reports_failure = True
                elif obs.outcome == HealthOutcome.OK.value:
                    self._server_reports_failure = False
        self.detector.observe(observations)
        self.stats.observe(observations)
        if probe is self.tracker and self.tracker.generation != self._generation:
            self._reattach()

    def _offer_topology(self, offered: Topology) -> None:
        """Use a topology learned from the server when it is better informed than the one
        in use (`topology.replaces`), everywhere at once, keeping the detector's state of
        the stages that stay. A re-attach keeps it too: a restarted server almost always
        runs the same pipeline, and whatever it runs now is learned again."""
        if not replaces(self.topology, offered):
            return
        self.topology = offered
        self.detector.set_topology(offered, self.clock.monotonic())
        self.tracker.set_topology(offered)
        if self._topology_senders is not None:
            self._topology_senders.set_topology(offered)
        log_event(
            logger,
            "topology_changed",
            source=offered.source,
            stages=[f"{s.stage_id}:{s.name}x{s.replicas}" for s in offered.stages],
        )

    def _reattach(self) -> None:
        """A new server answers on the target: judge the old one's exit, then start afresh."""
        previous = self.tracker.previous_generation()
        if self._generation > 0:
            report = self.detector.evaluate(self.clock.monotonic())
            self.stats.count_verdicts(report.verdicts)
            self.policy.on_report(report, lambda: self.snapshot(previous))
        self._generation = self.tracker.generation
        self._server_reports_failure = False
        self.detector = Detector(self.config.detection, self.topology, self.clock.monotonic())
        root = self.tracker.root
        self.policy.on_attach(root.identity if root else None)
        log_event(
            logger,
            "attached",
            generation=self._generation,
            pid=root.pid if root else None,
            processes=len(self.tracker.recorded()),
        )

    async def _evaluate_loop(self) -> None:
        while True:
            try:
                self._evaluate()
            except Exception as error:
                self._internal_error("evaluate", error)
            await asyncio.sleep(_EVALUATE_EVERY)

    def _evaluate(self) -> None:
        """Judge the stages once, and hand the report to the policy."""
        report = self.detector.evaluate(self.clock.monotonic())
        self.last_report = report
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
        self.stats.count_verdicts(report.verdicts)
        self.policy.on_report(report, self.snapshot)
        for incident in self.stats.count_incidents(self.policy.incidents()):
            if self.traces is not None:
                self.traces.export(incident)
        self.last_evaluation = self.clock.monotonic()


def _reading_of_snapshot(snapshot: dict[str, Any]) -> GpuReading | None:
    if snapshot.get("time") is None:
        return None
    devices = snapshot.get("devices") or []
    held = {
        (device["index"], process["pid"]): float(process["used_bytes"])
        for device in devices
        for process in device["processes"]
    }
    return GpuReading({d["index"]: float(d["used_bytes"]) for d in devices}, held)
