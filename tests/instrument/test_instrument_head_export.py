"""A headless stage's spans: to the watchdog beside it and to the head's, each on its own."""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

import pytest
from deadline import wait_until
from instrument.kept_spans import BlockedExporter, KeptSpans

from omni_watchdog.instrument.telemetry import StageTelemetry
from omni_watchdog.semconv import HEARTBEAT_SPAN, HOST_NAME, STAGE_REQUEST_SPAN

Collector = Any
# How long an export to a collector on this machine may take.
EXPORT_WAIT_S = 5.0
LOCAL_TOKEN = "local-token"
HEAD_TOKEN = "head-token"


def headless_stage(local_url: str, head_url: str, **more: str) -> StageTelemetry:
    """A stage process's telemetry with both watchdogs' endpoints and tokens."""
    return StageTelemetry.from_environment(
        process_kind="stage",
        stage_id=1,
        environ={
            "OMNI_WATCHDOG_OTLP_ENDPOINT": local_url,
            "OMNI_WATCHDOG_OTLP_TOKEN": LOCAL_TOKEN,
            "OMNI_WATCHDOG_HEAD_OTLP_ENDPOINT": head_url,
            "OMNI_WATCHDOG_HEAD_OTLP_TOKEN": HEAD_TOKEN,
            **more,
        },
    )


def emit(telemetry: StageTelemetry, requests: int) -> None:
    """A heartbeat and a stage span per request: two spans each."""
    for index in range(requests):
        telemetry.heartbeat()
        with telemetry.stage_request(f"req-{index}"):
            pass


def test_both_watchdogs_get_the_same_spans_each_with_its_own_token(
    collector: Collector, head_collector: Collector
) -> None:
    telemetry = headless_stage(collector.url, head_collector.url)
    emit(telemetry, 5)
    wait_until(lambda: len(collector.spans) == len(head_collector.spans) == 10, EXPORT_WAIT_S)
    telemetry.shutdown(timeout_s=2.0)

    def by_id(span: Any) -> bytes:
        return bytes(span.span_id)

    assert sorted(collector.spans, key=by_id) == sorted(head_collector.spans, key=by_id)
    assert set(collector.authorizations) == {f"Bearer {LOCAL_TOKEN}"}
    assert set(head_collector.authorizations) == {f"Bearer {HEAD_TOKEN}"}
    assert telemetry.dropped_spans == telemetry.head_dropped_spans == 0


def test_a_hanging_head_holds_back_none_of_the_local_watchdogs_heartbeats(
    collector: Collector, head_collector: Collector
) -> None:
    head_collector.hanging = True
    telemetry = headless_stage(collector.url, head_collector.url)
    # Each beat arrives as soon as it would without a head, for longer than the head's
    # export timeout (5 s) would have held back every batch had the two waited in turn.
    started = time.monotonic()
    beats = 0
    while time.monotonic() - started < 6.0:
        telemetry.heartbeat()
        beats += 1

        def landed(beats: int = beats) -> bool:
            return len(collector.named(HEARTBEAT_SPAN)) == beats

        wait_until(landed, 1.5)
    wait_until(lambda: telemetry.head_dropped_spans > 0, EXPORT_WAIT_S)
    assert telemetry.dropped_spans == 0
    assert not head_collector.spans
    started = time.monotonic()
    telemetry.shutdown(timeout_s=1.0)
    assert time.monotonic() - started < 1.5


@pytest.mark.parametrize("refusal", ["unauthorized", "nothing listening"])
def test_a_refusing_head_loses_only_its_own_spans_and_says_which_endpoint_failed(
    collector: Collector,
    head_collector: Collector,
    unused_port: int,
    caplog: pytest.LogCaptureFixture,
    refusal: str,
) -> None:
    caplog.set_level(logging.DEBUG, logger="omni_watchdog.instrument")
    head_url = f"http://127.0.0.1:{unused_port}"
    if refusal == "unauthorized":
        head_collector.status = 401
        head_url = head_collector.url
    telemetry = headless_stage(collector.url, head_url)
    emit(telemetry, 20)
    # Failed once in 1,202 on two busy workers, unseen since: each assertion says what it saw.
    wait_until(
        lambda: telemetry.head_dropped_spans == 40,
        EXPORT_WAIT_S,
        seen=lambda: telemetry.head_dropped_spans,
    )
    wait_until(
        lambda: len(collector.named(STAGE_REQUEST_SPAN)) == 20,
        EXPORT_WAIT_S,
        seen=lambda: len(collector.named(STAGE_REQUEST_SPAN)),
    )
    telemetry.shutdown(timeout_s=2.0)
    assert telemetry.dropped_spans == 0, telemetry.dropped_spans
    failures = [r.getMessage() for r in caplog.records if "span export to" in r.getMessage()]
    assert failures, [r.getMessage() for r in caplog.records]
    assert all(message.startswith(f"span export to {head_url}/v1/traces ") for message in failures)


def test_a_stuck_head_waits_with_a_bounded_backlog_and_the_local_one_gets_everything() -> None:
    local, head = KeptSpans(), BlockedExporter()
    telemetry = StageTelemetry(
        local,
        head_exporter=head,
        process_kind="stage",
        stage_id=1,
        max_queue_size=10,
        schedule_delay_s=0.01,
    )
    for sent in range(5, 35, 5):
        for _ in range(5):
            telemetry.heartbeat()

        def all_local(sent: int = sent) -> bool:
            return len(local.spans) == sent

        wait_until(all_local, EXPORT_WAIT_S)
    assert telemetry.dropped_spans == 0
    # At most the backlog's 10 spans wait for the head; the rest are lost to it, counted.
    assert telemetry.head_dropped_spans >= 20
    head.release.set()
    telemetry.shutdown(timeout_s=5.0)
    assert head.exported <= 10
    assert head.exported + telemetry.head_dropped_spans == 30


@pytest.mark.parametrize("token", [None, "  "])
def test_without_the_heads_token_nothing_goes_to_the_head_and_one_warning_says_why(
    collector: Collector,
    head_collector: Collector,
    caplog: pytest.LogCaptureFixture,
    token: str | None,
) -> None:
    environ = {
        "OMNI_WATCHDOG_OTLP_ENDPOINT": collector.url,
        "OMNI_WATCHDOG_HEAD_OTLP_ENDPOINT": head_collector.url,
    }
    if token is not None:
        environ["OMNI_WATCHDOG_HEAD_OTLP_TOKEN"] = token
    with caplog.at_level(logging.WARNING, logger="omni_watchdog.instrument"):
        telemetry = StageTelemetry.from_environment(
            process_kind="stage", stage_id=1, environ=environ
        )
    (warning,) = [record for record in caplog.records if record.levelno >= logging.WARNING]
    assert "OMNI_WATCHDOG_HEAD_OTLP_TOKEN" in warning.getMessage()
    assert warning.exc_info is None
    telemetry.heartbeat()
    wait_until(lambda: len(collector.spans) == 1, EXPORT_WAIT_S)
    telemetry.shutdown(timeout_s=2.0)
    assert head_collector.authorizations == []


def test_with_no_watchdog_beside_it_the_head_alone_gets_the_spans(
    head_collector: Collector,
) -> None:
    telemetry = StageTelemetry.from_environment(
        process_kind="stage",
        stage_id=1,
        environ={
            "OMNI_WATCHDOG_HEAD_OTLP_ENDPOINT": head_collector.url,
            "OMNI_WATCHDOG_HEAD_OTLP_TOKEN": HEAD_TOKEN,
        },
    )
    telemetry.heartbeat()
    wait_until(lambda: len(head_collector.spans) == 1, EXPORT_WAIT_S)
    telemetry.shutdown(timeout_s=2.0)
    assert head_collector.authorizations == [f"Bearer {HEAD_TOKEN}"]


@pytest.mark.parametrize(
    ("environ", "expected"),
    [({}, socket.gethostname()), ({"OMNI_WATCHDOG_HOST": " node-b "}, "node-b")],
)
def test_every_process_names_its_host(
    collector: Collector, environ: dict[str, str], expected: str
) -> None:
    telemetry = StageTelemetry.from_environment(
        process_kind="api", environ={"OMNI_WATCHDOG_OTLP_ENDPOINT": collector.url, **environ}
    )
    telemetry.heartbeat()
    wait_until(lambda: len(collector.spans) == 1, EXPORT_WAIT_S)
    telemetry.shutdown(timeout_s=2.0)
    assert collector.spans[0].resource[HOST_NAME] == expected
