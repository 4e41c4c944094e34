"""Making a `WatchdogState`: what the assembler adds to the components' own accounts."""

from __future__ import annotations

import asyncio
import os
from typing import Any, cast

from omni_watchdog.clock import FakeClock
from omni_watchdog.probes.activity import ActivityProbe
from omni_watchdog.self_health import ProbeBoard
from omni_watchdog.state import StateAssembler
from omni_watchdog.types import ProcessInfo, ProcessRole, ProcessStatus, StageRef


def assembler(board: ProbeBoard, activity: ActivityProbe | None) -> StateAssembler:
    """An assembler over the probes only: `probe_health` reads nothing else."""
    unused = cast(Any, None)
    return StateAssembler(
        clock=FakeClock(),
        target=unused,
        tracker=unused,
        receiver=unused,
        policy=unused,
        stats=unused,
        probes=board,
        errors=unused,
        write_errors=unused,
        listeners={},
        sight=unused,
        detector=unused,
        operator=unused,
        activity=activity,
    )


def test_the_activity_probes_failed_stack_samples_join_its_health() -> None:
    own = os.getpid()
    stage_process = ProcessInfo(
        own, 1.0, 1, own, own, "worker", ProcessStatus.RUNNING, 0.0, ProcessRole.WORKER, StageRef(0)
    )

    async def refused(argv: list[str], timeout: float) -> tuple[int | None, str]:
        return 1, "Error: Permission denied (os error 13)"

    probe = ActivityProbe(
        FakeClock(), lambda now: (StageRef(0),), lambda: [stage_process], "py-spy", refused
    )
    asyncio.run(probe.collect())
    board = ProbeBoard(["activity", "health"])
    board.succeeded("activity", 0.01)

    health = {h.name: h for h in assembler(board, probe).probe_health()}

    # The run succeeded, so the probe is up; the sample it could not take is counted apart.
    assert health["activity"].up and health["activity"].errors_total == 0
    assert health["activity"].stack_sample_errors_total == 1
    assert "Permission denied" in health["activity"].last_stack_sample_error
    assert health["health"].stack_sample_errors_total is None


def test_without_the_activity_probe_no_probe_counts_stack_samples() -> None:
    health = assembler(ProbeBoard(["activity", "health"]), None).probe_health()
    assert [h.stack_sample_errors_total for h in health] == [None, None]
