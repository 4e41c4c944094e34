"""Helper children a stage process starts for the escaped-child and zombie faults.

`python -m omni_watchdog.sim.children escaped-child|zombie DEVICE BYTES`
"""

from __future__ import annotations

import os
import signal
import sys

from omni_watchdog.sim.faults import FaultKind
from omni_watchdog.sim.nvml import STATE_ENV, GpuAllocations


def main(argv: list[str]) -> int:
    kind, device, nbytes = FaultKind(argv[0]), int(argv[1]), int(argv[2])
    if kind is FaultKind.ESCAPED_CHILD:
        # Its own session and process group: a kill of the server's group misses it.
        os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    GpuAllocations(os.environ[STATE_ENV]).hold_memory(device, nbytes)
    if kind is FaultKind.ZOMBIE:
        # Exit at once; the parent never reaps it, so it stays a zombie.
        return 0
    while True:
        signal.pause()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
