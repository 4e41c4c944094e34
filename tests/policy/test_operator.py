"""The operator's hand on the policy: remediate now, approve a plan, hold for maintenance.

Fake processes and clock, as in test_policy; the ladder runs through the same guards.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest
from fakes import FakePsutil
from policy.test_policy import KILL, TERM, VERDICT, Rig, report, the_0_11_tree

from omni_watchdog.clock import FakeClock
from omni_watchdog.policy.core import ActionRefused, Policy
from omni_watchdog.policy.incidents import IncidentJournal, StateWriteErrors
from omni_watchdog.policy.maintenance import MaintenanceWindow
from omni_watchdog.types import (
    DetectorReport,
    Incident,
    IncidentOutcome,
    MaintenancePause,
    Mode,
    OperatorAction,
    ProcessIdentity,
    ProcessStatus,
    StageState,
    StageStatus,
    StepName,
    StepOutcome,
    StepResult,
    TargetSnapshot,
)


def stage_report(state: StageState, verdict: bool = False) -> DetectorReport:
    """The stage of `VERDICT` in `state`, as an evaluation saw it, with the verdict."""
    status = StageStatus(VERDICT.stage, "talker", state, 1000.0, ())
    return DetectorReport(1001.0, True, (status,), (VERDICT,) if verdict else ())


async def opened(policy: Policy, evaluation: DetectorReport, rig: Rig) -> Incident:
    task = policy.on_report(evaluation, rig.snapshot)
    assert task is not None
    return await task


async def until(condition: Callable[[], bool]) -> None:
    """Let the climb run until `condition()` holds; it only waits on the fake clock."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the climb never got there")


async def held_by_a_pause(policy: Policy, rig: Rig) -> asyncio.Task[Incident]:
    """A stall verdict on the attached server during a pause: its incident, once held."""
    policy.on_attach(rig.snapshot().root)
    policy.window.pause(600, "driver upgrade")
    task = policy.on_report(stage_report(StageState.STALLED, True), rig.snapshot)
    assert task is not None
    await until(lambda: any("held" in i.timeline for i in policy.incidents()))
    return task


def test_an_approved_dry_run_plan_runs_for_real(tmp_path: Path, fake_psutil: FakePsutil) -> None:
    rig = Rig(tmp_path, fake_psutil, Mode.DRY_RUN)
    the_0_11_tree(rig)

    async def scenario() -> tuple[Incident, Incident]:
        async with aiohttp.ClientSession() as session:
            policy = rig.policy(session)
            planned = await opened(policy, report(), rig)
            assert fake_psutil.signals == []
            approved = await policy.remediate_now(planned.incident_id, None, rig.snapshot())
            await policy.wait_idle()
            done = policy.incident(approved.incident_id)
            assert done is not None
            return planned, done

    planned, done = asyncio.run(scenario())
    assert planned.outcome is IncidentOutcome.PLANNED
    assert done.mode is Mode.ENFORCE and done.outcome is IncidentOutcome.RECOVERED_BY_TERM
    assert done.verdicts == planned.verdicts
    assert f"approving incident {planned.incident_id}" in done.cause
    assert fake_psutil.signals == [("killpg", 100, TERM)]


@pytest.mark.parametrize(
    ("mode", "outcome"),
    [(Mode.DRY_RUN, IncidentOutcome.PLANNED), (Mode.OBSERVE, IncidentOutcome.OBSERVED)],
)
def test_an_operators_ladder_cuts_short_an_incident_that_acts_on_nothing(
    tmp_path: Path, fake_psutil: FakePsutil, mode: Mode, outcome: IncidentOutcome
) -> None:
    """The stage stalled again while on-call approved the first plan: the second plan is
    still capturing. Refusing the approval for it would make on-call race the detector."""
    rig = Rig(tmp_path, fake_psutil, mode)
    the_0_11_tree(rig)
    captures_started: list[str] = []
    taken = rig.capture

    async def capture(incident: Incident, snapshot: TargetSnapshot) -> StepResult:
        captures_started.append(incident.incident_id)
        if len(captures_started) == 2:
            await asyncio.Event().wait()  # the second plan's capture never ends by itself
        return await taken(incident, snapshot)

    rig.capture = capture  # type: ignore[method-assign]

    async def scenario() -> tuple[Incident, Incident, Incident]:
        async with aiohttp.ClientSession() as session:
            policy = rig.policy(session)
            planned = await opened(policy, report(), rig)
            again = policy.on_report(report(), rig.snapshot)
            assert again is not None
            await until(lambda: len(captures_started) == 2)
            approving = policy.remediate_now(planned.incident_id, None, rig.snapshot())
            approval = asyncio.ensure_future(approving)
            await asyncio.sleep(0)
            # A second approval while the first takes over is refused, naming the first.
            with pytest.raises(ActionRefused, match="a ladder is running now") as second:
                await policy.remediate_now(planned.incident_id, None, rig.snapshot())
            await until(again.done)
            # While the operator's ladder takes over, no automatic incident opens.
            assert policy.on_report(report(), rig.snapshot) is None
            started = await approval
            await policy.wait_idle()
            cut, done = (policy.incident(i.incident_id) for i in (await again, started))
            assert cut is not None and done is not None
            assert done.incident_id in second.value.reason
            return planned, cut, done

    planned, cut, done = asyncio.run(scenario())
    assert planned.outcome is outcome
    assert cut.outcome is outcome and cut.closed is not None and cut.steps == ()
    assert f"cut short: the operator's incident {done.incident_id} runs the ladder" in cut.cause
    assert done.outcome is IncidentOutcome.RECOVERED_BY_TERM
    assert f"approving incident {planned.incident_id}" in done.cause
    assert fake_psutil.signals == [("killpg", 100, TERM)]
    replayed = IncidentJournal(tmp_path / "journal.jsonl", StateWriteErrors()).replay()
    journaled = {e.incident.incident_id: e.incident for e in replayed}
    assert journaled[cut.incident_id].outcome is outcome
    assert all(i.outcome is not IncidentOutcome.OPEN for i in journaled.values())


def test_from_a_step_skips_the_ones_before_it_but_never_the_capture(
    tmp_path: Path, fake_psutil: FakePsutil
) -> None:
    rig = Rig(tmp_path, fake_psutil, Mode.OBSERVE)
    the_0_11_tree(rig)

    async def scenario() -> Incident:
        async with aiohttp.ClientSession() as session:
            policy = rig.policy(session)
            assert policy.planned_steps("kill") == (
                StepName.CAPTURE,
                StepName.KILL,
                StepName.VERIFY,
            )
            started = await policy.remediate_now(None, StepName.KILL, rig.snapshot())
            await policy.wait_idle()
            done = policy.incident(started.incident_id)
            assert done is not None
            return done

    done = asyncio.run(scenario())
    outcomes = {s.step: s.outcome for s in done.steps}
    assert outcomes[StepName.SHUTDOWN] is outcomes[StepName.TERMINATE] is StepOutcome.SKIPPED
    skipped = next(s for s in done.steps if s.step is StepName.SHUTDOWN)
    assert skipped.detail == "the operator started at kill"
    assert done.cause == "run by the operator from kill"
    assert outcomes[StepName.CAPTURE] is StepOutcome.OK and rig.captures == 1
    assert done.outcome is IncidentOutcome.RECOVERED_BY_KILL
    assert ("killpg", 100, KILL) in fake_psutil.signals
    assert ("killpg", 100, TERM) not in fake_psutil.signals


@pytest.mark.parametrize(
    ("case", "status", "reason"),
    [
        ("unknown incident", 404, "no incident nope"),
        ("no server", 409, "no server is attached"),
        ("the server gone", 409, "no server is attached"),
        ("another server", 409, "was about another server"),
        ("busy", 409, "a ladder is running now"),
        ("lock held", 409, "no target lock"),
    ],
)
def test_an_operator_action_is_refused_with_its_reason(
    tmp_path: Path, fake_psutil: FakePsutil, case: str, status: int, reason: str
) -> None:
    rig = Rig(tmp_path, fake_psutil, Mode.DRY_RUN)
    the_0_11_tree(rig)

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            policy = rig.policy(session)
            planned = await opened(policy, report(), rig)
            target = rig.snapshot()
            incident_id: str | None = None
            if case == "unknown incident":
                incident_id = "nope"
            elif case == "no server":
                target = TargetSnapshot(target.target, None, (), None)
            elif case == "the server gone":
                # Its processes are still recorded, every one exited: nothing to act on.
                gone = tuple(
                    dataclasses.replace(p, status=ProcessStatus.EXITED) for p in target.processes
                )
                target = TargetSnapshot(target.target, target.root, gone, None)
            elif case == "another server":
                incident_id = planned.incident_id
                other = ProcessIdentity(4242, 1.0)
                target = TargetSnapshot(target.target, other, target.processes, None)
            elif case == "busy":
                await policy.remediate_now(None, None, target)
            elif case == "lock held":
                # Another watchdog in enforce mode holds the target's lock from attach on.
                holder = Rig(tmp_path, fake_psutil, Mode.ENFORCE).policy(session)
                holder.on_attach(target.root)
            with pytest.raises(ActionRefused) as refused:
                await policy.remediate_now(incident_id, None, target)
            assert refused.value.status == status
            assert reason in refused.value.reason
            await policy.wait_idle()

    asyncio.run(scenario())


def test_a_pause_holds_an_incident_before_its_first_acting_step_and_resume_lets_it_act(
    tmp_path: Path, fake_psutil: FakePsutil
) -> None:
    rig = Rig(tmp_path, fake_psutil, Mode.ENFORCE)
    the_0_11_tree(rig)

    async def scenario() -> Incident:
        async with aiohttp.ClientSession() as session:
            policy = rig.policy(session)
            task = await held_by_a_pause(policy, rig)
            (incident,) = policy.incidents()
            assert [s.step for s in incident.steps] == [StepName.CAPTURE]
            assert "held by a maintenance pause" in incident.cause
            assert fake_psutil.signals == [] and not task.done()
            policy.window.resume()
            return await task

    done = asyncio.run(scenario())
    assert done.outcome is IncidentOutcome.RECOVERED_BY_TERM
    assert {"held", "unheld"} <= set(done.timeline)
    assert fake_psutil.signals == [("killpg", 100, TERM)]


@pytest.mark.parametrize(
    ("meanwhile", "why"),
    [
        ("recovered", "the stage recovered"),
        ("replaced", "another server is attached"),
    ],
)
def test_after_a_pause_an_incident_that_is_no_longer_needed_does_nothing(
    tmp_path: Path, fake_psutil: FakePsutil, meanwhile: str, why: str
) -> None:
    rig = Rig(tmp_path, fake_psutil, Mode.ENFORCE)
    the_0_11_tree(rig)

    async def scenario() -> Incident:
        async with aiohttp.ClientSession() as session:
            policy = rig.policy(session)
            task = await held_by_a_pause(policy, rig)
            if meanwhile == "recovered":
                policy.on_report(stage_report(StageState.HEALTHY), rig.snapshot)
            else:
                policy.on_attach(ProcessIdentity(4242, 1.0))
            policy.window.resume()
            return await task

    done = asyncio.run(scenario())
    assert done.mode is Mode.OBSERVE and done.outcome is IncidentOutcome.OBSERVED
    assert f"after the pause {why}: nothing done" in done.cause
    assert fake_psutil.signals == []


def test_an_operators_own_ladder_is_not_held_by_a_pause(
    tmp_path: Path, fake_psutil: FakePsutil
) -> None:
    rig = Rig(tmp_path, fake_psutil, Mode.ENFORCE)
    the_0_11_tree(rig)

    async def scenario() -> Incident | None:
        async with aiohttp.ClientSession() as session:
            policy = rig.policy(session)
            policy.window.pause(600, "maintenance")
            started = await policy.remediate_now(None, None, rig.snapshot())
            await policy.wait_idle()
            return policy.incident(started.incident_id)

    done = asyncio.run(scenario())
    assert done is not None and done.outcome is IncidentOutcome.RECOVERED_BY_TERM


def test_an_operators_ladder_takes_over_from_an_incident_held_by_a_pause(
    tmp_path: Path, fake_psutil: FakePsutil
) -> None:
    """The held incident acts on nothing until the pause ends: the operator, who is not
    held, is not refused because of it (it was: 409, "a ladder is running now")."""
    rig = Rig(tmp_path, fake_psutil, Mode.ENFORCE)
    the_0_11_tree(rig)

    async def scenario() -> tuple[Incident, Incident | None]:
        async with aiohttp.ClientSession() as session:
            policy = rig.policy(session)
            task = await held_by_a_pause(policy, rig)
            started = await policy.remediate_now(None, None, rig.snapshot())
            held = await task
            await policy.wait_idle()
            return held, policy.incident(started.incident_id)

    held, done = asyncio.run(scenario())
    assert "cut short: the operator's incident" in held.cause, held.cause
    assert held.closed is not None and "unheld" not in held.timeline
    assert done is not None and done.outcome is IncidentOutcome.RECOVERED_BY_TERM
    assert fake_psutil.signals == [("killpg", 100, TERM)]


def test_a_window_ends_by_its_clock_and_a_new_pause_replaces_the_old() -> None:
    clock = FakeClock()
    window = MaintenanceWindow(clock)
    first = window.pause(60, "one")
    assert window.current() == first
    second = window.pause(120, "two")
    assert window.current() == second
    clock.advance(121)
    assert window.current() is None
    for seconds, reason in ((0, "x"), (-1, "x"), (24 * 3600 + 1, "x"), (60, " "), (60, "y" * 501)):
        with pytest.raises(ValueError):
            window.pause(seconds, reason)


def test_a_restarted_watchdog_keeps_a_journaled_pause_until_its_end(
    tmp_path: Path, fake_psutil: FakePsutil
) -> None:
    rig = Rig(tmp_path, fake_psutil, Mode.ENFORCE)
    wall = rig.clock.wall()
    journal = IncidentJournal(tmp_path / "journal.jsonl", StateWriteErrors())
    pause = MaintenancePause(wall - 10, wall + 300, "driver upgrade")
    journal.record_action(OperatorAction(wall - 10, "pause", "accepted", None, "", pause))
    journal.record_action(OperatorAction(wall - 5, "resume", "unauthorized", None, ""))

    async def scenario() -> tuple[MaintenancePause | None, MaintenancePause | None]:
        async with aiohttp.ClientSession() as session:
            kept = rig.policy(session).window.current()
            journal.record_action(OperatorAction(wall, "resume", "accepted", None, ""))
            ended = rig.policy(session).window.current()
            return kept, ended

    kept, ended = asyncio.run(scenario())
    assert kept == pause
    assert ended is None
