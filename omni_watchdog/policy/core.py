"""The policy: which verdicts and exits become incidents, and under which safety rules.

One incident at a time; nothing before warm-up ends; an hourly budget of enforced
incidents; a lock per target, held from attachment on, so two watchdogs never both act;
and a journal so a restarted watchdog resumes an open incident instead of starting it
again. Neither a disk fault nor a bug in the climb leaves an incident open.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import Awaitable, Callable

from omni_watchdog.log import log_event
from omni_watchdog.policy.incidents import (
    BundleWriter,
    EnforcementBudget,
    IncidentJournal,
    JournalEntry,
    TargetLock,
)
from omni_watchdog.policy.ladder import LadderRunner, TargetSnapshot
from omni_watchdog.types import (
    Clock,
    DetectorReport,
    Incident,
    IncidentOutcome,
    LockStatus,
    Mode,
    ProcessIdentity,
    StepName,
    StepOutcome,
    TargetExit,
    Verdict,
)

logger = logging.getLogger("omni_watchdog.policy")


def new_incident_id(wall: float) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(wall)) + "-" + secrets.token_hex(3)


class Policy:
    """Turns verdicts and target exits into incidents and runs the ladder for them."""

    def __init__(
        self,
        mode: Mode,
        runner: LadderRunner,
        journal: IncidentJournal,
        budget: EnforcementBudget,
        lock: TargetLock,
        bundles: BundleWriter,
        clock: Clock,
        alive: Callable[[ProcessIdentity], bool],
        on_internal_error: Callable[[str, Exception], None],
    ) -> None:
        """`on_internal_error(loop, error)` logs with its traceback and counts a bug in the
        climb (loop "ladder"); the policy then closes the incident as failed."""
        self.mode = mode
        self._runner = runner
        self._journal = journal
        self._budget = budget
        self._lock = lock
        self._bundles = bundles
        self._clock = clock
        self._alive = alive
        self._on_internal_error = on_internal_error
        self._incidents: dict[str, Incident] = {}
        self._current: asyncio.Task[Incident] | None = None
        self._handled_roots: set[ProcessIdentity] = set()
        self._attached: ProcessIdentity | None = None
        self.budget_exhausted_total = 0
        for entry in journal.replay():
            self._incidents[entry.incident.incident_id] = entry.incident
            if entry.incident.mode is Mode.ENFORCE:
                budget.note(entry.incident.opened)

    # ---- queries ------------------------------------------------------------------

    def incidents(self) -> list[Incident]:
        return sorted(self._incidents.values(), key=lambda i: i.opened)

    def incident(self, incident_id: str) -> Incident | None:
        return self._incidents.get(incident_id)

    @property
    def busy(self) -> bool:
        return self._current is not None and not self._current.done()

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

    async def close(self) -> None:
        """Stop a running climb (the journal lets the next watchdog resume it) and release
        the target lock."""
        if self._current is not None and not self._current.done():
            self._current.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._current
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
        if self.busy:
            return None
        if report.target_exit is not None:
            return self._on_exit(report.target_exit, snapshot())
        verdicts = tuple(report.verdicts)
        if not verdicts or not report.warmed_up:
            return None
        target = snapshot()
        if target.root is not None and target.root in self._handled_roots:
            return None
        cause = "; ".join(f"stage {v.stage} {v.state.value}" for v in verdicts)
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
    ) -> asyncio.Task[Incident]:
        wall = self._clock.wall()
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
        incident_id = new_incident_id(wall)
        timeline = {"opened": wall}
        if verdicts:
            timeline["verdict"] = self._wall_of(min(v.time for v in verdicts))
            evidence = [e.since for v in verdicts for e in v.evidence]
            if evidence:
                timeline["first_evidence"] = self._wall_of(min(evidence))
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
        )
        log_event(logger, "incident_opened", id=incident_id, mode=mode.value, cause=incident.cause)
        self._task_for(incident, target)
        assert self._current is not None
        return self._current

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
        self._current = asyncio.get_running_loop().create_task(self._climb(incident, target))

    async def _climb(self, incident: Incident, target: TargetSnapshot) -> Incident:
        try:
            finished = await self._runner.run(
                incident, target, lambda step: self._record(step, target)
            )
            verify = next((s for s in finished.steps if s.step is StepName.VERIFY), None)
            timeline = dict(finished.timeline)
            # Without a visible process verify saw a port close, not memory come back.
            if verify is not None and verify.outcome is StepOutcome.OK and target.processes:
                timeline["released"] = verify.started + verify.duration
            timeline["closed"] = finished.closed or self._clock.wall()
            finished = dataclasses.replace(finished, timeline=timeline)
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
        return finished

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
        self._journal.record(
            incident, target.root, target.identities, target.pgids(), target.gpu_baseline
        )
        self._bundles.write_json(incident.incident_id, "incident.json", incident)

    def _wall_of(self, monotonic_time: float) -> float:
        return self._clock.wall() - (self._clock.monotonic() - monotonic_time)
