"""The process tracker: attach, record the tree, map stages, orphans, pid reuse, re-attach.

The first half drives a fake process table; the second half starts a real process tree
(API root -> spawn stage workers -> titled engine children, plus a setsid child, a zombie
and, on demand, a stopped or killed process) and kills all of it at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from itertools import pairwise
from pathlib import Path

import psutil
import pytest
from deadline import wait_for, wait_until
from fakes import SERVER_PORT, FakePsutil
from ports import free_port

from omni_watchdog.clock import FakeClock, SystemClock
from omni_watchdog.policy.actuators import SignalGuard, is_alive
from omni_watchdog.probes import processes
from omni_watchdog.probes.exits import ExitNotices
from omni_watchdog.probes.processes import ProcessTracker, ThreadWaits
from omni_watchdog.process_start import start_time
from omni_watchdog.types import (
    Observation,
    ObservationKind,
    ProbeError,
    ProcessIdentity,
    ProcessInfo,
    ProcessRole,
    ProcessStatus,
    Stage,
    StageRef,
    Topology,
    TopologyOrigin,
)

TWO_STAGES = Topology((Stage(0, "thinker", downstream=(1,)), Stage(1, "talker", upstream=(0,))))
SPAWN_CMDLINE = [
    "/usr/bin/python3",
    "-c",
    "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5, pipe_handle=7)",
    "--multiprocessing-fork",
]
TRACKER_CMDLINE = [
    "/usr/bin/python3",
    "-c",
    "from multiprocessing.resource_tracker import main;main(4)",
]
OWN_PID = 50


def groups_of(pid: int) -> tuple[int, int]:
    # Everyone is in the root's group except the watchdog, which has its own.
    return (OWN_PID, OWN_PID) if pid == OWN_PID else (100, 100)


def fake_tracker(
    table: FakePsutil,
    pid: int | None = None,
    topology: Topology = TWO_STAGES,
    cpu_wait: Callable[[int, bool], float] = lambda pid, runnable: 0.0,
) -> ProcessTracker:
    return ProcessTracker(
        table,
        FakeClock(),
        own_pid=OWN_PID,
        target_port=None if pid else SERVER_PORT,
        pid=pid,
        topology=topology,
        process_groups=groups_of,
        start_time=table.start_time,
        # The fake's start times are whole seconds: a tick is a second here.
        start_time_of_ticks=float,
        cpu_wait=cpu_wait,
    )


def collect(tracker: ProcessTracker) -> list[Observation]:
    return list(asyncio.run(tracker.collect()))


def by_pid(tracker: ProcessTracker) -> dict[int, ProcessInfo]:
    return {info.pid: info for info in tracker.recorded()}


def roles(tracker: ProcessTracker) -> dict[int, tuple[ProcessRole, StageRef | None]]:
    return {pid: (info.role, info.stage) for pid, info in by_pid(tracker).items()}


def test_titles_map_roles_and_stages() -> None:
    table = FakePsutil()
    table.add(100, 1, "vllm serve --omni")
    table.add(101, 100, "VLLM::StageEngineCoreProc_stage0_replica0_DP0")
    table.add(102, 100, "VLLM::StageEngineCoreProc_stage1_replica1_DP0")
    table.add(103, 102, "VLLM::Worker_TP0")
    table.add(104, 100, TRACKER_CMDLINE)
    table.add(105, 100, "VLLM::EngineCore_DP1")
    table.add(106, 105, "VLLM::Worker")
    table.add(107, 102, "VLLM::EngineCore")
    table.listening = [100]
    tracker = fake_tracker(table)
    observations = [o for o in collect(tracker) if o.kind is ObservationKind.PROCESS]
    assert roles(tracker) == {
        100: (ProcessRole.API, None),
        101: (ProcessRole.ENGINE, StageRef(0, 0)),
        102: (ProcessRole.ENGINE, StageRef(1, 1)),
        103: (ProcessRole.WORKER, StageRef(1, 1)),
        104: (ProcessRole.HELPER, None),
        105: (ProcessRole.ENGINE, StageRef(0, 1)),
        106: (ProcessRole.WORKER, StageRef(0, 1)),
        107: (ProcessRole.ENGINE, StageRef(1, 1)),
    }
    assert sorted(o.pid or 0 for o in observations) == [100, 101, 102, 103, 104, 105, 106, 107]
    assert observations[0].process == tracker.root
    assert {o.outcome for o in observations} == {"sleeping"}
    assert {o.pid: o.stage for o in observations}[102] == StageRef(1, 1)
    info = by_pid(tracker)[101]
    assert (info.title, info.cpu_seconds, info.pgid, info.sid) == (
        "VLLM::StageEngineCoreProc_stage0_replica0_DP0",
        2.0,
        100,
        100,
    )
    assert tracker.stage_of(103) == StageRef(1, 1)
    assert tracker.stage_of(999) is None
    assert tracker.pgids() == {100}


def test_spawn_order_maps_0_11_stage_workers_and_keeps_ranks() -> None:
    table = FakePsutil()
    table.add(100, 1, "python -m vllm_omni.entrypoints.cli serve --omni")
    table.add(101, 100, TRACKER_CMDLINE)
    table.add(110, 100, SPAWN_CMDLINE)
    table.add(120, 100, SPAWN_CMDLINE)
    table.add(130, 100, SPAWN_CMDLINE)
    table.add(111, 110, "VLLM::EngineCore")
    table.add(121, 120, "VLLM::EngineCore")
    table.listening = [100]
    tracker = fake_tracker(table)
    collect(tracker)
    assert roles(tracker) == {
        100: (ProcessRole.API, None),
        101: (ProcessRole.HELPER, None),
        110: (ProcessRole.STAGE, StageRef(0)),
        120: (ProcessRole.STAGE, StageRef(1)),
        130: (ProcessRole.HELPER, None),
        111: (ProcessRole.ENGINE, StageRef(0)),
        121: (ProcessRole.ENGINE, StageRef(1)),
    }
    del table.table[110]
    table.table[111].parent = 1
    collect(tracker)
    assert roles(tracker)[120] == (ProcessRole.STAGE, StageRef(1))
    assert by_pid(tracker)[111].orphaned
    assert roles(tracker)[111] == (ProcessRole.ENGINE, StageRef(0))


def test_a_replica_that_dies_untitled_keeps_the_stage_its_titled_siblings_leave() -> None:
    """0.30: a replica that dies before the tracker sees its title is still its stage's."""
    replicas = Topology(
        (
            Stage(0, "thinker", downstream=(1,)),
            Stage(1, "talker", upstream=(0,), downstream=(2,), replicas=2),
            Stage(2, "code2wav", upstream=(1,)),
        )
    )
    table = FakePsutil()
    table.add(100, 1, "vllm serve --omni")
    table.add(101, 100, TRACKER_CMDLINE)
    for pid in (110, 120, 121, 130):
        table.add(pid, 100, SPAWN_CMDLINE)
    table.listening = [100]
    tracker = fake_tracker(table, topology=replicas)
    collect(tracker)
    # Every replica is untitled at first: spawn order is all there is.
    assert [roles(tracker)[pid][1] for pid in (110, 120, 121, 130)] == [
        StageRef(0),
        StageRef(1, 0),
        StageRef(1, 1),
        StageRef(2),
    ]
    for pid, title in (
        (110, "VLLM::StageEngineCoreProc_stage0_replica0_DP0"),
        (121, "VLLM::StageEngineCoreProc_stage1_replica1_DP0"),
        (130, "VLLM::StageEngineCoreProc_stage2_replica0_DP0"),
    ):
        table.table[pid].argv = [title]
    collect(tracker)
    assert roles(tracker)[120] == (ProcessRole.STAGE, StageRef(1, 0))
    del table.table[120]
    observations = collect(tracker)
    exit_seen = next(o for o in observations if o.pid == 120)
    assert (exit_seen.outcome, exit_seen.stage) == ("exited", StageRef(1, 0))
    assert roles(tracker)[110] == (ProcessRole.ENGINE, StageRef(0))


def test_learned_stages_beat_titles_and_spawn_order() -> None:
    table = FakePsutil()
    table.add(100, 1, "vllm serve")
    table.add(101, 100, "python worker.py")
    table.add(102, 100, "VLLM::EngineCore")
    table.listening = [100]
    tracker = fake_tracker(table)
    tracker.learn_stage(101, StageRef(2, 1), "engine")
    tracker.learn_stage(102, StageRef(3), None)
    tracker.learn_stage(100, StageRef(0), "orchestrator")
    collect(tracker)
    assert roles(tracker) == {
        100: (ProcessRole.API, StageRef(0)),
        101: (ProcessRole.ENGINE, StageRef(2, 1)),
        102: (ProcessRole.ENGINE, StageRef(3)),
    }


def test_secrets_on_a_command_line_never_reach_a_title() -> None:
    table = FakePsutil()
    table.add(100, 1, "vllm serve m --api-key sk-123 --hf-token=hf_abc --port 8000")
    table.listening = [100]
    tracker = fake_tracker(table)
    collect(tracker)
    assert by_pid(tracker)[100].title == "vllm serve m --api-key *** --hf-token=*** --port 8000"


def test_spans_may_speak_only_for_live_recorded_processes_and_known_stages() -> None:
    table = FakePsutil()
    table.add(100, 1, "vllm serve --omni")
    table.add(101, 100, "VLLM::StageEngineCoreProc_stage0_replica0_DP0")
    table.add(102, 100, "VLLM::StageEngineCoreProc_stage5_replica0_DP0")
    table.listening = [100]
    tracker = fake_tracker(table)
    collect(tracker)
    started = int(by_pid(tracker)[101].create_time)
    assert tracker.owns(101, started)
    assert not tracker.owns(101, started + 1)  # the same pid, another process
    assert not tracker.owns(999, started)
    assert not tracker.owns(101, None) and not tracker.owns(None, started)
    # Stage 1 is the topology's; stage 5 is named by a live process's title; 7 by nothing.
    assert tracker.knows(StageRef(1)) and tracker.knows(StageRef(5))
    assert not tracker.knows(StageRef(7)) and not tracker.knows(StageRef(0, 3))
    assert tracker.maps(StageRef(0)) and not tracker.maps(StageRef(1))
    del table.table[101]
    collect(tracker)
    assert not tracker.owns(101, started)
    assert not tracker.maps(StageRef(0)) and tracker.knows(StageRef(0))


def test_zombies_stopped_and_disk_sleep_are_reported() -> None:
    table = FakePsutil()
    table.add(100, 1, "vllm serve")
    table.add(101, 100, "VLLM::EngineCore", status="running")
    table.add(102, 100, "VLLM::Worker", status="tracing-stop")
    table.add(103, 100, "helper", status="disk-sleep")
    table.listening = [100]
    tracker = fake_tracker(table)
    collect(tracker)
    table.table[101].state = "zombie"
    outcomes = {o.pid: o.outcome for o in collect(tracker)}
    assert outcomes == {100: "sleeping", 101: "zombie", 102: "stopped", 103: "disk_sleep"}
    # A zombie's command line is gone; it is still known as the engine it was.
    assert roles(tracker)[101] == (ProcessRole.ENGINE, StageRef(0))


def test_a_worker_already_a_zombie_when_first_read_is_still_its_stages_worker() -> None:
    """Measured on the real vLLM-Omni: a worker killed by its first forward, the canary's,
    was a zombie at the first scan; with no command line left it was a nameless helper,
    and its stage was judged `stalled` before its engine's exit made it `dead`."""
    table = FakePsutil()
    table.add(100, 1, "vllm serve --omni")
    table.add(101, 100, "VLLM::StageEngineCoreProc_stage0_replica0_DP0")
    table.add(102, 101, "VLLM::Worker", status="zombie").comm = "VLLM::Worker"
    table.add(103, 101, "lscpu", status="zombie").comm = "lscpu"
    table.listening = [100]
    tracker = fake_tracker(table)
    outcomes = {o.pid: o.outcome for o in collect(tracker)}
    assert (outcomes[102], outcomes[103]) == ("zombie", "zombie")
    assert roles(tracker)[102] == (ProcessRole.WORKER, StageRef(0))
    assert roles(tracker)[103] == (ProcessRole.HELPER, None)


def test_pid_reuse_is_an_exit_and_the_new_process_is_not_ours() -> None:
    table = FakePsutil()
    table.add(100, 1, "vllm serve")
    table.add(101, 100, "VLLM::EngineCore")
    table.add(102, 100, "helper")
    table.listening = [100]
    tracker = fake_tracker(table)
    collect(tracker)
    old = by_pid(tracker)[101].identity
    table.table[101].parent = 1  # left the tree: an orphan while it lives
    assert [o.outcome for o in collect(tracker) if o.pid == 101] == ["sleeping"]
    table.add(101, 1, "someone else's program")
    exits = [o for o in collect(tracker) if o.pid == 101]
    assert [(o.outcome, o.process and o.process.create_time) for o in exits] == [
        ("exited", old.create_time)
    ]
    assert [o.pid for o in collect(tracker)] == [100, 102]
    assert tracker.is_recorded(old)
    assert not tracker.is_recorded(ProcessIdentity(101, table.table[101].started))
    assert tracker.stage_of(101) is None
    assert 101 not in {info.pid for info in tracker.live()}


def test_a_reused_pid_inside_the_tree_is_a_new_member() -> None:
    table = FakePsutil()
    table.add(100, 1, "vllm serve")
    table.add(101, 100, "VLLM::EngineCore")
    table.listening = [100]
    tracker = fake_tracker(table)
    collect(tracker)
    table.add(101, 100, "VLLM::EngineCore")
    outcomes = sorted(
        (o.process.create_time, o.outcome) for o in collect(tracker) if o.pid == 101 and o.process
    )
    assert [outcome for _, outcome in outcomes] == ["exited", "sleeping"]
    assert len(tracker.recorded()) == 3


def test_attach_by_port_climbs_to_the_oldest_sharer_never_the_watchdog_or_init() -> None:
    table = FakePsutil()
    table.add(OWN_PID, 1, "omni-watchdog run")
    table.add(100, 1, "vllm serve")
    table.add(101, 100, "uvicorn worker")
    table.add(102, 101, "uvicorn worker")
    table.listening = [102, 101, 100, OWN_PID, 1]
    tracker = fake_tracker(table)
    collect(tracker)
    assert tracker.root is not None and tracker.root.pid == 100
    assert tracker.generation == 1 and tracker.target_alive
    table.listening = [OWN_PID, 1]
    with pytest.raises(ProbeError, match="no process listens"):
        collect(fake_tracker(table))


def test_no_server_is_a_probe_error_until_one_appears() -> None:
    table = FakePsutil()
    tracker = fake_tracker(table)
    with pytest.raises(ProbeError, match="no process listens on port 8000"):
        collect(tracker)
    table.add(100, 1, "vllm serve")
    table.listening = [100]
    assert [o.pid for o in collect(tracker)] == [100]
    with pytest.raises(ProbeError, match="no process with pid 7"):
        collect(fake_tracker(table, pid=7))
    with pytest.raises(ProbeError, match="is the watchdog or init"):
        collect(fake_tracker(table, pid=OWN_PID))


def test_pid_mode_never_attaches_to_a_reused_root_pid() -> None:
    table = FakePsutil()
    table.add(100, 1, "vllm serve")
    tracker = fake_tracker(table, pid=100)
    collect(tracker)
    table.add(100, 1, "another program")
    assert [o.outcome for o in collect(tracker)] == ["exited"]
    assert collect(tracker) == []
    assert (tracker.generation, tracker.target_alive) == (1, False)


def test_a_survivor_holding_the_old_socket_is_not_a_new_server() -> None:
    table = FakePsutil()
    table.add(100, 1, "vllm serve")
    table.add(101, 100, "forked worker")
    table.listening = [100, 101]
    tracker = fake_tracker(table)
    collect(tracker)
    del table.table[100]
    table.table[101].parent = 1
    table.listening = [101]
    observations = collect(tracker)
    assert [(o.pid, o.outcome, o.process and o.process.orphaned) for o in observations] == [
        (100, "exited", False),
        (101, "sleeping", True),
    ]
    assert (tracker.generation, tracker.target_alive) == (1, False)


def test_pgids_never_include_the_watchdogs_own_group() -> None:
    table = FakePsutil()
    table.add(100, 1, "vllm serve")
    table.listening = [100]
    tracker = ProcessTracker(
        table,
        FakeClock(),
        own_pid=OWN_PID,
        target_port=SERVER_PORT,
        pid=None,
        topology=TWO_STAGES,
        process_groups=lambda pid: (7, 7),
        start_time=table.start_time,
    )
    collect(tracker)
    assert tracker.pgids() == set()


def test_a_resumed_incidents_processes_are_adopted_while_they_are_the_same_processes() -> None:
    table = FakePsutil()
    old_root = table.add(100, 1, "vllm serve m --api-key sk-123")
    engine = table.add(101, 100, "VLLM::EngineCore", status="disk-sleep")
    reused = table.add(102, 100, "someone else's program")
    root = ProcessIdentity(100, old_root.started)
    journal = (
        root,
        ProcessIdentity(101, engine.started),
        ProcessIdentity(102, reused.started - 1.0),  # the pid now belongs to another
        ProcessIdentity(103, 1.0),  # gone
    )
    # The old server hangs without its socket; a new one answers on the port.
    table.add(200, 1, "vllm serve m")
    table.listening = [200]
    tracker = fake_tracker(table)
    adopted = asyncio.run(tracker.adopt(journal, root))
    assert [(i.identity, i.role, i.status, i.title) for i in adopted] == [
        (root, ProcessRole.API, ProcessStatus.SLEEPING, "vllm serve m --api-key ***"),
        (journal[1], ProcessRole.HELPER, ProcessStatus.DISK_SLEEP, "VLLM::EngineCore"),
    ]
    assert tracker.recorded() == ()

    collect(tracker)
    assert tracker.root is not None and tracker.root.pid == 200
    assert [tracker.is_recorded(identity) for identity in journal] == [True, True, False, False]
    assert not tracker.is_recorded(ProcessIdentity(102, reused.started))
    guard = SignalGuard(
        table, tracker.is_recorded, OWN_PID, OWN_PID, table.getpgid, table.start_time
    )
    assert guard.check_process(journal[1]) == ""
    assert guard.check_process(journal[2]) == "not a recorded process of the target"


# --- a real process tree ------------------------------------------------------------------

SERVER_PROGRAM = """
import multiprocessing, os, socket, sys, time
import setproctitle

def engine():
    setproctitle.setproctitle("VLLM::EngineCore")
    time.sleep(600)

def stage_worker():
    multiprocessing.get_context("fork").Process(target=engine).start()
    time.sleep(600)

if __name__ == "__main__":
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", int(sys.argv[1])))
    listener.listen()
    spawn = multiprocessing.get_context("spawn")
    for _ in range(2):
        spawn.Process(target=stage_worker).start()
    if os.fork() == 0:
        listener.close()
        os.setsid()
        setproctitle.setproctitle("escaped-helper")
        time.sleep(600)
        os._exit(0)
    if os.fork() == 0:
        os._exit(0)  # never waited for: a zombie
    print("ready", flush=True)
    time.sleep(600)
"""


class Servers:
    """Starts test servers and kills every process they or the trackers ever saw."""

    def __init__(self, directory: Path) -> None:
        self.program = directory / "server.py"
        self.program.write_text(SERVER_PROGRAM)
        self.started: list[subprocess.Popen[str]] = []
        self.trackers: list[ProcessTracker] = []

    def start(self, port: int) -> subprocess.Popen[str]:
        server = subprocess.Popen(
            [sys.executable, str(self.program), str(port)],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.started.append(server)
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        return server

    def tracker(self, *, port: int | None = None, pid: int | None = None) -> ProcessTracker:
        tracker = ProcessTracker(
            psutil,
            SystemClock(),
            own_pid=os.getpid(),
            target_port=port,
            pid=pid,
            topology=TWO_STAGES,
        )
        self.trackers.append(tracker)
        return tracker

    def kill_all(self) -> None:
        ours = {
            info.identity
            for tracker in self.trackers
            for info in (*tracker.recorded(), *tracker.previous_generation())
        }
        for server in self.started:
            with contextlib.suppress(psutil.NoSuchProcess):
                root = psutil.Process(server.pid)
                ours.update(
                    ProcessIdentity(p.pid, start_time(p.pid))
                    for p in (root, *root.children(recursive=True))
                )
        for identity in ours:
            with contextlib.suppress(psutil.NoSuchProcess):
                if identity.matches(ProcessIdentity(identity.pid, start_time(identity.pid))):
                    os.kill(identity.pid, signal.SIGKILL)
        for server in self.started:
            server.kill()
            server.wait(timeout=10)
            assert server.stdout is not None
            server.stdout.close()


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Servers]:
    harness = Servers(tmp_path)
    try:
        yield harness
    finally:
        harness.kill_all()


def until(
    tracker: ProcessTracker,
    predicate: Callable[[ProcessTracker], bool],
    seen: list[Observation] | None = None,
    timeout: float = 15.0,
) -> None:
    """Collect until the predicate holds, keeping every observation in `seen`."""

    async def reached() -> bool:
        with contextlib.suppress(ProbeError):
            observations = await tracker.collect()
            if seen is not None:
                seen.extend(observations)
            return predicate(tracker)
        return False

    asyncio.run(wait_for(reached, timeout, "the predicate", 0.05, seen=tracker.recorded))


def engines(tracker: ProcessTracker) -> list[ProcessInfo]:
    return sorted(
        (i for i in tracker.live() if i.title == "VLLM::EngineCore"), key=lambda i: i.stage or ()
    )


def tree_ready(tracker: ProcessTracker) -> bool:
    return len(engines(tracker)) == 2 and all(i.stage for i in engines(tracker))


def test_real_tree_attached_by_port(servers: Servers) -> None:
    port = free_port()
    server = servers.start(port)
    tracker = servers.tracker(port=port)
    until(
        tracker, lambda t: tree_ready(t) and any(i.status == ProcessStatus.ZOMBIE for i in t.live())
    )
    root = tracker.root
    assert root is not None and (root.pid, root.role) == (server.pid, ProcessRole.API)
    assert tracker.target_alive and tracker.generation == 1
    live = tracker.live()
    stage_workers = sorted(
        (i for i in live if i.role == ProcessRole.STAGE), key=lambda i: i.create_time
    )
    assert [i.stage for i in stage_workers] == [StageRef(0), StageRef(1)]
    assert [e.ppid for e in engines(tracker)] == [w.pid for w in stage_workers]
    assert [e.role for e in engines(tracker)] == [ProcessRole.ENGINE] * 2
    (tracker_helper,) = (i for i in live if "resource_tracker" in i.title)
    assert tracker_helper.role == ProcessRole.HELPER
    (escaped,) = (i for i in live if i.title == "escaped-helper")
    assert (escaped.sid, escaped.pgid, escaped.orphaned) == (escaped.pid, escaped.pid, False)
    (zombie,) = (i for i in live if i.status == ProcessStatus.ZOMBIE)
    assert (zombie.ppid, zombie.role) == (server.pid, ProcessRole.HELPER)
    assert {i.pgid for i in live if i is not escaped} == {server.pid}
    assert tracker.pgids() == {server.pid, escaped.pid}

    stopped = engines(tracker)[1]
    os.kill(stopped.pid, signal.SIGSTOP)
    seen: list[Observation] = []
    until(tracker, lambda t: by_pid(t)[stopped.pid].status == ProcessStatus.STOPPED, seen)
    assert seen[-1].kind.value == "process"
    assert any(o.pid == stopped.pid and o.outcome == "stopped" for o in seen)
    assert tracker.stage_of(stopped.pid) == StageRef(1)


def test_a_stepped_wall_clock_leaves_the_recorded_tree_the_same(
    servers: Servers, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    server = servers.start(port)
    tracker = servers.tracker(port=port)
    until(tracker, tree_ready)
    before = {i.identity for i in tracker.live()}
    engine = engines(tracker)[0]
    # What the kernel does when the wall clock is stepped (NTP, a VM resumed after a
    # pause): /proc/stat's boot time moves, and psutil's create times with it.
    psutil_create_time = psutil.Process(engine.pid).create_time()
    booted = psutil.boot_time()
    monkeypatch.setattr("psutil._psplatform.boot_time", lambda: booted + 30.0)
    assert psutil.Process(engine.pid).create_time() == pytest.approx(psutil_create_time + 30.0)

    seen: list[Observation] = []
    until(tracker, lambda t: True, seen)
    assert tracker.target_alive and tracker.generation == 1
    assert {i.identity for i in tracker.live()} == before
    assert not [o for o in seen if o.outcome == "exited"]
    guard = SignalGuard(psutil, tracker.is_recorded)
    assert guard.check_process(engine.identity) == ""
    assert guard.check_group(server.pid) == ""
    assert is_alive(psutil, engine.identity)


def test_orphan_after_the_middle_process_is_killed(servers: Servers) -> None:
    port = free_port()
    server = servers.start(port)
    tracker = servers.tracker(pid=server.pid)
    until(tracker, tree_ready)
    engine = engines(tracker)[0]
    os.kill(engine.ppid, signal.SIGKILL)

    def orphaned(t: ProcessTracker) -> bool:
        return by_pid(t)[engine.pid].orphaned and by_pid(t)[engine.ppid].status in (
            ProcessStatus.ZOMBIE,
            ProcessStatus.EXITED,
        )

    until(tracker, orphaned)
    orphan = by_pid(tracker)[engine.pid]
    assert (orphan.stage, orphan.role, orphan.status) == (
        StageRef(0),
        ProcessRole.ENGINE,
        ProcessStatus.SLEEPING,
    )
    assert orphan.ppid != engine.ppid
    assert tracker.stage_of(engine.pid) == StageRef(0)

    os.kill(engine.pid, signal.SIGKILL)
    seen: list[Observation] = []
    until(tracker, lambda t: by_pid(t)[engine.pid].status == ProcessStatus.EXITED, seen)
    until(tracker, lambda t: True, seen)
    # Until its new parent reaps it, the killed orphan is a zombie; then it exits once. A
    # reading in the moment the kill wakes it to die finds it running (seen once on two
    # busy cores).
    outcomes = [o.outcome for o in seen if o.pid == engine.pid]
    assert outcomes.count(ProcessStatus.EXITED) == 1 and outcomes[-1] == "exited"
    assert set(outcomes[:-1]) <= {"sleeping", "running", "zombie"}
    assert engine.pid not in {i.pid for i in tracker.live()}
    assert tracker.is_recorded(engine.identity)


def test_the_kill_of_an_engine_ends_the_rest_before_the_next_scan_is_due(
    servers: Servers,
) -> None:
    port = free_port()
    server = servers.start(port)
    notices = ExitNotices(start_time)
    tracker = ProcessTracker(
        psutil,
        SystemClock(),
        own_pid=os.getpid(),
        target_port=None,
        pid=server.pid,
        topology=TWO_STAGES,
        exit_notices=notices,
    )
    servers.trackers.append(tracker)
    until(tracker, tree_ready)

    async def scenario() -> tuple[bool, ProcessStatus, bool]:
        await tracker.collect()
        engine = engines(tracker)[0]
        watched = engine.identity in notices.watched
        resting = asyncio.create_task(tracker.rest(60))
        await asyncio.sleep(0)
        os.kill(engine.pid, signal.SIGKILL)
        done, _ = await asyncio.wait({resting}, timeout=10)
        await tracker.collect()
        tracker.close()
        return bool(done), by_pid(tracker)[engine.pid].status, watched

    ended, status, watched = asyncio.run(scenario())
    assert watched
    assert ended
    # Its parent has not reaped it yet, or has: either way the scan records the exit.
    assert status in (ProcessStatus.ZOMBIE, ProcessStatus.EXITED)
    assert notices.watched == frozenset()


def test_reattach_to_a_restarted_server(servers: Servers) -> None:
    port = free_port()
    first = servers.start(port)
    tracker = servers.tracker(port=port)
    until(tracker, tree_ready)
    old_workers = [i for i in tracker.live() if i.role == ProcessRole.STAGE]
    first.kill()
    first.wait(timeout=10)
    seen: list[Observation] = []
    until(tracker, lambda t: not t.target_alive, seen)
    until(tracker, lambda t: True, seen)
    assert [o.outcome for o in seen if o.pid == first.pid] == ["exited"]
    assert tracker.generation == 1
    assert all(by_pid(tracker)[w.pid].orphaned for w in old_workers)

    second = servers.start(port)
    until(tracker, lambda t: t.generation == 2 and tree_ready(t))
    assert tracker.target_alive
    assert tracker.root is not None and tracker.root.pid == second.pid
    assert {i.pid for i in tracker.recorded()}.isdisjoint(
        {first.pid, *(w.pid for w in old_workers)}
    )
    previous = {i.pid: i for i in tracker.previous_generation()}
    assert previous[first.pid].status == ProcessStatus.EXITED
    assert all(previous[w.pid].orphaned for w in old_workers)
    assert all(tracker.is_recorded(w.identity) for w in old_workers)


def topologies(observations: list[Observation]) -> list[Topology]:
    return [o.topology for o in observations if o.kind is ObservationKind.TOPOLOGY and o.topology]


def test_0_30_titles_report_the_stage_replicas_they_name_once_and_keep_dead_ones() -> None:
    table = FakePsutil()
    table.add(100, 1, "vllm serve --omni")
    table.add(101, 100, "VLLM::StageEngineCoreProc_stage0_replica0_DP0")
    table.add(102, 101, "VLLM::Worker")
    table.add(103, 100, "VLLM::StageEngineCoreProc_stage1_replica1_DP0")
    table.listening = [100]
    tracker = fake_tracker(table)
    [first] = topologies(collect(tracker))
    assert (first.source, first.origin) == ("titles", TopologyOrigin.TITLES)
    assert [(s.stage_id, s.name, s.replicas) for s in first.stages] == [
        (0, "stage0", 1),
        (1, "stage1", 2),
    ]
    assert topologies(collect(tracker)) == []
    del table.table[103]
    assert topologies(collect(tracker)) == []
    table.add(104, 100, "VLLM::StageEngineCoreProc_stage2_replica0_DP0")
    [grown] = topologies(collect(tracker))
    assert [(s.stage_id, s.replicas) for s in grown.stages] == [(0, 1), (1, 2), (2, 1)]


def test_plain_vllm_and_0_11_titles_report_no_topology() -> None:
    table = FakePsutil()
    table.add(100, 1, "python -m vllm_omni.entrypoints.cli serve --omni")
    table.add(110, 100, SPAWN_CMDLINE)
    table.add(111, 110, "VLLM::EngineCore")
    table.add(112, 100, "VLLM::EngineCore_DP1")
    table.listening = [100]
    assert topologies(collect(fake_tracker(table))) == []


def test_the_servers_stage_config_is_read_once_per_attach() -> None:
    table = FakePsutil()
    table.add(100, 1, "vllm serve m --omni --stage-configs-path s.yaml")
    table.listening = [100]
    asked: list[int] = []
    config = Topology((Stage(0, "thinker"),), "cmdline:s.yaml", TopologyOrigin.SERVER_CONFIG)

    def read_config(pid: int) -> Topology | None:
        asked.append(pid)
        return config

    tracker = ProcessTracker(
        table,
        FakeClock(),
        own_pid=OWN_PID,
        target_port=SERVER_PORT,
        pid=None,
        topology=TWO_STAGES,
        process_groups=groups_of,
        start_time=table.start_time,
        start_time_of_ticks=float,
        server_topology=read_config,
    )
    assert topologies(collect(tracker)) == [config]
    assert topologies(collect(tracker)) == []
    del table.table[100]
    table.add(200, 1, "vllm serve m --omni")
    table.listening = [200]
    assert topologies(collect(tracker)) == [config]
    assert asked == [100, 200]


def test_a_new_topology_maps_0_11_stage_workers_it_names() -> None:
    table = FakePsutil()
    table.add(100, 1, "python -m vllm_omni.entrypoints.cli serve --omni")
    for pid in (110, 120, 130):
        table.add(pid, 100, SPAWN_CMDLINE)
    table.listening = [100]
    tracker = fake_tracker(table, topology=Topology((Stage(0, "engine"),)))
    collect(tracker)
    assert roles(tracker)[130] == (ProcessRole.HELPER, None)
    tracker.set_topology(Topology(tuple(Stage(i, f"s{i}") for i in range(3))))
    assert not tracker.knows(StageRef(5))
    collect(tracker)
    assert roles(tracker)[130] == (ProcessRole.STAGE, StageRef(2))
    assert tracker.knows(StageRef(2))


def test_each_process_carries_how_long_it_waited_for_a_cpu() -> None:
    table = FakePsutil()
    table.add(100, 1, "vllm serve --omni")
    table.add(101, 100, "VLLM::StageEngineCoreProc_stage0_replica0_DP0")
    table.listening = [100]
    tracker = fake_tracker(table, cpu_wait=lambda pid, runnable: pid / 100)
    collect(tracker)
    assert {pid: info.cpu_wait_seconds for pid, info in by_pid(tracker).items()} == {
        100: 1.0,
        101: 1.01,
    }


def test_the_kernels_run_queue_delay_is_read_from_every_thread_and_a_missing_one_is_zero() -> None:
    waits = ThreadWaits()
    schedstat = Path(f"/proc/{os.getpid()}/schedstat").read_text().split()
    # The first reading is the busiest-waiting thread's, the main thread's or more.
    assert waits(os.getpid(), True) >= int(schedstat[1]) / 1e9
    assert waits(2**22 + 1, False) == 0.0  # above any pid the kernel hands out


def write_waits(
    proc: Path, pid: int, seconds: dict[int, float], cpu: dict[int, float] | None = None
) -> None:
    for tid, waited in seconds.items():
        task = proc / str(pid) / "task" / str(tid)
        task.mkdir(parents=True, exist_ok=True)
        ran = (cpu or {}).get(tid, 0.123)
        (task / "schedstat").write_text(f"{int(ran * 1e9)} {int(waited * 1e9)} 7\n")


class ReadingClock:
    """A reading a second after the one before."""

    def __init__(self) -> None:
        self.now = -1.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@pytest.mark.parametrize(
    ("readings", "counters"),
    [
        pytest.param([{1: 0.2, 2: 0.5}], [0.5], id="first-reading-is-the-busiest-thread"),
        pytest.param(
            [{1: 0.2, 2: 0.5}, {1: 0.5, 2: 0.6}],
            [0.5, 0.8],
            id="a-side-thread-waiting-counts-though-the-main-one-does-not-wait",
        ),
        pytest.param(
            [{1: 1.0, 2: 1.0}, {1: 1.4, 2: 1.4}],
            [1.0, 1.4],
            id="threads-waiting-together-count-once-not-summed",
        ),
        pytest.param(
            [{1: 0.0, 2: 0.0}, {1: 0.0, 2: 0.0}, {1: 0.0, 2: 1.5}, {1: 1.8, 2: 1.5}],
            [0.0, 0.0, 1.5, 2.5],
            id="waits-that-show-at-different-readings-count-no-faster-than-time-passes",
        ),
        pytest.param(
            [{1: 1.0}, {1: 1.0, 3: 0.3}],
            [1.0, 1.3],
            id="a-new-thread-counts-its-whole-wait",
        ),
        pytest.param(
            [{1: 1.0, 2: 2.0}, {1: 0.1, 2: 0.2}],
            [2.0, 2.0],
            id="a-reused-pid-never-makes-the-counter-go-back",
        ),
    ],
)
def test_thread_waits_grow_by_the_busiest_threads_gain(
    tmp_path: Path, readings: list[dict[int, float]], counters: list[float]
) -> None:
    waits = ThreadWaits(tmp_path, ReadingClock())
    seen = []
    for reading in readings:
        write_waits(tmp_path, 100, reading)
        seen.append(waits(100, False))
    assert seen == pytest.approx(counters)


# Each row: readings a second apart of the main thread 100 (state R or not, CPU time, the
# kernel's wait) and of a side thread 101 (the kernel's wait), and the counter after each.
MAIN_THREAD_WAITS = [
    pytest.param(
        [
            (True, 1.0, 0.5, 0.0),
            (True, 1.0, 0.5, 0.0),
            (True, 1.0, 0.5, 0.0),
            (True, 1.2, 2.5, 0.0),
        ],
        [0.5, 1.5, 2.5, 2.5],
        id="runnable-and-not-run-waits-as-time-passes-then-the-kernels-figure-is-not-counted-twice",
    ),
    pytest.param(
        [
            (True, 1.0, 0.5, 0.5),
            (True, 1.0, 0.5, 0.5),
            (True, 1.0, 0.5, 0.5),
            (True, 1.1, 2.5, 2.5),
        ],
        # Both may have run at once at 2 s or at 3 s: the later, and no faster than time.
        [0.5, 1.5, 2.5, 3.5],
        id="a-side-thread-that-waited-beside-it-counts-only-the-time-since-the-last-count",
    ),
    pytest.param(
        [(True, 1.0, 0.5, 0.0), (True, 1.9, 0.6, 0.0), (True, 2.8, 0.7, 0.0)],
        [0.5, 0.6, 0.7],
        id="runnable-and-running-waits-only-what-the-kernel-says",
    ),
    pytest.param(
        [
            (False, 1.0, 0.5, 0.0),
            (True, 1.0, 0.5, 0.0),
            (True, 1.0, 0.5, 0.0),
            (True, 1.1, 1.8, 0.0),
        ],
        [0.5, 0.5, 1.5, 1.8],
        id="woken-between-readings-counts-from-the-first-reading-that-sees-it-runnable",
    ),
    pytest.param(
        [(False, 1.0, 0.5, 0.0), (False, 1.0, 0.5, 0.0), (False, 1.0, 0.5, 0.0)],
        [0.5, 0.5, 0.5],
        id="asleep-waits-nothing",
    ),
    pytest.param(
        [(True, 1.0, 0.5, 0.0), (True, 1.0, 0.5, 0.0), (True, 1.3, 0.9, 0.0)],
        [0.5, 1.5, 1.5],
        id="the-kernel-saying-less-than-was-counted-never-takes-the-counter-back",
    ),
    pytest.param(
        [
            (True, 1.0, 0.5, 0.0),
            (True, 1.0, 0.5, 0.0),
            (False, 1.0, 0.5, 0.0),
            (True, 1.1, 2.0, 0.0),
        ],
        [0.5, 1.5, 1.5, 2.0],
        id="a-state-misread-between-keeps-what-was-counted-for-the-kernels-figure",
    ),
]


@pytest.mark.parametrize(("readings", "counters"), MAIN_THREAD_WAITS)
def test_a_main_thread_runnable_and_not_run_has_waited_though_the_kernel_does_not_say_yet(
    tmp_path: Path, readings: list[tuple[bool, float, float, float]], counters: list[float]
) -> None:
    waits = ThreadWaits(tmp_path, ReadingClock())
    seen = []
    for runnable, ran, waited, side_waited in readings:
        write_waits(tmp_path, 100, {100: waited, 101: side_waited}, {100: ran})
        seen.append(waits(100, runnable))
    assert seen == pytest.approx(counters)


def test_only_the_main_threads_state_is_known_so_a_side_thread_waits_what_the_kernel_says(
    tmp_path: Path,
) -> None:
    waits = ThreadWaits(tmp_path, ReadingClock())
    seen = []
    for main_ran in (1.0, 1.5, 2.0):
        write_waits(tmp_path, 100, {100: 0.1, 101: 0.2}, {100: main_ran, 101: 3.0})
        seen.append(waits(100, True))
    assert seen == pytest.approx([0.2, 0.2, 0.2])


# Two threads that spin at once: hashing a large buffer lets go of the GIL.
TWO_SPINNING_THREADS = """
import hashlib, threading
def hash_forever():
    data = bytes(1 << 22)
    while True:
        hashlib.sha256(data).digest()
threading.Thread(target=hash_forever, daemon=True).start()
while True:
    pass
"""


@pytest.mark.e2e
def test_a_process_starved_of_its_core_waits_as_time_passes_not_only_when_it_next_runs() -> None:
    """On this kernel: a process of two spinning threads kept off its one core by a
    spinner (`SCHED_IDLE` beside `SCHED_OTHER`) gets a slice about once a second; between
    slices the kernel's figures stand still and the counter does not, and when they catch
    up the counter has not grown faster than time passed."""
    core = {min(os.sched_getaffinity(0))}
    with (
        subprocess.Popen([sys.executable, "-c", TWO_SPINNING_THREADS]) as starved,
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) as hog,
    ):
        try:
            os.sched_setaffinity(hog.pid, core)
            wait_until(
                lambda: len(os.listdir(f"/proc/{starved.pid}/task")) >= 2,
                30,
                "the second thread started",
                0.05,
            )
            for tid in os.listdir(f"/proc/{starved.pid}/task"):
                os.sched_setaffinity(int(tid), core)
                os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
            read_at: list[float] = []

            def clock() -> float:
                read_at.append(time.monotonic())
                return read_at[-1]

            waits = ThreadWaits(clock=clock)
            readings = []
            for _ in range(30):
                runnable = psutil.Process(starved.pid).status() == psutil.STATUS_RUNNING
                ran = Path(f"/proc/{starved.pid}/schedstat").read_text().split()[0]
                readings.append((runnable, ran, waits(starved.pid, runnable)))
                time.sleep(0.1)
        finally:
            hog.kill()
            starved.kill()
    timed = list(zip(read_at, readings, strict=True))
    unrun = [
        (now - then, counter - counted)
        for (then, (was_runnable, ran_then, counted)), (now, (runnable, ran, counter)) in pairwise(
            timed
        )
        if was_runnable and runnable and ran == ran_then
    ]
    assert unrun, f"never runnable and unrun between two readings: {timed}"
    # Summed: one reading late by a busy host's moment does not decide it.
    assert sum(grown for _, grown in unrun) >= 0.9 * sum(passed for passed, _ in unrun), unrun
    (first_at, (_, _, first)), (last_at, (_, _, last)) = timed[0], timed[-1]
    assert last - first <= last_at - first_at + 1e-9, timed


def test_thread_waits_keep_the_count_of_a_process_gone_and_forget_the_gone_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(processes, "MAX_PROCESSES_REMEMBERED", 2)
    waits = ThreadWaits(tmp_path, ReadingClock())
    write_waits(tmp_path, 100, {100: 1.0})
    write_waits(tmp_path, 200, {200: 2.0})
    assert (waits(100, False), waits(200, False)) == (1.0, 2.0)
    shutil.rmtree(tmp_path / "100")
    assert waits(100, False) == 1.0  # a process that vanished mid-scan loses nothing
    write_waits(tmp_path, 300, {300: 3.0})
    assert waits(300, False) == 3.0  # 100 is gone from the kernel: it is forgotten, 200 is not
    write_waits(tmp_path, 200, {200: 2.5})
    assert waits(200, False) == 2.5
    write_waits(tmp_path, 400, {400: 4.0})
    assert waits(400, False) == 4.0  # none gone: the least recently read (300) makes room
    write_waits(tmp_path, 200, {200: 2.7})
    assert waits(200, False) == pytest.approx(2.7)
    assert waits(100, False) == 0.0


def test_diffusion_workers_are_their_stage_s_processes_without_a_stage_config() -> None:
    # vLLM-Omni 0.30's image pipeline: a text stage titled as such, and the diffusion
    # stage's process, which a DiffusionWorker title names no stage of, on the stage no
    # title claims; its mp executor's worker under it.
    table = FakePsutil()
    table.add(100, 1, "vllm serve --omni")
    table.add(101, 100, "VLLM::StageEngineCoreProc_stage0_replica0_DP0")
    table.add(102, 100, "vLLM-Omni::DiffusionWorker")
    table.add(103, 102, "vLLM-Omni::DiffusionWorker")
    table.listening = [100]
    tracker = fake_tracker(table)
    collect(tracker)
    assert roles(tracker) == {
        100: (ProcessRole.API, None),
        101: (ProcessRole.ENGINE, StageRef(0)),
        102: (ProcessRole.STAGE, StageRef(1)),
        103: (ProcessRole.WORKER, StageRef(1)),
    }
    assert not by_pid(tracker)[100].runs_stage_work
    assert by_pid(tracker)[103].runs_stage_work


@pytest.mark.parametrize("executor", ["inline", "mp"])
def test_a_one_stage_diffusion_server_s_api_process_or_its_worker_runs_the_stage(
    executor: str,
) -> None:
    table = FakePsutil()
    if executor == "inline":
        # The engine runs in the API process, which titles itself a DiffusionWorker.
        table.add(100, 1, "vLLM-Omni::DiffusionWorker")
    else:
        table.add(100, 1, "vllm serve tiny-dit --omni --distributed-executor-backend mp")
        table.add(101, 100, "vLLM-Omni::DiffusionWorker")
    table.listening = [100]
    tracker = fake_tracker(table, topology=Topology((Stage(0, "dit", final_output=True),)))
    collect(tracker)
    if executor == "inline":
        assert roles(tracker) == {100: (ProcessRole.API, StageRef(0))}
        # Read for its stage's causes; never a stage process whose exit spares the server.
        assert by_pid(tracker)[100].runs_stage_work
    else:
        assert roles(tracker) == {
            100: (ProcessRole.API, None),
            101: (ProcessRole.STAGE, StageRef(0)),
        }
