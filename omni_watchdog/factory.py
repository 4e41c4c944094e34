"""Builds a watchdog from its config and the world it is given.

Every component is made here, with keyword arguments, in dependency order; `Watchdog`
receives them finished and only runs the loops. What touches the world (time, the host
whose processes are watched, NVML, the server's own config, the HTTP session) comes in as
arguments, so a test builds the same watchdog over fakes: a fake host (`types.ProcessHost`)
brings a table of its own and none of the readers only this kernel can answer.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

import aiohttp
import psutil

from omni_watchdog import process_start
from omni_watchdog.app import CANARY_CHECK_EVERY, SPANS_EVERY, Watchdog
from omni_watchdog.config import WORKING_CAUSES, WatchdogConfig
from omni_watchdog.detector import Detector
from omni_watchdog.exporters.api import BundleReads, JsonApi
from omni_watchdog.exporters.history import IncidentHistory
from omni_watchdog.exporters.prometheus import MetricsExposition
from omni_watchdog.exporters.traces import IncidentTraces
from omni_watchdog.operator import OperatorActions
from omni_watchdog.policy.actuators import Actuators, SignalGuard
from omni_watchdog.policy.capture import Capturer, find_py_spy
from omni_watchdog.policy.core import Policy
from omni_watchdog.policy.incidents import (
    BundleWriter,
    HourlyBudget,
    IncidentJournal,
    SerialWriter,
    StateWriteErrors,
    TargetLock,
    lock_dir_for,
)
from omni_watchdog.policy.inspect import read_condition
from omni_watchdog.policy.ladder import LadderRunner, ladder_from_config
from omni_watchdog.policy.maintenance import MaintenanceWindow
from omni_watchdog.probes.activity import ActivityProbe
from omni_watchdog.probes.canary import CanaryProbe
from omni_watchdog.probes.exits import ExitNotices
from omni_watchdog.probes.gpu import GpuProbe, load_nvml
from omni_watchdog.probes.health import HealthProbe
from omni_watchdog.probes.link import MasterLinkProbe
from omni_watchdog.probes.metrics import MetricsProbe
from omni_watchdog.probes.peers import SocketOwners
from omni_watchdog.probes.processes import ProcessTracker, ThreadWaits
from omni_watchdog.probes.server_config import ServerConfigReader
from omni_watchdog.probes.span_forward import SpanForwarder
from omni_watchdog.probes.span_store import SpanStore
from omni_watchdog.probes.spans import SpanReceiver
from omni_watchdog.self_health import InternalErrors, LoopSight, ProbeBoard
from omni_watchdog.serving import Listener
from omni_watchdog.state import StateAssembler
from omni_watchdog.stats import WatchdogStats
from omni_watchdog.target import TargetWatch
from omni_watchdog.topology import (
    TopologySenders,
    default_topology,
    load_topology,
    with_remote_stages,
)
from omni_watchdog.types import (
    Clock,
    Exporter,
    Nvml,
    Probe,
    ProcessHost,
    StepName,
    Topology,
)

# The probes that ask the server over HTTP, which a headless stage server does not serve.
HTTP_PROBES = frozenset({"health", "metrics", "canary"})


def this_host() -> ProcessHost:
    """This machine's processes, as psutil and this kernel show them, with every reader
    this kernel answers. A new one for each watchdog: its readers keep what they read."""
    return ProcessHost(
        process_table=psutil,
        cpu_waits=ThreadWaits(),
        start_time=process_start.start_time,
        exit_notices=ExitNotices(process_start.start_time),
        socket_owners=SocketOwners(),
        activity_proc=process_start.PROC,
        last_pid=process_start.last_pid,
    )


async def build_watchdog(
    config: WatchdogConfig,
    *,
    clock: Clock,
    host: ProcessHost | None = None,
    nvml: Nvml[Any] | None = None,
    topology: Topology | None = None,
    read_server_config: Callable[[int], Topology | None] | None = None,
) -> Watchdog:
    """A watchdog ready to `start()`. Without `host`, this machine's processes are watched
    (`this_host()`). Without `nvml`, the config's GPU backend is loaded (none for
    `gpu_backend: none`); without `topology`, the config's stage config is read, or the
    server's own stages are learned as it runs."""
    session = aiohttp.ClientSession()
    try:
        return _assemble(
            config,
            session,
            clock=clock,
            host=host if host is not None else this_host(),
            nvml=nvml if nvml is not None else load_nvml(config.probes.gpu_backend),
            topology=with_remote_stages(
                topology
                or (
                    load_topology(config.stage_config)
                    if config.stage_config
                    else default_topology()
                ),
                config.remote_stages,
            ),
            read_server_config=read_server_config or ServerConfigReader().read,
        )
    except BaseException:
        await session.close()
        raise


def _assemble(
    config: WatchdogConfig,
    session: aiohttp.ClientSession,
    *,
    clock: Clock,
    host: ProcessHost,
    nvml: Nvml[Any] | None,
    topology: Topology,
    read_server_config: Callable[[int], Topology | None],
) -> Watchdog:
    process_table = host.process_table
    start_time = host.start_time
    probes = config.probes
    enabled = set(probes.enabled)
    if config.headless:
        # A headless stage server has no HTTP API to ask; its link to its master says
        # whether anything will send it work again.
        enabled = (enabled - HTTP_PROBES) | {MasterLinkProbe.name}
    host_name = config.resolved_host()
    target_url = f"headless://{host_name}" if config.headless else config.target
    port = urlparse(target_url).port or (443 if target_url.startswith("https") else 80)
    state_dir = config.resolved_state_dir()
    errors = InternalErrors()
    board = ProbeBoard(enabled)
    write_errors = StateWriteErrors()
    detector = Detector(
        config.detection, topology, clock.monotonic(), remote_stages=config.remote_stages
    )
    sight = LoopSight(clock, detector.blind)

    tracker = ProcessTracker(
        process_table,
        clock,
        own_pid=os.getpid(),
        target_port=None if config.pid or config.headless else port,
        pid=config.pid or None,
        headless=config.headless,
        topology=topology,
        start_time=start_time,
        server_topology=read_server_config,
        exit_notices=host.exit_notices,
        cpu_wait=host.cpu_waits,
        last_pid=host.last_pid,
    )
    # Without the process probe nothing records the senders' processes: spans are then
    # judged only against the topology.
    senders = None if "processes" in enabled else TopologySenders(topology)
    store = SpanStore(config.spans.ring_size)
    receiver = SpanReceiver(
        config.spans,
        clock,
        store,
        SpanForwarder(session, config.spans.forward_endpoint)
        if config.spans.forward_endpoint
        else None,
        senders=senders or tracker,
        token=config.otlp_token,
        boot_id=process_start.boot_id(),
        # A new process's spans wait for the tracker's next scans before they count as a
        # stranger's.
        sender_grace=max(2.0, 4 * probes.interval),
        remote_stages=frozenset(config.remote_stages),
        # Without a token (the loopback default), a sender of this host is looked up in
        # /proc: the pid a span claims must be the process whose connection it came on.
        # Only a host whose kernel runs the table's processes can tell; with a token, the
        # token proves the sender (whoever holds it can ptrace the server anyway).
        owners=host.socket_owners if senders is None and not config.otlp_token else None,
    )
    gpu = GpuProbe(nvml, clock, tracker.stage_of) if nvml is not None else None
    if gpu is None and "gpu" in enabled:
        board.failed("gpu", "no NVML backend (gpu_backend none)")
    target = TargetWatch(
        target_url,
        tracker,
        gpu,
        process_table,
        start_time,
        by_process="processes" in enabled,
        on_gpu_failure=lambda reason: board.failed("gpu", reason),
    )
    periodic: list[tuple[Probe, float]] = [
        (tracker, probes.interval),
        (HealthProbe(session, target_url, probes, clock), probes.health_interval),
        (MetricsProbe(session, target_url, probes, clock), probes.metrics_interval),
        (
            CanaryProbe(
                session, target_url, probes, clock, detector.last_progress, detector.canary_plan
            ),
            CANARY_CHECK_EVERY,
        ),
        (receiver, SPANS_EVERY),
    ]
    if gpu is not None:
        periodic.append((gpu, probes.interval))
    actuators = Actuators(
        SignalGuard(process_table, tracker.is_recorded, start_time=start_time), session
    )
    py_spy = find_py_spy()
    activity: ActivityProbe | None = None
    if host.activity_proc is not None:
        activity = ActivityProbe(
            clock,
            detector.silent_stages,
            tracker.live,
            py_spy,
            actuators.run_bounded,
            proc=host.activity_proc,
        )
        periodic.append((activity, probes.interval))
    link: MasterLinkProbe | None = None
    if config.headless:
        link = MasterLinkProbe(
            process_table,
            clock,
            lambda: tracker.root,
            tracker.live,
            timeout=probes.health_timeout,
        )
        periodic.append((link, probes.interval))
    periodic = [(probe, every) for probe, every in periodic if probe.name in enabled]

    bundles = BundleWriter(state_dir / "incidents", write_errors)
    capture = Capturer(
        actuators,
        session,
        bundles,
        clock,
        config.ladder.capture_timeout,
        target_url,
        probes.health_path,
        probes.metrics_path,
        store.to_jsonable,
        target.last_gpu,
        lambda info: target.alive(info.identity),
        py_spy,
    )
    runner = LadderRunner(
        tuple(
            step
            for step in ladder_from_config(config.ladder)
            # A headless stage server has no endpoint to ask: it is terminated.
            if not (config.headless and step.name is StepName.SHUTDOWN)
        ),
        config.ladder,
        actuators,
        capture,
        target.read_gpu,
        target.alive,
        clock,
        config.resolved_admin_url(),
        config.admin_token,
        server_gone=target.gone,
        inspect=lambda identity: read_condition(identity, process_table),
        report=bundles.write_json,
        on_internal_error=errors.record,
    )
    journal = IncidentJournal(state_dir / "journal.jsonl", write_errors, writer=SerialWriter())
    policy = Policy(
        config.mode,
        runner,
        journal,
        HourlyBudget(config.ladder.budget_per_hour),
        HourlyBudget(config.ladder.records_per_hour),
        TargetLock(lock_dir_for(state_dir, os.environ)),
        bundles,
        clock,
        target.alive,
        errors.record,
        MaintenanceWindow(clock),
        detector.activity_readings,
    )
    operator = OperatorActions(
        token=config.operator_token,
        policy=policy,
        window=policy.window,
        journal=journal,
        clock=clock,
        snapshot=target.snapshot,
    )
    stats = WatchdogStats()
    stats.ignore_closed(policy.incidents())

    listeners: dict[str, Listener] = {}
    reads = BundleReads()
    assembler = StateAssembler(
        clock=clock,
        target=target,
        tracker=tracker,
        receiver=receiver,
        policy=policy,
        stats=stats,
        probes=board,
        errors=errors,
        write_errors=write_errors,
        listeners=listeners,
        sight=sight,
        detector=detector,
        operator=operator,
        host=host_name,
        link=link,
        activity=activity if ActivityProbe.name in enabled else None,
        reads=reads,
    )
    first = assembler.make(topology, None, None)
    work_budgets = {cause: config.detection.work_budget(cause) for cause in WORKING_CAUSES}
    exposition = MetricsExposition(clock, first, work_budgets)
    api = JsonApi(clock, first, exposition, bundles, journal.actions, reads)
    exporters: list[Exporter] = [exposition, api, IncidentHistory(bundles.write_json)]
    traces = IncidentTraces(config.otlp_export_endpoint) if config.otlp_export_endpoint else None
    if traces is not None:
        exporters.append(traces)
    return Watchdog(
        config=config,
        clock=clock,
        session=session,
        topology=topology,
        detector=detector,
        tracker=tracker,
        senders=senders,
        receiver=receiver,
        store=store,
        periodic=tuple(periodic),
        target=target,
        policy=policy,
        stats=stats,
        probes=board,
        errors=errors,
        assembler=assembler,
        sight=sight,
        listeners=listeners,
        api=api,
        operator=operator,
        exporters=tuple(exporters),
        traces=traces,
    )
