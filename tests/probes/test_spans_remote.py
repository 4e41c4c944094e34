"""The head's receiver and a remote stage's spans: taken with the token, only for the
remote stages, from whatever pid and boot, and never mapped onto this host's processes."""

from __future__ import annotations

import asyncio

import pytest
from fakes import FakeSenders
from otlp_bodies import batch

from omni_watchdog.clock import FakeClock
from omni_watchdog.config import SpansConfig
from omni_watchdog.probes.otlp_decode import PROTOBUF
from omni_watchdog.probes.span_store import SpanStore
from omni_watchdog.probes.spans import SpanReceiver
from omni_watchdog.semconv import (
    HEARTBEAT_SPAN,
    HOST_BOOT_ID,
    HOST_NAME,
    PROCESS_PID,
    PROCESS_START_TICKS,
    STAGE_ID,
    STAGE_REPLICA,
)
from omni_watchdog.types import ObservationKind, StageRef

S0, S1 = StageRef(0), StageRef(1)
# The head's own tree: pid 40 serves stage 0; stage 1 runs on another host.
HEAD_TREE = FakeSenders(owned={(40, 900)}, stages={S0, S1}, mapped={S0})
# A process of the stage host: its pid may even be one the head's tree has.
REMOTE_PROCESS = {PROCESS_PID: 40, PROCESS_START_TICKS: 123, HOST_BOOT_ID: "stage-host-boot"}


def head_receiver() -> SpanReceiver:
    config = SpansConfig()
    return SpanReceiver(
        config,
        FakeClock(),
        SpanStore(config.ring_size),
        senders=HEAD_TREE,
        token="s3cret",
        boot_id="head-boot",
        remote_stages=frozenset({1}),
    )


def observed(receiver: SpanReceiver) -> list[tuple[ObservationKind, StageRef | None]]:
    return [(obs.kind, obs.stage) for obs in asyncio.run(receiver.collect())]


def test_a_remote_stage_s_heartbeats_are_taken_and_say_its_host() -> None:
    receiver = head_receiver()
    resource = {**REMOTE_PROCESS, STAGE_ID: 1, STAGE_REPLICA: 0, HOST_NAME: "gpu-node-b"}
    receiver.ingest(batch(resource, [(HEARTBEAT_SPAN, {})]), PROTOBUF)
    assert observed(receiver) == [(ObservationKind.HEARTBEAT, S1)]
    assert receiver.remote_hosts == {1: "gpu-node-b"}
    # Pid 40 of the stage host is not pid 40 of this one: nothing is learned of it.
    assert receiver.store.pid_stages() == {}


def test_a_remote_sender_never_speaks_for_a_local_stage() -> None:
    receiver = head_receiver()
    resource = {**REMOTE_PROCESS, STAGE_ID: 1, STAGE_REPLICA: 0}
    body = batch(resource, [(HEARTBEAT_SPAN, {STAGE_ID: 0}), (HEARTBEAT_SPAN, {})])
    receiver.ingest(body, PROTOBUF)
    assert observed(receiver) == [(ObservationKind.HEARTBEAT, S1)]
    assert receiver.stats.spans_rejected["unknown_sender"] == 1


def test_a_local_stage_from_another_boot_is_still_refused() -> None:
    receiver = head_receiver()
    resource = {**REMOTE_PROCESS, STAGE_ID: 0, STAGE_REPLICA: 0}
    receiver.ingest(batch(resource, [(HEARTBEAT_SPAN, {})]), PROTOBUF)
    assert observed(receiver) == []
    assert receiver.stats.spans_rejected["unknown_sender"] == 1


def test_remote_stages_need_the_token() -> None:
    config = SpansConfig()
    with pytest.raises(ValueError, match="token"):
        SpanReceiver(
            config,
            FakeClock(),
            SpanStore(config.ring_size),
            senders=HEAD_TREE,
            remote_stages=frozenset({1}),
        )


def test_an_unprintable_host_name_is_not_kept() -> None:
    receiver = head_receiver()
    resource = {**REMOTE_PROCESS, STAGE_ID: 1, HOST_NAME: "node\nb"}
    receiver.ingest(batch(resource, [(HEARTBEAT_SPAN, {})]), PROTOBUF)
    assert receiver.remote_hosts == {}
