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


def headless_cmdline(port: int) -> list[str]:
    return [
        "vllm",
        "serve",
        "/models/tiny",
        "--omni",
        "--stage-id",
        "1",
        "--headless",
        "--omni-master-address",
        "127.0.0.1",
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


def test_a_stage_without_a_master_on_its_command_line_is_reported() -> None:
    table = FakePsutil()
    table.add(100, 1, ["vllm", "serve", "m", "--omni", "--stage-id", "1", "--headless"])
    outcome, detail = check(table)
    assert outcome is HealthOutcome.ERROR
    assert "--omni-master-address" in detail
