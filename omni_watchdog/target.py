"""The target server as a whole, as the ladder and the state need it: whether it is up,
what its /health said last, its processes and GPU memory fixed into a snapshot."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from omni_watchdog.policy.actuators import is_alive
from omni_watchdog.policy.ladder import gpu_baseline, gpu_held
from omni_watchdog.probes.gpu import GpuProbe
from omni_watchdog.probes.processes import ProcessTracker, keeps_serving_after_a_stage_death
from omni_watchdog.types import (
    GpuReading,
    HealthOutcome,
    JournalEntry,
    Observation,
    ObservationKind,
    ProcessIdentity,
    ProcessInfo,
    ProcessRole,
    ProcessTable,
    TargetSnapshot,
)

_ANSWERED = (HealthOutcome.OK, HealthOutcome.UNHEALTHY)


class TargetWatch:
    """What is known of the target beyond its stages, fed by the probes' observations."""

    def __init__(
        self,
        url: str,
        tracker: ProcessTracker,
        gpu: GpuProbe | None,
        process_table: ProcessTable,
        start_time: Callable[[int], float],
        *,
        by_process: bool,
        on_gpu_failure: Callable[[str], None],
    ) -> None:
        """`by_process`: the process probe runs, so "up" means the root process lives.
        `on_gpu_failure(reason)` reports a GPU read the ladder asked for that failed."""
        self.url = url
        self.by_process = by_process
        self._tracker = tracker
        self._gpu = gpu
        self._process_table = process_table
        self._start_time = start_time
        self._on_gpu_failure = on_gpu_failure
        self.last_health: Observation | None = None
        # From a 503 to the next 200: vLLM answers 503, then refuses, then exits by itself.
        self._reports_failure = False

    def observe(self, observations: Sequence[Observation]) -> None:
        for obs in observations:
            if obs.kind is ObservationKind.HEALTH:
                self.last_health = obs
                if obs.outcome is HealthOutcome.UNHEALTHY:
                    self._reports_failure = True
                elif obs.outcome is HealthOutcome.OK:
                    self._reports_failure = False

    def reattached(self) -> None:
        """A new server answers on the target: what the old one reported is forgotten."""
        self._reports_failure = False

    @property
    def up(self) -> bool:
        """The server's root process is alive; without the process probe, /health answers.

        Without the server's PID namespace no process is ever visible, and "up" can only
        mean that the server answers at all (a 503 is an answer: its stages are judged
        elsewhere).
        """
        if self.by_process:
            return self._tracker.target_alive
        health = self.last_health
        return health is not None and health.outcome in _ANSWERED

    def gone(self) -> bool:
        """Nothing listens on the server's port: its last /health call was refused."""
        health = self.last_health
        return health is not None and health.outcome is HealthOutcome.REFUSED

    def alive(self, identity: ProcessIdentity) -> bool:
        return is_alive(self._process_table, identity, self._start_time)

    async def read_gpu(self) -> GpuReading | None:
        """A fresh reading for the ladder; None without NVML or when the read failed."""
        if self._gpu is None:
            return None
        try:
            await self._gpu.collect()
        except Exception as error:  # a failing NVML must not stop the ladder
            self._on_gpu_failure(str(error) or type(error).__name__)
            return None
        return self._gpu.last_reading

    def last_gpu(self) -> GpuReading | None:
        return self._gpu.last_reading if self._gpu is not None else None

    def snapshot(self, processes: tuple[ProcessInfo, ...] | None = None) -> TargetSnapshot:
        """What an incident opened now acts on: the recorded processes (or `processes`,
        those of a generation already replaced) and the GPU memory they hold."""
        recorded = self._tracker.recorded() if processes is None else processes
        root = next((p for p in recorded if p.role is ProcessRole.API and not p.orphaned), None)
        reading = self.last_gpu()
        return TargetSnapshot(
            self.url,
            root.identity if root else None,
            recorded,
            gpu_baseline(reading, recorded),
            self._reports_failure,
            gpu_held(reading, recorded),
            may_exit_by_itself=not keeps_serving_after_a_stage_death(recorded),
        )

    async def snapshot_of_entry(self, entry: JournalEntry) -> TargetSnapshot:
        """A journal's processes, as far as they are still the same processes, adopted as
        recorded (the tracker has not scanned yet, and may attach elsewhere), with the GPU
        baseline the incident opened with, or one read now."""
        adopted = await self._tracker.adopt(entry.processes, entry.root)
        baseline = entry.gpu_baseline
        if baseline is None:
            baseline = gpu_baseline(await self.read_gpu(), adopted)
        return TargetSnapshot(self.url, entry.root, adopted, baseline)
