"""The faults (docs/design.md, Fault table), how they are named, and the record of each firing."""

from __future__ import annotations

import enum
import json
import os
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EVENTS_FILE = "events.jsonl"
# A headless stage has no API: its faults at run time are lines appended here.
FAULTS_FILE = "faults.jsonl"


class FaultKind(str, enum.Enum):
    """One row of the fault table."""

    ENGINE_DEAD_HANG = "engine-dead-hang"
    STAGE_DEAD_503 = "stage-dead-503"
    SILENT_STALL = "silent-stall"
    IGNORE_SIGTERM = "ignore-sigterm"
    ESCAPED_CHILD = "escaped-child"
    ORPHANED_STAGES = "orphaned-stages"
    SLOW_BUT_ALIVE = "slow-but-alive"
    SLOW_STARTUP = "slow-startup"
    ZOMBIE = "zombie"
    ENGINE_DEAD_EXIT = "engine-dead-exit"
    FROZEN_ENGINE = "frozen-engine"
    LONG_STEPS = "long-steps"
    COMPILE = "compile"
    JIT = "jit"
    DENOISE_BLOCK = "denoise-block"
    DENOISE_RAISE = "denoise-raise"
    DENOISE_SLOW = "denoise-slow"


GENERATIONS = ("0.11", "0.30")

# Faults that fire on the next request reaching their stage; the others act when injected.
REQUEST_TRIGGERED = frozenset(
    {
        FaultKind.ENGINE_DEAD_HANG,
        FaultKind.STAGE_DEAD_503,
        FaultKind.SILENT_STALL,
        FaultKind.SLOW_BUT_ALIVE,
        FaultKind.ENGINE_DEAD_EXIT,
        FaultKind.FROZEN_ENGINE,
        FaultKind.LONG_STEPS,
        FaultKind.COMPILE,
        FaultKind.JIT,
        FaultKind.DENOISE_BLOCK,
        FaultKind.DENOISE_RAISE,
        FaultKind.DENOISE_SLOW,
    }
)
# Faults of a diffusion stage's denoising loop: only a DIFFUSION stage has one.
DENOISING = frozenset({FaultKind.DENOISE_BLOCK, FaultKind.DENOISE_RAISE, FaultKind.DENOISE_SLOW})
# Faults of the whole server rather than of one stage.
TARGET_WIDE = frozenset(
    {FaultKind.IGNORE_SIGTERM, FaultKind.ORPHANED_STAGES, FaultKind.SLOW_STARTUP}
)
# Faults that only one process model has. The real vLLM-Omni 0.30 keeps its API up,
# answering 503, after any stage death: an engine death that takes the server down with it
# is 0.11's (and plain vLLM's).
ONLY_IN = {
    FaultKind.ENGINE_DEAD_HANG: "0.11",
    FaultKind.ENGINE_DEAD_EXIT: "0.11",
    FaultKind.STAGE_DEAD_503: "0.30",
    # The simulator's diffusion stages are 0.30's `StageDiffusionProc`s.
    **{kind: "0.30" for kind in DENOISING},
}
# Faults that shape start-up and so cannot be injected into a running server.
START_ONLY = frozenset({FaultKind.SLOW_STARTUP})


class FaultError(ValueError):
    """A fault that cannot be injected, with the reason."""


@dataclass(frozen=True)
class Fault:
    """A fault aimed at one stage replica (stage 0, replica 0 unless named)."""

    kind: FaultKind
    stage: int = 0
    replica: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "stage": self.stage, "replica": self.replica}


def parse_fault(text: str) -> Fault:
    """A fault from `[STAGE[.REPLICA]:]KIND`, e.g. `1:engine-dead-hang` or `1.1:silent-stall`."""
    target, _, kind_text = text.rpartition(":")
    kind = _kind(kind_text)
    if not target:
        return Fault(kind)
    stage_text, _, replica_text = target.partition(".")
    if not stage_text.isdigit() or (replica_text and not replica_text.isdigit()):
        raise FaultError(f"{text!r}: expected [STAGE[.REPLICA]:]KIND, e.g. 1.0:silent-stall")
    return Fault(kind, int(stage_text), int(replica_text or 0))


def fault_from_mapping(document: Mapping[str, Any]) -> Fault:
    """A fault from the JSON body of `POST /sim/faults`."""
    stage = document.get("stage", 0)
    replica = document.get("replica", 0)
    for name, value in (("stage", stage), ("replica", replica)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise FaultError(f"{name}: expected a stage index, got {value!r}")
    return Fault(_kind(document.get("kind")), stage, replica)


def _kind(text: Any) -> FaultKind:
    try:
        return FaultKind(text)
    except ValueError:
        known = ", ".join(kind.value for kind in FaultKind)
        raise FaultError(f"unknown fault {text!r}; known: {known}") from None


def check_generation(kind: FaultKind, generation: str) -> None:
    """Raise `FaultError` if `kind` exists only in the other process model."""
    only = ONLY_IN.get(kind)
    if only is not None and only != generation:
        raise FaultError(f"{kind.value} exists only in generation {only}")


def check_fault(
    fault: Fault,
    generation: str,
    replicas: Mapping[int, int],
    remote: Collection[int] = (),
    diffusion: Collection[int] | None = None,
) -> None:
    """Raise `FaultError` unless `fault` applies to this generation and topology; a stage in
    `remote` runs headless elsewhere, out of this server's reach. `diffusion` names the
    DIFFUSION stages, where a denoising fault can fire (None: not checked)."""
    check_generation(fault.kind, generation)
    if fault.kind in TARGET_WIDE:
        return
    if fault.stage in remote:
        raise FaultError(
            f"{fault.kind.value}: stage {fault.stage} runs headless on another host; "
            "inject its faults there"
        )
    if fault.stage not in replicas:
        raise FaultError(f"{fault.kind.value}: no stage {fault.stage}")
    if not 0 <= fault.replica < replicas[fault.stage]:
        raise FaultError(f"{fault.kind.value}: stage {fault.stage} has no replica {fault.replica}")
    if fault.kind in DENOISING and diffusion is not None and fault.stage not in diffusion:
        raise FaultError(
            f"{fault.kind.value}: stage {fault.stage} is not a diffusion stage (see --pipeline)"
        )


def check_headless_fault(
    fault: Fault, stage_id: int, replicas: int, diffusion: bool | None = None
) -> None:
    """Raise `FaultError` unless `fault` applies to a 0.30 headless stage `stage_id`;
    `diffusion` says whether it is a DIFFUSION stage (None: not checked)."""
    if fault.kind in TARGET_WIDE:
        raise FaultError(f"{fault.kind.value} is a fault of the head, not of a headless stage")
    stages = None if diffusion is None else ({stage_id} if diffusion else set())
    check_fault(fault, "0.30", {stage_id: replicas}, diffusion=stages)


def record_fault_triggered(state_dir: str | Path, fault: Fault, pid: int) -> None:
    """Append the `fault_triggered` event the demo and the benchmarks measure from."""
    event = {
        "time": time.time(),
        "event": "fault_triggered",
        "kind": fault.kind.value,
        "stage": fault.stage,
        "replica": fault.replica,
        "pid": pid,
    }
    line = (json.dumps(event) + "\n").encode()
    # One O_APPEND write per event, so lines from several processes never interleave.
    descriptor = os.open(Path(state_dir) / EVENTS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(descriptor, line)
    finally:
        os.close(descriptor)
