"""The remediation ladder as data, and the runner that climbs it one step at a time.

capture -> shutdown -> terminate -> kill -> verify. Each step has a time bound and an
outcome; a step that leaves no recorded process alive ends the climb early and goes to
verify, which decides the incident's outcome from processes and GPU memory. A recorded
process that SIGKILL reached and that verify still finds alive is unkillable: it sleeps
uninterruptibly in the kernel, and verify reports its state and wait channel.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from omni_watchdog.config import LadderConfig
from omni_watchdog.policy.actuators import Actuators
from omni_watchdog.policy.inspect import ProcessCondition, read_condition
from omni_watchdog.types import (
    Clock,
    GpuReading,
    Incident,
    IncidentOutcome,
    Mode,
    ProcessIdentity,
    ProcessInfo,
    StepName,
    StepOutcome,
    StepResult,
    TargetSnapshot,
)

# Allocator slack: a released device rarely reads back to the exact byte.
GPU_TOLERANCE_BYTES = 64 * 2**20
_POLL = 0.05

# Scheduler states (psutil's names) in which a process runs no code: SIGSTOP or a tracer.
_CANNOT_ANSWER = frozenset({"stopped", "tracing-stop"})
# How the shutdown step says that the server went away on its own: then it crashed.
EXITED_BY_ITSELF = "the server exited by itself"
# The bundle file naming the processes that outlived SIGKILL, with state and wait channel.
UNKILLABLE_REPORT = "unkillable.json"
# A survivor of SIGKILL that shows no progress in its exit for this long (not runnable,
# no CPU time gained, no thread left, no memory freed) is held, not slow. A worker torn
# down on a core shared with busy neighbours gains CPU time every few hundred ms.
TEARDOWN_STILL = 5.0

_RECOVERED_BY = {
    StepName.SHUTDOWN: IncidentOutcome.RECOVERED_BY_SHUTDOWN,
    StepName.TERMINATE: IncidentOutcome.RECOVERED_BY_TERM,
    StepName.KILL: IncidentOutcome.RECOVERED_BY_KILL,
}
# The steps that act on the server: a maintenance pause holds an incident before them.
ACTING_STEPS = tuple(_RECOVERED_BY)


@dataclass(frozen=True)
class LadderStep:
    """One rung: which step, and how long it may take."""

    name: StepName
    timeout: float


def ladder_from_config(config: LadderConfig) -> tuple[LadderStep, ...]:
    bounds = {
        StepName.CAPTURE: config.capture_timeout,
        StepName.SHUTDOWN: config.admin_timeout + config.shutdown_grace,
        StepName.TERMINATE: config.term_grace,
        StepName.KILL: config.kill_grace,
        StepName.VERIFY: config.release_timeout,
    }
    return tuple(LadderStep(StepName(name), bounds[StepName(name)]) for name in config.steps)


def gpu_held(reading: GpuReading | None, processes: tuple[ProcessInfo, ...]) -> float:
    """Bytes the given processes hold on all devices."""
    if reading is None:
        return 0.0
    ours = {p.pid for p in processes}
    return sum(held.used_bytes for held in reading.processes if held.pid in ours)


def gpu_baseline(
    reading: GpuReading | None, processes: tuple[ProcessInfo, ...]
) -> dict[int, float] | None:
    """What each device should read once the given processes' memory is freed."""
    if reading is None:
        return None
    ours = {p.pid for p in processes}
    baseline = reading.used_by_device
    for held in reading.processes:
        if held.pid in ours and held.gpu in baseline:
            baseline[held.gpu] = max(0.0, baseline[held.gpu] - held.used_bytes)
    return baseline


class LadderRunner:
    """Runs the steps of one incident in the given mode and reports each as it ends."""

    def __init__(
        self,
        steps: tuple[LadderStep, ...],
        config: LadderConfig,
        actuators: Actuators,
        capture: Callable[[Incident, TargetSnapshot], Awaitable[StepResult]],
        read_gpu: Callable[[], Awaitable[GpuReading | None]],
        alive: Callable[[ProcessIdentity], bool],
        clock: Clock,
        admin_url: str,
        admin_token: str,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        server_gone: Callable[[], bool] = lambda: False,
        inspect: Callable[[ProcessIdentity], ProcessCondition] = read_condition,
        report: Callable[[str, str, object], None] = lambda incident_id, name, value: None,
        on_internal_error: Callable[[str, Exception], None] = lambda loop, error: None,
    ) -> None:
        """`server_gone` tells whether nothing listens on the server's port any more: the
        only sign of its exit when none of its processes is visible. `inspect` reads a
        survivor's state and wait channel; `report` writes a named file into the incident's
        bundle; `on_internal_error(loop, error)` counts a bug in the capture (loop
        "ladder"), which fails that step and stops no other."""
        self._steps = steps
        self._config = config
        self._actuators = actuators
        self._capture = capture
        self._read_gpu = read_gpu
        self._alive = alive
        self._clock = clock
        self._admin_url = admin_url
        self._admin_token = admin_token
        self._sleep = sleep
        self._server_gone = server_gone
        self._inspect = inspect
        self._report = report
        self._on_internal_error = on_internal_error

    @property
    def step_names(self) -> tuple[StepName, ...]:
        return tuple(step.name for step in self._steps)

    async def run(
        self,
        incident: Incident,
        snapshot: TargetSnapshot,
        on_step: Callable[[Incident], None],
        hold: Callable[[Incident], Awaitable[Incident]] | None = None,
        holding: Callable[[Incident], bool] = lambda incident: False,
    ) -> Incident:
        """Run the steps not done yet. `hold` is awaited once before the first step that
        acts on the server, and may hand back the incident changed (in another mode);
        `holding` says whether it would wait now.

        In enforce mode a capture followed by the shutdown step runs while the shutdown
        request waits: both are bounded, the request needs no stack, and a server that
        answers nothing costs the longer of the two rather than their sum. The capture is
        recorded first, as the step before. Under a pause the capture runs alone, so that
        it is on record while the incident is held."""
        done = {result.step for result in incident.steps}
        recovered_by: StepName | None = None
        crashed = incident.crashed
        capturing: asyncio.Task[tuple[StepResult, bool]] | None = None
        try:
            for index, step in enumerate(self._steps):
                if step.name in done:
                    continue
                if recovered_by is not None and step.name is not StepName.VERIFY:
                    continue
                if self._shutdown_follows(index, incident, done) and not holding(incident):
                    capturing = asyncio.get_running_loop().create_task(
                        self._perform(step, incident, snapshot),
                        name=f"capture of incident {incident.incident_id}",
                    )
                    continue
                if hold is not None and incident.mode is Mode.ENFORCE and step.name in ACTING_STEPS:
                    held = await hold(incident)
                    hold = None
                    if held is not incident:
                        incident = held
                        on_step(incident)
                if incident.mode is not Mode.ENFORCE and step.name is not StepName.CAPTURE:
                    result = self._plan(step, snapshot)
                else:
                    result, exited_by_itself = await self._perform(step, incident, snapshot)
                    crashed = crashed or exited_by_itself
                if capturing is not None:
                    incident = self._add(incident, (await capturing)[0], on_step)
                    capturing = None
                incident = self._add(incident, result, on_step)
                if (
                    step.name in _RECOVERED_BY
                    and incident.mode is Mode.ENFORCE
                    and result.outcome is StepOutcome.RECOVERED
                ):
                    recovered_by = step.name
        finally:
            if capturing is not None:
                capturing.cancel()
        cause = incident.cause
        if crashed and not incident.crashed:
            cause += f"; the server crashed: {EXITED_BY_ITSELF}"
        return dataclasses.replace(
            incident,
            cause=cause,
            outcome=self.outcome(incident, recovered_by),
            closed=self._clock.wall(),
            crashed=crashed,
        )

    def _shutdown_follows(self, index: int, incident: Incident, done: set[StepName]) -> bool:
        """The step at `index` is a capture that the shutdown step comes right after."""
        following = self._steps[index + 1 : index + 2]
        return (
            incident.mode is Mode.ENFORCE
            and self._steps[index].name is StepName.CAPTURE
            and bool(following)
            and following[0].name is StepName.SHUTDOWN
            and StepName.SHUTDOWN not in done
        )

    @staticmethod
    def _add(
        incident: Incident, result: StepResult, on_step: Callable[[Incident], None]
    ) -> Incident:
        incident = dataclasses.replace(incident, steps=(*incident.steps, result))
        on_step(incident)
        return incident

    def outcome(self, incident: Incident, recovered_by: StepName | None) -> IncidentOutcome:
        if incident.mode is Mode.DRY_RUN:
            return IncidentOutcome.PLANNED
        if incident.mode is Mode.OBSERVE:
            return IncidentOutcome.OBSERVED
        verify = next((s for s in incident.steps if s.step is StepName.VERIFY), None)
        if verify is None:
            return IncidentOutcome.FAILED
        if verify.outcome is StepOutcome.FAILED:
            return IncidentOutcome.UNKILLABLE if _killed(incident) else IncidentOutcome.FAILED
        if verify.outcome is StepOutcome.TIMEOUT:
            # Survivors still being torn down when teardown_timeout ran out.
            return IncidentOutcome.FAILED
        if verify.outcome is not StepOutcome.OK:
            return IncidentOutcome.LEAKED
        if recovered_by is None:
            recovered_by = next(
                (s.step for s in incident.steps if s.outcome is StepOutcome.RECOVERED), None
            )
        if recovered_by is None:
            # A process that exits only after its step's grace (a slow driver release) was
            # still stopped by that step, not crashed.
            recovered_by = next(
                (
                    s.step
                    for s in reversed(incident.steps)
                    if s.step in _RECOVERED_BY and s.outcome is StepOutcome.NOT_RECOVERED
                ),
                None,
            )
        if recovered_by is None:
            # Nothing had to be stopped: the server had already gone by itself.
            return IncidentOutcome.CRASHED
        return _RECOVERED_BY[recovered_by]

    # ---- the steps ----------------------------------------------------------------

    async def _perform(
        self, step: LadderStep, incident: Incident, snapshot: TargetSnapshot
    ) -> tuple[StepResult, bool]:
        """The step's result, and whether it found that the server exited by itself."""
        started, begun = self._clock.wall(), self._clock.monotonic()
        if step.name is StepName.CAPTURE:
            try:
                captured = await asyncio.wait_for(
                    self._capture(incident, snapshot), step.timeout + 1
                )
            except asyncio.TimeoutError:
                captured = StepResult(step.name, StepOutcome.TIMEOUT, started, step.timeout)
            except Exception as error:  # a bug in a capture must not stop the ladder
                self._on_internal_error("ladder", error)
                duration = self._clock.monotonic() - begun
                detail = f"capture failed: {type(error).__name__}: {error}"
                captured = StepResult(step.name, StepOutcome.FAILED, started, duration, detail)
            return captured, False
        exited_by_itself = False
        if step.name is StepName.SHUTDOWN:
            outcome, detail, exited_by_itself = await self._shutdown(snapshot)
        elif step.name is StepName.TERMINATE:
            outcome, detail = await self._signal_all(snapshot, signal.SIGTERM, step.timeout, False)
        elif step.name is StepName.KILL:
            outcome, detail = await self._signal_all(snapshot, signal.SIGKILL, step.timeout, True)
        else:
            outcome, detail = await self._verify(incident, snapshot, step.timeout)
        duration = self._clock.monotonic() - begun
        pids = tuple(p.pid for p in snapshot.processes)
        return StepResult(step.name, outcome, started, duration, detail, pids), exited_by_itself

    async def _shutdown(self, snapshot: TargetSnapshot) -> tuple[StepOutcome, str, bool]:
        """How the step ended, why, and whether the server had exited by itself."""
        # Without the server's PID namespace nothing is recorded: the admin endpoint is then
        # the only lever, and its answer the only sign that the server is going.
        blind = not snapshot.processes
        if not blind and not self._survivors(snapshot):
            return StepOutcome.SKIPPED, "no recorded process is alive", False
        if not blind and snapshot.root is None:
            return StepOutcome.SKIPPED, "no server process was recorded; nothing to ask", False
        if snapshot.root is not None and not self._alive(snapshot.root):
            detail = await self._after_self_exit(
                snapshot, f"{EXITED_BY_ITSELF} before the ladder reached it"
            )
            return StepOutcome.SKIPPED, detail, True
        if (
            snapshot.server_reports_failure
            and snapshot.may_exit_by_itself
            and snapshot.root is not None
        ):
            grace = self._config.self_exit_grace
            if await self._wait_exit(snapshot.root, grace):
                detail = await self._after_self_exit(
                    snapshot, f"{EXITED_BY_ITSELF} within {grace:g}s of its 503"
                )
                return StepOutcome.SKIPPED, detail, True
        if snapshot.root is not None:
            condition = self._inspect(snapshot.root)
            if condition.state in _CANNOT_ANSWER:
                # A stopped process answers nothing until it is continued: waiting out the
                # request's timeout would only delay the signals that can end it.
                return (
                    StepOutcome.SKIPPED,
                    f"the server process pid {snapshot.root.pid} is {condition.state}:"
                    " it cannot answer a request",
                    False,
                )
        answer = await self._actuators.request_shutdown(
            self._admin_url,
            self._config.admin_method,
            self._admin_token,
            self._config.admin_timeout,
        )
        if answer.outcome is not StepOutcome.OK:
            return answer.outcome, answer.detail, False
        if blind:
            return (
                StepOutcome.RECOVERED,
                f"{answer.detail}; the server's processes are not visible from here,"
                " so only its port can confirm the exit",
                False,
            )
        gone = await self._wait_gone(snapshot, self._config.shutdown_grace)
        if gone:
            return StepOutcome.RECOVERED, f"{answer.detail}; every recorded process exited", False
        left = ", ".join(str(p.pid) for p in self._survivors(snapshot))
        return StepOutcome.NOT_RECOVERED, f"{answer.detail}; still alive: {left}", False

    async def _signal_all(
        self, snapshot: TargetSnapshot, sig: signal.Signals, grace: float, sweep: bool
    ) -> tuple[StepOutcome, str]:
        survivors = self._survivors(snapshot)
        if not survivors:
            return StepOutcome.SKIPPED, "no recorded process is alive"
        notes = []
        refused = False
        for pgid in snapshot.pgids():
            members = [p.identity for p in survivors if p.pgid == pgid]
            if not members:
                continue
            record = self._actuators.signal_group(pgid, sig)
            notes.append(self._note(record.target, record.sent, record.reason))
            if not record.sent:
                for identity in members:
                    single = self._actuators.signal_process(identity, sig)
                    notes.append(self._note(single.target, single.sent, single.reason))
        if sweep:
            for target in await self._kill_targets(snapshot):
                record = self._actuators.signal_process(target, sig)
                notes.append(self._note(record.target, record.sent, record.reason))
                # A survivor the guard or the kernel kept SIGKILL from is not unkillable.
                refused = refused or (not record.sent and self._alive(target))
        gone = await self._wait_gone(snapshot, grace)
        detail = f"{sig.name}: " + "; ".join(notes)
        if gone:
            return StepOutcome.RECOVERED, detail + "; every recorded process exited"
        left = ", ".join(str(p.pid) for p in self._survivors(snapshot))
        outcome = StepOutcome.REFUSED if refused else StepOutcome.NOT_RECOVERED
        return outcome, detail + f"; still alive after {grace:g}s: {left}"

    async def _kill_targets(self, snapshot: TargetSnapshot) -> list[ProcessIdentity]:
        """Every surviving recorded process, and every recorded pid NVML shows holding memory."""
        targets = [p.identity for p in self._survivors(snapshot)]
        reading = await self._read_gpu()
        if reading is not None:
            recorded = {p.pid: p.identity for p in snapshot.processes}
            for pid, used in reading.used_by_pid.items():
                identity = recorded.get(pid)
                if used > 0 and identity is not None and identity not in targets:
                    targets.append(identity)
        return targets

    async def _verify(
        self, incident: Incident, snapshot: TargetSnapshot, timeout: float
    ) -> tuple[StepOutcome, str]:
        if not snapshot.processes:
            return await self._verify_port(timeout)
        started = self._clock.monotonic()
        deadline = started + timeout
        # Past the deadline, a survivor that SIGKILL reached is waited for while its
        # teardown advances, up to this; one held in the kernel, or one that stopped
        # advancing, is unkillable at once.
        teardown_deadline = deadline + self._config.teardown_timeout
        teardown = _Teardown()
        while True:
            survivors = self._survivors(snapshot)
            memory_ok, memory_note = await self._memory_released(snapshot)
            if not survivors and memory_ok:
                detail = f"every recorded process is gone; {memory_note}"
                if teardown.waited_for:
                    late = self._clock.monotonic() - deadline
                    pids = ", ".join(f"pid {pid}" for pid in sorted(teardown.waited_for))
                    detail += f"; the kernel took {late:.1f}s more to end {pids}"
                return StepOutcome.OK, detail
            now = self._clock.monotonic()
            if now >= deadline:
                conditions = [(p, self._inspect(p.identity)) for p in survivors]
                if not (survivors and _killed(incident)):
                    break
                teardown.read(conditions, now)
                if now >= teardown_deadline or not teardown.advancing():
                    break
            await self._sleep(_POLL)
        if not survivors:
            return StepOutcome.NOT_RECOVERED, f"processes gone but {memory_note}"
        left = ", ".join(_survivor(p, c) for p, c in conditions)
        if not _killed(incident):
            return StepOutcome.FAILED, f"still alive after {timeout:g}s: {left}; {memory_note}"
        waited = self._clock.monotonic() - started
        if teardown.advancing():
            # Still being torn down at the bound: slow, not held. Calling it unkillable
            # would send on-call to reset a GPU that is about to be free.
            return StepOutcome.TIMEOUT, (
                f"still being torn down {waited:.1f}s after the kill step, past"
                f" teardown_timeout: {left}; {teardown.describe()}; {memory_note}"
            )
        detail = (
            f"unkillable: still alive {waited:.1f}s after the kill step: {left};"
            f" {teardown.describe()}; {memory_note}"
        )
        report = [
            {
                "pid": p.pid,
                "create_time": p.create_time,
                "title": p.title,
                "state": condition.state,
                "kill_pending": condition.kill_pending,
                "exiting": condition.exiting,
                "wait_channel": condition.wait_channel,
            }
            for p, condition in conditions
        ]
        try:
            self._report(incident.incident_id, UNKILLABLE_REPORT, report)
        except OSError as error:
            # A full or read-only state directory costs the file, not the incident.
            detail += f"; {UNKILLABLE_REPORT} not written: {error}"
        return StepOutcome.FAILED, detail

    async def _verify_port(self, timeout: float) -> tuple[StepOutcome, str]:
        """Without the server's processes in view, its port going quiet is the exit."""
        deadline = self._clock.monotonic() + timeout
        while not self._server_gone():
            if self._clock.monotonic() >= deadline:
                return StepOutcome.FAILED, (
                    f"the server still answers on its port {timeout:g}s later; its processes"
                    " are not visible from here"
                )
            await self._sleep(_POLL)
        return StepOutcome.OK, (
            "nothing listens on the server's port any more; its processes and GPU memory are"
            " not visible from here"
        )

    async def _memory_released(self, snapshot: TargetSnapshot) -> tuple[bool, str]:
        reading = await self._read_gpu()
        if reading is None or snapshot.gpu_baseline is None:
            return True, "GPU memory not checked (no NVML)"
        ours = {p.pid for p in snapshot.processes}
        held = sum(b for pid, b in reading.used_by_pid.items() if pid in ours and b > 0)
        over = {
            device: used - snapshot.gpu_baseline.get(device, 0.0)
            for device, used in reading.used_by_device.items()
            if used - snapshot.gpu_baseline.get(device, 0.0) > GPU_TOLERANCE_BYTES
        }
        if held > 0 or over:
            return False, (
                f"GPU memory still held: {held / 2**20:.0f} MiB by recorded pids,"
                f" devices over baseline: {sorted(over)}"
            )
        used = sum(reading.used_by_device.values())
        freed = snapshot.gpu_held_at_open / 2**20
        return (
            True,
            f"GPU memory back to baseline: {freed:.0f} MiB released, {used / 2**20:.0f} MiB used",
        )

    def _plan(self, step: LadderStep, snapshot: TargetSnapshot) -> StepResult:
        """What enforce mode would do, exactly, without doing it."""
        pids = ", ".join(f"{p.pid} ({p.title})" for p in snapshot.processes)
        groups = ", ".join(str(g) for g in snapshot.pgids())
        plans = {
            StepName.SHUTDOWN: f"would {self._config.admin_method} {self._admin_url}",
            StepName.TERMINATE: f"would send SIGTERM to process group(s) {groups}"
            f" and wait {self._config.term_grace:g}s",
            StepName.KILL: f"would send SIGKILL to process group(s) {groups}, then to each"
            f" surviving recorded process ({pids}) and to recorded pids holding GPU memory",
            StepName.VERIFY: f"would wait up to {self._config.release_timeout:g}s for every"
            " recorded process to exit and GPU memory to return to baseline",
        }
        targets = tuple(p.pid for p in snapshot.processes)
        return StepResult(
            step.name, StepOutcome.PLANNED, self._clock.wall(), 0.0, plans[step.name], targets
        )

    # ---- helpers ------------------------------------------------------------------

    def _survivors(self, snapshot: TargetSnapshot) -> list[ProcessInfo]:
        return [p for p in snapshot.processes if self._alive(p.identity)]

    async def _after_self_exit(self, snapshot: TargetSnapshot, what: str) -> str:
        """The rest of a server that left by itself follows it (a parent-death signal, its
        own shutdown) within a moment: wait for that before anything is signalled."""
        if await self._wait_gone(snapshot, self._config.shutdown_grace):
            return f"{what}; the rest of its tree followed"
        left = ", ".join(str(p.pid) for p in self._survivors(snapshot))
        return f"{what}; left behind: {left}"

    async def _wait_exit(self, identity: ProcessIdentity, grace: float) -> bool:
        deadline = self._clock.monotonic() + grace
        while self._alive(identity):
            if self._clock.monotonic() >= deadline:
                return False
            await self._sleep(_POLL)
        return True

    async def _wait_gone(self, snapshot: TargetSnapshot, grace: float) -> bool:
        deadline = self._clock.monotonic() + grace
        while self._survivors(snapshot):
            if self._clock.monotonic() >= deadline:
                return False
            await self._sleep(_POLL)
        return True

    @staticmethod
    def _note(target: str, sent: bool, reason: str) -> str:
        return f"{target} sent" if sent else f"{target} not signalled ({reason})"


def _survivor(process: ProcessInfo, condition: ProcessCondition) -> str:
    """A survivor as verify names it: what it is, what the kernel shows of it, and whether
    it ran since the incident opened (a process held in the kernel does not; one starved of
    CPU hardly does)."""
    text = f"pid {process.pid} ({process.title}) {condition.describe()}"
    if condition.cpu_seconds is None:
        return text
    opening, now = process.cpu_seconds, condition.cpu_seconds
    return f"{text}, CPU {opening:.2f}s at the opening, {now:.2f}s now"


class _Teardown:
    """The survivors of SIGKILL past verify's bound, and whether each still advances
    towards its end.

    Measured on the real vLLM-Omni: a SIGKILLed stage worker loses its threads, then spends
    its last moments in the kernel's `exit_mmap`, freeing its address space, on the one
    core vLLM binds it to: runnable, its CPU time rising, for seconds where busy neighbours
    share that core. A process in that state is waited for. One in uninterruptible sleep,
    one that SIGKILL did not reach, or one that showed no progress for `TEARDOWN_STILL`
    is held and will not go by itself (docs/design.md, Remediation)."""

    def __init__(self) -> None:
        self._last: dict[int, ProcessCondition] = {}
        self._advanced_at: dict[int, float] = {}
        self._held: list[str] = []
        self.waited_for: set[int] = set()

    def read(self, conditions: list[tuple[ProcessInfo, ProcessCondition]], now: float) -> None:
        self._held = []
        for process, condition in conditions:
            pid = process.pid
            before = self._last.get(pid)
            if before is None or condition.advanced_since(before) or condition.runnable:
                self._advanced_at[pid] = now
            self._last[pid] = condition
            if not condition.dying:
                self._held.append(f"pid {pid} {condition.describe()}")
            elif now - self._advanced_at[pid] >= TEARDOWN_STILL:
                still = now - self._advanced_at[pid]
                self._held.append(f"pid {pid} made no progress in its exit for {still:.1f}s")
            else:
                self.waited_for.add(pid)

    def advancing(self) -> bool:
        """Every survivor is on its way out and advanced within `TEARDOWN_STILL`."""
        return bool(self._last) and not self._held

    def describe(self) -> str:
        if self._held:
            return "held: " + ", ".join(self._held)
        return "each still advancing in its exit (runnable, CPU time, threads or memory)"


def _killed(incident: Incident) -> bool:
    """SIGKILL reached every process the kill step found alive, and not all of them died."""
    return any(
        s.step is StepName.KILL and s.outcome is StepOutcome.NOT_RECOVERED for s in incident.steps
    )
