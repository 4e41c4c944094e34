"""The processes probe: attach to the server, record its process tree, map it to stages.

Every process ever seen in the target's tree is recorded by identity (pid + create time),
so the actuators can later signal exactly these and never a process that reused a pid.
Reading the process table runs in a thread; the recorded state is only changed on the
event loop, so the query methods never see it half updated.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from omni_watchdog import process_start
from omni_watchdog.redact import redact_argv
from omni_watchdog.topology import observed_topology
from omni_watchdog.types import (
    DIFFUSION_WORKER_TITLE,
    LLM_STAGE_TITLE,
    Clock,
    CpuWaits,
    ExitWatch,
    Observation,
    ObservationKind,
    ProbeError,
    ProcessHandle,
    ProcessIdentity,
    ProcessInfo,
    ProcessRole,
    ProcessSocket,
    ProcessStatus,
    ProcessTable,
    StageRef,
    Topology,
    TopologyOrigin,
)

STAGE_ENGINE_TITLE = re.compile(re.escape(LLM_STAGE_TITLE) + r"(\d+)_replica(\d+)")
ENGINE_CORE_TITLE = re.compile(r"VLLM::EngineCore(?:_DP(\d+))?(?![A-Za-z0-9])")
WORKER_TITLE = re.compile(r"VLLM::Worker")
DIFFUSION_WORKER = re.compile(re.escape(DIFFUSION_WORKER_TITLE))
SPAWN_MARKERS = ("multiprocessing.spawn", "from multiprocessing.spawn import spawn_main")
RESOURCE_TRACKER_MARKER = "multiprocessing.resource_tracker"

# Span resource attribute values (`omni.process.kind`, and vLLM's `vllm.process_kind`).
ROLE_OF_KIND = {
    "api": ProcessRole.API,
    "orchestrator": ProcessRole.API,
    "stage": ProcessRole.STAGE,
    "engine": ProcessRole.ENGINE,
    "engine_core": ProcessRole.ENGINE,
    "worker": ProcessRole.WORKER,
    "helper": ProcessRole.HELPER,
}

# A scan that reads only the tree it knows lists the whole table again this often.
RELIST_EVERY = 10.0
STATUS_OF_PSUTIL = {
    "running": ProcessStatus.RUNNING,
    "sleeping": ProcessStatus.SLEEPING,
    "idle": ProcessStatus.SLEEPING,
    "waking": ProcessStatus.SLEEPING,
    "waiting": ProcessStatus.SLEEPING,
    "parked": ProcessStatus.SLEEPING,
    "locked": ProcessStatus.SLEEPING,
    "wake-kill": ProcessStatus.SLEEPING,
    "disk-sleep": ProcessStatus.DISK_SLEEP,
    "stopped": ProcessStatus.STOPPED,
    "tracing-stop": ProcessStatus.STOPPED,
    "zombie": ProcessStatus.ZOMBIE,
    "dead": ProcessStatus.EXITED,
}


def os_process_groups(pid: int) -> tuple[int, int]:
    """(pgid, sid) of a live process, which psutil does not expose."""
    return os.getpgid(pid), os.getsid(pid)


@dataclass(frozen=True)
class _Snapshot:
    """One process as read from the process table, before roles are assigned."""

    pid: int
    create_time: float
    ppid: int
    pgid: int
    sid: int
    title: str
    status: ProcessStatus
    cpu_seconds: float
    cpu_wait_seconds: float

    @property
    def identity(self) -> ProcessIdentity:
        return ProcessIdentity(self.pid, self.create_time)

    def info(self, role: ProcessRole, stage: StageRef | None = None) -> ProcessInfo:
        return ProcessInfo(
            pid=self.pid,
            create_time=self.create_time,
            ppid=self.ppid,
            pgid=self.pgid,
            sid=self.sid,
            title=self.title,
            status=self.status,
            cpu_seconds=self.cpu_seconds,
            role=role,
            stage=stage,
            cpu_wait_seconds=self.cpu_wait_seconds,
        )


@dataclass
class _Scan:
    """What one pass over the process table found; applied on the event loop."""

    tree: list[_Snapshot] | None = None
    outside: dict[ProcessIdentity, _Snapshot | None] = field(default_factory=dict)
    new_tree: list[_Snapshot] | None = None
    server_topology: Topology | None = None


@dataclass(frozen=True)
class _Listing:
    """A tree's descendants as the whole process table showed them, and the last pid
    handed out before that table was read."""

    root: ProcessIdentity
    last_pid: int
    listed_at: float
    pids: tuple[int, ...]


@dataclass
class _Generation:
    """The processes recorded for one attach to one server root."""

    root: ProcessIdentity
    records: dict[ProcessIdentity, ProcessInfo] = field(default_factory=dict)
    titled: frozenset[StageRef] = frozenset()

    def live(self) -> list[ProcessInfo]:
        return [info for info in self.records.values() if info.status != ProcessStatus.EXITED]


class ProcessTracker:
    """Finds the server's root process and keeps its whole process tree recorded."""

    name = "processes"

    def __init__(
        self,
        process_table: ProcessTable,
        clock: Clock,
        *,
        own_pid: int,
        target_port: int | None,
        pid: int | None,
        topology: Topology,
        process_groups: Callable[[int], tuple[int, int]] = os_process_groups,
        start_time: Callable[[int], float] = process_start.start_time,
        start_time_of_ticks: Callable[[int], float] = process_start.start_time_of_ticks,
        server_topology: Callable[[int], Topology | None] = lambda pid: None,
        exit_notices: ExitWatch | None = None,
        headless: bool = False,
        cpu_wait: CpuWaits = lambda pid, runnable: 0.0,
        last_pid: Callable[[], int] | None = None,
    ) -> None:
        """`headless`: without a pid, the server is found by its `--headless` command line
        (a vLLM-Omni 0.30 stage server on this host), not by a listening port. `cpu_wait`
        reads how long a process has waited for a CPU (`ThreadWaits` for this kernel's);
        by default none is read. `last_pid` reads the pid handed out last: while it
        stands, a scan reads the tree's known processes instead of listing the whole
        table to find their children."""
        if pid is None and target_port is None and not headless:
            raise ValueError("ProcessTracker needs the server's pid or its port")
        self._headless = headless
        self._woken = asyncio.Event()
        # Look-alike headless servers among which none has proven itself yet.
        self._unproven: tuple[int, ...] = ()
        self._psutil = process_table
        self._clock = clock
        self._own_pid = own_pid
        self._port = target_port
        self._pid = pid
        self._topology = topology
        self._process_groups = process_groups
        self._start_time = start_time
        self._start_time_of_ticks = start_time_of_ticks
        self._server_topology = server_topology
        self._exits = exit_notices
        self._cpu_wait = cpu_wait
        self._last_pid = last_pid
        self._listing: _Listing | None = None
        self._current: _Generation | None = None
        self._previous: _Generation | None = None
        self._learned: dict[int, tuple[StageRef, ProcessRole | None]] = {}
        self._adopted: set[ProcessIdentity] = set()
        self.generation = 0
        self.target_alive = False

    # --- query API -------------------------------------------------------------------

    @property
    def root(self) -> ProcessInfo | None:
        """The current generation's root process (status EXITED once it is gone)."""
        if self._current is None:
            return None
        return self._current.records.get(self._current.root)

    def recorded(self) -> tuple[ProcessInfo, ...]:
        """Latest info of every process recorded in this generation, exited ones included."""
        return tuple(self._current.records.values()) if self._current else ()

    def live(self) -> tuple[ProcessInfo, ...]:
        """Recorded processes of this generation that still exist (zombies included)."""
        return tuple(self._current.live()) if self._current else ()

    def previous_generation(self) -> tuple[ProcessInfo, ...]:
        """Latest info of the processes recorded for the server before the last re-attach."""
        return tuple(self._previous.records.values()) if self._previous else ()

    def stage_of(self, pid: int) -> StageRef | None:
        """The stage a live recorded process of this generation works for."""
        for info in self.live():
            if info.pid == pid:
                return info.stage
        return None

    def is_recorded(self, identity: ProcessIdentity) -> bool:
        """True for a process recorded in this or the previous generation, or adopted from
        a resumed incident (pid + start)."""
        return identity in self._adopted or any(
            generation is not None and identity in generation.records
            for generation in (self._current, self._previous)
        )

    def pgids(self) -> set[int]:
        """Process groups of the live recorded processes, never the watchdog's own group."""
        groups = {info.pgid for info in self.live() if info.pgid > 1}
        with contextlib.suppress(OSError):
            groups.discard(self._process_groups(self._own_pid)[0])
        return groups

    # --- whom spans may speak for (types.SpanSenders) ----------------------------------

    def owns(self, pid: int | None, start_ticks: int | None) -> bool:
        """The sender is a live recorded process of the current generation."""
        if pid is None or start_ticks is None or self._current is None:
            return False
        identity = ProcessIdentity(pid, self._start_time_of_ticks(start_ticks))
        info = self._current.records.get(identity)
        return info is not None and info.status is not ProcessStatus.EXITED

    def knows(self, stage: StageRef) -> bool:
        """A stage replica of the topology, or one a live recorded process serves."""
        return stage in self._topology.refs() or self.maps(stage)

    def maps(self, stage: StageRef) -> bool:
        """A live recorded process of this generation serves the stage replica."""
        return any(info.stage == stage for info in self.live())

    def live_pids(self) -> list[int]:
        """The pids of the live recorded processes of this generation."""
        return [info.pid for info in self.live()]

    def set_topology(self, topology: Topology) -> None:
        """Map processes (0.11's untitled stage workers by spawn order) and judge spans
        against this topology from the next scan on."""
        self._topology = topology

    def learn_stage(self, pid: int, stage: StageRef, process_kind: str | None) -> None:
        """Map a pid to a stage from span resource attributes; this beats titles and order."""
        role = ROLE_OF_KIND.get(process_kind.lower()) if process_kind else None
        self._learned[pid] = (stage, role)

    async def adopt(
        self, identities: Iterable[ProcessIdentity], root: ProcessIdentity | None
    ) -> tuple[ProcessInfo, ...]:
        """Record a resumed incident's processes that are still the same processes, read as
        they are now: `root` as the API server, the others as helpers. They stay recorded
        for the tracker's life, whichever server its scans attach to, so that the ladder
        may finish them.
        """
        snapshots = await asyncio.to_thread(self._read_identities, tuple(identities))
        adopted = tuple(
            # Named as the journal named it: the ladder's guards compare with that.
            replace(
                snapshot.info(ProcessRole.API if identity == root else ProcessRole.HELPER),
                create_time=identity.create_time,
            )
            for identity, snapshot in snapshots
        )
        self._adopted.update(info.identity for info in adopted)
        return adopted

    # --- collection ------------------------------------------------------------------

    async def collect(self) -> Sequence[Observation]:
        root = self._current.root if self._current else None
        recorded = [
            info.identity
            for generation in (self._current, self._previous)
            if generation is not None
            for info in generation.live()
        ]
        if self._exits is not None:
            self._exits.scanning()
        try:
            scan = await asyncio.to_thread(self._scan, root, recorded)
        except self._psutil.Error as error:
            raise ProbeError(f"cannot read the process table: {error!r}") from None
        observations = self._apply(scan)
        if self._exits is not None:
            self._exits.watch(
                info.identity
                for info in self.live()
                if info.status not in (ProcessStatus.ZOMBIE, ProcessStatus.EXITED)
            )
        return observations

    async def rest(self, seconds: float) -> None:
        """Wait until the next scan is due, until the kernel says a recorded process
        exited (the scan that records the exit then runs at once), or until `wake`."""
        resting = asyncio.ensure_future(
            asyncio.sleep(seconds) if self._exits is None else self._exits.rest(seconds)
        )
        woken = asyncio.ensure_future(self._woken.wait())
        try:
            await asyncio.wait((resting, woken), return_when=asyncio.FIRST_COMPLETED)
        finally:
            resting.cancel()
            woken.cancel()
        self._woken.clear()

    def wake(self) -> None:
        """Scan now rather than at the end of the rest: what the scan reads matters again."""
        self._woken.set()

    def close(self) -> None:
        """Let go of the exit notices' descriptors."""
        if self._exits is not None:
            self._exits.close()

    def _scan(self, root: ProcessIdentity | None, recorded: list[ProcessIdentity]) -> _Scan:
        """Read the process table: the current tree, recorded processes outside it, a new root."""
        scan = _Scan()
        if root is not None:
            scan.tree = self._read_tree(root)
        in_tree = {snapshot.identity for snapshot in scan.tree or ()}
        for identity in recorded:
            if identity not in in_tree:
                scan.outside[identity] = self._read_identity(identity)
        root_gone = not scan.tree or scan.tree[0].status == ProcessStatus.ZOMBIE
        may_search = self._pid is None or root is None
        if root_gone and may_search:
            found = self._find_root()
            # A recorded survivor that still holds the old socket is not a new server.
            if found is not None and found != root and found not in recorded:
                scan.new_tree = self._read_tree(found)
                if scan.new_tree:
                    scan.server_topology = self._server_topology(found.pid)
        return scan

    def _apply(self, scan: _Scan) -> list[Observation]:
        now = self._clock.monotonic()
        observations: list[Observation] = []
        if self._previous is not None:
            self._update_outside(self._previous, scan.outside, now)
        if self._current is not None:
            observations.extend(self._update(self._current, scan.tree, scan.outside, now))
        if scan.new_tree:
            if self._current is not None:
                self._previous = self._current
            self._current = _Generation(scan.new_tree[0].identity)
            self.generation += 1
            observations.extend(self._update(self._current, scan.new_tree, {}, now))
            if scan.server_topology is not None:
                observations.append(
                    Observation(ObservationKind.TOPOLOGY, now, topology=scan.server_topology)
                )
        if self._current is not None:
            observations.extend(self._titled_topology(self._current, now))
        root = self.root
        self.target_alive = root is not None and root.status not in (
            ProcessStatus.EXITED,
            ProcessStatus.ZOMBIE,
        )
        if self._current is None:
            raise ProbeError(self._not_found_reason())
        return observations

    def _update(
        self,
        generation: _Generation,
        tree: list[_Snapshot] | None,
        outside: dict[ProcessIdentity, _Snapshot | None],
        now: float,
    ) -> list[Observation]:
        """Record the tree, mark what left it as orphaned, and report every change."""
        observations: list[Observation] = []
        seen: set[ProcessIdentity] = set()
        for info in self._classify(generation, tree or []):
            seen.add(info.identity)
            generation.records[info.identity] = info
            observations.append(self._observation(info, now))
        for identity, previous in list(generation.records.items()):
            if identity in seen or previous.status == ProcessStatus.EXITED:
                continue
            snapshot = outside.get(identity)
            if snapshot is None:
                gone = replace(previous, status=ProcessStatus.EXITED)
                generation.records[identity] = gone
                self._forget_learned(gone.pid)
                observations.append(self._observation(gone, now))
                continue
            learned = self._learned.get(identity.pid)
            orphan = replace(
                snapshot.info(previous.role, learned[0] if learned else previous.stage),
                create_time=previous.create_time,
                orphaned=True,
            )
            generation.records[identity] = orphan
            observations.append(self._observation(orphan, now))
        return observations

    def _update_outside(
        self,
        generation: _Generation,
        outside: dict[ProcessIdentity, _Snapshot | None],
        now: float,
    ) -> None:
        """Keep a previous generation's survivors current, silently: the lead cleans them up."""
        for identity, previous in generation.records.items():
            if previous.status == ProcessStatus.EXITED:
                continue
            snapshot = outside.get(identity)
            if snapshot is None:
                generation.records[identity] = replace(previous, status=ProcessStatus.EXITED)
            else:
                generation.records[identity] = replace(
                    previous, status=snapshot.status, ppid=snapshot.ppid, orphaned=True
                )

    def _titled_topology(self, generation: _Generation, now: float) -> list[Observation]:
        """A TOPOLOGY observation when the 0.30 stage replicas' titles name stages or
        replicas not named before. Exited processes keep their titles in the records, so
        a dead replica stays in the topology, to be judged dead."""
        titled = frozenset(
            ref
            for info in generation.records.values()
            if STAGE_ENGINE_TITLE.search(info.title) and (ref := _titled_stage(info.title))
        )
        if titled == generation.titled:
            return []
        generation.titled = titled
        topology = observed_topology(titled, TopologyOrigin.TITLES, "titles")
        if topology is None:
            return []
        return [Observation(ObservationKind.TOPOLOGY, now, topology=topology)]

    def _observation(self, info: ProcessInfo, now: float) -> Observation:
        return Observation(
            ObservationKind.PROCESS,
            now,
            stage=info.stage,
            outcome=info.status,
            process=info,
            pid=info.pid,
        )

    def _forget_learned(self, pid: int) -> None:
        # A learned pid belongs to the process that exited; a later one with it is another.
        self._learned.pop(pid, None)

    # --- roles and stages ------------------------------------------------------------

    def _classify(self, generation: _Generation, tree: list[_Snapshot]) -> list[ProcessInfo]:
        """ProcessInfo with role and stage for every process of the tree, root first."""
        if not tree:
            return []
        # A zombie's command line is gone; its title from life still says what it was.
        tree = [
            replace(snapshot, title=generation.records[snapshot.identity].title)
            if snapshot.status == ProcessStatus.ZOMBIE and snapshot.identity in generation.records
            else snapshot
            for snapshot in tree
        ]
        root = tree[0]
        by_pid = {snapshot.pid: snapshot for snapshot in tree}
        spawn_stages = self._spawn_order_stages(generation, tree)
        assigned: dict[int, tuple[ProcessRole, StageRef | None]] = {}

        def role_of(snapshot: _Snapshot) -> tuple[ProcessRole, StageRef | None]:
            if snapshot.pid in assigned:
                return assigned[snapshot.pid]
            parent = by_pid.get(snapshot.ppid) if snapshot.pid != root.pid else None
            parent_role, parent_stage = role_of(parent) if parent else (None, None)
            role, stage = self._title_role(snapshot, root, parent_role, parent_stage)
            if snapshot.identity in spawn_stages and role == ProcessRole.HELPER:
                role, stage = ProcessRole.STAGE, spawn_stages[snapshot.identity]
            learned = self._learned.get(snapshot.pid)
            if learned is not None:
                stage = learned[0]
                if learned[1] is not None and snapshot.pid != root.pid:
                    role = learned[1]
            assigned[snapshot.pid] = (role, stage)
            return role, stage

        infos = []
        for snapshot in tree:
            role, stage = role_of(snapshot)
            infos.append(snapshot.info(role, stage))
        return infos

    def _title_role(
        self,
        snapshot: _Snapshot,
        root: _Snapshot,
        parent_role: ProcessRole | None,
        parent_stage: StageRef | None,
    ) -> tuple[ProcessRole, StageRef | None]:
        if snapshot.pid == root.pid:
            only = self._topology.refs()
            if DIFFUSION_WORKER.search(snapshot.title) and len(only) == 1:
                # A one-stage diffusion server: the API process runs the stage itself.
                return ProcessRole.API, only[0]
            return ProcessRole.API, None
        named = _titled_stage(snapshot.title)
        if named is not None:
            # An EngineCore under a stage worker serves that stage, whatever its DP rank.
            under_stage = parent_role in (ProcessRole.STAGE, ProcessRole.ENGINE) and parent_stage
            if under_stage and not STAGE_ENGINE_TITLE.search(snapshot.title):
                return ProcessRole.ENGINE, parent_stage
            return ProcessRole.ENGINE, named
        if WORKER_TITLE.search(snapshot.title):
            return ProcessRole.WORKER, parent_stage
        if DIFFUSION_WORKER.search(snapshot.title) and parent_stage is not None:
            # The mp executor's worker, under its stage's process (or under an API process
            # that runs the stage inline).
            return ProcessRole.WORKER, parent_stage
        return ProcessRole.HELPER, None

    def _spawn_order_stages(
        self, generation: _Generation, tree: list[_Snapshot]
    ) -> dict[ProcessIdentity, StageRef]:
        """The root's untitled spawn children and its diffusion workers, oldest first, on
        the stages no title claims.

        vLLM-Omni 0.11 stage workers are never titled: their order is all there is. A 0.30
        replica is untitled only until it sets its title; one that dies before the tracker
        saw the title must not push its titled siblings' stages onto the others. Exited
        children keep their rank, so a stage worker that dies does not shift the others.
        """
        root_pid = tree[0].pid
        children: dict[ProcessIdentity, tuple[float, str]] = {
            identity: (info.create_time, info.title)
            for identity, info in generation.records.items()
            if info.ppid == root_pid and info.pid != root_pid
        }
        for snapshot in tree[1:]:
            if snapshot.ppid == root_pid:
                children[snapshot.identity] = (snapshot.create_time, snapshot.title)
        claimed = {_titled_stage(title) for _, title in children.values()}
        spawned = sorted(
            (create_time, identity)
            for identity, (create_time, title) in children.items()
            if _is_untitled_spawn(title) or DIFFUSION_WORKER.search(title)
        )
        free = [ref for ref in self._topology.refs() if ref not in claimed]
        return {identity: ref for (_, identity), ref in zip(spawned, free, strict=False)}

    # --- reading the process table (in a thread) --------------------------------------

    def _find_root(self) -> ProcessIdentity | None:
        if self._pid is not None:
            if self._pid in (self._own_pid, 1):
                raise ProbeError(f"pid {self._pid} is the watchdog or init, not a server")
            snapshot = self._read_pid(self._pid)
            return snapshot.identity if snapshot else None
        if self._headless:
            return self._find_headless_root()
        # The system-wide socket table names one holder per socket, and forked children
        # (even short-lived ones) share the server's: the root is the oldest ancestor that
        # holds a listening socket on the port too.
        roots = set()
        for pid in self._listener_pids():
            try:
                top = self._psutil.Process(pid)
                for parent in top.parents():
                    if parent.pid not in (1, self._own_pid) and self._listens(parent):
                        top = parent
                roots.add((self._start_time(top.pid), top.pid))
            except self._psutil.NoSuchProcess:
                continue
        if not roots:
            return None
        created, pid = min(roots)
        return ProcessIdentity(pid, created)

    def _find_headless_root(self) -> ProcessIdentity | None:
        """The headless stage server: of the processes whose command line starts one (its
        children inherit the command line in a fork, so the oldest of a tree is its root),
        the oldest that started a stage process titled as vLLM-Omni titles them; the only
        one while none has yet. A command line anyone can write: a look-alike started
        earlier was attached instead of the stage, whose death then went unjudged. Two or
        more and none proven: none yet, until one starts its stage."""
        found = []
        for process in self._psutil.process_iter(["pid"]):
            if process.pid in (self._own_pid, 1):
                continue
            try:
                if is_headless_stage_server(process.cmdline()):
                    found.append((self._start_time(process.pid), process.pid))
            except self._psutil.Error:
                continue
        roots = [(created, pid) for created, pid in found if not self._forked_from(pid, found)]
        proven = [(created, pid) for created, pid in roots if self._started_a_stage(pid)]
        self._unproven = () if proven or len(roots) < 2 else tuple(pid for _, pid in roots)
        chosen = min(proven) if proven else (roots[0] if len(roots) == 1 else None)
        return None if chosen is None else ProcessIdentity(chosen[1], chosen[0])

    def _forked_from(self, pid: int, found: Sequence[tuple[float, int]]) -> bool:
        """A child of another candidate: a fork that kept the command line."""
        others = {other for _, other in found if other != pid}
        try:
            return any(parent.pid in others for parent in self._psutil.Process(pid).parents())
        except self._psutil.Error:
            return False

    def _started_a_stage(self, pid: int) -> bool:
        try:
            children = self._psutil.Process(pid).children(recursive=True)
        except self._psutil.Error:
            return False
        for child in children:
            try:
                title = " ".join(child.cmdline())
            except self._psutil.Error:
                continue
            if STAGE_ENGINE_TITLE.search(title) or DIFFUSION_WORKER.search(title):
                return True
        return False

    def _listener_pids(self) -> set[int]:
        """Pids the socket table shows listening on the target port, less watchdog and init."""
        try:
            connections = self._psutil.net_connections(kind="tcp")
        except self._psutil.AccessDenied as error:
            raise ProbeError(
                f"not allowed to list sockets to find port {self._port}; give --pid ({error})"
            ) from None
        return {
            connection.pid
            for connection in connections
            if connection.pid is not None
            and connection.pid not in (self._own_pid, 1)
            and self._is_target_listener(connection)
        }

    def _listens(self, process: ProcessHandle) -> bool:
        try:
            connections = process.net_connections(kind="tcp")
        except self._psutil.Error:
            return False
        return any(self._is_target_listener(connection) for connection in connections)

    def _is_target_listener(self, connection: ProcessSocket) -> bool:
        return bool(
            connection.status == self._psutil.CONN_LISTEN
            and connection.laddr
            and connection.laddr.port == self._port
        )

    def _read_tree(self, root: ProcessIdentity) -> list[_Snapshot] | None:
        """The root (if it is still the same process) and all its descendants."""
        try:
            process = self._psutil.Process(root.pid)
            root_snapshot = self._read(process)
            if not root.matches(root_snapshot.identity):
                return None
            # Read before the table is listed: a birth after it moves the count again.
            births = self._births()
            known = self._known_descendants(root, births)
            if known is not None:
                return [root_snapshot, *self._still_descendants(root.pid, known)]
            children = process.children(recursive=True)
        except self._psutil.NoSuchProcess:
            return None
        if births is not None:
            pids = tuple(child.pid for child in children)
            self._listing = _Listing(root, births, self._clock.monotonic(), pids)
        tree = [root_snapshot]
        for child in children:
            if child.pid == self._own_pid:
                continue
            try:
                tree.append(self._read(child))
            except self._psutil.NoSuchProcess:
                continue
        return tree

    def _births(self) -> int | None:
        """The pid handed out last, or None where it cannot be read."""
        if self._last_pid is None:
            return None
        try:
            return self._last_pid()
        except (OSError, ValueError):
            return None

    def _known_descendants(
        self, root: ProcessIdentity, births: int | None
    ) -> tuple[int, ...] | None:
        """The root's descendants of the last listing while no process was born since it
        was made: only a fork brings a process into a tree (an orphan is handed to an
        ancestor, never to a stranger). None when the table must be listed again; it is
        at least every RELIST_EVERY, in case a kernel's count stands when it should not."""
        listing = self._listing
        if listing is None or listing.root != root:
            return None
        if births is None or self._clock.monotonic() - listing.listed_at >= RELIST_EVERY:
            return None
        return listing.pids if births == listing.last_pid else None

    def _still_descendants(self, root_pid: int, pids: Sequence[int]) -> list[_Snapshot]:
        """The known descendants still under the root: one whose parent exited went to
        an ancestor outside the tree (init or a subreaper) and is no longer the tree's."""
        snapshots = []
        for pid in pids:
            if pid == self._own_pid:
                continue
            try:
                snapshots.append(self._read(self._psutil.Process(pid)))
            except self._psutil.NoSuchProcess:
                continue
        under = {root_pid}
        grew = True
        while grew:
            found = {s.pid for s in snapshots if s.ppid in under and s.pid not in under}
            under |= found
            grew = bool(found)
        return [snapshot for snapshot in snapshots if snapshot.pid in under]

    def _read_identity(self, identity: ProcessIdentity) -> _Snapshot | None:
        """The process if it still lives with the same start time, else None: it is gone."""
        snapshot = self._read_pid(identity.pid)
        if snapshot is None or not identity.matches(snapshot.identity):
            return None
        return snapshot

    def _read_identities(
        self, identities: Sequence[ProcessIdentity]
    ) -> list[tuple[ProcessIdentity, _Snapshot]]:
        """The processes that are still the same processes, each as `_read_identity` reads
        it; one that may not be read is left out like one that is gone."""
        found = []
        for identity in identities:
            try:
                snapshot = self._read_identity(identity)
            except self._psutil.Error:
                continue
            if snapshot is not None:
                found.append((identity, snapshot))
        return found

    def _read_pid(self, pid: int) -> _Snapshot | None:
        try:
            return self._read(self._psutil.Process(pid))
        except self._psutil.NoSuchProcess:
            return None

    def _read(self, process: ProcessHandle) -> _Snapshot:
        """One process's facts; a zombie still has a pid, a start time and a status."""
        psutil = self._psutil
        create_time = self._start_time(process.pid)
        with process.oneshot():
            status = STATUS_OF_PSUTIL.get(process.status(), ProcessStatus.SLEEPING)
            ppid = process.ppid()
            try:
                # Titles reach the API, logs and bundles: a secret on the command line must not.
                title = " ".join(part for part in redact_argv(process.cmdline()) if part).strip()
                title = title or process.name()
            except psutil.ZombieProcess:
                title = self._zombie_name(process)
            except psutil.AccessDenied:
                title = ""
            try:
                times = process.cpu_times()
                cpu_seconds = times.user + times.system
            except (psutil.ZombieProcess, psutil.AccessDenied):
                cpu_seconds = 0.0
        try:
            pgid, sid = self._process_groups(process.pid)
        except OSError:
            pgid, sid = -1, -1
        return _Snapshot(
            pid=process.pid,
            create_time=create_time,
            ppid=ppid,
            pgid=pgid,
            sid=sid,
            title=title,
            status=status,
            cpu_seconds=cpu_seconds,
            cpu_wait_seconds=self._cpu_wait(process.pid, status is ProcessStatus.RUNNING),
        )

    def _zombie_name(self, process: ProcessHandle) -> str:
        """A zombie's command line is gone, but the kernel keeps its name, which a title
        vLLM set names too (cut to 15 characters): a worker that died before it was first
        read is still known as a worker, and its death as its stage's."""
        try:
            return process.name()
        except self._psutil.Error:
            return ""

    def _not_found_reason(self) -> str:
        if self._pid is not None:
            return f"no process with pid {self._pid}"
        if self._headless and self._unproven:
            pids = ", ".join(str(pid) for pid in self._unproven)
            return (
                f"processes {pids} each look like a headless stage server and none has"
                " started a stage process yet: waiting for one to start its stage"
            )
        if self._headless:
            return "no headless stage server (a command line with --headless and --stage-id)"
        return f"no process listens on port {self._port}"


# Threads of one process whose run-queue delay is read per scan: a torch process runs a few
# dozen; one that runs thousands must not make each scan read thousands of files.
MAX_THREADS_READ = 256
# Processes whose threads' waits are remembered between scans: a server's tree, with room.
MAX_PROCESSES_REMEMBERED = 1024


@dataclass
class _ThreadsReading:
    """One process's threads as last read: when, and each thread's (CPU time, wait)."""

    at: float
    threads: dict[int, tuple[float, float]]
    main_runnable: bool
    # Wait counted for the main thread as it waited since it last ran: its own figure,
    # when it runs, holds that too.
    main_counted: float
    # The counter holds waits up to this moment.
    counted_to: float


class ThreadWaits:
    """How long a process's threads have waited, runnable, for a CPU: the time during
    which some thread of it waited, as near as readings tell (`types.CpuWaits`, of this
    kernel's processes).

    The kernel counts each thread's run-queue delay (`/proc/<pid>/task/<tid>/schedstat`,
    its second field, in ns). A stage's heartbeat passes through two threads, the loop that
    beats and the exporter that sends it; either one waiting leaves the stage silent, and
    the process's own schedstat is only its main thread's. The kernel adds a wait to a
    thread's figure only once the thread gets its CPU, so a figure that grows at a reading
    tells of a wait that ended since the last one. Each is taken to end at the reading
    that sees it, the latest it can: waits of threads that overlap then count once, and
    the counter never grows faster than time passes (summed over threads it would, and a
    stage's waits would outlast its silence).

    A thread starved for seconds shows no wait until it runs. But a main thread runnable
    (state R) at two readings whose CPU time (the first field, to the ns) did not move
    between them waited throughout, as to leave the run queue it must run: that time
    counts as it passes, and not again when its figure catches up.
    """

    def __init__(
        self,
        proc: Path = process_start.PROC,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._proc = proc
        self._clock = clock
        self._readings: dict[int, _ThreadsReading] = {}
        self._total: dict[int, float] = {}

    def __call__(self, pid: int, runnable: bool) -> float:
        """The counter for `pid`, in seconds; 0 when the kernel does not say. `runnable`:
        its main thread's state is R now (running or waiting for a CPU)."""
        now = self._clock()
        threads = self._read(pid)
        if not threads:
            return self._total.get(pid, 0.0)
        # Popped and put back: the least recently read come first when some must go.
        before = self._readings.pop(pid, None)
        if before is None:
            if len(self._readings) >= MAX_PROCESSES_REMEMBERED:
                self._forget_gone()
            reading = _ThreadsReading(now, threads, runnable, 0.0, now)
            gained = max(wait for _, wait in threads.values())
        else:
            reading = _ThreadsReading(now, threads, runnable, 0.0, before.counted_to)
            gained = self._gained(pid, before, reading)
        self._readings[pid] = reading
        self._total[pid] = self._total.get(pid, 0.0) + gained
        return self._total[pid]

    @staticmethod
    def _gained(pid: int, before: _ThreadsReading, now: _ThreadsReading) -> float:
        """The counter's growth since `before`; sets `now`'s main_counted and counted_to.
        A thread new since then waited all of its wait since then."""
        gains = {
            tid: max(0.0, wait - before.threads.get(tid, (0.0, 0.0))[1])
            for tid, (_, wait) in now.threads.items()
        }
        main, main_before = now.threads.get(pid), before.threads.get(pid)
        if main is not None and main_before is not None:
            if now.main_runnable and before.main_runnable and main[0] == main_before[0]:
                gains[pid] = now.at - before.at
                now.main_counted = before.main_counted + gains[pid]
            elif main[0] != main_before[0]:
                gains[pid] = max(0.0, gains[pid] - before.main_counted)
            else:
                now.main_counted = before.main_counted
        longest = max(gains.values())
        if longest <= 0.0:
            return 0.0
        now.counted_to = now.at
        return min(longest, now.at - before.counted_to)

    def _read(self, pid: int) -> dict[int, tuple[float, float]]:
        # Plain descriptors, not Path.read_text: this runs for every thread of the tree at
        # each scan, and they read 61 threads in 0.4 ms where Path took 1.3 ms.
        tasks = f"{self._proc}/{pid}/task/"
        try:
            tids = sorted(int(name) for name in os.listdir(tasks))
        except (OSError, ValueError):
            return {}
        threads: dict[int, tuple[float, float]] = {}
        for tid in tids[:MAX_THREADS_READ]:
            try:
                descriptor = os.open(f"{tasks}{tid}/schedstat", os.O_RDONLY)
                try:
                    fields = os.read(descriptor, 128).split()
                finally:
                    os.close(descriptor)
                threads[tid] = (int(fields[0]) / 1e9, int(fields[1]) / 1e9)
            except (OSError, IndexError, ValueError):
                continue  # the thread ended between the listing and the read
        return threads

    def _forget_gone(self) -> None:
        for pid in [pid for pid in self._readings if not (self._proc / str(pid)).exists()]:
            del self._readings[pid]
            self._total.pop(pid, None)
        while len(self._readings) >= MAX_PROCESSES_REMEMBERED:
            pid = next(iter(self._readings))
            del self._readings[pid]
            self._total.pop(pid, None)


def is_headless_stage_server(argv: Sequence[str]) -> bool:
    """A command line that starts a vLLM-Omni 0.30 stage without its API (`vllm serve …
    --omni --stage-id N --headless`, or the simulator's imitation of it)."""
    return "--headless" in argv and any(
        part == "--stage-id" or part.startswith("--stage-id=") for part in argv
    )


def keeps_serving_after_a_stage_death(processes: Iterable[ProcessInfo]) -> bool:
    """The tree is vLLM-Omni 0.30's (stage replicas titled as such): a dead stage leaves its
    API up, answering 503, for good, and it never exits by itself (measured on the real
    server). vLLM and vLLM-Omni 0.11 exit within seconds of their engine's death."""
    return any(STAGE_ENGINE_TITLE.search(info.title) for info in processes)


def _titled_stage(title: str) -> StageRef | None:
    """The stage a process's own title names, if it names one."""
    match = STAGE_ENGINE_TITLE.search(title)
    if match:
        return StageRef(int(match.group(1)), int(match.group(2)))
    match = ENGINE_CORE_TITLE.search(title)
    return StageRef(0, int(match.group(1) or 0)) if match else None


def _is_untitled_spawn(title: str) -> bool:
    return any(marker in title for marker in SPAWN_MARKERS) and RESOURCE_TRACKER_MARKER not in title
