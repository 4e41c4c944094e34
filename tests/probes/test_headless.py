"""A headless stage server on this host: found by its command line, mapped by its titles,
and its link to its master checked against a real listening socket."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from fakes import FakePsutil
from ports import free_port

from omni_watchdog.clock import FakeClock
from omni_watchdog.probes.link import MasterLinkProbe, master_of
from omni_watchdog.probes.processes import ProcessTracker, is_headless_stage_server
from omni_watchdog.topology import default_topology
from omni_watchdog.types import HealthOutcome, ObservationKind, ProbeError, ProcessRole, StageRef

OWN_PID = 50


def headless_cmdline(port: int, address: str = "127.0.0.1") -> list[str]:
    return [
        "vllm",
        "serve",
        "/models/tiny",
        "--omni",
        "--stage-id",
        "1",
        "--headless",
        "--omni-master-address",
        address,
        "--omni-master-port",
        str(port),
    ]


def headless_tracker(table: FakePsutil, pid: int | None = None) -> ProcessTracker:
    return ProcessTracker(
        table,
        FakeClock(),
        own_pid=OWN_PID,
        target_port=None,
        pid=pid,
        topology=default_topology(),
        process_groups=lambda pid: (100, 100),
        start_time=table.start_time,
        start_time_of_ticks=float,
        headless=True,
    )


@pytest.mark.parametrize(
    ("argv", "headless"),
    [
        (headless_cmdline(29500), True),
        (["python", "-m", "omni_watchdog.sim", "--headless", "--stage-id=2"], True),
        (["vllm", "serve", "m", "--omni"], False),
        (["vllm", "serve", "m", "--omni", "--headless"], False),
        (["omni-watchdog", "run", "--headless"], False),
    ],
)
def test_a_headless_stage_server_is_told_by_its_command_line(
    argv: list[str], headless: bool
) -> None:
    assert is_headless_stage_server(argv) is headless


def test_the_headless_root_is_the_oldest_matching_process_never_the_watchdog() -> None:
    table = FakePsutil()
    table.add(OWN_PID, 1, ["omni-watchdog", "run", "--headless", "--stage-id", "1"])
    table.add(100, 1, headless_cmdline(29500))
    table.add(101, 100, headless_cmdline(29500))  # a forked helper keeps its argv
    table.add(102, 100, "VLLM::StageEngineCoreProc_stage1_replica0_DP0")
    table.add(103, 102, "VLLM::Worker")
    tracker = headless_tracker(table)
    asyncio.run(tracker.collect())
    assert tracker.root is not None and tracker.root.pid == 100
    assert {info.pid: (info.role, info.stage) for info in tracker.recorded()}[102] == (
        ProcessRole.ENGINE,
        StageRef(1, 0),
    )


def test_a_look_alike_started_earlier_is_never_the_stage() -> None:
    """Anyone can start a process with `--headless --stage-id 1` in its command line; the
    stage is the one that started a stage process titled as vLLM-Omni titles them."""
    table = FakePsutil()
    table.add(90, 1, ["python3", "-c", "pass", *headless_cmdline(29500)])
    table.add(100, 1, headless_cmdline(29500))
    tracker = headless_tracker(table)
    # Neither has started a stage yet: none is taken, and the error names both.
    with pytest.raises(ProbeError, match="processes 90, 100 each look like a headless"):
        asyncio.run(tracker.collect())
    table.add(102, 100, "VLLM::StageEngineCoreProc_stage1_replica0_DP0")
    asyncio.run(tracker.collect())
    assert tracker.root is not None and tracker.root.pid == 100


def test_no_headless_server_is_a_probe_error_that_says_what_was_looked_for() -> None:
    table = FakePsutil()
    table.add(100, 1, "vllm serve m --omni")
    with pytest.raises(ProbeError, match="no headless stage server"):
        asyncio.run(headless_tracker(table).collect())


@pytest.mark.parametrize(
    ("argv", "master"),
    [
        (headless_cmdline(29500), ("127.0.0.1", 29500)),
        (["x", "--omni-master-address=head.svc", "--omni-master-port=7"], ("head.svc", 7)),
        (["x", "--omni-master-address", "h"], None),
        (["x", "--omni-master-address", "h", "--omni-master-port", "99999"], None),
        (["x", "--omni-master-address", "h", "--omni-master-port", "http"], None),
    ],
)
def test_the_master_comes_from_the_command_line(
    argv: list[str], master: tuple[str, int] | None
) -> None:
    assert master_of(argv) == master


@contextmanager
def master_listening() -> Iterator[int]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    try:
        yield server.getsockname()[1]
    finally:
        server.close()


def check(table: FakePsutil) -> tuple[HealthOutcome | None, str]:
    tracker = headless_tracker(table)
    asyncio.run(tracker.collect())
    probe = MasterLinkProbe(table, FakeClock(), lambda: tracker.root, tracker.live, timeout=1.0)
    (observation,) = asyncio.run(probe.collect())
    assert observation.kind is ObservationKind.LINK
    state = probe.state()
    assert state is not None and state.up is (observation.outcome is HealthOutcome.OK)
    outcome = observation.outcome
    assert outcome is None or isinstance(outcome, HealthOutcome)
    return outcome, observation.detail


def test_the_link_is_up_while_a_stage_process_is_connected_to_a_listening_master() -> None:
    with master_listening() as port:
        table = FakePsutil()
        table.add(100, 1, headless_cmdline(port))
        engine = table.add(102, 100, "VLLM::StageEngineCoreProc_stage1_replica0_DP0")
        engine.connected_to = {("127.0.0.1", port)}
        outcome, detail = check(table)
        assert outcome is HealthOutcome.OK, detail
        assert "pid 102" in detail


def test_a_registered_engine_is_connected_to_the_head_on_ports_the_head_picked() -> None:
    """vLLM-Omni 0.30 registers over a short-lived connection; the engine core then stays
    connected to the head's coordinator and its input and output sockets."""
    with master_listening() as port:
        table = FakePsutil()
        table.add(100, 1, headless_cmdline(port))
        engine = table.add(102, 100, "VLLM::StageEngineCoreProc_stage1_replica0_DP0")
        engine.connected_to = {("127.0.0.1", 41001), ("127.0.0.1", 41002)}
        outcome, detail = check(table)
        assert outcome is HealthOutcome.OK, detail


def test_a_stage_connected_to_its_master_s_host_only_for_spans_is_not_registered() -> None:
    """The head restarted and forgot the stage: what is left is the plugin's connection to
    the head's watchdog, which says nothing of the registration."""
    with master_listening() as port:
        table = FakePsutil()
        root = table.add(100, 1, headless_cmdline(port))
        root.env = {"OMNI_WATCHDOG_HEAD_OTLP_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}
        engine = table.add(102, 100, "VLLM::StageEngineCoreProc_stage1_replica0_DP0")
        engine.connected_to = {("127.0.0.1", 4318), ("10.9.9.9", 41001)}
        outcome, detail = check(table)
        assert outcome is HealthOutcome.UNHEALTHY
        assert "not registered" in detail


def test_a_master_that_refuses_is_no_link() -> None:
    port = free_port()
    table = FakePsutil()
    table.add(100, 1, headless_cmdline(port))
    outcome, detail = check(table)
    assert outcome is HealthOutcome.REFUSED
    assert f"127.0.0.1:{port}" in detail


def test_a_stage_talking_to_itself_on_its_head_s_host_is_not_registered() -> None:
    """The head shares the stage's host: the stage's processes talking to each other over
    loopback (ZMQ between engine and worker; the fakes' sockets all end at
    127.0.0.1:40000) are no registration with the master listening there."""
    with master_listening() as port:
        table = FakePsutil()
        table.add(100, 1, headless_cmdline(port))
        engine = table.add(102, 100, "VLLM::StageEngineCoreProc_stage1_replica0_DP0")
        worker = table.add(103, 102, "VLLM::Worker")
        engine.connected_to = {("127.0.0.1", 40000)}
        worker.connected_to = {("127.0.0.1", 40000)}
        outcome, detail = check(table)
        assert outcome is HealthOutcome.UNHEALTHY, detail
        assert "not registered" in detail


def test_a_master_that_does_not_answer_is_no_link_whatever_the_stage_still_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Across a partition the stage's side of its connections stays established for
    minutes: they prove nothing when the master's host does not answer at all."""

    async def unanswered(self: MasterLinkProbe, ip: str, port: int) -> tuple[HealthOutcome, str]:
        return HealthOutcome.TIMEOUT, "did not answer in 1s"

    monkeypatch.setattr(MasterLinkProbe, "_connect", unanswered)
    table = FakePsutil()
    table.add(100, 1, headless_cmdline(25000))
    engine = table.add(102, 100, "VLLM::StageEngineCoreProc_stage1_replica0_DP0")
    engine.connected_to = {("127.0.0.1", 41001)}
    outcome, detail = check(table)
    assert outcome is HealthOutcome.TIMEOUT, detail


def test_a_stage_without_a_master_on_its_command_line_is_reported() -> None:
    table = FakePsutil()
    table.add(100, 1, ["vllm", "serve", "m", "--omni", "--stage-id", "1", "--headless"])
    outcome, detail = check(table)
    assert outcome is HealthOutcome.ERROR
    assert "--omni-master-address" in detail


def test_a_master_name_that_stops_resolving_is_no_orphan() -> None:
    """The name of the master (the shipped manifest uses a DNS name) stops resolving while
    the stage's connections stand: a watchdog judged `link_lost` and stopped a healthy
    stage in 10.5 s. The stage's own connection says whether its master is gone."""
    with master_listening() as port:
        table = FakePsutil()
        table.add(100, 1, headless_cmdline(port, address="head.cluster.local"))
        engine = table.add(102, 100, "VLLM::StageEngineCoreProc_stage1_replica0_DP0")
        engine.connected_to = {("127.0.0.1", 41001)}
        tracker = headless_tracker(table)
        asyncio.run(tracker.collect())
        answers: list[set[str] | OSError] = [
            {"127.0.0.1"},
            socket.gaierror(socket.EAI_NONAME, "Name or service not known"),
        ]

        async def resolve(name: str, port: int) -> set[str]:
            assert name == "head.cluster.local"
            answer = answers.pop(0) if len(answers) > 1 else answers[0]
            if isinstance(answer, OSError):
                raise answer
            return answer

        probe = MasterLinkProbe(
            table, FakeClock(), lambda: tracker.root, tracker.live, 1.0, resolve
        )
        (first,) = asyncio.run(probe.collect())
        (second,) = asyncio.run(probe.collect())
        assert first.outcome is second.outcome is HealthOutcome.OK, second.detail
        assert "head.cluster.local did not resolve" in second.detail
        assert "its last address 127.0.0.1" in second.detail
        # The master gone meanwhile: still judged, by its port and the stage's connection.
        engine.connected_to = set()
        (third,) = asyncio.run(probe.collect())
        assert third.outcome is HealthOutcome.UNHEALTHY, third.detail


def test_a_master_name_that_never_resolved_leaves_the_link_unjudged() -> None:
    table = FakePsutil()
    table.add(100, 1, headless_cmdline(free_port(), address="head.cluster.local"))
    tracker = headless_tracker(table)
    asyncio.run(tracker.collect())

    async def resolve(name: str, port: int) -> set[str]:
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    probe = MasterLinkProbe(table, FakeClock(), lambda: tracker.root, tracker.live, 1.0, resolve)
    with pytest.raises(ProbeError, match="the link is judged once it resolves"):
        asyncio.run(probe.collect())
    assert probe.state() is None
