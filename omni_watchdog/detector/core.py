"""The detector as the watchdog uses it: observations and a clock in, per-stage states and
verdicts out, no I/O.

`Detector` holds the memory of the attached server and answers the other components'
questions of it; the work is done beside it: `intake` folds observations into memory,
`evidence` reads what it says against each stage, `silence` (with `causes` and
`starved`) names why a silent stage is silent, `work` tells whether a stage works on
what it owes, `exits` classifies exits, and `rules` decides.
"""

from __future__ import annotations

from collections.abc import Iterable

from omni_watchdog.config import DetectionConfig
from omni_watchdog.detector import evidence, rules
from omni_watchdog.detector.exits import released_after_exit
from omni_watchdog.detector.expectations import BlindSpells
from omni_watchdog.detector.intake import fold, take_topology, unseen_timeout
from omni_watchdog.detector.memory import TargetMemory, attach, heartbeat_timeout
from omni_watchdog.detector.silence import silent
from omni_watchdog.detector.work import step_left, waiting_unworked
from omni_watchdog.types import (
    LLM_STAGE_TITLE,
    STAGE_TYPE_DIFFUSION,
    STAGE_TYPE_LLM,
    CanaryPlan,
    DetectorReport,
    Observation,
    ObservationKind,
    ProcessReadings,
    ProcessStatus,
    StageRef,
    Topology,
)


class Detector:
    """Per-stage state machine over observations; pure, so tests drive it with a fake clock."""

    def __init__(
        self,
        config: DetectionConfig,
        topology: Topology,
        start: float,
        remote_stages: Iterable[int] = (),
    ) -> None:
        """`remote_stages`: stage ids that run on other hosts (vLLM-Omni 0.30 headless
        stages), judged from their spans and the server's /health only."""
        self._config = config
        self._remote = frozenset(remote_stages)
        # The watchdog's, not the target's: kept across a re-attach.
        self._blind = BlindSpells()
        self.set_aside = dict.fromkeys((ObservationKind.HEALTH, ObservationKind.CANARY), 0)
        self._exits_of_earlier_servers = 0
        self._target: TargetMemory = attach(topology, start, self._remote, self._blind)

    @property
    def stage_exits(self) -> int:
        """Stage processes seen to exit while their server lived, each once, over every
        server attached: news to act on."""
        return self._exits_of_earlier_servers + self._target.stage_exits

    def reset(self, topology: Topology, start: float) -> None:
        """Forget everything and judge `topology` afresh from `start`: a new server was
        attached. The detector stays the same object, so whatever reads it keeps reading."""
        self._exits_of_earlier_servers += self._target.stage_exits
        self._target = attach(topology, start, self._remote, self._blind)

    def attached(self, now: float) -> None:
        """The first server was found on the target: `startup_timeout` counts from now, and
        everything observed so far, which came from it, stays."""
        self._target.attached = now

    def set_topology(self, topology: Topology, now: float) -> None:
        """Judge the stages of `topology` from now on (see `intake.take_topology`)."""
        take_topology(self._target, topology, now)

    # ---- observations -------------------------------------------------------------

    def blind(self, start: float, end: float) -> None:
        """The watchdog could not look from `start` to `end` (its own loop ran late)."""
        self._blind.add(start, end)

    def observe(self, observations: Iterable[Observation]) -> None:
        for obs in observations:
            if obs.kind in self.set_aside and unseen_timeout(obs, self._blind):
                # Neither success nor failure: counted, and set aside.
                self.set_aside[obs.kind] += 1
                continue
            fold(self._config, self._target, obs)

    def canary_plan(self, now: float) -> CanaryPlan:
        """The canary this server gets when one is due (see `CanaryPlan`).

        Asked by the canary probe when one is due. Where the answer is that the stages'
        beats speak for the server, a canary failure from before lapses: no canary will
        come to clear it, and it is no longer what tells this server's state."""
        config, target = self._config, self._target
        # A stage that left its step is no reason to wait: the canary is what proves it.
        stages = target.stages.items()
        left = any(step_left(config, target, ref, memory, now) for ref, memory in stages)
        if not left and any(memory.denoising for memory in target.stages.values()):
            return CanaryPlan.NONE
        types = {stage.stage_id: stage.stage_type for stage in target.topology.stages}
        if not target.diffusion_seen and STAGE_TYPE_DIFFUSION not in types.values():
            return CanaryPlan.TEXT
        if not left and all(
            memory.last_heartbeat is not None
            and now - memory.last_heartbeat <= heartbeat_timeout(config, memory)
            for memory in target.stages.values()
        ):
            target.canary_failed_at = target.canary_last_failed = None
            target.canary_detail = ""
            return CanaryPlan.NONE
        entry = [types.get(stage_id, "") for stage_id in target.topology.entry_stages()]
        titles = [p.info.title for m in target.stages.values() for p in m.processes.values()]
        if STAGE_TYPE_LLM in entry or any(LLM_STAGE_TITLE in title for title in titles):
            return CanaryPlan.IMAGE_CHAT
        return CanaryPlan.IMAGE

    # ---- queries ------------------------------------------------------------------

    def warmed_up(self, now: float) -> bool:
        """Start-up is over (see `rules.warmed_up`)."""
        return rules.warmed_up(self._config, self._target, now)

    def last_progress(self) -> float | None:
        """When any stage's counters last moved on the server's /metrics, for scheduling
        the canary. Spans do not count: a holder of the OTLP token could send them, and a
        stage's forged successes held every canary back from a deadlocked server."""
        return self._target.last_progress

    def deadline(self, stage_id: int) -> float:
        """How long a request may stay at a stage before its span is overdue."""
        return evidence.deadline(self._config, self._target, stage_id)

    def in_flight(self, stage_id: int) -> int:
        return self._target.pending.in_flight(stage_id)

    def overdue_count(self, stage_id: int, now: float) -> int:
        return evidence.overdue_count(self._config, self._target, stage_id, now)

    def last_heartbeat(self, ref: StageRef) -> float | None:
        memory = self._target.stages.get(ref)
        return memory.last_heartbeat if memory else None

    def last_progress_of(self, ref: StageRef) -> float | None:
        memory = self._target.stages.get(ref)
        return memory.progress_changed_at if memory else None

    def activity_readings(self, ref: StageRef) -> tuple[ProcessReadings, ...]:
        """The readings of each of the stage's processes that its cause was last found
        from, by pid; none once it is no longer silent. For the bundle of a verdict."""
        memory = self._target.stages.get(ref)
        if memory is None:
            return ()
        return tuple(
            ProcessReadings(
                known.latest,
                tuple(known.sampled),
                None if known.finding is None else known.finding.cause,
                known.finding is not None and known.finding.working,
                "" if known.finding is None else known.finding.detail,
            )
            for _, known in sorted(memory.activity.items())
        )

    def silent_stages(self, now: float) -> tuple[StageRef, ...]:
        """The local stage replicas whose processes are worth reading for a cause now: their
        loop has stopped beating, or their counters stay flat under load (see
        `silence.SILENT_SHARE`), or they are judged stalled. A slow stage that beats and
        moves is not read: the watchdog's cost grows only with silence."""
        config, target = self._config, self._target
        return tuple(
            ref
            for ref, memory in target.stages.items()
            if ref.stage_id not in target.remote and silent(config, target, ref, memory, now)
        )

    def next_due(self, now: float) -> float | None:
        """The first moment after `now` at which a timeout runs out for what is known now:
        a stage's heartbeat silence, its counters flat under load, a stopped or D-state
        process. Judging then, rather than at the next tick, gives the verdict as soon as
        the rules allow."""
        config, target = self._config, self._target
        due: list[float] = []
        for ref, memory in target.stages.items():
            if memory.last_heartbeat is not None:
                due.append(memory.last_heartbeat + heartbeat_timeout(config, memory))
            if memory.load > 0 and memory.load_positive_since is not None:
                flat_from = max(memory.progress_changed_at or 0.0, memory.load_positive_since)
                due.append(flat_from + config.progress_timeout)
            if (waiting := waiting_unworked(config, target, ref, memory, now)) is not None:
                due.append(waiting[1] + config.progress_timeout)
            due.extend(
                process.status_since + config.stuck_timeout
                for process in memory.processes.values()
                if process.exited_at is None
                and process.info.status in (ProcessStatus.STOPPED, ProcessStatus.DISK_SLEEP)
            )
            due.extend(since for since, _ in released_after_exit(target, memory))
            if memory.cause is not None and memory.working_since is not None:
                due.append(memory.working_since + config.work_budget(memory.cause.cause))
        if target.link_down_since is not None:
            due.append(target.link_down_since + config.link_grace)
        return min((moment for moment in due if moment > now), default=None)

    # ---- evaluation ---------------------------------------------------------------

    def evaluate(self, now: float) -> DetectorReport:
        """Every stage judged now (see `rules.evaluate`)."""
        return rules.evaluate(self._config, self._target, now)
