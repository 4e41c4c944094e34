"""The OTLP/HTTP endpoint on its own: the token and the sink's refusals are answered before
a body is read, bodies past the cap are refused, and answers are counted by status."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping

from aiohttp.test_utils import TestClient, TestServer
from google.rpc import status_pb2

from omni_watchdog.config import SpansConfig
from omni_watchdog.probes.otlp_decode import JSON, PROTOBUF, OtlpError
from omni_watchdog.probes.otlp_transport import (
    RESPONSE_STATUSES,
    TRACES_PATH,
    IngestResult,
    TracesEndpoint,
)
from omni_watchdog.probes.span_trust import ConnectionSender
from omni_watchdog.probes.spans import REJECTION_REASONS

Answer = tuple[int, bytes, Mapping[str, str]]


class Sink:
    """Takes every body, or refuses every one with `refusal` before it is read."""

    def __init__(self, refusal: OtlpError | None = None, result: IngestResult | None = None):
        self.refusal = refusal
        self.result = result or IngestResult(1, 0)
        self.bodies: list[tuple[bytes, str, str]] = []

    def check_acceptable(self, media_type: str, content_encoding: str) -> None:
        if self.refusal is not None:
            raise self.refusal

    def ingest(
        self,
        body: bytes,
        media_type: str,
        content_encoding: str,
        sender: ConnectionSender | None,
    ) -> IngestResult:
        self.bodies.append((body, media_type, content_encoding))
        return self.result


def answers(
    endpoint: TracesEndpoint, posts: list[tuple[str, bytes, Mapping[str, str]]]
) -> list[Answer]:
    async def main() -> list[Answer]:
        got: list[Answer] = []
        async with TestClient(TestServer(endpoint.app())) as client:
            for path, body, headers in posts:
                response = await client.post(path, data=body, headers=headers)
                got.append((response.status, await response.read(), dict(response.headers)))
        return got

    return asyncio.run(main())


def new_endpoint(
    sink: Sink, token: str = "", max_body_bytes: int = SpansConfig().max_body_bytes
) -> tuple[TracesEndpoint, dict[str, int]]:
    rejected = dict.fromkeys(REJECTION_REASONS, 0)
    config = SpansConfig(max_body_bytes=max_body_bytes)
    return TracesEndpoint(config, sink, rejected, token=token), rejected


def test_an_export_without_the_token_is_refused_before_the_sink_sees_it() -> None:
    sink = Sink()
    endpoint, rejected = new_endpoint(sink, token="s3cret")
    plain = {"Content-Type": PROTOBUF}
    got = answers(
        endpoint,
        [
            (TRACES_PATH, b"one", plain),
            (TRACES_PATH, b"two", {**plain, "Authorization": "Bearer wrong"}),
            (TRACES_PATH, b"three", {**plain, "Authorization": "Bearer s3cret"}),
        ],
    )
    assert [status for status, _, _ in got] == [401, 401, 200]
    assert sink.bodies == [(b"three", PROTOBUF, "")]
    assert rejected["unauthorized"] == 2
    assert endpoint.requests[401] == 2 and endpoint.requests[200] == 1


def test_the_sink_s_refusal_is_answered_in_the_body_s_encoding() -> None:
    sink = Sink(OtlpError(503, "queue_full", "the receiver's queue is full, retry later"))
    endpoint, rejected = new_endpoint(sink)
    ((status, body, headers), (json_status, json_body, _)) = answers(
        endpoint,
        [
            (TRACES_PATH, b"x", {"Content-Type": PROTOBUF, "Content-Encoding": "GZIP "}),
            (TRACES_PATH, b"x", {"Content-Type": JSON}),
        ],
    )
    assert (status, headers["Retry-After"]) == (503, "1")
    assert status_pb2.Status.FromString(body).message == "the receiver's queue is full, retry later"
    assert json_status == 503 and json.loads(json_body)["code"] == 14
    assert sink.bodies == [] and rejected["queue_full"] == 2


def test_a_body_past_the_cap_is_refused_and_a_partial_success_told() -> None:
    sink = Sink(result=IngestResult(3, 2, "2 span(s) rejected"))
    endpoint, rejected = new_endpoint(sink, max_body_bytes=1024)
    got = answers(
        endpoint,
        [
            (TRACES_PATH, b"x" * 1025, {"Content-Type": PROTOBUF}),
            (TRACES_PATH, b"x" * 1024, {"Content-Type": JSON}),
        ],
    )
    (too_large, _, _), (partial, body, _) = got
    assert too_large == 413 and rejected["too_large"] == 1
    assert partial == 200
    assert json.loads(body) == {
        "partialSuccess": {"rejectedSpans": "2", "errorMessage": "2 span(s) rejected"}
    }
    assert [len(body) for body, _, _ in sink.bodies] == [1024]


def test_other_paths_and_methods_are_counted() -> None:
    endpoint, _ = new_endpoint(Sink())
    assert [status for status, _, _ in answers(endpoint, [("/v1/metrics", b"", {})])] == [404]
    assert endpoint.requests == {**dict.fromkeys(RESPONSE_STATUSES, 0), 404: 1}
