"""Policy and ladder tables: fake processes and clock; each safety rule has its own test."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import json
import os
import signal
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import aiohttp
import pytest
from fakes import FakePsutil, info

from omni_watchdog.clock import FakeClock
from omni_watchdog.config import LadderConfig
from omni_watchdog.policy.actuators import Actuators, SignalGuard, is_alive
from omni_watchdog.policy.core import Policy
from omni_watchdog.policy.incidents import (
    BundleWriter,
    HourlyBudget,
    IncidentJournal,
    StateWriteErrors,
    TargetLock,
    append_private,
    replace_private,
)
from omni_watchdog.policy.inspect import read_condition
from omni_watchdog.policy.ladder import (
    LadderRunner,
    gpu_baseline,
    ladder_from_config,
)
from omni_watchdog.probes.processes import ProcessTracker
from omni_watchdog.target import TargetWatch
from omni_watchdog.types import (
    PIPELINE,
    DetectorReport,
    Evidence,
    EvidenceKind,
    GpuDevice,
    GpuProcess,
    GpuReading,
    HealthOutcome,
    Incident,
    IncidentOutcome,
    JournalEntry,
    LockStatus,
    Mode,
    Observation,
    ObservationKind,
    ProcessIdentity,
    ProcessInfo,
    ProcessReadings,
    ProcessRole,
    StageRef,
    StageState,
    StepName,
    StepOutcome,
    StepResult,
    TargetSnapshot,
    Verdict,
)

OWN_PID, OWN_PGID = 999, 999
VERDICT = Verdict(
    StageRef(1),
    StageState.DEAD,
    1000.0,
    (Evidence(EvidenceKind.PROCESS_EXIT, StageRef(1), 999.0, "engine exited"),),
)
TERM, KILL = int(signal.SIGTERM), int(signal.SIGKILL)


def gpu_reading(used: dict[int, float], held: dict[tuple[int, int], float]) -> GpuReading:
    """Devices' used bytes by index, and the bytes each pid holds by (device, pid)."""
    return GpuReading(
        1000.0,
        tuple(GpuDevice(index, used_bytes, 80e9, None) for index, used_bytes in used.items()),
        tuple(GpuProcess(gpu, pid, held_bytes) for (gpu, pid), held_bytes in held.items()),
    )


class Rig:
    """A policy wired to fakes: processes, GPU memory, clock, a refused admin port."""

    def __init__(
        self, tmp_path: Path, fake: FakePsutil, mode: Mode, budget: int = 3, records: int = 30
    ) -> None:
        self.fake = fake
        self.clock = FakeClock()
        self.processes: list[ProcessInfo] = []
        self.gpu_by_pid: dict[int, float] = {}
        self.captures = 0
        self.tmp_path = tmp_path
        self.mode = mode
        self.budget = budget
        self.records = records
        self.write_errors = StateWriteErrors()
        self.internal_errors: list[tuple[str, Exception]] = []
        self.disk: Callable[[Path, bytes], None] | None = None

    def process(
        self,
        pid: int,
        pgid: int,
        role: ProcessRole,
        *,
        recorded_time: float = 100.0,
        create_time: float = 100.0,
        ignores: set[int] | None = None,
    ) -> ProcessInfo:
        entry = info(pid, pgid, role, recorded_time)
        self.fake.add(pid, pgid=pgid, create_time=create_time, ignores=ignores)
        self.processes.append(entry)
        return entry

    def recorded(self, identity: ProcessIdentity) -> bool:
        return identity in {p.identity for p in self.processes}

    def alive(self, identity: ProcessIdentity) -> bool:
        return is_alive(self.fake, identity, self.fake.start_time)

    async def read_gpu(self) -> GpuReading:
        held = {pid: b for pid, b in self.gpu_by_pid.items() if pid in self.fake.table}
        return gpu_reading({0: 1e9 + sum(held.values())}, {(0, pid): b for pid, b in held.items()})

    async def capture(self, incident: Incident, snapshot: TargetSnapshot) -> StepResult:
        self.captures += 1
        return StepResult(StepName.CAPTURE, StepOutcome.OK, self.clock.wall(), 0.0, "captured")

    def snapshot(self) -> TargetSnapshot:
        root = next(p for p in self.processes if p.role is ProcessRole.API)
        reading = gpu_reading(
            {0: 1e9 + sum(self.gpu_by_pid.values())},
            {(0, pid): b for pid, b in self.gpu_by_pid.items()},
        )
        return TargetSnapshot(
            "http://127.0.0.1:1",
            root.identity,
            tuple(self.processes),
            gpu_baseline(reading, tuple(self.processes)),
        )

    def actuators(self, session: aiohttp.ClientSession) -> Actuators:
        guard = SignalGuard(
            self.fake, self.recorded, OWN_PID, OWN_PGID, self.fake.getpgid, self.fake.start_time
        )
        return Actuators(guard, session, kill=self.fake.kill, killpg=self.fake.killpg)

    def policy(
        self,
        session: aiohttp.ClientSession,
        lock_dir: Path | None = None,
        admin_url: str = "http://127.0.0.1:1/admin/shutdown",
        server_gone: bool = False,
        activity_readings: Callable[[StageRef], Sequence[ProcessReadings]] = lambda stage: (),
    ) -> Policy:
        config = LadderConfig(term_grace=3.0, kill_grace=1.0, release_timeout=2.0)
        actuators = self.actuators(session)
        runner = LadderRunner(
            ladder_from_config(config),
            config,
            actuators,
            self.capture,
            self.read_gpu,
            self.alive,
            self.clock,
            admin_url,
            "token",
            sleep=self.clock.sleep,
            server_gone=lambda: server_gone,
            inspect=lambda identity: read_condition(identity, self.fake, self.tmp_path),
            on_internal_error=lambda loop, error: self.internal_errors.append((loop, error)),
        )
        return Policy(
            self.mode,
            runner,
            IncidentJournal(
                self.tmp_path / "journal.jsonl", self.write_errors, self.disk or append_private
            ),
            HourlyBudget(self.budget),
            HourlyBudget(self.records),
            TargetLock(lock_dir or self.tmp_path / "locks"),
            BundleWriter(
                self.tmp_path / "incidents", self.write_errors, self.disk or replace_private
            ),
            self.clock,
            self.alive,
            lambda loop, error: self.internal_errors.append((loop, error)),
            activity_readings=activity_readings,
        )


def report(warm: bool = True, verdicts: tuple[Verdict, ...] = (VERDICT,)) -> DetectorReport:
    return DetectorReport(1000.0, warm, (), verdicts)


def run_incident(rig: Rig, *, warm: bool = True, lock_dir: Path | None = None) -> Incident | None:
    async def scenario() -> Incident | None:
        async with aiohttp.ClientSession() as session:
            policy = rig.policy(session, lock_dir)
            task = policy.on_report(report(warm), rig.snapshot)
            return None if task is None else await task

    return asyncio.run(scenario())


def the_0_11_tree(rig: Rig, ignores: set[int] | None = None) -> None:
    """API, two stage workers and an engine in one group, like vLLM-Omni 0.11."""
    rig.process(100, 100, ProcessRole.API, ignores=ignores)
    rig.process(101, 100, ProcessRole.STAGE, ignores=ignores)
    rig.process(102, 100, ProcessRole.STAGE, ignores=ignores)
    rig.process(103, 100, ProcessRole.ENGINE, ignores=ignores)
    rig.gpu_by_pid.update({101: 5e8, 103: 7e9})


def test_sigterm_obeyed_recovers_by_term(tmp_path: Path, fake_psutil: FakePsutil) -> None:
    rig = Rig(tmp_path, fake_psutil, Mode.ENFORCE)
    the_0_11_tree(rig)
    incident = run_incident(rig)
    assert incident is not None and incident.outcome is IncidentOutcome.RECOVERED_BY_TERM
    assert [s.step for s in incident.steps] == [
        StepName.CAPTURE,
        StepName.SHUTDOWN,
        StepName.TERMINATE,
        StepName.VERIFY,
    ]
    assert incident.steps[1].outcome is StepOutcome.UNREACHABLE
    assert fake_psutil.signals == [("killpg", 100, TERM)]


def test_ignored_sigterm_escalates_to_kill_and_memory_is_released(
    tmp_path: Path, fake_psutil: FakePsutil
) -> None:
    rig = Rig(tmp_path, fake_psutil, Mode.ENFORCE)
    the_0_11_tree(rig, ignores={TERM})
    incident = run_incident(rig)
    assert incident is not None and incident.outcome is IncidentOutcome.RECOVERED_BY_KILL
    assert ("killpg", 100, KILL) in fake_psutil.signals
    assert fake_psutil.table == {}
    verify = incident.steps[-1]
    assert verify.step is StepName.VERIFY and verify.outcome is StepOutcome.OK


def test_escaped_child_holding_memory_is_killed_by_pid(
    tmp_path: Path, fake_psutil: FakePsutil
) -> None:
    rig = Rig(tmp_path, fake_psutil, Mode.ENFORCE)
    the_0_11_tree(rig, ignores={TERM})
    # It called setsid: its own group, which also holds a process that is not ours.
    rig.process(104, 104, ProcessRole.HELPER, ignores={TERM})
    fake_psutil.add(500, pgid=104)
    rig.gpu_by_pid[104] = 1e9
    incident = run_incident(rig)
    assert incident is not None and incident.outcome is IncidentOutcome.RECOVERED_BY_KILL
    assert ("kill", 104, KILL) in fake_psutil.signals
    assert not any(s[0] == "killpg" and s[1] == 104 for s in fake_psutil.signals)
    assert 500 in fake_psutil.table


def test_memory_still_held_ends_leaked(tmp_path: Path, fake_psutil: FakePsutil) -> None:
    rig = Rig(tmp_path, fake_psutil, Mode.ENFORCE)
    the_0_11_tree(rig)

    async def stuck_gpu() -> GpuReading:
        return gpu_reading({0: 1e9 + 7.5e9}, {})

    rig.read_gpu = stuck_gpu  # type: ignore[method-assign]
    incident = run_incident(rig)
    assert incident is not None and incident.outcome is IncidentOutcome.LEAKED


def test_no_action_before_warm_up_ends(tmp_path: Path, fake_psutil: FakePsutil) -> None:
    rig = Rig(tmp_path, fake_psutil, Mode.ENFORCE)
    the_0_11_tree(rig)
    assert run_incident(rig, warm=False) is None
    assert fake_psutil.signals == [] and rig.captures == 0


def test_a_reused_pid_is_never_signalled(tmp_path: Path, fake_psutil: FakePsutil) -> None:
    rig = Rig(tmp_path, fake_psutil, Mode.ENFORCE)
    rig.process(100, 100, ProcessRole.API, ignores={TERM})
    # Recorded at create time 100; the pid now belongs to a process started at 250.
    rig.process(101, 101, ProcessRole.ENGINE, create_time=250.0, recorded_time=100.0)
    incident = run_incident(rig)
    assert incident is not None
    assert all(s[1] != 101 for s in fake_psutil.signals)
    assert 101 in fake_psutil.table


@pytest.mark.parametrize(
    ("started", "same"),
    [
        (100.0, True),
        (100.0 + 1e-9, True),  # the same start, rounded another way
        (100.01, False),  # the next tick: another process got the pid
        (99.99, False),
    ],
)
def test_a_process_is_the_recorded_one_only_if_it_started_in_the_same_tick(
    fake_psutil: FakePsutil, started: float, same: bool
) -> None:
    recorded = ProcessIdentity(101, 100.0)
    fake_psutil.add(101, create_time=started)
    assert recorded.matches(ProcessIdentity(101, started)) is same
    assert not recorded.matches(ProcessIdentity(102, 100.0))
    guard = SignalGuard(
        fake_psutil,
        lambda identity: identity == recorded,
        OWN_PID,
        OWN_PGID,
        fake_psutil.getpgid,
        fake_psutil.start_time,
    )
    assert (guard.check_process(recorded) == "") is same
    assert is_alive(fake_psutil, recorded, fake_psutil.start_time) is same


def test_never_the_watchdog_its_group_or_pid_1(tmp_path: Path, fake_psutil: FakePsutil) -> None:
    rig = Rig(tmp_path, fake_psutil, Mode.ENFORCE)
    # A server started from the watchdog's own shell script shares the watchdog's group.
    rig.process(100, OWN_PGID, ProcessRole.API)
    rig.process(OWN_PID, OWN_PGID, ProcessRole.HELPER)
    rig.process(1, 1, ProcessRole.HELPER)
    run_incident(rig)
    assert ("kill", 100, TERM) in fake_psutil.signals
    assert all(s[1] not in (OWN_PID, OWN_PGID, 1) for s in fake_psutil.signals)
    assert OWN_PID in fake_psutil.table and 1 in fake_psutil.table
    guard = SignalGuard(
        fake_psutil, rig.recorded, OWN_PID, OWN_PGID, fake_psutil.getpgid, fake_psutil.start_time
    )
    assert "itself" in guard.check_process(ProcessIdentity(OWN_PID, 100.0))
    assert "pid 1" in guard.check_process(ProcessIdentity(1, 100.0))
    assert "own process group" in guard.check_group(OWN_PGID)


def test_a_group_with_a_foreign_member_is_signalled_pid_by_pid(
    tmp_path: Path, fake_psutil: FakePsutil
) -> None:
    rig = Rig(tmp_path, fake_psutil, Mode.ENFORCE)
    the_0_11_tree(rig)
    fake_psutil.add(600, pgid=100)  # the shell that started the server, in its group
    run_incident(rig)
    assert not any(s[0] == "killpg" for s in fake_psutil.signals)
    assert {s[1] for s in fake_psutil.signals} == {100, 101, 102, 103}
    assert 600 in fake_psutil.table


def test_one_incident_at_a_time(tmp_path: Path, fake_psutil: FakePsutil) -> None:
    rig = Rig(tmp_path, fake_psutil, Mode.ENFORCE)
    the_0_11_tree(rig, ignores={TERM})

    async def scenario() -> tuple[object, object]:
        async with aiohttp.ClientSession() as session:
            policy = rig.policy(session)
            first = policy.on_report(report(), rig.snapshot)
            second = policy.on_report(report(), rig.snapshot)
            assert first is not None
            await first
            return second, len(policy.incidents())

    second, count = asyncio.run(scenario())
    assert second is None and count == 1


def test_enforcement_budget_per_hour(tmp_path: Path, fake_psutil: FakePsutil) -> None:
    rig = Rig(tmp_path, fake_psutil, Mode.ENFORCE, budget=1)

    async def scenario() -> list[Incident]:
        async with aiohttp.ClientSession() as session:
            policy = rig.policy(session)
            done = []
            for pid in (100, 200):
                rig.processes.clear()
                rig.process(pid, pid, ProcessRole.API)
                task = policy.on_report(report(), rig.snapshot)
                assert task is not None
                done.append(await task)
            rig.clock.advance(3601)
            rig.processes.clear()
            rig.process(300, 300, ProcessRole.API)
            task = policy.on_report(report(), rig.snapshot)
            assert task is not None
            done.append(await task)
            assert policy.budget_exhausted_total == 1
            return done

    first, second, third = asyncio.run(scenario())
    assert first.mode is Mode.ENFORCE and first.outcome is IncidentOutcome.RECOVERED_BY_TERM
    assert second.mode is Mode.OBSERVE and "budget" in second.cause
    assert ("killpg", 200, TERM) not in fake_psutil.signals
    assert third.mode is Mode.ENFORCE


@pytest.mark.parametrize(
    ("memory_drops", "outcome"),
    [(True, IncidentOutcome.RECOVERED_BY_KILL), (False, IncidentOutcome.LEAKED)],
)
def test_restarted_watchdog_resumes_the_open_incident(
    tmp_path: Path, fake_psutil: FakePsutil, memory_drops: bool, outcome: IncidentOutcome
) -> None:
    rig = Rig(tmp_path, fake_psutil, Mode.ENFORCE)
    the_0_11_tree(rig, ignores={TERM})
    snapshot = rig.snapshot()
    # The previous watchdog died after capture and a refused shutdown, before SIGTERM.
    half_done = Incident(
        "20260101T000000Z-abcdef",
        snapshot.target,
        Mode.ENFORCE,
        rig.clock.wall(),
        "stage 1.0 dead",
        (VERDICT,),
        (
            StepResult(StepName.CAPTURE, StepOutcome.OK, 0.0, 1.0),
            StepResult(StepName.SHUTDOWN, StepOutcome.UNREACHABLE, 1.0, 0.1),
        ),
    )
    IncidentJournal(tmp_path / "journal.jsonl", StateWriteErrors()).record(
        half_done, snapshot.root, snapshot.identities, snapshot.pgids(), snapshot.gpu_baseline
    )
    # The restarted watchdog has recorded nothing of its own: it adopts the journal's.
    before_restart = tuple(rig.processes)
    rig.processes.clear()
    if not memory_drops:

        async def stuck_gpu() -> GpuReading:
            return gpu_reading({0: 1e9 + 7.5e9}, {})

        rig.read_gpu = stuck_gpu  # type: ignore[method-assign]
    entries: list[JournalEntry] = []

    async def adopt(entry: JournalEntry) -> TargetSnapshot:
        entries.append(entry)
        adopted = tuple(p for p in before_restart if p.identity in entry.processes)
        rig.processes.extend(adopted)
        return TargetSnapshot(snapshot.target, entry.root, adopted, entry.gpu_baseline)

    async def scenario() -> Incident:
        async with aiohttp.ClientSession() as session:
            policy = rig.policy(session)
            await policy.resume(adopt)
            assert policy.busy
            await policy.wait_idle()
            return policy.incidents()[0]

    resumed = asyncio.run(scenario())
    (entry,) = entries
    assert entry.root == snapshot.root and entry.pgids == (100,)
    assert entry.processes == snapshot.identities
    assert entry.gpu_baseline == {0: 1e9}
    assert rig.captures == 0
    steps = [s.step for s in resumed.steps]
    assert steps.count(StepName.CAPTURE) == 1 and steps.count(StepName.SHUTDOWN) == 1
    # The root's own group, not refused as "not a recorded process of the target".
    assert step_detail(resumed, StepName.TERMINATE).startswith("SIGTERM: process group 100 sent")
    assert ("killpg", 100, TERM) in fake_psutil.signals
    assert resumed.outcome is outcome
    verify = step_detail(resumed, StepName.VERIFY)
    assert ("back to baseline" in verify) is memory_drops
    assert ("devices over baseline: [0]" in verify) is not memory_drops
    replayed = IncidentJournal(tmp_path / "journal.jsonl", StateWriteErrors()).replay()
    assert len(replayed) == 1 and replayed[0].incident.outcome is outcome


def test_a_second_watchdog_on_the_same_target_does_not_act(
    tmp_path: Path, fake_psutil: FakePsutil
) -> None:
    rig = Rig(tmp_path, fake_psutil, Mode.ENFORCE)
    the_0_11_tree(rig)
    other = TargetLock(tmp_path / "locks")
    root = rig.snapshot().root
    assert root is not None
    assert other.acquire(root)
    try:
        incident = run_incident(rig, lock_dir=tmp_path / "locks")
    finally:
        other.release()
    assert incident is not None and incident.mode is Mode.OBSERVE
    holder = f"held by another watchdog (pid {os.getpid()})"
    assert f"no target lock ({holder}): observing only" in incident.cause
    assert fake_psutil.signals == []


def test_the_lock_is_taken_on_attach_so_a_second_watchdog_stands_by_at_once(
    tmp_path: Path, fake_psutil: FakePsutil
) -> None:
    rig = Rig(tmp_path, fake_psutil, Mode.ENFORCE)
    the_0_11_tree(rig)
    root = rig.snapshot().root
    assert root is not None

    async def scenario() -> tuple[LockStatus, LockStatus, Incident, LockStatus]:
        async with aiohttp.ClientSession() as session:
            first, second = rig.policy(session), rig.policy(session)
            first.on_attach(root)
            second.on_attach(root)
            holding, standing_by = first.lock_status(), second.lock_status()
            task = second.on_report(report(), rig.snapshot)
            assert task is not None
            observed = await task
            await first.close()
            second.on_attach(root)
            return holding, standing_by, observed, second.lock_status()

    holding, standing_by, observed, taken_over = asyncio.run(scenario())
    path = str(TargetLock(tmp_path / "locks").path_for(root))
    holder = f"held by another watchdog (pid {os.getpid()})"
    assert holding == LockStatus(True, "", path)
    assert standing_by == LockStatus(False, holder, path)
    assert observed.mode is Mode.OBSERVE and f"no target lock ({holder})" in observed.cause
    assert fake_psutil.signals == []
    assert taken_over == LockStatus(True, "", path)


def test_the_lock_outlives_the_incident_and_follows_the_attached_server(
    tmp_path: Path, fake_psutil: FakePsutil
) -> None:
    rig = Rig(tmp_path, fake_psutil, Mode.ENFORCE)
    the_0_11_tree(rig)
    root, next_root = rig.snapshot().root, ProcessIdentity(200, 300.0)
    assert root is not None
    probe = TargetLock(tmp_path / "locks")

    async def scenario() -> tuple[bool, bool, bool]:
        async with aiohttp.ClientSession() as session:
            policy = rig.policy(session)
            policy.on_attach(root)
            task = policy.on_report(report(), rig.snapshot)
            assert task is not None
            await task
            after_incident = probe.acquire(root)
            policy.on_attach(next_root)
            after_reattach = probe.acquire(root)
            probe.release()
            next_taken = probe.acquire(next_root)
            probe.release()
            await policy.close()
            return after_incident, after_reattach, next_taken

    assert asyncio.run(scenario()) == (False, True, False)


def test_an_attach_during_a_climb_takes_its_lock_when_the_climb_ends(
    tmp_path: Path, fake_psutil: FakePsutil
) -> None:
    rig = Rig(tmp_path, fake_psutil, Mode.ENFORCE)
    the_0_11_tree(rig, ignores={TERM})
    root, next_root = rig.snapshot().root, ProcessIdentity(200, 300.0)
    assert root is not None
    locks = TargetLock(tmp_path / "locks")

    async def scenario() -> tuple[LockStatus, LockStatus]:
        async with aiohttp.ClientSession() as session:
            policy = rig.policy(session)
            policy.on_attach(root)
            task = policy.on_report(report(), rig.snapshot)
            assert task is not None
            # The server restarted while the ladder still acts on the old one's processes.
            policy.on_attach(next_root)
            during = policy.lock_status()
            await task
            return during, policy.lock_status()

    during, after = asyncio.run(scenario())
    assert during == LockStatus(True, "", str(locks.path_for(root)))
    assert after == LockStatus(True, "", str(locks.path_for(next_root)))


def test_close_stops_the_climb_for_the_next_watchdog_and_releases_the_lock(
    tmp_path: Path, fake_psutil: FakePsutil
) -> None:
    rig = Rig(tmp_path, fake_psutil, Mode.ENFORCE)
    the_0_11_tree(rig)
    root = rig.snapshot().root
    assert root is not None

    async def scenario() -> tuple[bool, Incident, LockStatus]:
        capturing = asyncio.Event()

        async def endless_capture(incident: Incident, snapshot: TargetSnapshot) -> StepResult:
            capturing.set()
            await asyncio.Event().wait()
            raise AssertionError("never set")

        rig.capture = endless_capture  # type: ignore[method-assign]
        async with aiohttp.ClientSession() as session:
            policy = rig.policy(session)
            policy.on_attach(root)
            task = policy.on_report(report(), rig.snapshot)
            assert task is not None
            await capturing.wait()
            await policy.close()
            return task.cancelled(), policy.incidents()[0], policy.lock_status()

    cancelled, incident, status = asyncio.run(scenario())
    assert cancelled and incident.outcome is IncidentOutcome.OPEN
    assert status == LockStatus(False, "", None)
    assert TargetLock(tmp_path / "locks").acquire(root)
    (entry,) = IncidentJournal(tmp_path / "journal.jsonl", StateWriteErrors()).replay()
    assert entry.incident.outcome is IncidentOutcome.OPEN, "the next watchdog resumes it"
    assert fake_psutil.signals == []


@pytest.mark.parametrize(
    ("code", "message"),
    [
        (errno.ENOSPC, "No space left on device"),
        (errno.EROFS, "Read-only file system"),
        (errno.EACCES, "Permission denied"),
        (errno.EIO, "Input/output error"),
    ],
)
def test_a_failing_disk_never_holds_the_ladder_back(
    tmp_path: Path, fake_psutil: FakePsutil, policy_events: Any, code: int, message: str
) -> None:
    rig = Rig(tmp_path, fake_psutil, Mode.ENFORCE)
    the_0_11_tree(rig)

    def failing_disk(path: Path, data: bytes) -> None:
        raise OSError(code, message, str(path))

    rig.disk = failing_disk

    async def scenario() -> tuple[Incident, list[Incident]]:
        async with aiohttp.ClientSession() as session:
            policy = rig.policy(session)
            task = policy.on_report(report(), rig.snapshot)
            assert task is not None
            return await task, policy.incidents()

    incident, in_memory = asyncio.run(scenario())
    assert incident.outcome is IncidentOutcome.RECOVERED_BY_TERM
    assert [s.step for s in incident.steps] == [
        StepName.CAPTURE,
        StepName.SHUTDOWN,
        StepName.TERMINATE,
        StepName.VERIFY,
    ]
    assert fake_psutil.signals == [("killpg", 100, TERM)]
    assert in_memory == [incident] and incident.closed is not None
    # Opened, each step, closed: every record fails in the journal and in the bundle alike.
    assert rig.write_errors.total == 2 * (len(incident.steps) + 2)
    assert message in rig.write_errors.last
    failures = policy_events.named("state_write_failed")
    assert sorted(f["writer"] for f in failures) == ["bundle", "journal"], "once each"
    assert all(message in f["error"] and f["path"] for f in failures)
    assert not (tmp_path / "journal.jsonl").exists()


@pytest.mark.parametrize(
    ("broken", "done_before"),
    [("read_gpu", [StepName.CAPTURE, StepName.SHUTDOWN, StepName.TERMINATE])],
)
def test_a_bug_in_the_climb_closes_the_incident_as_failed(
    tmp_path: Path, fake_psutil: FakePsutil, broken: str, done_before: list[StepName]
) -> None:
    rig = Rig(tmp_path, fake_psutil, Mode.ENFORCE)
    the_0_11_tree(rig)

    async def bug(*args: object) -> None:
        raise RuntimeError("boom")

    setattr(rig, broken, bug)

    async def scenario() -> tuple[Incident, bool]:
        async with aiohttp.ClientSession() as session:
            policy = rig.policy(session)
            task = policy.on_report(report(), rig.snapshot)
            assert task is not None
            incident = await task
            assert policy.incidents() == [incident]
            return incident, policy.busy

    incident, busy = asyncio.run(scenario())
    assert not busy
    assert incident.outcome is IncidentOutcome.FAILED
    assert incident.closed is not None and "closed" in incident.timeline
    assert incident.cause.endswith("; internal error in the ladder: RuntimeError: boom")
    assert [s.step for s in incident.steps] == done_before
    assert [(loop, str(error)) for loop, error in rig.internal_errors] == [("ladder", "boom")]
    (entry,) = IncidentJournal(tmp_path / "journal.jsonl", StateWriteErrors()).replay()
    assert entry.incident.outcome is IncidentOutcome.FAILED


def test_dry_run_prints_the_exact_plan_and_signals_nothing(
    tmp_path: Path, fake_psutil: FakePsutil
) -> None:
    rig = Rig(tmp_path, fake_psutil, Mode.DRY_RUN)
    the_0_11_tree(rig)
    incident = run_incident(rig)
    assert incident is not None and incident.outcome is IncidentOutcome.PLANNED
    assert fake_psutil.signals == []
    plan = {s.step: s for s in incident.steps}
    assert plan[StepName.SHUTDOWN].detail == "would POST http://127.0.0.1:1/admin/shutdown"
    assert "SIGTERM to process group(s) 100" in plan[StepName.TERMINATE].detail
    assert "101" in plan[StepName.KILL].detail and "103" in plan[StepName.KILL].detail
    assert all(s.outcome is StepOutcome.PLANNED for s in incident.steps[1:])


def test_observe_mode_records_without_acting(tmp_path: Path, fake_psutil: FakePsutil) -> None:
    rig = Rig(tmp_path, fake_psutil, Mode.OBSERVE)
    the_0_11_tree(rig)
    incident = run_incident(rig)
    assert incident is not None and incident.outcome is IncidentOutcome.OBSERVED
    assert fake_psutil.signals == [] and rig.captures == 1


def test_an_incident_records_the_monotonic_clock_beside_the_wall_clock_as_it_opens(
    tmp_path: Path, fake_psutil: FakePsutil
) -> None:
    """Verdict and evidence times are monotonic: with the reading taken at the opening in
    its journal line and its bundle, the report places them without guessing the clock."""
    rig = Rig(tmp_path, fake_psutil, Mode.OBSERVE)
    the_0_11_tree(rig)
    rig.clock.advance(2.5)  # the verdict (at 1000.0) came 2.5 s before the incident opened
    incident = run_incident(rig)
    assert incident is not None
    assert incident.opened_monotonic == 1002.5
    assert incident.opened == rig.clock.wall() - (rig.clock.monotonic() - 1002.5)
    assert incident.timeline["verdict"] == incident.opened - 2.5
    assert incident.timeline["first_evidence"] == incident.opened - 3.5
    (entry,) = IncidentJournal(tmp_path / "journal.jsonl", StateWriteErrors()).replay()
    assert entry.incident.opened_monotonic == 1002.5
    bundle = tmp_path / "incidents" / incident.incident_id / "incident.json"
    assert json.loads(bundle.read_text())["opened_monotonic"] == 1002.5


def test_an_incident_journaled_without_the_monotonic_reading_replays_without_one(
    tmp_path: Path,
) -> None:
    """A line an older watchdog wrote: resumed as it was, its verdict times left unplaced."""
    line = {
        "incident": {
            "incident_id": "20260101T000000Z-abcdef",
            "target": "http://127.0.0.1:8000",
            "mode": "enforce",
            "opened": 1_700_001_000.0,
            "cause": "stage 1.0 dead",
        },
        "root": [100, 100.0],
        "processes": [],
        "pgids": [100],
    }
    (tmp_path / "journal.jsonl").write_text(json.dumps(line) + "\n")
    (entry,) = IncidentJournal(tmp_path / "journal.jsonl", StateWriteErrors()).replay()
    assert entry.incident.opened_monotonic is None
    assert entry.incident.outcome is IncidentOutcome.OPEN


@pytest.mark.parametrize("mode", [Mode.OBSERVE, Mode.DRY_RUN])
def test_incidents_that_act_on_nothing_are_bounded_per_hour(
    tmp_path: Path, fake_psutil: FakePsutil, mode: Mode
) -> None:
    """A stage that flaps in observe mode makes a verdict a minute: each would capture
    stacks into a bundle. Past the hour's bound a verdict opens nothing and is counted,
    also after a restart; the next hour records again."""
    rig = Rig(tmp_path, fake_psutil, mode, records=2)
    the_0_11_tree(rig)

    async def flaps(policy: Policy, verdicts: int) -> int:
        opened = 0
        for _ in range(verdicts):
            task = policy.on_report(report(), rig.snapshot)
            if task is not None:
                opened += 1
                await task
            rig.clock.advance(60)
        return opened

    async def scenario() -> tuple[int, int, int, int]:
        async with aiohttp.ClientSession() as session:
            policy = rig.policy(session)
            opened = await flaps(policy, 5)
            exhausted = policy.records_exhausted_total
            restarted = rig.policy(session)  # the journal's incidents count
            reopened = await flaps(restarted, 1)
            rig.clock.advance(3600)
            return opened, exhausted, reopened, await flaps(restarted, 1)

    opened, exhausted, after_restart, next_hour = asyncio.run(scenario())
    assert (opened, exhausted, after_restart, next_hour) == (2, 3, 0, 1)
    assert rig.captures == 3 and fake_psutil.signals == []


@pytest.mark.parametrize("steps", [["capture", "verify"], ["kill", "verify"]])
def test_the_ladder_is_data(steps: list[str]) -> None:
    ladder = ladder_from_config(LadderConfig(steps=steps))
    assert [s.name.value for s in ladder] == steps


def test_gpu_baseline_is_per_device() -> None:
    ours = (info(10, 10, ProcessRole.ENGINE),)
    reading = gpu_reading({0: 5e9, 1: 9e9}, {(0, 99): 5e9, (1, 10): 8e9, (1, 99): 1e9})
    assert gpu_baseline(reading, ours) == {0: 5e9, 1: 1e9}
    assert reading.used_by_pid == {99: 6e9, 10: 8e9}


@pytest.mark.parametrize(("mode", "incidents"), [(Mode.OBSERVE, 2), (Mode.ENFORCE, 1)])
def test_a_server_acted_on_is_not_acted_on_again(
    tmp_path: Path, fake_psutil: FakePsutil, mode: Mode, incidents: int
) -> None:
    rig = Rig(tmp_path, fake_psutil, mode)
    the_0_11_tree(rig)

    async def scenario() -> int:
        async with aiohttp.ClientSession() as session:
            policy = rig.policy(session)
            for _ in range(2):
                task = policy.on_report(report(), rig.snapshot)
                if task is not None:
                    await task
            return len(policy.incidents())

    assert asyncio.run(scenario()) == incidents


@pytest.mark.parametrize(
    ("leftover", "outcome"),
    [(False, IncidentOutcome.CRASHED), (True, IncidentOutcome.RECOVERED_BY_TERM)],
)
def test_a_server_that_answers_503_and_exits_by_itself_crashed(
    tmp_path: Path, fake_psutil: FakePsutil, leftover: bool, outcome: IncidentOutcome
) -> None:
    rig = Rig(tmp_path, fake_psutil, Mode.ENFORCE)
    the_0_11_tree(rig)
    exiting = [100, 101, 103] + ([] if leftover else [102])
    tick = rig.clock.sleep

    async def server_exits_after_a_moment(seconds: float) -> None:
        await tick(seconds)
        if rig.clock.monotonic() > 1001.0:
            for pid in exiting:
                fake_psutil.table.pop(pid, None)

    rig.clock.sleep = server_exits_after_a_moment  # type: ignore[method-assign]
    original = rig.snapshot
    rig.snapshot = lambda: dataclasses.replace(original(), server_reports_failure=True)  # type: ignore[method-assign]
    incident = run_incident(rig)
    assert incident is not None and incident.outcome is outcome
    assert incident.crashed and "the server crashed" in incident.cause
    assert step_detail(incident, StepName.SHUTDOWN).startswith("the server exited by itself")
    assert ("killpg", 100, TERM) not in fake_psutil.signals or leftover


@pytest.mark.parametrize(
    ("engine_title", "waited"),
    [
        # vLLM and vLLM-Omni 0.11 exit by themselves seconds after their engine dies.
        ("VLLM::EngineCore", LadderConfig().self_exit_grace),
        # vLLM-Omni 0.30 answers 503 after a stage death for good: nothing to wait for.
        ("VLLM::StageEngineCoreProc_stage1_replica0", 0.0),
    ],
)
def test_only_a_server_that_can_exit_by_itself_is_given_time_to(
    tmp_path: Path, fake_psutil: FakePsutil, engine_title: str, waited: float
) -> None:
    rig = Rig(tmp_path, fake_psutil, Mode.ENFORCE)
    the_0_11_tree(rig)
    rig.processes[-1] = dataclasses.replace(rig.processes[-1], title=engine_title)
    tracker = cast(ProcessTracker, SimpleNamespace(recorded=lambda: tuple(rig.processes)))
    target = TargetWatch(
        "http://127.0.0.1:1",
        tracker,
        None,
        fake_psutil,
        fake_psutil.start_time,
        by_process=True,
        on_gpu_failure=lambda reason: None,
    )
    target.observe([Observation(ObservationKind.HEALTH, 999.0, outcome=HealthOutcome.UNHEALTHY)])
    rig.snapshot = target.snapshot  # type: ignore[method-assign]
    incident = run_incident(rig)
    assert incident is not None and incident.outcome is IncidentOutcome.RECOVERED_BY_TERM
    shutdown = next(s for s in incident.steps if s.step is StepName.SHUTDOWN)
    # The request itself is refused at once: the step lasts what was waited before it.
    assert shutdown.outcome is StepOutcome.UNREACHABLE
    assert shutdown.duration == pytest.approx(waited, abs=0.5)


def step_detail(incident: Incident, name: StepName) -> str:
    return next(s.detail for s in incident.steps if s.step is name)


@pytest.mark.parametrize(
    ("accepts", "port_closes", "outcome", "verified"),
    [
        (True, True, IncidentOutcome.RECOVERED_BY_SHUTDOWN, StepOutcome.OK),
        (True, False, IncidentOutcome.FAILED, StepOutcome.FAILED),
        (False, False, IncidentOutcome.FAILED, StepOutcome.FAILED),
        # Refused, yet gone: nothing the watchdog did stopped it.
        (False, True, IncidentOutcome.CRASHED, StepOutcome.OK),
    ],
)
def test_without_the_pid_namespace_the_admin_endpoint_is_the_only_lever(
    tmp_path: Path,
    fake_psutil: FakePsutil,
    accepts: bool,
    port_closes: bool,
    outcome: IncidentOutcome,
    verified: StepOutcome,
) -> None:
    from aiohttp import web

    rig = Rig(tmp_path, fake_psutil, Mode.ENFORCE)
    blind = TargetSnapshot("http://127.0.0.1:1", None, (), None)

    async def scenario() -> Incident:
        calls: list[str] = []

        async def shutdown(request: web.Request) -> web.Response:
            calls.append(request.headers.get("Authorization", ""))
            return web.Response(status=202 if accepts else 401)

        app = web.Application()
        app.router.add_post("/admin/shutdown", shutdown)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            async with aiohttp.ClientSession() as session:
                policy = rig.policy(
                    session,
                    admin_url=f"http://127.0.0.1:{port}/admin/shutdown",
                    server_gone=port_closes,
                )
                task = policy.on_report(report(), lambda: blind)
                assert task is not None
                incident = await task
        finally:
            await runner.cleanup()
        assert calls == ["Bearer token"]
        return incident

    incident = asyncio.run(scenario())
    assert incident.outcome is outcome
    verify = next(s for s in incident.steps if s.step is StepName.VERIFY)
    assert verify.outcome is verified
    assert "not visible from here" in verify.detail
    assert "released" not in incident.timeline, "no memory was seen coming back"
    assert fake_psutil.signals == []


def test_a_remote_stage_s_verdict_is_never_acted_on(
    tmp_path: Path, fake_psutil: FakePsutil, policy_events: Any
) -> None:
    """Another host's watchdog acts on its own stage: this one logs it and opens nothing,
    whatever its mode, and signals nothing."""
    rig = Rig(tmp_path, fake_psutil, Mode.ENFORCE)
    the_0_11_tree(rig)
    remote = dataclasses.replace(VERDICT, remote=True)

    async def scenario() -> asyncio.Task[Incident] | None:
        async with aiohttp.ClientSession() as session:
            policy = rig.policy(session)
            task = policy.on_report(report(verdicts=(remote,)), rig.snapshot)
            assert policy.incidents() == []
            return task

    assert asyncio.run(scenario()) is None
    assert fake_psutil.signals == []
    (event,) = policy_events.named("remote_stage_judged")
    assert event["stage"] == "1.0" and event["state"] == "dead"


def test_a_verdict_on_the_whole_pipeline_is_acted_on_like_a_stage_s(
    tmp_path: Path, fake_psutil: FakePsutil
) -> None:
    """Without the plugin a failing canary may prove no stage: the target is judged as a
    whole, and the ladder, which ends the whole server anyway, ends it as for a stage."""
    rig = Rig(tmp_path, fake_psutil, Mode.ENFORCE)
    the_0_11_tree(rig)
    canary = Evidence(EvidenceKind.CANARY_FAILED, PIPELINE, 990.0, "canary timeout")
    verdict = Verdict(PIPELINE, StageState.STALLED, 1000.0, (canary,))

    async def scenario() -> Incident | None:
        async with aiohttp.ClientSession() as session:
            policy = rig.policy(session)
            task = policy.on_report(report(verdicts=(verdict,)), rig.snapshot)
            return None if task is None else await task

    incident = asyncio.run(scenario())
    assert incident is not None and incident.cause == "target stalled, stage unknown"
    assert incident.outcome is IncidentOutcome.RECOVERED_BY_TERM
    assert fake_psutil.signals == [("killpg", 100, TERM)]
    # The journal keeps it as the pipeline's, for a restarted watchdog and the report.
    entries = IncidentJournal(tmp_path / "journal.jsonl", StateWriteErrors()).replay()
    assert [e.incident.verdicts[0].stage for e in entries] == [PIPELINE]
