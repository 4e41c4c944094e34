"""The policy: which verdicts and exits become incidents, and under which safety rules.

One incident at a time; nothing before warm-up ends; an hourly budget of enforced
incidents; a lock per target, held from attachment on, so two watchdogs never both act;
and a journal so a restarted watchdog resumes an open incident instead of starting it
again. Neither a disk fault nor a bug in the climb leaves an incident open.

An operator can run the ladder now (`remediate_now`), through the same guards, and hold
automatic actions for a while (a maintenance pause): a held incident captures its
evidence, waits before its first acting step, and acts after the pause only if its
server is still the attached one and still needs it. An operator's ladder cuts short an
incident that acts on nothing (observe, dry-run): it would only capture what the
operator's own capture takes again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence

from omni_watchdog.log import log_event
from omni_watchdog.policy.activity import ACTIVITY_FILE, activity_document
from omni_watchdog.policy.incidents import (
    BundleWriter,
    HourlyBudget,
    IncidentJournal,
    TargetLock,
)
from omni_watchdog.policy.ladder import LadderRunner
from omni_watchdog.policy.maintenance import MaintenanceWindow
from omni_watchdog.tasks import end_tasks
from omni_watchdog.types import (
    Clock,
    DetectorReport,
    Incident,
    IncidentOutcome,
    JournalEntry,
    LockStatus,
    Mode,
    ProcessIdentity,
    ProcessReadings,
    ProcessStatus,
    StageRef,
    StageState,
    StepName,
    StepOutcome,
    StepResult,
    TargetExit,
    TargetSnapshot,
    Verdict,
)

logger = logging.getLogger("omni_watchdog.policy")

# How long `close` waits for a cancelled climb to end.
CLOSE_PATIENCE = 5.0


class ActionRefused(Exception):
    """An operator action the policy will not take now, with the HTTP status that says why."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def new_incident_id(wall: float) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(wall)) + "-" + secrets.token_hex(3)


class Policy:
    """Turns verdicts and target exits into incidents and runs the ladder for them."""

    def __init__(
        self,
        mode: Mode,
        runner: LadderRunner,
        journal: IncidentJournal,
        budget: HourlyBudget,
        records: HourlyBudget,
        lock: TargetLock,
        bundles: BundleWriter,
        clock: Clock,
        alive: Callable[[ProcessIdentity], bool],
        on_internal_error: Callable[[str, Exception], None],
        window: MaintenanceWindow | None = None,
        activity_readings: Callable[[StageRef], Sequence[ProcessReadings]] = lambda stage: (),
    ) -> None:
        """`on_internal_error(loop, error)` logs with its traceback and counts a bug in the
        climb (loop "ladder"); the policy then closes the incident as failed.
        `activity_readings(stage)`: the detector's readings of a silent stage's processes,
        written into the bundle of a verdict that names its cause."""
        self.mode = mode
        self._runner = runner
        self._journal = journal
        self._budget = budget
        self._records = records
        self._lock = lock
        self._bundles = bundles
        self._clock = clock
        self._alive = alive
        self._on_internal_error = on_internal_error
        self._activity_readings = activity_readings
        self.window = window or MaintenanceWindow(clock)
        self._incidents: dict[str, Incident] = {}
        # The server each incident was about, to approve a plan only for that server.
        self._roots: dict[str, ProcessIdentity | None] = {}
        # Incidents an operator started: a pause does not hold them.
        self._by_operator: set[str] = set()
        # The operator's incident waiting for the running one, which acts on nothing, to be
        # cut short: the climb cancelled meanwhile closes as cut short for it.
        self._claimed_by: str | None = None
        self._latest: DetectorReport | None = None
        self._current: asyncio.Task[Incident] | None = None
        self._handled_roots: set[ProcessIdentity] = set()
        self._attached: ProcessIdentity | None = None
        self.budget_exhausted_total = 0
        self.records_exhausted_total = 0
        # Verdicts go unrecorded since the last recorded incident: logged once a spell.
        self._records_spell = False
        for entry in journal.replay():
            self._incidents[entry.incident.incident_id] = entry.incident
            self._roots[entry.incident.incident_id] = entry.root
            if entry.incident.mode is Mode.ENFORCE:
                budget.note(entry.incident.opened)
            else:
                records.note(entry.incident.opened)
        windows = [a for a in journal.actions() if a.outcome == "accepted"]
        windows = [a for a in windows if a.action in ("pause", "resume")]
        if windows and windows[-1].pause is not None:
            self.window.restore(windows[-1].pause)

    # ---- queries ------------------------------------------------------------------

    def incidents(self) -> list[Incident]:
        return sorted(self._incidents.values(), key=lambda i: i.opened)

    def incident(self, incident_id: str) -> Incident | None:
        return self._incidents.get(incident_id)

    @property
    def busy(self) -> bool:
        return self._claimed_by is not None or (
            self._current is not None and not self._current.done()
        )

    def budget_remaining(self) -> int:
        return self._budget.remaining(self._clock.wall())

    def lock_status(self) -> LockStatus:
        lock = self._lock
        return LockStatus(lock.held, lock.conflict, None if lock.path is None else str(lock.path))

    async def wait_idle(self) -> None:
        if self._current is not None:
            await asyncio.shield(self._current)

    # ---- life cycle ---------------------------------------------------------------

    def on_attach(self, root: ProcessIdentity | None) -> None:
        """A server was attached: in enforce mode hold its lock from now on, so that a
        second watchdog on it learns at once that it stands by."""
        self._attached = root
        # A running climb keeps its own target's lock; it takes this one when it ends.
        if self.mode is Mode.ENFORCE and not self.busy:
            self._hold_attached_lock()

    async def close(self, patience: float = CLOSE_PATIENCE) -> None:
        """Stop a running climb (the journal lets the next watchdog resume it) and release
        the target lock; a climb still running after `patience` seconds is logged and left
        to end with the process."""
        if self._current is not None and await end_tasks([self._current], patience):
            log_event(
                logger,
                "climb_not_stopped",
                logging.ERROR,
                climb=self._current.get_name(),
                patience=patience,
            )
        # What was recorded is on disk before the next watchdog replays it.
        if not await asyncio.to_thread(self._journal.close, patience):
            log_event(logger, "journal_not_flushed", logging.ERROR, patience=patience)
        self._lock.release()

    def _hold_attached_lock(self) -> None:
        if self._attached is None:
            self._lock.release()
        elif self._lock.acquire(self._attached):
            log_event(logger, "target_locked", pid=self._attached.pid, path=str(self._lock.path))
        else:
            log_event(
                logger,
                "standing_by",
                logging.WARNING,
                pid=self._attached.pid,
                conflict=self._lock.conflict,
            )

    # ---- decisions ----------------------------------------------------------------

    def on_report(
        self, report: DetectorReport, snapshot: Callable[[], TargetSnapshot]
    ) -> asyncio.Task[Incident] | None:
        """Open an incident for a new verdict or a bad exit, if the rules allow one now."""
        self._latest = report
        if self.busy:
            return None
        if report.target_exit is not None:
            return self._on_exit(report.target_exit, snapshot())
        for verdict in report.verdicts:
            if verdict.remote:
                # Another host's watchdog acts on its own stage; this one only says so.
                log_event(
                    logger,
                    "remote_stage_judged",
                    stage=str(verdict.stage),
                    state=verdict.state.value,
                    evidence=[e.detail for e in verdict.evidence],
                )
        verdicts = tuple(v for v in report.verdicts if not v.remote)
        if not verdicts or not report.warmed_up:
            return None
        target = snapshot()
        if target.root is not None and target.root in self._handled_roots:
            return None
        cause = "; ".join(v.describe() for v in verdicts)
        return self._open(cause, verdicts, target)

    def _on_exit(self, exit_: TargetExit, target: TargetSnapshot) -> asyncio.Task[Incident] | None:
        if exit_.root is not None and exit_.root in self._handled_roots:
            return None
        orphans = [p for p in target.processes if self._alive(p.identity)]
        if not exit_.crashed and not orphans:
            log_event(logger, "target_stopped", target=target.target, crashed=False)
            return None
        what = "crashed" if exit_.crashed else "exited"
        cause = f"server {what} by itself"
        if orphans:
            cause += f", leaving {len(orphans)} orphaned process(es)"
        if exit_.reasons:
            cause += ": " + "; ".join(exit_.reasons[-4:])
        return self._open(cause, (), target, crashed=exit_.crashed)

    def _open(
        self,
        cause: str,
        verdicts: tuple[Verdict, ...],
        target: TargetSnapshot,
        crashed: bool = False,
    ) -> asyncio.Task[Incident] | None:
        """The incident's climb, started; None when it would act on nothing and the hour's
        bound of such incidents is reached (each captures stacks into a bundle: a stage
        that flaps in observe mode would fill the disk)."""
        wall, monotonic = self._clock.wall(), self._clock.monotonic()
        mode = self.mode
        notes = []
        if mode is Mode.ENFORCE and self._budget.remaining(wall) <= 0:
            mode = Mode.OBSERVE
            self.budget_exhausted_total += 1
            notes.append("enforcement budget for this hour exhausted: observing only")
        if mode is Mode.ENFORCE and target.root is not None and not self._lock.acquire(target.root):
            mode = Mode.OBSERVE
            notes.append(f"no target lock ({self._lock.conflict}): observing only")
        if mode is Mode.ENFORCE:
            self._budget.note(wall)
            # A server the ladder acted on is not acted on again, nor is its exit a crash;
            # one that was only watched can have a later incident of its own.
            if target.root is not None:
                self._handled_roots.add(target.root)
        elif self._records.remaining(wall) <= 0:
            self.records_exhausted_total += 1
            if not self._records_spell:
                log_event(
                    logger,
                    "incident_not_recorded",
                    level=logging.WARNING,
                    mode=mode.value,
                    cause=cause,
                    reason="the hourly bound of incidents that act on nothing is reached",
                )
            self._records_spell = True
            return None
        else:
            self._records.note(wall)
            self._records_spell = False
        incident_id = new_incident_id(wall)
        timeline = {"opened": wall}
        if verdicts:
            # On the wall clock as the incident records the clocks' relation: its report
            # places every verdict and evidence time the same way.
            timeline["verdict"] = wall - (monotonic - min(v.time for v in verdicts))
            evidence = [e.since for v in verdicts for e in v.evidence]
            if evidence:
                timeline["first_evidence"] = wall - (monotonic - min(evidence))
        incident = Incident(
            incident_id=incident_id,
            target=target.target,
            mode=mode,
            opened=wall,
            cause="; ".join([cause, *notes]),
            verdicts=verdicts,
            bundle_dir=str(self._bundles.directory(incident_id)),
            timeline=timeline,
            crashed=crashed,
            opened_monotonic=monotonic,
        )
        log_event(logger, "incident_opened", id=incident_id, mode=mode.value, cause=incident.cause)
        # Now, from the evaluation that gave the verdicts: the detector forgets the
        # readings once the stage beats again, or is gone with its server.
        readings = activity_document(verdicts, self._activity_readings)
        if readings is not None:
            self._bundles.write_json(incident_id, ACTIVITY_FILE, readings)
        self._task_for(incident, target)
        assert self._current is not None
        return self._current

    # ---- the operator -------------------------------------------------------------

    def planned_steps(self, first: str | None) -> tuple[StepName, ...]:
        """The steps an operator's ladder runs: the capture, then from `first` on."""
        names = self._runner.step_names
        start = names.index(StepName(first)) if first is not None else 0
        return tuple(n for i, n in enumerate(names) if i >= start or n is StepName.CAPTURE)

    async def remediate_now(
        self, incident_id: str | None, first: StepName | None, target: TargetSnapshot
    ) -> Incident:
        """Run the ladder on the attached server now, in enforce mode whatever the
        watchdog's mode: an operator's explicit request, approving the plan of
        `incident_id` when given. An incident that acts on nothing (observe, dry-run),
        running meanwhile, is cut short and closed first. Refused (`ActionRefused`) while
        a ladder acts (an incident held by a pause does not), without a server, for an
        incident about another server, or without the target lock."""
        running = self._incidents.get(self.open_incident_id() or "") if self.busy else None
        # An incident held by a maintenance pause acts on nothing until the pause ends: the
        # operator's ladder is not held, so it takes over from that one too.
        acting = running is not None and running.mode is Mode.ENFORCE and not _held(running)
        if self._claimed_by is not None or acting:
            current = self._claimed_by or self.open_incident_id()
            raise ActionRefused(409, f"a ladder is running now (incident {current})")
        approved = None
        if incident_id is not None:
            approved = self._incidents.get(incident_id)
            if approved is None:
                raise ActionRefused(404, f"no incident {incident_id}")
        if target.root is None or all(p.status is ProcessStatus.EXITED for p in target.processes):
            # Gone, its processes still recorded: a ladder would only close as `crashed`.
            raise ActionRefused(409, "no server is attached: nothing to act on")
        if approved is not None and self._roots.get(approved.incident_id) != target.root:
            raise ActionRefused(
                409,
                f"incident {approved.incident_id} was about another server; the one attached"
                f" now (pid {target.root.pid}) is not the one its plan was made for",
            )
        if not self._lock.acquire(target.root):
            raise ActionRefused(409, f"no target lock ({self._lock.conflict})")
        wall, monotonic = self._clock.wall(), self._clock.monotonic()
        new_id = new_incident_id(wall)
        if running is not None:
            await self._cut_short(running.incident_id, new_id)
        # A climb that ends without enforcing gives the lock up: it is taken again.
        if not self._lock.acquire(target.root):
            raise ActionRefused(409, f"no target lock ({self._lock.conflict})")
        asked = "capture" if first is None else first.value
        steps = self.planned_steps(None if first is None else first.value)
        skipped = tuple(
            StepResult(name, StepOutcome.SKIPPED, wall, 0.0, f"the operator started at {asked}")
            for name in self._runner.step_names
            if name not in steps
        )
        how = f"run by the operator from {asked}" if first else "run by the operator"
        cause = f"{approved.cause}; {how}" if approved else how
        if approved is not None:
            cause += f", approving incident {approved.incident_id}"
        incident = Incident(
            incident_id=new_id,
            target=target.target,
            mode=Mode.ENFORCE,
            opened=wall,
            cause=cause,
            verdicts=approved.verdicts if approved else (),
            steps=skipped,
            bundle_dir=str(self._bundles.directory(new_id)),
            timeline={"opened": wall},
            opened_monotonic=monotonic,
        )
        self._by_operator.add(incident.incident_id)
        self._handled_roots.add(target.root)
        log_event(
            logger,
            "incident_opened",
            id=incident.incident_id,
            mode=incident.mode.value,
            cause=incident.cause,
            by="operator",
        )
        self._task_for(incident, target)
        return incident

    async def _cut_short(self, incident_id: str, by: str) -> None:
        """End the running climb of `incident_id`, which acts on nothing (observe, dry-run,
        or held by a pause), for the operator's incident `by`; no automatic incident opens
        meanwhile."""
        assert self._current is not None
        self._claimed_by = by
        try:
            left = await end_tasks([self._current], CLOSE_PATIENCE)
        finally:
            self._claimed_by = None
        if left:
            log_event(
                logger,
                "climb_not_stopped",
                logging.ERROR,
                climb=left[0].get_name(),
                patience=CLOSE_PATIENCE,
            )
            raise ActionRefused(409, f"a ladder is running now (incident {incident_id})")

    def open_incident_id(self) -> str | None:
        return next((i.incident_id for i in self.incidents() if i.closed is None), None)

    def _holds(self, incident: Incident) -> bool:
        """A maintenance pause is on, and `incident` is not one an operator started."""
        return self.window.current() is not None and incident.incident_id not in self._by_operator

    async def _hold(self, incident: Incident, target: TargetSnapshot) -> Incident:
        """Wait out a maintenance pause before the first acting step; after it, act only
        if the incident's server is still the attached one and still needs it."""
        pause = self.window.current()
        if pause is None or not self._holds(incident):
            return incident
        until = time.strftime("%H:%M:%SZ", time.gmtime(pause.until))
        incident = dataclasses.replace(
            incident,
            cause=f"{incident.cause}; held by a maintenance pause until {until}: {pause.reason}",
            timeline={**incident.timeline, "held": self._clock.wall()},
        )
        self._record(incident, target)
        log_event(logger, "incident_held", id=incident.incident_id, until=pause.until)
        await self.window.wait_until_over()
        timeline = {**incident.timeline, "unheld": self._clock.wall()}
        moot = self._moot(incident, target)
        if moot:
            log_event(logger, "incident_moot", id=incident.incident_id, reason=moot)
            return dataclasses.replace(
                incident,
                mode=Mode.OBSERVE,
                cause=f"{incident.cause}; after the pause {moot}: nothing done",
                timeline=timeline,
            )
        return dataclasses.replace(incident, timeline=timeline)

    def _moot(self, incident: Incident, target: TargetSnapshot) -> str:
        """Why acting after a pause would be wrong now, or "" when it is still needed."""
        # An exit's incident is about a server already gone: its orphans still need it.
        if incident.verdicts and target.root is not None and target.root != self._attached:
            return "another server is attached"
        # Without a process table in view (another pid namespace) there is nothing to count.
        if target.processes and not any(self._alive(p.identity) for p in target.processes):
            return "none of the server's processes is left"
        report = self._latest
        stages = {v.stage for v in incident.verdicts}
        if stages and report is not None:
            # The target as a whole (`PIPELINE`) stands beside the stages while no stage
            # answers for its failing /health or canary.
            standing = (*report.statuses, *(() if report.pipeline is None else (report.pipeline,)))
            bad = {
                s.stage
                for s in standing
                if s.state in (StageState.STALLED, StageState.DEAD)
                # A remote stage whose replica is missing may show only as unknown here.
                or (s.remote and s.state is StageState.UNKNOWN)
            }
            if not stages & bad:
                return "the stage recovered"
        return ""

    async def resume(
        self, snapshot_of: Callable[[JournalEntry], Awaitable[TargetSnapshot]]
    ) -> None:
        """Continue the journal's open incident, if any, from the step after its last.

        `snapshot_of` rebuilds what the incident acts on from the journal's entry: its
        processes adopted as recorded (the signal guard allows them) and its GPU baseline.
        """
        entry = next(
            (e for e in self._journal.replay() if e.incident.outcome is IncidentOutcome.OPEN),
            None,
        )
        if entry is None:
            return
        target = await snapshot_of(entry)
        incident = entry.incident
        if target.root is not None:
            self._handled_roots.add(target.root)
        if (
            incident.mode is Mode.ENFORCE
            and target.root is not None
            and not self._lock.acquire(target.root)
        ):
            note = f"no target lock on resuming ({self._lock.conflict}): observing only"
            incident = dataclasses.replace(
                incident, mode=Mode.OBSERVE, cause=f"{incident.cause}; {note}"
            )
        log_event(
            logger,
            "incident_resumed",
            id=incident.incident_id,
            mode=incident.mode.value,
            done=[s.step.value for s in incident.steps],
        )
        self._task_for(incident, target)

    def _task_for(self, incident: Incident, target: TargetSnapshot) -> None:
        self._record(incident, target)
        self._current = asyncio.get_running_loop().create_task(
            self._climb(incident, target), name=f"climb of incident {incident.incident_id}"
        )

    async def _climb(self, incident: Incident, target: TargetSnapshot) -> Incident:
        try:
            finished = await self._runner.run(
                incident,
                target,
                lambda step: self._record(step, target),
                lambda held: self._hold(held, target),
                self._holds,
            )
            verify = next((s for s in finished.steps if s.step is StepName.VERIFY), None)
            timeline = dict(finished.timeline)
            # Without a visible process verify saw a port close, not memory come back.
            if verify is not None and verify.outcome is StepOutcome.OK and target.processes:
                timeline["released"] = verify.started + verify.duration
            timeline["closed"] = finished.closed or self._clock.wall()
            finished = dataclasses.replace(finished, timeline=timeline)
        except asyncio.CancelledError:
            if self._claimed_by is None:
                raise
            finished = self._closed_for_operator(incident.incident_id, self._claimed_by)
        except Exception as error:  # a bug must not leave the incident open for ever
            finished = self._failed_internally(incident.incident_id, error)
        self._record(finished, target)
        log_event(
            logger,
            "incident_closed",
            id=finished.incident_id,
            outcome=finished.outcome.value,
            steps=[f"{s.step.value}:{s.outcome.value}" for s in finished.steps],
        )
        # The lock stays with the attached server; an incident about another one (the exit
        # of the previous server, a resumed one) borrowed it.
        if self.mode is Mode.ENFORCE and target.root != self._attached:
            self._hold_attached_lock()
        elif self.mode is not Mode.ENFORCE:
            # An operator's ladder borrowed it; a watchdog that does not enforce holds none.
            self._lock.release()
        return finished

    def _closed_for_operator(self, incident_id: str, by: str) -> Incident:
        """The incident as far as its climb got, cut short for the operator's `by`."""
        latest = self._incidents[incident_id]
        wall = self._clock.wall()
        return dataclasses.replace(
            latest,
            outcome=self._runner.outcome(latest, None),
            cause=f"{latest.cause}; cut short: the operator's incident {by} runs the ladder",
            closed=wall,
            timeline={**latest.timeline, "closed": wall},
        )

    def _failed_internally(self, incident_id: str, error: Exception) -> Incident:
        """The incident as far as the climb got, closed as failed."""
        self._on_internal_error("ladder", error)
        latest = self._incidents[incident_id]
        wall = self._clock.wall()
        return dataclasses.replace(
            latest,
            outcome=IncidentOutcome.FAILED,
            cause=f"{latest.cause}; internal error in the ladder: {type(error).__name__}: {error}",
            closed=wall,
            timeline={**latest.timeline, "closed": wall},
        )

    def _record(self, incident: Incident, target: TargetSnapshot) -> None:
        # Memory first: the journal and the bundle log and count a disk fault, never raise it.
        self._incidents[incident.incident_id] = incident
        self._roots[incident.incident_id] = target.root
        self._journal.record(
            incident, target.root, target.identities, target.pgids(), target.gpu_baseline
        )
        self._bundles.write_json(incident.incident_id, "incident.json", incident)


def _held(incident: Incident) -> bool:
    """Held by a maintenance pause now: it waits before its first acting step."""
    return "held" in incident.timeline and "unheld" not in incident.timeline
