"""Ending asyncio tasks in bounded time, even those that lose a cancellation.

On Python < 3.12 `asyncio.wait_for` returns its result when the awaited thing finishes in
the same loop iteration as the cancellation of the task that waits, and the cancellation
is gone. A loop that meets that race keeps running, and a plain `task.cancel(); await
task` then waits for ever: a watchdog that cannot stop holds its ports and its target
lock. So a task is cancelled again until it ends, and one that still runs when patience
is out is given up on, named, rather than waited for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

RECANCEL_EVERY = 0.1


async def end_tasks(tasks: Iterable[asyncio.Task[Any]], patience: float) -> list[asyncio.Task[Any]]:
    """Cancel `tasks`, again every `RECANCEL_EVERY` seconds while any still runs, for at
    most `patience` seconds; the ones still running then, in the order given."""
    given = list(tasks)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + patience
    pending = {task for task in given if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        remaining = deadline - loop.time()
        if remaining <= 0:
            break
        _, pending = await asyncio.wait(pending, timeout=min(RECANCEL_EVERY, remaining))
    for task in given:
        if task.done() and not task.cancelled():
            # Retrieved, so that asyncio does not log it as never retrieved: a loop's own
            # errors were logged where they happened.
            task.exception()
    return [task for task in given if not task.done()]
