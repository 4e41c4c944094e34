"""Faults a test arms inside one stage's forward, through a file the stage reads.

`$OMNI_CPU_HARNESS_FAULTS/stage-<S>` holds one word, read at every forward of stage S:

- `raise`: the forward raises (vLLM-Omni then loses the stage);
- `block`: the forward never returns (the process stays alive; `/health` stays 200);
- `exit`: the worker exits with status 1;
- `signal:<NAME>`: the worker sends itself that signal (`signal:ILL` is the SIGILL seen on
  a first forward with bfloat16 kernels);
- `slow:<seconds>`: every forward takes that much longer (a slow but healthy stage).

No file, an empty one or an unknown word: no fault. The test writes the file; nothing
here ever deletes it.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

FAULTS_ENV = "OMNI_CPU_HARNESS_FAULTS"


class InjectedFault(RuntimeError):
    """Raised by a forward armed with `raise`."""


def armed(stage_id: int, environ: dict[str, str] | None = None) -> str:
    """The fault word armed for `stage_id`, or ""."""
    directory = (environ if environ is not None else os.environ).get(FAULTS_ENV)
    if not directory:
        return ""
    try:
        return (Path(directory) / f"stage-{stage_id}").read_text().strip()
    except OSError:
        return ""


def strike(stage_id: int) -> None:
    """Carry out the fault armed for `stage_id`, if any, in the calling forward."""
    word = armed(stage_id)
    if not word:
        return
    kind, _, argument = word.partition(":")
    if kind == "raise":
        raise InjectedFault(f"fault injected into stage {stage_id}'s forward")
    if kind == "block":
        threading.Event().wait()
    elif kind == "exit":
        os._exit(1)
    elif kind == "signal":
        os.kill(os.getpid(), signal.Signals[f"SIG{argument.upper()}"])
    elif kind == "slow":
        threading.Event().wait(float(argument))
