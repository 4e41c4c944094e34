"""Processes that outlive SIGKILL: reported with state and wait channel, outcome unkillable."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Set
from pathlib import Path

import aiohttp
import pytest
from fakes import FakePsutil, info

from omni_watchdog.clock import FakeClock
from omni_watchdog.config import LadderConfig
from omni_watchdog.policy.actuators import Actuators, SignalGuard, is_alive
from omni_watchdog.policy.inspect import ProcessCondition, read_condition
from omni_watchdog.policy.ladder import (
    UNKILLABLE_REPORT,
    LadderRunner,
    ladder_from_config,
)
from omni_watchdog.types import (
    GpuReading,
    Incident,
    IncidentOutcome,
    Mode,
    ProcessIdentity,
    ProcessInfo,
    ProcessRole,
    StepName,
    StepOutcome,
    StepResult,
    TargetSnapshot,
)

OWN_PID, OWN_PGID = 999, 999
TERM, KILL = int(signal.SIGTERM), int(signal.SIGKILL)
INCIDENT_ID = "20260101T000000Z-abcdef"
WITH_KILL = ["capture", "terminate", "kill", "verify"]
WITHOUT_KILL = ["capture", "terminate", "verify"]


class Rig:
    """A ladder runner over fake processes whose SIGKILL the test decides the fate of."""

    def __init__(self, fake: FakePsutil, steps: list[str]) -> None:
        self.fake = fake
        self.clock = FakeClock()
        self.config = LadderConfig(steps=steps, term_grace=3.0, kill_grace=1.0, release_timeout=2.0)
        self.processes: list[ProcessInfo] = []
        self.reports: list[tuple[str, str, object]] = []
        # Pids the driver holds: SIGKILL is delivered to them and changes nothing.
        self.in_the_driver: set[int] = set()
        # Pids whose SIGKILL the kernel refuses (another user's process).
        self.not_permitted: set[int] = set()
        # Pids that exit this long after SIGKILL reaches them, the signal pending meanwhile.
        self.exit_delay: dict[int, float] = {}
        # Pids of `exit_delay` whose exit the kernel runs meanwhile (else they wait for a CPU).
        self.exit_begun: set[int] = set()
        # Pids of `in_the_driver` that SIGKILL got as far as starting their exit.
        self.stuck_exiting: set[int] = set()
        # How a pid of `exit_delay` looks until it exits: its scheduler state (a runnable
        # one waits for a CPU) and the CPU seconds it gains each second (its teardown).
        self.exit_state: dict[int, str] = {}
        self.exit_cpu_rate: dict[int, float] = {}
        # When SIGKILL reached each pid of `exit_delay`, and when it exits.
        self._killed_at: dict[int, float] = {}
        self._dying: dict[int, float] = {}
        # Called after each step, as the policy would journal it.
        self.after_step: Callable[[Incident], None] = lambda incident: None

    def process(self, pid: int, pgid: int, role: ProcessRole) -> None:
        self.fake.add(pid, pgid=pgid, create_time=100.0, ignores={TERM})
        self.processes.append(info(pid, pgid, role))

    def recorded(self, identity: ProcessIdentity) -> bool:
        return identity in {p.identity for p in self.processes}

    def alive(self, identity: ProcessIdentity) -> bool:
        return is_alive(self.fake, identity, self.fake.start_time)

    def kill(self, pid: int, sig: int) -> None:
        if pid not in self.fake.table:
            raise ProcessLookupError(pid)
        if pid in self.not_permitted:
            raise PermissionError(1, "Operation not permitted")
        self.fake.signals.append(("kill", pid, sig))
        self._deliver(pid, sig)

    def killpg(self, pgid: int, sig: int) -> None:
        members = [p.pid for p in self.fake.table.values() if p.pgid == pgid]
        if not members:
            raise ProcessLookupError(pgid)
        if self.not_permitted & set(members):
            raise PermissionError(1, "Operation not permitted")
        self.fake.signals.append(("killpg", pgid, sig))
        for pid in members:
            self._deliver(pid, sig)

    def _deliver(self, pid: int, sig: int) -> None:
        if sig == KILL and pid in self.in_the_driver:
            return
        if sig == KILL and pid in self.exit_delay:
            self._killed_at.setdefault(pid, self.clock.monotonic())
            self._dying.setdefault(pid, self.clock.monotonic() + self.exit_delay[pid])
        elif sig == KILL or sig not in self.fake.table[pid].ignores:
            del self.fake.table[pid]

    async def sleep(self, seconds: float) -> None:
        await self.clock.sleep(seconds)
        for pid, when in list(self._dying.items()):
            if self.clock.monotonic() >= when:
                self.fake.table.pop(pid, None)
                del self._dying[pid]

    async def read_gpu(self) -> GpuReading | None:
        return None

    async def capture(self, incident: Incident, snapshot: TargetSnapshot) -> StepResult:
        return StepResult(StepName.CAPTURE, StepOutcome.OK, self.clock.wall(), 0.0, "captured")

    def inspect(self, identity: ProcessIdentity) -> ProcessCondition:
        pid = identity.pid
        if pid in self._dying:
            dying_for = self.clock.monotonic() - self._killed_at[pid]
            cpu = 2.5 + self.exit_cpu_rate.get(pid, 0.0) * dying_for
            state = self.exit_state.get(pid, "running")
            return ProcessCondition(pid, state, "0", True, pid in self.exit_begun, cpu)
        stuck_exiting = pid in self.stuck_exiting
        return ProcessCondition(pid, "disk-sleep", "nvidia_wait", stuck_exiting, stuck_exiting)

    def report(self, incident_id: str, name: str, value: object) -> None:
        self.reports.append((incident_id, name, value))

    def run(self) -> Incident:
        snapshot = TargetSnapshot(
            "http://127.0.0.1:1",
            self.processes[0].identity,
            tuple(self.processes),
            None,
        )
        incident = Incident(INCIDENT_ID, snapshot.target, Mode.ENFORCE, self.clock.wall(), "hang")

        async def scenario() -> Incident:
            async with aiohttp.ClientSession() as session:
                guard = SignalGuard(
                    self.fake,
                    self.recorded,
                    OWN_PID,
                    OWN_PGID,
                    self.fake.getpgid,
                    self.fake.start_time,
                )
                runner = LadderRunner(
                    ladder_from_config(self.config),
                    self.config,
                    Actuators(guard, session, kill=self.kill, killpg=self.killpg),
                    self.capture,
                    self.read_gpu,
                    self.alive,
                    self.clock,
                    "http://127.0.0.1:1/admin/shutdown",
                    "token",
                    sleep=self.sleep,
                    inspect=self.inspect,
                    report=self.report,
                )
                return await runner.run(incident, snapshot, self.after_step)

        return asyncio.run(scenario())


def a_server(rig: Rig) -> None:
    """An API server and an engine in one process group."""
    rig.process(100, 100, ProcessRole.API)
    rig.process(103, 100, ProcessRole.ENGINE)


def run_a_server(
    fake: FakePsutil,
    steps: list[str],
    *,
    in_the_driver: Set[int] = frozenset(),
    stuck_exiting: Set[int] = frozenset(),
    not_permitted: Set[int] = frozenset(),
    exit_delay: dict[int, float] | None = None,
    exit_begun: Set[int] = frozenset(),
    exit_state: dict[int, str] | None = None,
    exit_cpu_rate: dict[int, float] | None = None,
) -> tuple[Rig, Incident]:
    """`a_server` through the ladder, SIGKILL doing to each pid what the sets say."""
    rig = Rig(fake, steps)
    a_server(rig)
    rig.in_the_driver = set(in_the_driver | stuck_exiting)
    rig.stuck_exiting = set(stuck_exiting)
    rig.not_permitted = set(not_permitted)
    rig.exit_delay = exit_delay or {}
    rig.exit_begun = set(exit_begun)
    rig.exit_state = exit_state or {}
    rig.exit_cpu_rate = exit_cpu_rate or {}
    return rig, rig.run()


def step(incident: Incident, name: StepName) -> StepResult:
    return next(s for s in incident.steps if s.step is name)


def test_a_process_that_outlives_sigkill_is_unkillable(fake_psutil: FakePsutil) -> None:
    rig = Rig(fake_psutil, WITH_KILL)
    a_server(rig)
    rig.in_the_driver = {103}
    incident = rig.run()
    assert incident.outcome is IncidentOutcome.UNKILLABLE
    assert ("kill", 103, KILL) in fake_psutil.signals and 103 in fake_psutil.table
    assert step(incident, StepName.KILL).outcome is StepOutcome.NOT_RECOVERED
    verify = step(incident, StepName.VERIFY)
    assert verify.outcome is StepOutcome.FAILED
    assert "pid 103 (engine) disk-sleep in nvidia_wait" in verify.detail
    assert "100" not in verify.detail
    assert rig.reports == [
        (
            INCIDENT_ID,
            UNKILLABLE_REPORT,
            [
                {
                    "pid": 103,
                    "create_time": 100.0,
                    "title": "engine",
                    "state": "disk-sleep",
                    "kill_pending": False,
                    "exiting": False,
                    "wait_channel": "nvidia_wait",
                }
            ],
        )
    ]


# A teardown as the real one looks: a SIGKILLed vLLM-Omni worker freeing its address space
# on a core shared with busy neighbours, sleeping on and off, gaining a little CPU time.
# (the state it shows, the CPU seconds it gains a second) while it is torn down.
Teardown = tuple[dict[int, str], dict[int, float]]
SLOW_TEARDOWN: Teardown = ({103: "sleeping"}, {103: 0.02})
# Sleeping in its exit and gaining nothing: held somewhere, though not in D state.
STILL_TEARDOWN: Teardown = ({103: "sleeping"}, {103: 0.0})
# Runnable, as the rig's processes are unless told otherwise.
RUNNABLE: Teardown = ({}, {})


@pytest.mark.parametrize(
    ("exit_delay", "exit_begun", "stuck_exiting", "teardown", "outcome", "detail"),
    [
        # SIGKILL pending on a process that waits for a busy CPU to act on it: waited for.
        (
            {103: 9.0},
            set(),
            set(),
            RUNNABLE,
            IncidentOutcome.RECOVERED_BY_KILL,
            "the kernel took 6.0s more to end pid 103",
        ),
        # A big process whose exit the kernel runs, slowly: waited for while it advances,
        # past `TEARDOWN_STILL` and for as long as the real one took in CI (40 s).
        (
            {103: 45.0},
            {103},
            set(),
            SLOW_TEARDOWN,
            IncidentOutcome.RECOVERED_BY_KILL,
            "the kernel took 42.0s more to end pid 103",
        ),
        # Still advancing in its exit when teardown_timeout runs out: not unkillable, but
        # the ladder stops waiting and says so.
        (
            {103: 600.0},
            {103},
            set(),
            SLOW_TEARDOWN,
            IncidentOutcome.FAILED,
            "still being torn down 122.0s after the kill step, past teardown_timeout: pid 103"
            " (engine) sleeping, SIGKILL pending, exiting, wait channel hidden by the kernel,"
            " CPU 0.00s at the opening, 4.96s now; each still advancing in its exit",
        ),
        # On its way out but no longer advancing: held, so unkillable once that is clear.
        (
            {103: 600.0},
            {103},
            set(),
            STILL_TEARDOWN,
            IncidentOutcome.UNKILLABLE,
            "still alive 7.1s after the kill step: pid 103 (engine) sleeping, SIGKILL pending,"
            " exiting, wait channel hidden by the kernel, CPU 0.00s at the opening, 2.50s now;"
            " held: pid 103 made no progress in its exit for 5.0s",
        ),
        # Held in the driver on its way out: nothing to wait for, so no longer wait.
        (
            {},
            set(),
            {103},
            RUNNABLE,
            IncidentOutcome.UNKILLABLE,
            "still alive 2.0s after the kill step: pid 103 (engine) disk-sleep, SIGKILL"
            " pending, exiting in nvidia_wait",
        ),
    ],
    ids=[
        "starved-of-cpu",
        "torn-down-slowly",
        "teardown-outlasts-its-bound",
        "no-progress-in-its-exit",
        "stuck-in-exit",
    ],
)
def test_a_survivor_on_its_way_out_is_waited_for_while_it_advances(
    fake_psutil: FakePsutil,
    exit_delay: dict[int, float],
    exit_begun: set[int],
    stuck_exiting: set[int],
    teardown: Teardown,
    outcome: IncidentOutcome,
    detail: str,
) -> None:
    rig, incident = run_a_server(
        fake_psutil,
        WITH_KILL,
        stuck_exiting=stuck_exiting,
        exit_delay=exit_delay,
        exit_begun=exit_begun,
        exit_state=teardown[0],
        exit_cpu_rate=teardown[1],
    )
    assert incident.outcome is outcome, step(incident, StepName.VERIFY).detail
    assert step(incident, StepName.KILL).outcome is StepOutcome.NOT_RECOVERED
    assert detail in step(incident, StepName.VERIFY).detail
    assert [name for _, name, _ in rig.reports] == (
        [UNKILLABLE_REPORT] if outcome is IncidentOutcome.UNKILLABLE else []
    )


def test_a_report_that_cannot_be_written_does_not_stop_the_incident(
    fake_psutil: FakePsutil,
) -> None:
    rig = Rig(fake_psutil, WITH_KILL)
    a_server(rig)
    rig.in_the_driver = {103}

    def disk_full(incident_id: str, name: str, value: object) -> None:
        raise OSError(28, "No space left on device")

    rig.report = disk_full  # type: ignore[method-assign]
    incident = rig.run()
    assert incident.outcome is IncidentOutcome.UNKILLABLE
    assert "unkillable.json not written" in step(incident, StepName.VERIFY).detail


@pytest.mark.parametrize(
    ("steps", "in_the_driver", "not_permitted", "exit_delay", "outcome", "kill"),
    [
        # SIGKILL works: the engine dies within the kill step's grace.
        (WITH_KILL, set(), set(), {}, IncidentOutcome.RECOVERED_BY_KILL, StepOutcome.RECOVERED),
        # The driver lets go a moment after the grace: still the kill step's doing.
        (
            WITH_KILL,
            set(),
            set(),
            {103: 1.5},
            IncidentOutcome.RECOVERED_BY_KILL,
            StepOutcome.NOT_RECOVERED,
        ),
        # No kill step configured: a survivor of SIGTERM is a failure, not unkillable.
        (WITHOUT_KILL, {103}, set(), {}, IncidentOutcome.FAILED, None),
        # SIGKILL never reached it: the kernel refused, so nothing shows it unkillable.
        (WITH_KILL, set(), {103}, {}, IncidentOutcome.FAILED, StepOutcome.REFUSED),
    ],
    ids=["dies", "dies-late", "no-kill-step", "not-permitted"],
)
def test_outcomes_other_than_unkillable(
    fake_psutil: FakePsutil,
    steps: list[str],
    in_the_driver: set[int],
    not_permitted: set[int],
    exit_delay: dict[int, float],
    outcome: IncidentOutcome,
    kill: StepOutcome | None,
) -> None:
    rig, incident = run_a_server(
        fake_psutil,
        steps,
        in_the_driver=in_the_driver,
        not_permitted=not_permitted,
        exit_delay=exit_delay,
    )
    assert incident.outcome is outcome
    kill_step = next((s for s in incident.steps if s.step is StepName.KILL), None)
    assert (kill_step.outcome if kill_step else None) == kill
    assert rig.reports == []


def test_a_kill_step_skipped_because_nothing_survived_reports_nothing(
    fake_psutil: FakePsutil,
) -> None:
    rig = Rig(fake_psutil, WITH_KILL)
    a_server(rig)

    def exit_after_terminate(incident: Incident) -> None:
        if incident.steps[-1].step is StepName.TERMINATE:
            fake_psutil.table.clear()

    rig.after_step = exit_after_terminate
    incident = rig.run()
    assert step(incident, StepName.KILL).outcome is StepOutcome.SKIPPED
    assert incident.outcome is IncidentOutcome.RECOVERED_BY_TERM
    assert all(s[2] != KILL for s in fake_psutil.signals)
    assert rig.reports == []


# /proc/<pid>/stat of a process named with a space and a parenthesis, flags as given.
def stat_line(flags: int) -> str:
    return f"103 (VLLM::Engine (1)) R 100 100 100 0 -1 {flags} 0 0 0 0 1 2 0 0 20 0 4 0\n"


# /proc/<pid>/status with the pending-signal masks as given.
def status_text(own: int, shared: int) -> str:
    return (
        f"Name:\tVLLM::Engine\nState:\tR (running)\nSigPnd:\t{own:016x}\nShdPnd:\t{shared:016x}\n"
    )


RUNNING, EXITING = 0x400100, 0x40040C
SIGKILL_MASK = 1 << 8


@pytest.mark.parametrize(
    ("wchan", "state", "flags", "pending", "described", "dying"),
    [
        ("nvidia_wait\n", "disk-sleep", RUNNING, (0, 0), "disk-sleep in nvidia_wait", False),
        (
            "nvidia_wait\n",
            "disk-sleep",
            EXITING,
            (SIGKILL_MASK, SIGKILL_MASK),
            "disk-sleep, SIGKILL pending, exiting in nvidia_wait",
            False,
        ),
        ("0", "running", RUNNING, (0, 0), "running, not waiting in the kernel", False),
        (
            "0",
            "running",
            RUNNING,
            (0, SIGKILL_MASK),
            "running, SIGKILL pending, not waiting in the kernel",
            True,
        ),
        (
            "0",
            "running",
            RUNNING,
            (SIGKILL_MASK, 0),
            "running, SIGKILL pending, not waiting in the kernel",
            True,
        ),
        ("0", "running", EXITING, (0, 0), "running, exiting, not waiting in the kernel", True),
        (
            "0",
            "sleeping",
            RUNNING,
            (0, 1 << 14),
            "sleeping, wait channel hidden by the kernel",
            False,
        ),
        (None, "disk-sleep", None, None, "disk-sleep, wait channel unreadable", False),
    ],
    ids=[
        "in-the-driver",
        "in-the-driver-killed",
        "running",
        "kill-pending-on-the-process",
        "kill-pending-on-its-thread",
        "exiting",
        "sigterm-pending",
        "unreadable",
    ],
)
def test_read_condition_reads_state_signals_exit_and_wait_channel(
    tmp_path: Path,
    fake_psutil: FakePsutil,
    wchan: str | None,
    state: str,
    flags: int | None,
    pending: tuple[int, int] | None,
    described: str,
    dying: bool,
) -> None:
    fake_psutil.add(103, pgid=100).state = state
    (tmp_path / "103").mkdir()
    if wchan is not None:
        (tmp_path / "103" / "wchan").write_text(wchan)
    if flags is not None:
        (tmp_path / "103" / "stat").write_text(stat_line(flags))
    if pending is not None:
        (tmp_path / "103" / "status").write_text(status_text(*pending))
    condition = read_condition(ProcessIdentity(103, 100.0), fake_psutil, tmp_path)
    assert condition.pid == 103 and condition.state == state
    assert condition.cpu_seconds == 2.0
    assert condition.describe() == described
    assert condition.dying is dying


def test_read_condition_of_a_gone_process(tmp_path: Path, fake_psutil: FakePsutil) -> None:
    condition = read_condition(ProcessIdentity(103, 100.0), fake_psutil, tmp_path)
    assert condition == ProcessCondition(103, "gone", "")
