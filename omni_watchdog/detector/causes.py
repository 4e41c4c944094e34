"""Why a silent stage is silent: two readings of its processes in, a cause out, no I/O.

A silence is not a hang (docs/design.md, Why a stage is silent). What a stage process is
doing shows from outside without its help: its threads' kernel states, wait channels and
CPU times; its descendants (a compiler child burning CPU is work done for it); and, where
they were sampled, its Python frames. Each reading is compared with the one before it, so
a cause also says whether the work advances: a compiler child gaining CPU time does, one
that was stopped does not, and neither does a thread busy in the same frames sample after
sample.

A finding names its cause, whether the work advances (`working`), and the readings behind
it in words an operator can check ("g++ pid 123 at 98 % CPU").
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from omni_watchdog.types import ChildActivity, ProcessActivity, SilenceCause, ThreadActivity

# A thread or child that used a CPU at least this share of the time between two readings
# is working, not waiting (the detector's RUNNING_SHARE, measured on the real vLLM-Omni: a
# worker blocked in its forward used 1 % of a core through 11 s of silence).
WORKING_SHARE = 0.1
# A descendant that gained at least this share of the time between two readings on a CPU,
# or was runnable at both, is working: a sleeping child gains nothing, and a compiler on a
# loaded host may get little of a core but still advances (or waits for a CPU to).
CHILD_WORKING_SHARE = 0.01
# A thread that waited, runnable, for a CPU at least this share of the time between two
# readings, and longer than it ran, was starved by its neighbours.
STARVED_SHARE = 0.1
# The shortest span two compared readings cover before they say that work stopped: the
# kernel's CPU times move in ticks, and on a loaded host a compiler waits its turn for a
# CPU. Measured on the real vLLM-Omni under two busy loops on two cores: a g++ building for
# a `torch.compile` gained nothing between two readings 0.3 s apart, and the compile was
# judged stopped and its server shut down.
COMPARED_SPAN = 2.0
# Command names (as the kernel keeps them, 15 characters at most) of the programs a JIT
# build runs: host compilers and linkers, and CUDA's compiler drivers and assemblers.
COMPILER_NAMES = frozenset(
    {
        "as",
        "c++",
        "cc",
        "cc1",
        "cc1plus",
        "cicc",
        "clang",
        "clang++",
        "collect2",
        "fatbinary",
        "g++",
        "gcc",
        "ld",
        "ld.gold",
        "ld.lld",
        "ninja",
        "nvcc",
        "nvlink",
        "ptxas",
    }
)
# Frames (file paths and function names, matched as parts) that say what a thread does.
COMPILE_FRAMES = (
    "torch/_dynamo/",
    "torch/_inductor/",
    "triton/compiler/",
    "triton/runtime/jit",
    "torch/utils/cpp_extension",
    "deep_gemm/jit",
    "flashinfer/jit",
)
LOAD_FRAMES = (
    "safetensors",
    "model_loader",
    "load_weights",
    "load_state_dict",
    "from_pretrained",
)
# Work that its frames name, and the cause it is.
_WORK_FRAMES = (
    (COMPILE_FRAMES, SilenceCause.COMPILING),
    (LOAD_FRAMES, SilenceCause.LOADING),
)
DEVICE_FRAMES = (
    "synchronize",
    "torch/distributed/distributed_c10d",
    "nccl",
    "Tensor.item",
)
# Kernel functions a thread sleeps in while it waits on a child: wait(2) itself, a read of
# the child's output, or vfork's wait for the child to exec (in D: subprocess starts its
# children so); names differ between kernel versions.
CHILD_WAIT_CHANNELS = frozenset(
    {
        "do_wait",
        "kernel_wait4",
        "kernel_waitid",
        "pipe_read",
        "anon_pipe_read",
        "pipe_wait",
        "kernel_clone",
        "wait_for_vfork_done",
    }
)
# A thread busy in the same functions in every stack sample of its silence, at least
# SPIN_SAMPLES of them, holding the GIL in half of them or more, is spinning; with fewer
# samples its frames say nothing yet. The samples looked at are the latest SAMPLES_KEPT:
# once its frames moved, it takes that many in a row on one line, not three, so Python
# work that dwells on one line is not caught.
SPIN_SAMPLES = 3
SAMPLES_KEPT = 10
# The line at the end of a frame as `activity.parse_py_spy_json` writes it.
_LINE = re.compile(r":[^:()]*\)$")
# The stopped states: T (SIGSTOP) and t (a tracer's stop).
_STOPPED_STATES = frozenset("Tt")


@dataclass(frozen=True)
class CauseFinding:
    """What one stage process (or the stage, its processes combined) is doing: the cause,
    whether the work visibly advances between the two readings, and the readings behind it."""

    cause: SilenceCause
    working: bool
    detail: str


# The order in which the findings of a stage's processes explain the stage: a stopped
# process stops the stage whatever the others do; work for it comes next (the engine
# waits on its queue while its worker compiles); then what is wrong with a busy process,
# then the host's doing, then plain waits.
_STAGE_ORDER = (
    SilenceCause.STOPPED,
    SilenceCause.COMPILING,
    SilenceCause.LOADING,
    SilenceCause.WAITING_ON_CHILD,
    SilenceCause.COMPUTING,
    SilenceCause.SPINNING,
    SilenceCause.STARVED,
    SilenceCause.DEVICE_WAIT,
    SilenceCause.UNKNOWN,
    SilenceCause.LOCK_OR_QUEUE_WAIT,
)


def compared_reading(earlier: Sequence[ProcessActivity], after: ProcessActivity) -> ProcessActivity:
    """Of `earlier` (oldest first, all before `after`), the reading `after` is compared
    with: the latest at least COMPARED_SPAN before it, else the oldest there is."""
    base = earlier[0]
    for reading in earlier:
        if after.time - reading.time < COMPARED_SPAN:
            break
        base = reading
    return base


def process_cause(
    before: ProcessActivity,
    after: ProcessActivity,
    sampled: Sequence[ProcessActivity] = (),
) -> CauseFinding:
    """What the process read at `before` and again at `after` is doing (`compared_reading`
    picks `before`). `sampled`: the readings with stacks before `after` in this silence,
    oldest first (the latest SAMPLES_KEPT count), for telling a spin (the same frames sample
    after sample) from work whose frames move."""
    interval = after.time - before.time
    if interval <= 0:
        return CauseFinding(SilenceCause.UNKNOWN, False, f"pid {after.pid}: one reading only")
    stopped = [t for t in after.threads if t.state in _STOPPED_STATES]
    if stopped:
        return CauseFinding(
            SilenceCause.STOPPED, False, f"pid {after.pid} stopped ({stopped[0].state})"
        )
    earlier = {t.tid: t for t in before.threads}
    # In D at both readings and not a tick on a CPU between them: one wait all along, not
    # a stream of short disk writes.
    held = [
        t
        for t in after.threads
        if t.state == "D"
        and earlier.get(t.tid, t).state == "D"
        and t.cpu_seconds == earlier.get(t.tid, t).cpu_seconds
        and t.wait_channel not in CHILD_WAIT_CHANNELS
    ]
    if held and interval >= COMPARED_SPAN and not _busy(after.threads, earlier, interval):
        where = held[0].wait_channel or "an unnamed kernel wait"
        return CauseFinding(
            SilenceCause.STOPPED,
            False,
            f"pid {after.pid} in uninterruptible sleep (D) in {where} for {interval:.1f}s",
        )
    child = _child_finding(before, after, interval)
    if child is not None:
        return child
    return _own_finding(after, earlier, interval, sampled)


def stage_cause(findings: Iterable[CauseFinding]) -> CauseFinding:
    """The cause of a stage from the findings of its processes (see `_STAGE_ORDER`)."""
    ranked = sorted(findings, key=lambda finding: _STAGE_ORDER.index(finding.cause))
    if not ranked:
        return CauseFinding(SilenceCause.UNKNOWN, False, "no process of the stage read")
    return ranked[0]


def _child_finding(
    before: ProcessActivity, after: ProcessActivity, interval: float
) -> CauseFinding | None:
    """A descendant working for the process, or one it waits on that does not advance.
    A build moves through its passes in new processes (g++ runs cc1plus, then as, then
    ld): a descendant started since `before` is working, unless stopped."""
    earlier = {c.pid: c for c in before.children}
    gains = {c.pid: c.cpu_seconds - _child_cpu(earlier.get(c.pid)) for c in after.children}
    working = [
        c
        for c in after.children
        if gains[c.pid] >= CHILD_WORKING_SHARE * interval
        or c.state == "R" == _child_state(earlier.get(c.pid))
        or (c.pid not in earlier and c.state not in _STOPPED_STATES)
    ]
    if working:
        compilers = [c for c in working if c.name in COMPILER_NAMES]
        top = max(compilers or working, key=lambda c: gains[c.pid])
        share = gains[top.pid] / interval
        cause = SilenceCause.COMPILING if compilers else SilenceCause.WAITING_ON_CHILD
        more = f" and {len(working) - 1} more" if len(working) > 1 else ""
        return CauseFinding(cause, True, f"{top.name} pid {top.pid} at {share:.0%} CPU{more}")
    if not after.children or not _waits_on_children(after):
        return None
    stopped = [c for c in after.children if c.state in _STOPPED_STATES]
    child = stopped[0] if stopped else after.children[0]
    waits = f"pid {after.pid} waits on {child.name} pid {child.pid}"
    if stopped:
        return CauseFinding(
            SilenceCause.WAITING_ON_CHILD, False, f"{waits}: stopped ({child.state})"
        )
    if interval < COMPARED_SPAN:
        return CauseFinding(SilenceCause.UNKNOWN, False, f"{waits}: read over {interval:.1f}s only")
    return CauseFinding(
        SilenceCause.WAITING_ON_CHILD, False, f"{waits}: no CPU time gained in {interval:.1f}s"
    )


def _own_finding(
    after: ProcessActivity,
    earlier: dict[int, ThreadActivity],
    interval: float,
    sampled: Sequence[ProcessActivity],
) -> CauseFinding:
    """What the process's own threads do: busy (in which frames), starved, or asleep.

    Waiting for a CPU slows work down; it does not make it other work. A thread starved in
    a compile's or a load's frames is that work, advancing as the host lets it; one busy in
    frames that move computes. The host is the cause only of a silence that no work of the
    process explains. (Read as starved, a compile generating its code in a worker, waiting
    for a CPU longer than it ran, was judged stalled 30 s into its silence: the likeliest
    reading of a real server shut down mid-compile in CI, beside another on two cores.)"""
    starved = _starved_thread(after.threads, earlier, interval)
    starved_finding = None
    if starved is not None:
        thread, waited = starved
        waiting = f"waited {waited:.1f}s of {interval:.1f}s for a CPU"
        frames = _latest_frames(after, sampled, thread.tid)
        for markers, cause in _WORK_FRAMES:
            if _matches(frames, markers):
                ran = (thread.cpu_seconds - _cpu(earlier.get(thread.tid))) / interval
                where = _named(frames, markers)
                return CauseFinding(
                    cause, True, f"pid {after.pid} at {ran:.0%} CPU in {where}, {waiting}"
                )
        starved_finding = CauseFinding(
            SilenceCause.STARVED, False, f"pid {after.pid}: thread {thread.tid} {waiting}"
        )
    busy = _busy(after.threads, earlier, interval)
    if busy:
        finding = _busy_finding(after, busy, interval, sampled)
        # A thread that runs is judged by what it runs: spinning in one frame on a loaded
        # host is still spinning. Starved tells only what no busy thread's frames tell.
        if starved_finding is None or finding.cause is not SilenceCause.UNKNOWN:
            return finding
    if starved_finding is not None:
        return starved_finding
    main = next((t for t in after.threads if t.tid == after.pid), None)
    frames = main.frames if main is not None else ()
    if _matches(frames, DEVICE_FRAMES):
        return CauseFinding(
            SilenceCause.DEVICE_WAIT,
            False,
            f"pid {after.pid} asleep in {_named(frames, DEVICE_FRAMES)}",
        )
    where = frames[0] if frames else (main.wait_channel if main and main.wait_channel else "")
    return CauseFinding(
        SilenceCause.LOCK_OR_QUEUE_WAIT,
        False,
        f"pid {after.pid} asleep{f' in {where}' if where else ''}, nothing working for it",
    )


def _busy_finding(
    after: ProcessActivity,
    busy: Sequence[tuple[ThreadActivity, float]],
    interval: float,
    sampled: Sequence[ProcessActivity],
) -> CauseFinding:
    thread, used = busy[0]
    share = f"{used / interval:.0%} CPU"
    # Stacks are sampled less often than the kernel is read: between samples, the latest
    # sample tells what the busy threads are in.
    if after.stacks_read:
        latest, before = after, sampled
    elif sampled:
        latest, before = sampled[-1], sampled[:-1]
    else:
        return CauseFinding(
            SilenceCause.UNKNOWN,
            False,
            f"pid {after.pid}: thread {thread.tid} at {share}, its stack not read",
        )
    stacks = [_frames_of(latest, t.tid) or () for t, _ in busy]
    for markers, cause in _WORK_FRAMES:
        found = [frames for frames in stacks if _matches(frames, markers)]
        if found:
            frame = _named(found[0], markers)
            return CauseFinding(cause, True, f"pid {after.pid} at {share} in {frame}")
    frames = stacks[0]
    if _matches(frames, DEVICE_FRAMES):
        frame = _named(frames, DEVICE_FRAMES)
        return CauseFinding(
            SilenceCause.DEVICE_WAIT, False, f"pid {after.pid} at {share} in {frame}"
        )
    where = frames[0] if frames else "no Python frame"
    window = [_sample_of(reading, thread.tid) for reading in (*before, latest)]
    window = window[-SAMPLES_KEPT:]
    if len(window) < SPIN_SAMPLES:
        return CauseFinding(
            SilenceCause.UNKNOWN,
            False,
            f"pid {after.pid}: thread {thread.tid} at {share} in {where},"
            f" its stack sampled {len(window)} of {SPIN_SAMPLES} times",
        )
    functions = _functions(frames)
    if any(sample is None or _functions(sample.frames) != functions for sample in window):
        return CauseFinding(
            SilenceCause.COMPUTING, True, f"pid {after.pid} at {share}, its frames moving: {where}"
        )
    holding = sum(1 for sample in window if sample is not None and sample.owns_gil)
    if holding * 2 >= len(window):
        return CauseFinding(
            SilenceCause.SPINNING,
            False,
            f"pid {after.pid}: thread {thread.tid} at {share} in the same frames, holding"
            f" the GIL, {len(window)} samples running: {where}",
        )
    # The same Python frame, the GIL mostly released: one long native call (a large tensor
    # operation). A loop in Python holds the GIL but for the moments the interpreter hands
    # it to the process's other threads (measured: a sample in three can miss it).
    return CauseFinding(
        SilenceCause.COMPUTING,
        True,
        f"pid {after.pid} at {share} in one native call, {len(window)} samples running: {where}",
    )


def _latest_frames(
    after: ProcessActivity, sampled: Sequence[ProcessActivity], tid: int
) -> tuple[str, ...]:
    """The thread's frames in the latest stack sample of this silence, if any."""
    latest = after if after.stacks_read else (sampled[-1] if sampled else None)
    return (_frames_of(latest, tid) or ()) if latest is not None else ()


def _functions(frames: Sequence[str]) -> tuple[str, ...]:
    """The frames without their lines: a loop moves between its own lines, a spin-wait
    between its condition and its body, and stays in its functions all the same."""
    return tuple(_LINE.sub(")", frame) for frame in frames)


def _sample_of(reading: ProcessActivity, tid: int) -> ThreadActivity | None:
    return next((t for t in reading.threads if t.tid == tid), None)


def _frames_of(reading: ProcessActivity, tid: int) -> tuple[str, ...] | None:
    sample = _sample_of(reading, tid)
    return sample.frames if sample is not None else None


def _busy(
    threads: Iterable[ThreadActivity], earlier: dict[int, ThreadActivity], interval: float
) -> list[tuple[ThreadActivity, float]]:
    """The threads that used a CPU for `WORKING_SHARE` of the interval, busiest first."""
    used = [(t, t.cpu_seconds - _cpu(earlier.get(t.tid))) for t in threads]
    busy = [(t, gained) for t, gained in used if gained >= WORKING_SHARE * interval]
    return sorted(busy, key=lambda pair: -pair[1])


def _starved_thread(
    threads: Iterable[ThreadActivity], earlier: dict[int, ThreadActivity], interval: float
) -> tuple[ThreadActivity, float] | None:
    """A thread that waited for a CPU a share of the interval, and longer than it ran."""
    for thread in threads:
        previous = earlier.get(thread.tid)
        if previous is None:
            continue
        waited = thread.cpu_wait_seconds - previous.cpu_wait_seconds
        ran = thread.cpu_seconds - previous.cpu_seconds
        if waited >= STARVED_SHARE * interval and waited > ran:
            return thread, waited
    return None


def _waits_on_children(activity: ProcessActivity) -> bool:
    """A thread of the process sleeps in wait(2) or on a pipe: how a parent waits on a
    child it started (subprocess.run, a compiler's output read through a pipe)."""
    return any(t.wait_channel in CHILD_WAIT_CHANNELS for t in activity.threads)


def _matches(frames: Sequence[str], markers: Sequence[str]) -> bool:
    return any(marker in frame for frame in frames for marker in markers)


def _named(frames: Sequence[str], markers: Sequence[str]) -> str:
    """The innermost frame that matches one of `markers`."""
    return next(frame for frame in frames if any(marker in frame for marker in markers))


def _cpu(thread: ThreadActivity | None) -> float:
    return thread.cpu_seconds if thread is not None else 0.0


def _child_cpu(child: ChildActivity | None) -> float:
    return child.cpu_seconds if child is not None else 0.0


def _child_state(child: ChildActivity | None) -> str:
    return child.state if child is not None else ""
