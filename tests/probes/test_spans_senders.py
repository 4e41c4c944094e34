"""A span from this host counts only from the process whose connection it came on: pids
and start times are world-readable, descriptors are not anyone's to take."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import pytest
from fakes import FakeSenders
from listening import listening
from otlp_bodies import batch
from span_evidence import evidence

from omni_watchdog.clock import FakeClock
from omni_watchdog.config import SpansConfig
from omni_watchdog.probes.peers import SocketOwners, kernel_forms
from omni_watchdog.probes.span_store import SpanStore
from omni_watchdog.probes.spans import SpanReceiver
from omni_watchdog.process_start import boot_id, sender_attributes, start_ticks
from omni_watchdog.semconv import (
    HEARTBEAT_SPAN,
    PROCESS_PID,
    REQUEST_ID,
    STAGE_ID,
    STAGE_REPLICA,
    STAGE_REQUEST_SPAN,
    VLLM_REQUEST_SPAN,
)
from omni_watchdog.types import ObservationKind, StageRef

S0 = StageRef(0)
Spans = list[tuple[str, Mapping[str, object]]]
STAGE_SPANS: Spans = [(HEARTBEAT_SPAN, {}), (STAGE_REQUEST_SPAN, {REQUEST_ID: "r1"})]
ANONYMOUS_SPAN: Spans = [(VLLM_REQUEST_SPAN, {"gen_ai.request.id": "cmpl-1"})]


@pytest.fixture
def other_process() -> Iterator[int]:
    """A live process of this host that is not this test's."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        yield process.pid
    finally:
        process.kill()
        process.wait()


def claiming(pid: int) -> dict[str, object]:
    return {PROCESS_PID: pid, **sender_attributes(pid), STAGE_ID: 0, STAGE_REPLICA: 0}


def receiver_believing(*pids: int, owners: SocketOwners | None = None) -> SpanReceiver:
    """A receiver whose target is `pids`, checking senders through `owners` (this host's
    /proc by default)."""
    owned = {(pid, start_ticks(pid)) for pid in pids}
    config = SpansConfig()
    return SpanReceiver(
        config,
        FakeClock(),
        SpanStore(config.ring_size),
        senders=FakeSenders(owned=owned, stages={S0}, mapped={S0}),
        boot_id=boot_id(),
        owners=owners or SocketOwners(),
    )


def post(port: int, body: bytes, family: socket.AddressFamily, host: str) -> bytes:
    """One export over a socket of `family`, made here: its status line."""
    with socket.socket(family) as connection:
        connection.settimeout(10)
        connection.connect((host, port))
        head = (
            f"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        connection.sendall(head.encode() + body)
        return connection.makefile("rb").readline().strip()


def exported(
    receiver: SpanReceiver,
    resource: Mapping[str, object],
    spans: Spans,
    family: socket.AddressFamily = socket.AF_INET,
    host: str = "127.0.0.1",
) -> tuple[list[ObservationKind], dict[str, int]]:
    """What one export from this process gave: the observations taken, the refusals."""

    async def scenario() -> bytes:
        async with listening(receiver.app()) as listener:
            assert listener.port is not None
            return await asyncio.to_thread(
                post, listener.port, batch(resource, spans), family, host
            )

    assert asyncio.run(scenario()) == b"HTTP/1.1 200 OK"
    taken = [obs.kind for obs in evidence(asyncio.run(receiver.collect()))]
    return taken, {reason: n for reason, n in receiver.stats.spans_rejected.items() if n}


def test_spans_in_its_own_name_count() -> None:
    receiver = receiver_believing(os.getpid())
    taken, refused = exported(receiver, claiming(os.getpid()), STAGE_SPANS)
    assert taken == [ObservationKind.HEARTBEAT, ObservationKind.STAGE_SPAN] and not refused


def test_spans_in_another_process_s_name_are_refused(other_process: int) -> None:
    # Its pid, start and boot are all right: only the connection says who sent them.
    receiver = receiver_believing(os.getpid(), other_process)
    taken, refused = exported(receiver, claiming(other_process), STAGE_SPANS)
    assert taken == [] and refused == {"unproven_sender": 2}


def ipv6_sockets() -> bool:
    try:
        socket.socket(socket.AF_INET6).close()
    except OSError:
        return False
    return True


@pytest.mark.skipif(not ipv6_sockets(), reason="this kernel makes no IPv6 sockets")
def test_an_ipv6_socket_to_the_mapped_loopback_is_checked_the_same(other_process: int) -> None:
    receiver = receiver_believing(os.getpid(), other_process)
    taken, refused = exported(
        receiver, claiming(other_process), STAGE_SPANS, socket.AF_INET6, "::ffff:127.0.0.1"
    )
    assert taken == [] and refused == {"unproven_sender": 2}
    receiver = receiver_believing(os.getpid())
    taken, refused = exported(
        receiver, claiming(os.getpid()), STAGE_SPANS, socket.AF_INET6, "::ffff:127.0.0.1"
    )
    assert len(taken) == 2 and not refused


def test_a_span_naming_no_process_counts_only_from_a_process_of_the_target(
    other_process: int,
) -> None:
    taken, refused = exported(receiver_believing(os.getpid()), {}, ANONYMOUS_SPAN)
    assert taken == [ObservationKind.STAGE_SPAN] and not refused
    taken, refused = exported(receiver_believing(other_process), {}, ANONYMOUS_SPAN)
    assert taken == [] and refused == {"unproven_sender": 1}


@pytest.mark.parametrize(
    ("host", "port", "forms"),
    [
        (
            "127.0.0.1",
            4318,
            [("tcp", "0100007F:10DE"), ("tcp6", "0000000000000000FFFF00000100007F:10DE")],
        ),
        (
            "::ffff:127.0.0.1",
            80,
            [("tcp", "0100007F:0050"), ("tcp6", "0000000000000000FFFF00000100007F:0050")],
        ),
        ("::1", 1, [("tcp6", "00000000000000000000000001000000:0001")]),
    ],
)
def test_addresses_are_looked_for_as_the_kernel_prints_them(
    host: str, port: int, forms: list[tuple[str, str]]
) -> None:
    if sys.byteorder != "little":
        pytest.skip("the kernel prints words in host order")
    assert kernel_forms(host, port) == forms


def test_a_peer_in_no_table_is_of_another_host(tmp_path: Path) -> None:
    (tmp_path / "net").mkdir()
    heading = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt  uid"
    heading += "  timeout inode\n"
    row = "   0: 0100007F:9C40 0100007F:10DE 01 00000000:00000000 00:00000000 00000000"
    row += "     0        0 4242\n"
    (tmp_path / "net" / "tcp").write_text(heading + row)
    (tmp_path / "net" / "tcp6").write_text(heading)
    owners = SocketOwners(tmp_path)
    assert owners.peer_inode(("127.0.0.1", 40000), ("127.0.0.1", 4318)) == 4242
    assert owners.peer_inode(("10.0.0.5", 40000), ("127.0.0.1", 4318)) is None
    assert owners.holders(4242, [1, 2]) == (set(), set())  # no descriptor table here


class UnreadableDescriptors(SocketOwners):
    """This host's socket table, but descriptor tables it may not read: another user's
    processes, to a watchdog without ptrace rights."""

    def holders(self, inode: int, pids: Iterable[int]) -> tuple[set[int], set[int]]:
        return set(), set(pids)


def test_a_sender_whose_descriptors_cannot_be_read_is_believed_and_that_is_said(
    other_process: int, caplog: pytest.LogCaptureFixture
) -> None:
    receiver = receiver_believing(os.getpid(), other_process, owners=UnreadableDescriptors())
    taken, refused = exported(receiver, claiming(other_process), STAGE_SPANS)
    # As without the check: never blind to the target for want of a permission.
    assert len(taken) == 2 and not refused
    assert "otlp_sender_check_unavailable" in caplog.text
