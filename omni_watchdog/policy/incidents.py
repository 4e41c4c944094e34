"""Incidents on disk: the journal a restarted watchdog resumes from, the hourly budget, the
per-target lock, and the bundle directory of each incident.

Everything here is private to the watchdog's user (files 0600, directories 0700, whatever
the umask) and passes through redaction; a full or read-only disk is logged and counted,
never raised, so that it cannot hold the ladder back.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import queue
import stat
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from omni_watchdog.jsonable import to_jsonable
from omni_watchdog.log import log_event
from omni_watchdog.redact import redact_json, redact_text
from omni_watchdog.types import (
    Evidence,
    EvidenceKind,
    Incident,
    IncidentOutcome,
    JournalEntry,
    MaintenancePause,
    Mode,
    OperatorAction,
    ProcessIdentity,
    SilenceCause,
    StageCause,
    StageRef,
    StageState,
    StepName,
    StepOutcome,
    StepResult,
    Verdict,
)

logger = logging.getLogger("omni_watchdog.policy")

# What the incident report reads of a bundle: a stack dump is a few KiB, a /metrics page
# of a large server a few MiB.
MAX_BUNDLE_FILE_READ = 4 * 2**20
MAX_BUNDLE_READ = 32 * 2**20
_PRIVATE_FILE = 0o600
_PRIVATE_DIRECTORY = 0o700


def _stage(data: Mapping[str, Any]) -> StageRef:
    return StageRef(int(data["stage_id"]), int(data.get("replica", 0)))


def _verdict(data: Mapping[str, Any]) -> Verdict:
    return Verdict(
        _stage(data["stage"]),
        StageState(data["state"]),
        float(data["time"]),
        tuple(
            Evidence(EvidenceKind(e["kind"]), _stage(e["stage"]), float(e["since"]), e["detail"])
            for e in data["evidence"]
        ),
        remote=bool(data.get("remote", False)),
        cause=_cause(data.get("cause")),
    )


def _cause(data: Mapping[str, Any] | None) -> StageCause | None:
    if data is None:
        return None
    working_since = data.get("working_since")
    return StageCause(
        SilenceCause(data["cause"]),
        float(data["since"]),
        bool(data["working"]),
        data["detail"],
        None if working_since is None else float(working_since),
    )


def _step(data: Mapping[str, Any]) -> StepResult:
    return StepResult(
        StepName(data["step"]),
        StepOutcome(data["outcome"]),
        float(data["started"]),
        float(data["duration"]),
        data.get("detail", ""),
        tuple(int(pid) for pid in data.get("targets", ())),
    )


def _action_from_json(data: Mapping[str, Any]) -> OperatorAction:
    pause = data.get("pause")
    return OperatorAction(
        time=float(data["time"]),
        action=str(data["action"]),
        outcome=str(data["outcome"]),
        incident_id=None if data.get("incident_id") is None else str(data["incident_id"]),
        detail=str(data.get("detail", "")),
        pause=None
        if pause is None
        else MaintenancePause(float(pause["since"]), float(pause["until"]), str(pause["reason"])),
    )


def incident_from_json(data: Mapping[str, Any]) -> Incident:
    # Absent from lines an older watchdog journaled.
    opened_monotonic = data.get("opened_monotonic")
    return Incident(
        incident_id=data["incident_id"],
        target=data["target"],
        mode=Mode(data["mode"]),
        opened=float(data["opened"]),
        cause=data["cause"],
        verdicts=tuple(_verdict(v) for v in data.get("verdicts", ())),
        steps=tuple(_step(s) for s in data.get("steps", ())),
        outcome=IncidentOutcome(data.get("outcome", "open")),
        closed=data.get("closed"),
        bundle_dir=data.get("bundle_dir"),
        timeline=dict(data.get("timeline", {})),
        crashed=bool(data.get("crashed", False)),
        opened_monotonic=None if opened_monotonic is None else float(opened_monotonic),
    )


# Replay reads at most this much of the journal's end: the open incident, if any, is the
# last one written, and an old journal never grows the watchdog's start-up.
MAX_JOURNAL_READ = 64 * 2**20
# The operator's latest actions kept in memory for the reports.
MAX_ACTIONS_KEPT = 4096
# Journal lines that may wait for the disk; past them a line is dropped and counted as a
# failed write, as on a full disk (an incident makes a handful, an operator's action one).
MAX_PENDING_LINES = 4096


def private_directory(path: Path) -> None:
    """Create `path` and its missing parents as 0700 directories, whatever the umask."""
    missing: list[Path] = []
    for directory in (path, *path.parents):
        if os.path.lexists(directory):
            break
        missing.append(directory)
    for directory in reversed(missing):
        try:
            os.mkdir(directory, _PRIVATE_DIRECTORY)
        except FileExistsError:
            continue
        os.chmod(directory, _PRIVATE_DIRECTORY)


def replace_private(path: Path, data: bytes) -> None:
    """Write `path` whole as a 0600 file: a reader sees the old or the new text, never part."""
    temporary = path.with_name(path.name + ".tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        with os.fdopen(os.open(temporary, flags, _PRIVATE_FILE), "wb") as handle:
            os.fchmod(handle.fileno(), _PRIVATE_FILE)
            handle.write(data)
        os.replace(temporary, path)
    except OSError:
        # A full disk leaves a partial temporary file that no reader should ever list.
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def append_private(path: Path, data: bytes) -> None:
    """Append `data` to a 0600 file and wait until it is on disk."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    with os.fdopen(os.open(path, flags, _PRIVATE_FILE), "ab") as handle:
        os.fchmod(handle.fileno(), _PRIVATE_FILE)
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def read_journal_tail(path: Path, limit: int = MAX_JOURNAL_READ) -> bytes:
    """The last `limit` bytes of the journal, whole lines only; an OSError unless it is a
    regular file (a device or a pipe there could be read for ever)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    with os.fdopen(os.open(path, flags), "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        if info.st_size <= limit:
            return handle.read(limit)
        handle.seek(info.st_size - limit)
        # The first line read from the middle of the file is only its end.
        return handle.read(limit).partition(b"\n")[2]


class SerialWriter:
    """Runs writes in order on a thread of its own: an fsync on a busy disk can take
    seconds, and the loop that judges the server must never wait for one. At most
    `max_pending` writes wait; `submit` refuses more."""

    def __init__(self, max_pending: int = MAX_PENDING_LINES) -> None:
        # None: the thread's end, once what came before it is written.
        self._pending: queue.Queue[Callable[[], None] | None] = queue.Queue(max_pending)
        self._thread = threading.Thread(target=self._run, name="omni-watchdog-writer", daemon=True)
        self._thread.start()

    def submit(self, write: Callable[[], None]) -> bool:
        """Queue `write` after every write submitted before it; False if too many wait."""
        try:
            self._pending.put_nowait(write)
        except queue.Full:
            return False
        return True

    def close(self, timeout: float) -> bool:
        """Write what waits and end the thread; whether it ended within `timeout` s."""
        try:
            self._pending.put(None, timeout=timeout)
        except queue.Full:
            return False
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            write = self._pending.get()
            if write is None:
                return
            try:
                write()
            except Exception:  # a write reports its own OSError; this is a bug, not the disk
                logger.exception("journal write failed")


class StateWriteErrors:
    """Failed writes to the state directory, counted for the exporter and logged once each.

    One is shared by the journal and the bundle writer; a writer's failure is logged again
    only when its error changes or after it has written successfully in between.
    """

    def __init__(self) -> None:
        self.total = 0
        self.last = ""
        self._failing: dict[str, int | None] = {}

    def failed(self, writer: str, path: Path, error: OSError) -> None:
        self.total += 1
        self.last = f"{writer} {path}: {error}"
        if writer in self._failing and self._failing[writer] == error.errno:
            return
        self._failing[writer] = error.errno
        log_event(
            logger,
            "state_write_failed",
            logging.ERROR,
            writer=writer,
            path=str(path),
            error=str(error),
            errors_total=self.total,
        )

    def succeeded(self, writer: str) -> None:
        if writer in self._failing:
            del self._failing[writer]
            log_event(logger, "state_write_recovered", logging.WARNING, writer=writer)


class IncidentJournal:
    """Append-only JSON lines; replayed at start so an open incident is resumed, not redone."""

    def __init__(
        self,
        path: Path,
        errors: StateWriteErrors,
        append: Callable[[Path, bytes], None] = append_private,
        writer: SerialWriter | None = None,
    ) -> None:
        """`writer`: where lines are written, in order, off the caller's thread (None: at
        once, on it)."""
        self._path = path
        self._errors = errors
        self._append = append
        self._writer = writer
        self._torn = False
        # The operator's actions, read from the journal once and kept since: a report
        # lists them, and a reader must never make the watchdog parse its journal again.
        self._actions: deque[OperatorAction] | None = None
        try:
            private_directory(path.parent)
        except OSError as error:
            errors.failed("journal", path.parent, error)

    def record(
        self,
        incident: Incident,
        root: ProcessIdentity | None = None,
        processes: tuple[ProcessIdentity, ...] = (),
        pgids: tuple[int, ...] = (),
        gpu_baseline: Mapping[int, float] | None = None,
    ) -> None:
        line = json.dumps(
            {
                "incident": redact_json(to_jsonable(incident)),
                "root": [root.pid, root.create_time] if root else None,
                "processes": [[p.pid, p.create_time] for p in processes],
                "pgids": list(pgids),
                "gpu_baseline": None if gpu_baseline is None else to_jsonable(gpu_baseline),
            }
        )
        self._append_line(line)

    def _append_line(self, line: str) -> None:
        if self._writer is None:
            self._write_line(line)
        elif not self._writer.submit(lambda: self._write_line(line)):
            error = OSError(errno.EAGAIN, "too many journal lines wait for the disk")
            self._errors.failed("journal", self._path, error)

    def close(self, timeout: float) -> bool:
        """Write every line recorded so far (True if within `timeout` s); later lines are
        written at once, on the caller's thread."""
        writer, self._writer = self._writer, None
        return writer is None or writer.close(timeout)

    def _write_line(self, line: str) -> None:
        # After a failed append the file may end mid-line: a fresh line keeps this one whole.
        data = ("\n" if self._torn else "") + line + "\n"
        try:
            self._append(self._path, data.encode())
        except OSError as error:
            self._torn = True
            self._errors.failed("journal", self._path, error)
        else:
            self._torn = False
            self._errors.succeeded("journal")

    def record_action(self, action: OperatorAction) -> None:
        """One operator action, on a line of its own beside the incidents."""
        self._journaled_actions().append(action)
        self._append_line(json.dumps({"action": redact_json(to_jsonable(action))}))

    def actions(self, incident_id: str | None = None) -> list[OperatorAction]:
        """The operator's actions, oldest first (the latest `MAX_ACTIONS_KEPT`); of one
        incident when given."""
        kept = list(self._journaled_actions())
        return [a for a in kept if incident_id is None or a.incident_id == incident_id]

    def _journaled_actions(self) -> deque[OperatorAction]:
        if self._actions is None:
            self._actions = deque(maxlen=MAX_ACTIONS_KEPT)
            for data in self._lines():
                try:
                    self._actions.append(_action_from_json(data["action"]))
                except (ValueError, KeyError, TypeError, AttributeError):
                    continue
        return self._actions

    def _lines(self) -> Iterator[Any]:
        try:
            text = read_journal_tail(self._path).decode(errors="replace")
        except FileNotFoundError:
            return
        except OSError as error:
            log_event(
                logger, "journal_unreadable", logging.ERROR, path=str(self._path), error=str(error)
            )
            return
        for line in text.splitlines():
            try:
                yield json.loads(line)
            except ValueError:
                continue

    def replay(self) -> list[JournalEntry]:
        """The latest entry of every incident, oldest first; a torn line is skipped."""
        latest: dict[str, JournalEntry] = {}
        for data in self._lines():
            try:
                incident = incident_from_json(data["incident"])
                processes = tuple(ProcessIdentity(int(p), float(t)) for p, t in data["processes"])
                root = (
                    ProcessIdentity(int(data["root"][0]), float(data["root"][1]))
                    if data.get("root")
                    else None
                )
                pgids = tuple(int(g) for g in data["pgids"])
                baseline = data.get("gpu_baseline")
                gpu = (
                    None
                    if baseline is None
                    else {int(device): float(used) for device, used in baseline.items()}
                )
            except (ValueError, KeyError, TypeError, IndexError, AttributeError):
                continue
            latest[incident.incident_id] = JournalEntry(incident, root, processes, pgids, gpu)
        return sorted(latest.values(), key=lambda entry: entry.incident.opened)


class HourlyBudget:
    """At most `per_hour` incidents of one kind in any rolling hour (wall clock)."""

    def __init__(self, per_hour: int) -> None:
        self._per_hour = per_hour
        self._opened: list[float] = []

    def note(self, wall_time: float) -> None:
        self._opened.append(wall_time)

    def remaining(self, wall_now: float) -> int:
        recent = [t for t in self._opened if wall_now - t < 3600.0]
        self._opened = recent
        return max(0, self._per_hour - len(recent))


def lock_dir_for(state_dir: Path, environ: Mapping[str, str]) -> Path:
    """Where target locks live: the user's runtime directory when it really is this user's
    (shared by all their watchdogs, whatever their state directories), else the state one."""
    runtime = environ.get("XDG_RUNTIME_DIR", "")
    if runtime and Path(runtime).is_absolute():
        try:
            status = os.stat(runtime)
        except OSError:
            return state_dir / "locks"
        if stat.S_ISDIR(status.st_mode) and status.st_uid == os.getuid():
            return Path(runtime) / "omni-watchdog"
    return state_dir / "locks"


class TargetLock:
    """An exclusive lock per target process, so two watchdogs on one server never both act.

    Keyed on the server's pid and create time, in a directory only this user can write to
    (see `lock_dir_for`), and never opened through a link: no other user can plant,
    pre-create or redirect it. When the lock is not taken, `conflict` says why.
    """

    def __init__(self, lock_dir: Path) -> None:
        self._dir = lock_dir
        self._held: int | None = None
        self._root: ProcessIdentity | None = None
        self.conflict = ""
        self.path: Path | None = None

    @property
    def held(self) -> bool:
        return self._held is not None

    def path_for(self, root: ProcessIdentity) -> Path:
        key = hashlib.sha256(f"{root.pid}:{root.create_time:.3f}".encode()).hexdigest()[:16]
        return self._dir / f"target-{key}.lock"

    def acquire(self, root: ProcessIdentity) -> bool:
        """Hold `root`'s lock (one held already is kept), giving up any other target's."""
        if self._held is not None and self._root == root:
            return True
        self.release()
        self.path = self.path_for(root)
        self.conflict = self._directory_refusal() or self._lock(self.path)
        if self._held is not None:
            self._root = root
        return self._held is not None

    def release(self) -> None:
        # The file stays: were it removed, a watchdog that had opened it could lock the
        # removed file while a newcomer locks a new one, and both would act.
        if self._held is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._held, fcntl.LOCK_UN)
            os.close(self._held)
        self._held = None
        self._root = None
        self.conflict = ""
        self.path = None

    def _directory_refusal(self) -> str:
        try:
            private_directory(self._dir)
            status = os.lstat(self._dir)
        except OSError as error:
            return f"cannot create lock directory {self._dir}: {error}"
        if stat.S_ISLNK(status.st_mode):
            return f"lock directory {self._dir} is a symbolic link"
        if not stat.S_ISDIR(status.st_mode):
            return f"lock directory {self._dir} is not a directory"
        if status.st_uid != os.getuid():
            return f"lock directory {self._dir} is owned by uid {status.st_uid}"
        if status.st_mode & 0o077:
            mode = stat.S_IMODE(status.st_mode)
            return f"lock directory {self._dir} is not private (mode {mode:04o})"
        return ""

    def _lock(self, path: Path) -> str:
        """Open and lock `path`, holding it on success; else why not."""
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            descriptor = os.open(path, flags, _PRIVATE_FILE)
        except OSError as error:
            if error.errno == errno.ELOOP:
                return f"lock file {path} is a symbolic link"
            return f"cannot open {path}: {error}"
        refusal = _foreign_file(descriptor, path)
        if not refusal:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                refusal = f"held by another watchdog (pid {_holder(descriptor)})"
            except OSError as error:
                refusal = f"cannot lock {path}: {error}"
        if refusal:
            os.close(descriptor)
            return refusal
        # The pid only names this watchdog to another one: the lock holds without it.
        with contextlib.suppress(OSError):
            os.fchmod(descriptor, _PRIVATE_FILE)
            os.ftruncate(descriptor, 0)
            os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)
        self._held = descriptor
        return ""


def _foreign_file(descriptor: int, path: Path) -> str:
    """Why an opened lock file is not this user's own regular file; empty when it is."""
    try:
        status = os.fstat(descriptor)
    except OSError as error:
        return f"cannot open {path}: {error}"
    if not stat.S_ISREG(status.st_mode):
        return f"lock file {path} is not a regular file"
    if status.st_uid != os.getuid():
        return f"lock file {path} is owned by uid {status.st_uid}"
    return ""


def _holder(descriptor: int) -> str:
    """The pid the holding watchdog wrote into its lock file."""
    try:
        return str(int(os.pread(descriptor, 32, 0).split()[0]))
    except (OSError, ValueError, IndexError):
        return "unknown"


class BundleWriter:
    """Writes one incident's evidence under `<state_dir>/incidents/<id>/`, redacted."""

    def __init__(
        self,
        root: Path,
        errors: StateWriteErrors,
        write: Callable[[Path, bytes], None] = replace_private,
    ) -> None:
        self._root = root
        self._errors = errors
        self._write_file = write

    def directory(self, incident_id: str) -> Path:
        path = self._root / incident_id
        try:
            private_directory(path)
        except OSError as error:
            self._errors.failed("bundle", path, error)
        return path

    def write_text(self, incident_id: str, name: str, text: str) -> None:
        self._write(incident_id, name, redact_text(text))

    def write_json(self, incident_id: str, name: str, value: Any) -> None:
        self._write(incident_id, name, json.dumps(redact_json(to_jsonable(value)), indent=2) + "\n")

    def files(self, incident_id: str) -> Iterator[Path]:
        base = self._root / incident_id
        return (p for p in sorted(base.rglob("*")) if p.is_file()) if base.exists() else iter(())

    def names(self, incident_id: str) -> list[str]:
        """The bundle's files, as paths relative to the bundle."""
        base = self._root / incident_id
        return [str(path.relative_to(base)) for path in self.files(incident_id)]

    def read(self, incident_id: str) -> dict[str, str]:
        """The bundle's files as text, each cut at `MAX_BUNDLE_FILE_READ` bytes, the whole
        at `MAX_BUNDLE_READ`; one that cannot be read is left out."""
        base = self._root / incident_id
        found: dict[str, str] = {}
        budget = MAX_BUNDLE_READ
        for path in self.files(incident_id):
            if budget <= 0:
                break
            try:
                with path.open("rb") as handle:
                    data = handle.read(min(MAX_BUNDLE_FILE_READ, budget))
            except OSError:
                continue
            budget -= len(data)
            found[str(path.relative_to(base))] = data.decode(errors="replace")
        return found

    def _write(self, incident_id: str, name: str, text: str) -> None:
        """Write an already redacted text; a disk error is counted, never raised."""
        target = self._root / incident_id / name
        try:
            private_directory(target.parent)
            self._write_file(target, text.encode())
        except OSError as error:
            self._errors.failed("bundle", target, error)
        else:
            self._errors.succeeded("bundle")
