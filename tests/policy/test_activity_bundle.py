"""The bundle of a verdict that names a cause keeps the readings that cause was found from."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
from detector.test_silence_causes import DEFAULTS, PIPELINE, S1, Work, drive
from fakes import FakePsutil
from policy.test_policy import Rig, the_0_11_tree

from omni_watchdog.clock import FakeClock
from omni_watchdog.detector import Detector
from omni_watchdog.policy.activity import ACTIVITY_FILE, activity_document
from omni_watchdog.types import (
    DetectorReport,
    Incident,
    Mode,
    ProcessActivity,
    ProcessReadings,
    SilenceCause,
    StageCause,
    StageRef,
    StageState,
    ThreadActivity,
    Verdict,
)


def judged_at_its_verdict(work: Work) -> tuple[Detector, DetectorReport]:
    """The detector as it was when it gave its first verdict on `work`, and that report."""
    found = next(r for r in drive(work, 60.0, DEFAULTS) if r.verdicts)
    detector = Detector(DEFAULTS, PIPELINE, FakeClock().monotonic())
    # The same story again, stopped at the verdict: the readings are those it came from.
    reports = drive(work, found.time, DEFAULTS, detector)
    assert reports[-1].verdicts, "the story is not the same the second time"
    return detector, reports[-1]


def opened(rig: Rig, detector: Detector, report: DetectorReport) -> Incident:
    async def scenario() -> Incident:
        async with aiohttp.ClientSession() as session:
            policy = rig.policy(session, activity_readings=detector.activity_readings)
            task = policy.on_report(report, rig.snapshot)
            assert task is not None
            return await task

    return asyncio.run(scenario())


def test_a_stalled_verdicts_bundle_holds_the_readings_behind_its_cause(
    tmp_path: Path, fake_psutil: FakePsutil
) -> None:
    detector, report = judged_at_its_verdict(Work("compile", child_stopped_at=20.0))
    (verdict,) = report.verdicts
    assert verdict.cause is not None and verdict.cause.cause is SilenceCause.WAITING_ON_CHILD
    rig = Rig(tmp_path, fake_psutil, Mode.OBSERVE)
    the_0_11_tree(rig)

    incident = opened(rig, detector, report)

    assert incident.bundle_dir is not None
    document = json.loads((Path(incident.bundle_dir) / ACTIVITY_FILE).read_text())
    assert document["readings_left_out"] == 0
    (stage,) = document["stages"]
    assert stage["stage"] == str(S1) and stage["cause"]["cause"] == "waiting_on_child"
    (worker,) = stage["processes"]
    assert worker["pid"] == 201 and worker["cause"] == "waiting_on_child"
    assert "cc1plus pid 300: stopped (T)" in worker["detail"]
    readings = worker["readings"]
    # The latest reading (its compiler child stopped), and the samples with stacks before.
    assert len(readings) > 1
    assert [r["time"] for r in readings] == sorted(r["time"] for r in readings)
    latest = readings[-1]
    assert latest["children"][0]["name"] == "cc1plus" and latest["children"][0]["state"] == "T"
    assert latest["threads"][0]["wait_channel"] == "do_wait"
    sampled = [r for r in readings if r["stacks_read"]]
    assert (
        sampled
        and "wait (/usr/lib/python3.11/threading.py:327)" in sampled[0]["threads"][0]["frames"]
    )


def test_a_verdict_without_a_cause_writes_no_readings(
    tmp_path: Path, fake_psutil: FakePsutil
) -> None:
    rig = Rig(tmp_path, fake_psutil, Mode.OBSERVE)
    the_0_11_tree(rig)
    detector = Detector(DEFAULTS, PIPELINE, FakeClock().monotonic())
    dead = Verdict(StageRef(1), StageState.DEAD, 1000.0, ())
    incident = opened(rig, detector, DetectorReport(1000.0, True, (), (dead,)))
    assert incident.bundle_dir is not None
    assert not (Path(incident.bundle_dir) / ACTIVITY_FILE).exists()


def reading(pid: int, time: float, frames: int) -> ProcessActivity:
    thread = ThreadActivity(
        pid, "R", "", 1.0, 0.0, tuple(f"f{n} (/a.py:{n})" for n in range(frames))
    )
    return ProcessActivity(pid, time, (thread,), (), stacks_read=frames > 0)


def test_the_readings_stay_within_their_bound_latest_of_every_process_first() -> None:
    cause = StageCause(SilenceCause.SPINNING, 10.0, False, "spinning")
    verdict = Verdict(S1, StageState.STALLED, 20.0, (), cause=cause)
    samples_at = [float(at) for at in range(11, 20)]
    processes = tuple(
        ProcessReadings(
            reading(pid, 20.0, 0),
            tuple(reading(pid, at, 40) for at in samples_at),
            SilenceCause.SPINNING,
        )
        for pid in (201, 202)
    )
    whole = activity_document([verdict], lambda stage: processes)
    assert whole is not None and whole["readings_left_out"] == 0
    limit = 8_000
    bounded = activity_document([verdict], lambda stage: processes, limit)
    assert bounded is not None and bounded["readings_left_out"] > 0
    kept = {p["pid"]: [r["time"] for r in p["readings"]] for p in bounded["stages"][0]["processes"]}
    # The readings take no more than the bound in the bundle's indented JSON.
    size = len(json.dumps(bounded, indent=2))
    for process in bounded["stages"][0]["processes"]:
        process["readings"] = []
    assert 0 < size - len(json.dumps(bounded, indent=2)) <= limit
    # Each process keeps its latest reading; the samples kept are the newest of all.
    assert all(times[-1] == 20.0 for times in kept.values())
    sampled_kept = sorted(t for times in kept.values() for t in times[:-1])
    assert sampled_kept == sorted(samples_at * 2)[-len(sampled_kept) :]


def test_no_verdict_naming_a_cause_is_no_document() -> None:
    dead = Verdict(S1, StageState.DEAD, 20.0, ())
    assert activity_document([dead], lambda stage: ()) is None
