"""The state directory against a hostile neighbour and a bad disk: private modes, redaction,
a lock no one else can plant or redirect, and disk faults that are counted, never raised."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from omni_watchdog.policy.incidents import (
    BundleWriter,
    IncidentJournal,
    StateWriteErrors,
    TargetLock,
    append_private,
    lock_dir_for,
    read_journal_tail,
)
from omni_watchdog.semconv import GEN_AI_USAGE_PROMPT_TOKENS
from omni_watchdog.types import (
    Incident,
    IncidentOutcome,
    Mode,
    ProcessIdentity,
    StepName,
    StepOutcome,
    StepResult,
)

ROOT = ProcessIdentity(100, 100.0)
INCIDENT = Incident(
    "20260101T000000Z-abcdef",
    "http://127.0.0.1:8000",
    Mode.ENFORCE,
    1_700_000_000.0,
    "stage 1.0 dead",
    steps=(
        StepResult(
            StepName.VERIFY,
            StepOutcome.FAILED,
            1.0,
            2.0,
            "still alive after 2s: 100 (python -m vllm --model m --api-key sk-123)",
        ),
    ),
)


def mode_of(path: Path) -> int:
    return os.stat(path).st_mode & 0o777


@pytest.fixture(params=[0o000, 0o022, 0o277], ids=["umask-000", "umask-022", "umask-277"])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    previous = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(previous)


def test_files_are_0600_and_directories_0700_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    state = tmp_path / "state"
    errors = StateWriteErrors()
    IncidentJournal(state / "journal.jsonl", errors).record(INCIDENT, ROOT)
    bundles = BundleWriter(state / "incidents", errors)
    bundles.write_json(INCIDENT.incident_id, "incident.json", INCIDENT)
    bundles.write_text(INCIDENT.incident_id, "stacks/101.txt", "Thread 1 (idle)\n")
    lock = TargetLock(state / "locks")
    assert lock.acquire(ROOT) and lock.path is not None
    bundle = state / "incidents" / INCIDENT.incident_id
    files = [state / "journal.jsonl", bundle / "incident.json", bundle / "stacks/101.txt"]
    directories = [state, state / "incidents", bundle, bundle / "stacks", state / "locks"]
    assert [mode_of(f) for f in [*files, lock.path]] == [0o600] * 4
    assert [mode_of(d) for d in directories] == [0o700] * 5
    assert sorted(p.name for p in bundles.files(INCIDENT.incident_id)) == [
        "101.txt",
        "incident.json",
    ]
    assert errors.total == 0
    lock.release()


def test_a_journal_left_readable_by_an_older_version_becomes_private(tmp_path: Path) -> None:
    journal = tmp_path / "journal.jsonl"
    journal.write_text("")
    journal.chmod(0o644)
    IncidentJournal(journal, StateWriteErrors()).record(INCIDENT)
    assert mode_of(journal) == 0o600


def test_the_journal_and_the_bundle_carry_no_secret(tmp_path: Path) -> None:
    errors = StateWriteErrors()
    incident = Incident(
        INCIDENT.incident_id,
        INCIDENT.target,
        INCIDENT.mode,
        INCIDENT.opened,
        "stage 1.0 dead; Authorization: Bearer b-987",
        steps=INCIDENT.steps,
    )
    IncidentJournal(tmp_path / "journal.jsonl", errors).record(incident, ROOT)
    bundles = BundleWriter(tmp_path / "incidents", errors)
    bundles.write_json(incident.incident_id, "incident.json", incident)
    spans = {"attributes": {"x.api_key": "sk-123", GEN_AI_USAGE_PROMPT_TOKENS: 12}}
    bundles.write_json(incident.incident_id, "spans.json", spans)
    texts = [
        (tmp_path / "journal.jsonl").read_text(),
        *(p.read_text() for p in bundles.files(incident.incident_id)),
    ]
    assert all("sk-123" not in t and "b-987" not in t for t in texts)
    (entry,) = IncidentJournal(tmp_path / "journal.jsonl", errors).replay()
    assert entry.incident.cause == "stage 1.0 dead; Authorization: ***"
    assert entry.incident.steps[0].detail.endswith("--model m --api-key ***")
    written = json.loads((tmp_path / "incidents" / incident.incident_id / "spans.json").read_text())
    assert written == {"attributes": {"x.api_key": "***", GEN_AI_USAGE_PROMPT_TOKENS: 12}}


# ---- the lock --------------------------------------------------------------------------


def test_a_second_lock_on_one_target_names_the_holder(tmp_path: Path) -> None:
    first, second = TargetLock(tmp_path / "locks"), TargetLock(tmp_path / "locks")
    assert first.acquire(ROOT) and first.held and first.conflict == ""
    assert first.path is not None and first.path.read_text() == f"{os.getpid()}\n"
    assert not second.acquire(ROOT) and not second.held
    assert second.conflict == f"held by another watchdog (pid {os.getpid()})"
    assert second.path == first.path
    first.release()
    assert second.acquire(ROOT) and second.conflict == ""
    second.release()
    assert lock_state(second) == (False, "", None)


def lock_state(lock: TargetLock) -> tuple[bool, str, Path | None]:
    # Read afresh: what the asserts above narrowed, release() has since changed.
    return (lock.held, lock.conflict, lock.path)


def plant_symlink(lock_dir: Path, path: Path, victim: Path) -> None:
    lock_dir.mkdir(mode=0o700)
    path.symlink_to(victim)


def foreign_file(lock_dir: Path, path: Path, victim: Path) -> None:
    lock_dir.mkdir(mode=0o700)
    path.write_text("")
    os.chown(path, 4242, 4242)


def open_directory(lock_dir: Path, path: Path, victim: Path) -> None:
    lock_dir.mkdir()
    lock_dir.chmod(0o777)


def foreign_directory(lock_dir: Path, path: Path, victim: Path) -> None:
    lock_dir.mkdir(mode=0o700)
    os.chown(lock_dir, 4242, 4242)


def linked_directory(lock_dir: Path, path: Path, victim: Path) -> None:
    elsewhere = victim.parent / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    lock_dir.symlink_to(elsewhere)


def directory_under_a_file(lock_dir: Path, path: Path, victim: Path) -> None:
    lock_dir.parent.rmdir()
    lock_dir.parent.write_text("a regular file")


@pytest.mark.parametrize(
    ("plant", "conflict"),
    [
        (plant_symlink, "lock file {path} is a symbolic link"),
        (foreign_file, "lock file {path} is owned by uid 4242"),
        (open_directory, "lock directory {dir} is not private (mode 0777)"),
        (foreign_directory, "lock directory {dir} is owned by uid 4242"),
        (linked_directory, "lock directory {dir} is a symbolic link"),
        (directory_under_a_file, "cannot create lock directory {dir}: [Errno 20] Not a directory"),
    ],
)
def test_a_lock_another_user_could_plant_or_redirect_is_refused(
    tmp_path: Path, plant: Callable[[Path, Path, Path], None], conflict: str
) -> None:
    lock_dir = tmp_path / "state" / "locks"
    lock_dir.parent.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    victim_mode = mode_of(victim)
    lock = TargetLock(lock_dir)
    plant(lock_dir, lock.path_for(ROOT), victim)
    assert not lock.acquire(ROOT) and not lock.held
    expected = conflict.format(path=lock.path_for(ROOT), dir=lock_dir)
    assert lock.conflict.startswith(expected), lock.conflict
    assert victim.read_text() == "precious\n" and mode_of(victim) == victim_mode


def runtime_dir(tmp_path: Path, owner: int | None, kind: str = "directory") -> str:
    path = tmp_path / "run"
    if kind == "file":
        path.write_text("")
    else:
        path.mkdir(mode=0o700)
    if owner is not None:
        os.chown(path, owner, owner)
    return str(path)


@pytest.mark.parametrize(
    ("environ", "where"),
    [
        (lambda tmp: {"XDG_RUNTIME_DIR": runtime_dir(tmp, None)}, "run/omni-watchdog"),
        (lambda tmp: {}, "state/locks"),
        (lambda tmp: {"XDG_RUNTIME_DIR": ""}, "state/locks"),
        (lambda tmp: {"XDG_RUNTIME_DIR": str(tmp / "missing")}, "state/locks"),
        (lambda tmp: {"XDG_RUNTIME_DIR": runtime_dir(tmp, None, "file")}, "state/locks"),
        (lambda tmp: {"XDG_RUNTIME_DIR": runtime_dir(tmp, 4242)}, "state/locks"),
        (lambda tmp: {"XDG_RUNTIME_DIR": "relative/run"}, "state/locks"),
    ],
    ids=["owned", "unset", "empty", "missing", "a-file", "another-user", "relative"],
)
def test_locks_live_in_the_runtime_directory_only_when_it_is_this_users(
    tmp_path: Path, environ: Callable[[Path], dict[str, str]], where: str
) -> None:
    assert lock_dir_for(tmp_path / "state", environ(tmp_path)) == tmp_path / where


# ---- a bad disk --------------------------------------------------------------------------


class FailingDisk:
    """Writes that fail with the errors given, in turn; None writes for real."""

    def __init__(self, *codes: int | None) -> None:
        self._codes = list(codes)

    def __call__(self, path: Path, data: bytes) -> None:
        code = self._codes.pop(0)
        if code is not None:
            raise OSError(code, os.strerror(code), str(path))
        append_private(path, data)


def test_a_failing_write_is_counted_each_time_and_logged_once_per_error(
    tmp_path: Path, policy_events: Any
) -> None:
    errors = StateWriteErrors()
    disk = FailingDisk(errno.ENOSPC, errno.ENOSPC, errno.EIO, None, errno.ENOSPC)
    journal = IncidentJournal(tmp_path / "journal.jsonl", errors, disk)
    for _ in range(5):
        journal.record(INCIDENT)
    assert errors.total == 4
    assert errors.last.startswith(f"journal {tmp_path / 'journal.jsonl'}: [Errno 28]")
    failed = policy_events.named("state_write_failed")
    assert [f["error"].split("]")[0] for f in failed] == ["[Errno 28", "[Errno 5", "[Errno 28"]
    assert [f["errors_total"] for f in failed] == [1, 3, 4]
    assert len(policy_events.named("state_write_recovered")) == 1


def test_a_line_torn_by_a_full_disk_does_not_swallow_the_next(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    calls = []

    def tearing(target: Path, data: bytes) -> None:
        calls.append(data)
        if len(calls) == 1:
            append_private(target, data[:25])
            raise OSError(errno.ENOSPC, "No space left on device")
        append_private(target, data)

    errors = StateWriteErrors()
    journal = IncidentJournal(path, errors, tearing)
    journal.record(INCIDENT)
    closed = dataclasses.replace(INCIDENT, outcome=IncidentOutcome.FAILED)
    journal.record(closed, ROOT, (ROOT,), (100,), {0: 1e9})
    (entry,) = journal.replay()
    assert entry.incident.outcome is IncidentOutcome.FAILED
    assert (entry.root, entry.processes, entry.pgids, entry.gpu_baseline) == (
        ROOT,
        (ROOT,),
        (100,),
        {0: 1e9},
    )
    assert errors.total == 1


def test_a_state_directory_that_cannot_exist_is_counted_not_raised(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    state = tmp_path / "file" / "state"
    errors = StateWriteErrors()
    journal = IncidentJournal(state / "journal.jsonl", errors)
    journal.record(INCIDENT)
    bundles = BundleWriter(state / "incidents", errors)
    assert bundles.directory(INCIDENT.incident_id) == state / "incidents" / INCIDENT.incident_id
    bundles.write_text(INCIDENT.incident_id, "stacks/1.txt", "text")
    assert errors.total == 4
    assert "Not a directory" in errors.last
    assert journal.replay() == [] and list(bundles.files(INCIDENT.incident_id)) == []


def test_an_unreadable_journal_replays_as_empty(tmp_path: Path, policy_events: Any) -> None:
    (tmp_path / "journal.jsonl").mkdir()
    assert IncidentJournal(tmp_path / "journal.jsonl", StateWriteErrors()).replay() == []
    assert policy_events.named("journal_unreadable")[0]["path"] == str(tmp_path / "journal.jsonl")


def test_a_failed_bundle_write_leaves_the_old_file_and_no_partial_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    errors = StateWriteErrors()
    bundles = BundleWriter(tmp_path / "incidents", errors)
    bundles.write_text(INCIDENT.incident_id, "health.txt", "HTTP 200\nold")

    def full(source: Any, destination: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    bundles.write_text(INCIDENT.incident_id, "health.txt", "HTTP 200\nnew")
    monkeypatch.undo()
    assert [p.name for p in bundles.files(INCIDENT.incident_id)] == ["health.txt"]
    assert (tmp_path / "incidents" / INCIDENT.incident_id / "health.txt").read_text() == (
        "HTTP 200\nold"
    )
    assert errors.total == 1


def test_a_journal_that_is_not_a_regular_file_is_not_read(tmp_path: Path) -> None:
    # A /dev/full-like node answers every read with zeros, for ever.
    path = tmp_path / "journal.jsonl"
    os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 7))
    assert IncidentJournal(path, StateWriteErrors()).replay() == []


def test_replay_reads_only_the_end_of_a_long_journal(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    path.write_bytes(b'{"old": "line"}\n' * 1000 + b'{"last": "line"}\n')
    tail = read_journal_tail(path, limit=100)
    assert len(tail) <= 100 and tail.endswith(b'{"last": "line"}\n')
    assert tail.startswith(b"{")
