"""Faults a test arms inside one stage's forward, through a file the stage reads.

`$OMNI_CPU_HARNESS_FAULTS/stage-<S>` holds one word, read at every forward of stage S:

- `raise`: the forward raises (vLLM-Omni then loses the stage);
- `block`: the forward never returns (the process stays alive; `/health` stays 200);
- `exit`: the worker exits with status 1;
- `signal:<NAME>`: the worker sends itself that signal (`signal:ILL` is the SIGILL seen on
  a first forward with bfloat16 kernels);
- `slow:<seconds>`: every forward takes that much longer (a slow but healthy stage);
- `spin`: the forward busy-loops in one Python frame until the word is taken away;
- `jit:<seconds>`: one forward waits on a child process working at full CPU for that long
  (how nvcc, ptxas, Triton or FlashInfer JIT builds look from outside);
- `compile`: one forward runs real `torch.compile`s of new functions on a fresh Inductor
  cache (Python code generation here, `g++` in child processes): the first in a process
  15 s and more on two cores, a later one several seconds;
- `slow-step:<seconds>`: one forward does that much CPU work (tensor operations in a
  Python loop), then goes on.

A diffusion stage reads the same file at every denoising step of its DiT instead (through
`strike_step`, once per step, the startup warm-up's steps included):

- `block`: the step never returns (the process stays alive; vLLM-Omni's engine has no
  timeout on it);
- `raise`: the step raises (vLLM-Omni answers 500 for that request; the stage stays
  healthy);
- `spin`, `exit`, `signal:<NAME>`, `slow-step:<seconds>`: as above, inside the step;
- `step-work:<seconds>`: every step does that much CPU work (tensor operations in a Python
  loop), then goes on: a legitimately slow image, e.g. 4 steps of 3 s;
- `slow:<seconds>`: every step waits that much longer, the CPU free (a device that
  computes slowly).

Both places take every word (one dispatch): a test arms the ones that mean something there.

No file, an empty one or an unknown word: no fault. The test writes the file; nothing
here ever deletes it. The one-forward faults write `stage-<S>.fired` with their word once
they fired, and do not fire again for the same word.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

FAULTS_ENV = "OMNI_CPU_HARNESS_FAULTS"
# Functions compiled by one `compile` fault.
COMPILED_FUNCTIONS = 6


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


def strike(stage_id: int, place: str = "forward") -> None:
    """Carry out the fault armed for `stage_id`, if any, in the calling `place` (a forward,
    or a denoising step)."""
    word = armed(stage_id)
    if not word:
        return
    kind, _, argument = word.partition(":")
    if kind == "raise":
        raise InjectedFault(f"fault injected into stage {stage_id}'s {place}")
    if kind == "block":
        threading.Event().wait()
    elif kind == "exit":
        os._exit(1)
    elif kind == "signal":
        os.kill(os.getpid(), signal.Signals[f"SIG{argument.upper()}"])
    elif kind == "slow":
        threading.Event().wait(float(argument))
    elif kind == "spin":
        _spin(stage_id)
    elif kind == "step-work":
        _work(float(argument))
    elif kind == "jit":
        _once(stage_id, word, lambda: _wait_on_a_busy_child(float(argument)))
    elif kind == "compile":
        _once(stage_id, word, _compile_new_functions)
    elif kind == "slow-step":
        _once(stage_id, word, lambda: _work(float(argument)))


def strike_step(stage_id: int) -> None:
    """Carry out the fault armed for `stage_id`, if any, in the calling denoising step."""
    strike(stage_id, "denoising step")


def _once(stage_id: int, word: str, fault: Callable[[], None]) -> None:
    directory = Path(os.environ[FAULTS_ENV])
    fired = directory / f"stage-{stage_id}.fired"
    try:
        if fired.read_text() == word:
            return
    except OSError:
        pass
    fired.write_text(word)
    fault()


def _spin(stage_id: int) -> None:
    # Busy in this one frame, holding the GIL. Once a second, for a moment a stack sample
    # almost never meets, it looks whether the test took the word away: a server that
    # later tests share is whole again once it is disarmed.
    look_at = time.monotonic() + 1.0
    while True:
        if time.monotonic() >= look_at:
            if armed(stage_id) != "spin":
                return
            look_at = time.monotonic() + 1.0


_BUSY_CHILD = """\
import sys, time
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    pass
"""


def _wait_on_a_busy_child(seconds: float) -> None:
    subprocess.run([sys.executable, "-c", _BUSY_CHILD, str(seconds)], check=True)


def _compile_new_functions() -> None:
    # Imported here: only a forward armed with `compile` pays for it.
    import torch

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="harness-inductor-")
    # Functions no cache has seen, each its own kernel: constants of their own make their
    # C++ source new, so each is generated and built by g++ again. One alone takes about a
    # second once the process has compiled before (measured on an idle host: twelve took
    # 24 s the first time in a process, 12 s to 13 s after). Six, as the first compile of
    # a process (16 s alone), make a silence longer than the shipped heartbeat timeout.
    salt = uuid.uuid4().hex[:8]
    for index in range(COMPILED_FUNCTIONS):
        constant = uuid.uuid4().int % 100_000 + index
        name = f"fresh_{salt}_{index}"
        source = (
            f"def {name}(x):\n"
            f"    return (torch.sin(x) * {index + 1} + torch.cos(x) * {constant}).relu().sum()\n"
        )
        scope: dict[str, object] = {"torch": torch}
        exec(source, scope)
        torch.compile(scope[name], backend="inductor")(torch.randn(64, 64))


def _work(seconds: float) -> None:
    import torch

    x = torch.randn(128, 128)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        y = x @ x
        y = torch.softmax(y, dim=-1)
        x = y / (y.norm() + 1.0)
