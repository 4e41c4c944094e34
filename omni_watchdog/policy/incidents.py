"""Incidents on disk: the journal a restarted watchdog resumes from, the hourly budget, the
per-target lock, and the bundle directory of each incident."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import fcntl
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from omni_watchdog.types import (
    Evidence,
    EvidenceKind,
    Incident,
    IncidentOutcome,
    Mode,
    ProcessIdentity,
    StageRef,
    StageState,
    StepName,
    StepOutcome,
    StepResult,
    Verdict,
)


def to_jsonable(value: Any) -> Any:
    """Dataclasses, enums and tuples as plain JSON values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    return value


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


def incident_from_json(data: Mapping[str, Any]) -> Incident:
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
    )


@dataclasses.dataclass(frozen=True)
class JournalEntry:
    """An incident as the journal knows it, with the processes it was about."""

    incident: Incident
    root: ProcessIdentity | None
    processes: tuple[ProcessIdentity, ...]
    pgids: tuple[int, ...]


class IncidentJournal:
    """Append-only JSON lines; replayed at start so an open incident is resumed, not redone."""

    def __init__(self, path: Path) -> None:
        self._path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def record(
        self,
        incident: Incident,
        root: ProcessIdentity | None = None,
        processes: tuple[ProcessIdentity, ...] = (),
        pgids: tuple[int, ...] = (),
    ) -> None:
        line = json.dumps(
            {
                "incident": to_jsonable(incident),
                "root": [root.pid, root.create_time] if root else None,
                "processes": [[p.pid, p.create_time] for p in processes],
                "pgids": list(pgids),
            }
        )
        with self._path.open("a") as handle:
            handle.write(line + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def replay(self) -> list[JournalEntry]:
        """The latest entry of every incident, oldest first; a torn last line is skipped."""
        if not self._path.exists():
            return []
        latest: dict[str, JournalEntry] = {}
        for line in self._path.read_text().splitlines():
            try:
                data = json.loads(line)
                incident = incident_from_json(data["incident"])
                processes = tuple(ProcessIdentity(int(p), float(t)) for p, t in data["processes"])
                root = (
                    ProcessIdentity(int(data["root"][0]), float(data["root"][1]))
                    if data.get("root")
                    else None
                )
                pgids = tuple(int(g) for g in data["pgids"])
            except (ValueError, KeyError, TypeError, IndexError):
                continue
            latest[incident.incident_id] = JournalEntry(incident, root, processes, pgids)
        return sorted(latest.values(), key=lambda entry: entry.incident.opened)


class EnforcementBudget:
    """At most `per_hour` enforced incidents in any rolling hour (wall clock)."""

    def __init__(self, per_hour: int) -> None:
        self._per_hour = per_hour
        self._opened: list[float] = []

    def note(self, wall_time: float) -> None:
        self._opened.append(wall_time)

    def remaining(self, wall_now: float) -> int:
        recent = [t for t in self._opened if wall_now - t < 3600.0]
        self._opened = recent
        return max(0, self._per_hour - len(recent))


class TargetLock:
    """An exclusive lock per target process, so two watchdogs on one server never both act.

    Keyed on the server's pid and create time and kept in the system's temporary
    directory, so it holds across watchdogs with different state directories.
    """

    def __init__(self, lock_dir: Path | None = None) -> None:
        self._dir = lock_dir or Path(tempfile.gettempdir()) / "omni-watchdog-locks"
        self._held: IO[str] | None = None

    def path_for(self, root: ProcessIdentity) -> Path:
        key = hashlib.sha256(f"{root.pid}:{root.create_time:.3f}".encode()).hexdigest()[:16]
        return self._dir / f"target-{key}.lock"

    def acquire(self, root: ProcessIdentity) -> bool:
        self._dir.mkdir(parents=True, exist_ok=True)
        handle = self.path_for(root).open("a+")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            return False
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        self._held = handle
        return True

    def release(self) -> None:
        if self._held is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._held.fileno(), fcntl.LOCK_UN)
            self._held.close()
            self._held = None


class BundleWriter:
    """Writes one incident's evidence under `<state_dir>/incidents/<id>/`."""

    def __init__(self, root: Path) -> None:
        self._root = root

    def directory(self, incident_id: str) -> Path:
        path = self._root / incident_id
        path.mkdir(parents=True, exist_ok=True)
        return path

    def write_text(self, incident_id: str, name: str, text: str) -> None:
        target = self.directory(incident_id) / name
        target.parent.mkdir(parents=True, exist_ok=True)
        temporary = target.with_name(target.name + ".tmp")
        temporary.write_text(text)
        temporary.replace(target)

    def write_json(self, incident_id: str, name: str, value: Any) -> None:
        self.write_text(incident_id, name, json.dumps(to_jsonable(value), indent=2) + "\n")

    def files(self, incident_id: str) -> Iterator[Path]:
        base = self._root / incident_id
        return (p for p in sorted(base.rglob("*")) if p.is_file()) if base.exists() else iter(())
