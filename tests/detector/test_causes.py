"""Why a silent stage process is silent, from two readings of it: a table per cause."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from omni_watchdog.detector.causes import (
    COMPARED_SPAN,
    SAMPLES_KEPT,
    SPIN_SAMPLES,
    CauseFinding,
    compared_reading,
    process_cause,
    stage_cause,
)
from omni_watchdog.types import ChildActivity, ProcessActivity, SilenceCause, ThreadActivity

PID = 100
INTERVAL = 2.0
INDUCTOR = "codegen (/venv/lib/python3.11/site-packages/torch/_inductor/codegen/cpp.py)"
FORWARD = "forward (/models/tiny.py)"
STEP = "execute_model (/venv/lib/python3.11/site-packages/vllm/v1/worker/gpu_worker.py)"
SYNC = "synchronize (/venv/lib/python3.11/site-packages/torch/cuda/__init__.py)"
SAFETENSORS = "load_file (/venv/lib/python3.11/site-packages/safetensors/torch.py)"
QUEUE_WAIT = "acquire_read (/venv/lib/python3.11/site-packages/vllm/shm_broadcast.py)"


@dataclass(frozen=True)
class Thread:
    """A thread's change between the two readings."""

    state: str = "S"
    wchan: str = "futex_do_wait"
    ran: float = 0.0
    waited: float = 0.0
    frames: tuple[str, ...] = ()
    frames_before: tuple[str, ...] | None = None  # None: the same as now
    tid: int = PID
    gil: bool = False  # it held the GIL in every sample


@dataclass(frozen=True)
class Child:
    name: str
    ran: float
    state: str = "R"
    new: bool = False
    pid: int = 200


def readings(
    threads: tuple[Thread, ...] = (Thread(),),
    children: tuple[Child, ...] = (),
    stacks: bool = False,
    samples_before: int = SPIN_SAMPLES - 1,
    interval: float = INTERVAL,
) -> tuple[ProcessActivity, ProcessActivity, tuple[ProcessActivity, ...]]:
    """Two readings `interval` apart in which each thread and child did what it says, and
    with `stacks`, `samples_before` earlier samples that showed the frames before."""
    before_threads, after_threads = [], []
    for thread in threads:
        frames_before = thread.frames if thread.frames_before is None else thread.frames_before
        before_threads.append(
            ThreadActivity(
                thread.tid, thread.state, thread.wchan, 10.0, 1.0, frames_before, thread.gil
            )
        )
        after_threads.append(
            ThreadActivity(
                thread.tid,
                thread.state,
                thread.wchan,
                10.0 + thread.ran,
                1.0 + thread.waited,
                thread.frames,
                thread.gil,
            )
        )
    before_children = tuple(
        ChildActivity(c.pid, c.name, c.state, 5.0) for c in children if not c.new
    )
    after_children = tuple(
        ChildActivity(c.pid, c.name, c.state, (0.0 if c.new else 5.0) + c.ran) for c in children
    )
    before = ProcessActivity(PID, 50.0, tuple(before_threads), before_children, stacks)
    after = ProcessActivity(PID, 50.0 + interval, tuple(after_threads), after_children, stacks)
    return before, after, (before,) * samples_before if stacks else ()


CASES = {
    "a SIGSTOPped stage process is stopped, whatever else it does": (
        readings((Thread(state="T", wchan="do_signal_stop"),), (Child("g++", 2.0),)),
        SilenceCause.STOPPED,
        False,
        "pid 100 stopped (T)",
    ),
    "a thread held in D for the whole interval is stopped there": (
        readings((Thread(state="D", wchan="nv_wait_event"),)),
        SilenceCause.STOPPED,
        False,
        "uninterruptible sleep (D) in nv_wait_event",
    ),
    "a thread in D at both readings that ran between them is no stop: short waits": (
        readings((Thread(state="D", wchan="nv_wait_event", ran=0.01),)),
        SilenceCause.LOCK_OR_QUEUE_WAIT,
        False,
        "asleep in nv_wait_event",
    ),
    "a thread in D at two readings a moment apart is not yet stopped": (
        readings((Thread(state="D", wchan="nv_wait_event"),), interval=0.3),
        SilenceCause.LOCK_OR_QUEUE_WAIT,
        False,
        "asleep in nv_wait_event",
    ),
    "a g++ child at full CPU is a compile, advancing": (
        readings(
            (Thread(wchan="do_wait"),),
            (Child("g++", 0.1, state="S"), Child("cc1plus", 1.96, pid=201)),
        ),
        SilenceCause.COMPILING,
        True,
        "cc1plus pid 201 at 98% CPU",
    ),
    "a ptxas child started since the last reading is a compile": (
        readings((Thread(wchan="anon_pipe_read"),), (Child("ptxas", 1.5, new=True),)),
        SilenceCause.COMPILING,
        True,
        "ptxas pid 200 at 75% CPU",
    ),
    "a compiler's next pass, started since the last reading, no tick yet, is a compile": (
        readings(
            (Thread(wchan="do_wait"),),
            (Child("g++", 0.0, state="S"), Child("as", 0.0, state="S", new=True, pid=201)),
        ),
        SilenceCause.COMPILING,
        True,
        "as pid 201 at 0% CPU",
    ),
    "a child started since the last reading and stopped is work stopped": (
        readings((Thread(wchan="do_wait"),), (Child("cc1plus", 0.0, state="T", new=True),)),
        SilenceCause.WAITING_ON_CHILD,
        False,
        "waits on cc1plus pid 200: stopped (T)",
    ),
    "another child working for it is waited on, advancing": (
        readings((Thread(wchan="do_wait"),), (Child("python3", 1.9),)),
        SilenceCause.WAITING_ON_CHILD,
        True,
        "python3 pid 200 at 95% CPU",
    ),
    "a compiler child runnable throughout but given no CPU is work waiting for one": (
        readings((Thread(wchan="do_wait"),), (Child("cc1plus", 0.0, state="R"),)),
        SilenceCause.COMPILING,
        True,
        "cc1plus pid 200 at 0% CPU",
    ),
    "a child that gained a little CPU on a loaded host still advances": (
        readings((Thread(wchan="do_wait"),), (Child("python3", 0.04, state="S"),)),
        SilenceCause.WAITING_ON_CHILD,
        True,
        "python3 pid 200 at 2% CPU",
    ),
    "a child it waits on that was stopped is work stopped": (
        readings((Thread(wchan="do_wait"),), (Child("cc1plus", 0.0, state="T"),)),
        SilenceCause.WAITING_ON_CHILD,
        False,
        "waits on cc1plus pid 200: stopped (T)",
    ),
    "a child it waits on that gains no CPU is no work": (
        readings((Thread(wchan="do_wait"),), (Child("sleep", 0.0, state="S"),)),
        SilenceCause.WAITING_ON_CHILD,
        False,
        "no CPU time gained",
    ),
    "a child it waits on, no tick gained between readings a moment apart, is not known": (
        readings((Thread(wchan="do_wait"),), (Child("cc1plus", 0.0, state="S"),), interval=0.3),
        SilenceCause.UNKNOWN,
        False,
        "waits on cc1plus pid 200: read over 0.3s only",
    ),
    "an idle child it does not wait on is no cause: a lock wait": (
        readings((Thread(wchan="futex_do_wait"),), (Child("resource_tracker", 0.0, state="S"),)),
        SilenceCause.LOCK_OR_QUEUE_WAIT,
        False,
        "asleep in futex_do_wait",
    ),
    "a thread that waited for a CPU longer than it ran is starved": (
        readings((Thread(state="R", wchan="", ran=0.3, waited=1.5),)),
        SilenceCause.STARVED,
        False,
        "waited 1.5s of 2.0s for a CPU",
    ),
    "a thread waiting for a CPU in inductor frames is compiling, slowly": (
        readings(
            (Thread(state="R", wchan="", ran=0.6, waited=1.2, frames=(INDUCTOR, FORWARD)),),
            stacks=True,
        ),
        SilenceCause.COMPILING,
        True,
        "at 30% CPU in codegen (/venv/lib/python3.11/site-packages/torch/_inductor/codegen/cpp.py),"
        " waited 1.2s of 2.0s for a CPU",
    ),
    "a thread barely run, waiting for a CPU in frames that name no work, is starved": (
        readings(
            (Thread(state="R", wchan="", ran=0.1, waited=1.2, frames=(FORWARD, STEP)),),
            stacks=True,
        ),
        SilenceCause.STARVED,
        False,
        "thread 100 waited 1.2s of 2.0s for a CPU",
    ),
    "spinning in one frame, holding the GIL, on a host that makes it wait is spinning": (
        # Measured on the real vLLM-Omni beside another server on two cores: the spinning
        # forward ran 7.1 s and waited 13.1 s of 15 s, and was judged starved.
        readings(
            (Thread(state="R", wchan="", ran=0.8, waited=1.1, frames=(FORWARD, STEP), gil=True),),
            stacks=True,
        ),
        SilenceCause.SPINNING,
        False,
        "in the same frames, holding the GIL",
    ),
    "busy with moving frames while a side thread waits for a CPU is computing": (
        readings(
            (
                Thread(
                    state="R",
                    wchan="",
                    ran=2.0,
                    frames=("matmul (/models/tiny.py)", FORWARD, STEP),
                    frames_before=("softmax (/models/tiny.py)", FORWARD, STEP),
                ),
                Thread(state="R", wchan="", ran=0.1, waited=0.5, tid=PID + 1),
            ),
            stacks=True,
        ),
        SilenceCause.COMPUTING,
        True,
        "its frames moving",
    ),
    "busy in inductor frames is compiling in-process, advancing": (
        readings((Thread(state="R", wchan="", ran=1.9, frames=(INDUCTOR, FORWARD)),), stacks=True),
        SilenceCause.COMPILING,
        True,
        "at 95% CPU in codegen",
    ),
    "busy in safetensors is loading": (
        readings((Thread(state="R", wchan="", ran=1.0, frames=(SAFETENSORS,)),), stacks=True),
        SilenceCause.LOADING,
        True,
        "load_file",
    ),
    "busy in a device synchronize is a device wait": (
        readings((Thread(state="R", wchan="", ran=2.0, frames=(SYNC, STEP)),), stacks=True),
        SilenceCause.DEVICE_WAIT,
        False,
        "synchronize",
    ),
    "asleep in a device synchronize is a device wait": (
        readings((Thread(wchan="futex_do_wait", frames=(SYNC, STEP)),), stacks=True),
        SilenceCause.DEVICE_WAIT,
        False,
        "asleep in synchronize",
    ),
    "busy holding the GIL in the same frames in every sample is spinning": (
        readings(
            (Thread(state="R", wchan="", ran=2.0, frames=(FORWARD, STEP), gil=True),),
            stacks=True,
        ),
        SilenceCause.SPINNING,
        False,
        "in the same frames, holding the GIL, 3 samples running: forward",
    ),
    "a spin-wait moving between the lines of its loop, holding the GIL, is a spin": (
        readings(
            (
                Thread(
                    state="R",
                    wchan="",
                    ran=2.0,
                    frames=("wait_ready (/models/tiny.py:41)", STEP),
                    frames_before=("wait_ready (/models/tiny.py:40)", STEP),
                    gil=True,
                ),
            ),
            stacks=True,
        ),
        SilenceCause.SPINNING,
        False,
        "holding the GIL",
    ),
    "busy in the same frames without the GIL is one long native call, advancing": (
        readings((Thread(state="R", wchan="", ran=2.0, frames=(FORWARD, STEP)),), stacks=True),
        SilenceCause.COMPUTING,
        True,
        "in one native call, 3 samples running: forward",
    ),
    "busy with frames that move is computing, advancing": (
        readings(
            (
                Thread(
                    state="R",
                    wchan="",
                    ran=2.0,
                    frames=("matmul (/models/tiny.py)", FORWARD, STEP),
                    frames_before=("softmax (/models/tiny.py)", FORWARD, STEP),
                ),
            ),
            stacks=True,
        ),
        SilenceCause.COMPUTING,
        True,
        "its frames moving: matmul",
    ),
    "busy in the same frames, sampled too few times to tell, is unknown, never work": (
        readings(
            (Thread(state="R", wchan="", ran=2.0, frames=(FORWARD, STEP)),),
            stacks=True,
            samples_before=1,
        ),
        SilenceCause.UNKNOWN,
        False,
        "its stack sampled 2 of 3 times",
    ),
    "busy without its stack read is unknown, never work": (
        readings((Thread(state="R", wchan="", ran=2.0),)),
        SilenceCause.UNKNOWN,
        False,
        "at 100% CPU, its stack not read",
    ),
    "asleep on its queue with nothing working for it is a queue wait": (
        readings((Thread(wchan="futex_do_wait", frames=(QUEUE_WAIT, STEP)),), stacks=True),
        SilenceCause.LOCK_OR_QUEUE_WAIT,
        False,
        "asleep in acquire_read",
    ),
    "a thread other than the busy one that spins is what is read": (
        readings(
            (
                Thread(tid=PID, wchan="futex_do_wait", frames=(QUEUE_WAIT,)),
                Thread(tid=PID + 1, state="R", wchan="", ran=1.8, frames=(FORWARD,), gil=True),
            ),
            stacks=True,
        ),
        SilenceCause.SPINNING,
        False,
        "thread 101 at 90% CPU",
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_process_cause_from_two_readings(name: str) -> None:
    (before, after, sampled), cause, working, detail = CASES[name]
    finding = process_cause(before, after, sampled)
    assert (finding.cause, finding.working) == (cause, working), finding
    assert detail in finding.detail, finding


def test_one_reading_is_no_cause() -> None:
    before, _, _ = readings()
    assert process_cause(before, before).cause is SilenceCause.UNKNOWN


STAGE_CASES = {
    "the engine waits on its queue while its worker compiles: compiling": (
        [
            CauseFinding(SilenceCause.LOCK_OR_QUEUE_WAIT, False, "engine"),
            CauseFinding(SilenceCause.COMPILING, True, "worker"),
        ],
        "worker",
    ),
    "one process stopped stops the stage, whatever the other does": (
        [
            CauseFinding(SilenceCause.COMPILING, True, "worker"),
            CauseFinding(SilenceCause.STOPPED, False, "engine"),
        ],
        "engine",
    ),
    "a spinning worker beside a waiting engine: spinning": (
        [
            CauseFinding(SilenceCause.LOCK_OR_QUEUE_WAIT, False, "engine"),
            CauseFinding(SilenceCause.SPINNING, False, "worker"),
        ],
        "worker",
    ),
}


@pytest.mark.parametrize("name", list(STAGE_CASES))
def test_a_stage_cause_from_its_processes(name: str) -> None:
    findings, chosen = STAGE_CASES[name]
    assert stage_cause(findings).detail == chosen


def test_a_stage_with_no_process_read_has_an_unknown_cause() -> None:
    assert stage_cause([]).cause is SilenceCause.UNKNOWN


def test_once_its_frames_moved_a_few_samples_on_one_line_are_no_spin() -> None:
    """Python work that dwells on one line is not a spin for it: after its frames moved in
    this silence, it takes SAMPLES_KEPT samples in a row on one line."""
    spinning = Thread(state="R", wchan="", ran=2.0, frames=(FORWARD, STEP), gil=True)
    moved = Thread(state="R", wchan="", ran=2.0, frames=("softmax (/models/tiny.py)",), gil=True)
    before, after, _ = readings((spinning,), stacks=True)
    earliest = readings((moved,), stacks=True)[1]
    # The latest sample is `after`: with `on_one_line - 1` before it, on its line.
    for on_one_line in range(SPIN_SAMPLES, SAMPLES_KEPT):
        sampled = (earliest, *(after,) * (on_one_line - 1))
        finding = process_cause(before, after, sampled)
        assert finding.cause is SilenceCause.COMPUTING and finding.working, (on_one_line, finding)
    sampled = (earliest, *(after,) * (SAMPLES_KEPT - 1))
    assert process_cause(before, after, sampled).cause is SilenceCause.SPINNING


def test_a_spin_that_sometimes_yields_the_gil_to_other_threads_is_still_a_spin() -> None:
    """Measured on a spinning Python thread beside another: one sample in three caught the
    interpreter handing the GIL over."""
    holding = Thread(state="R", wchan="", ran=2.0, frames=(FORWARD, STEP), gil=True)
    yielded = Thread(state="R", wchan="", ran=2.0, frames=(FORWARD, STEP), gil=False)
    before, after, _ = readings((holding,), stacks=True)
    _, handed_over, _ = readings((yielded,), stacks=True)
    assert process_cause(before, after, (after, handed_over)).cause is SilenceCause.SPINNING
    assert process_cause(before, handed_over, (handed_over, after)).cause is (
        SilenceCause.COMPUTING
    )


def test_a_reading_is_compared_with_the_latest_one_a_span_before_it() -> None:
    def at(time: float) -> ProcessActivity:
        return ProcessActivity(PID, time, (ThreadActivity(PID, "S", "", 1.0, 0.0),))

    every_half_second = [at(10.0 + 0.5 * i) for i in range(8)]  # 10.0 .. 13.5
    assert compared_reading(every_half_second, at(14.0)).time == 14.0 - COMPARED_SPAN
    assert compared_reading(every_half_second, at(13.7)).time == 11.5
    # The silence has only begun: the oldest there is.
    assert compared_reading(every_half_second[:2], at(11.0)).time == 10.0
