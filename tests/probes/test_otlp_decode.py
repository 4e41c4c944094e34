"""Decoding OTLP bodies: protobuf and JSON to one request, gzip within a bound, malformed
bodies refused with a clear error, and attributes read as typed values."""

from __future__ import annotations

import gzip
import json
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from otlp_bodies import batch, key_value

from omni_watchdog.probes.otlp_decode import (
    JSON,
    PROTOBUF,
    WANTED_KEYS,
    OtlpError,
    StageRefs,
    WantedAttributes,
    as_int,
    attribute_value,
    bounded_attributes,
    check_decodable,
    decode_export,
    flat_attributes,
    gunzip,
    has_valid_ids,
    request_id,
    stage_path,
)
from omni_watchdog.semconv import (
    PROCESS_PID,
    PROCESS_START_TICKS,
    REQUEST_ID,
    REQUEST_STAGE_PATH,
    STAGE_ID,
    STAGE_REPLICA,
    STAGE_REQUEST_SPAN,
    VLLM_OMNI_STAGE_ID,
    VLLM_OMNI_STAGE_REPLICA,
)
from omni_watchdog.types import StageRef

RESOURCE = {PROCESS_PID: 40, PROCESS_START_TICKS: 900, STAGE_ID: 1}
ATTRIBUTES = {REQUEST_ID: "r1", REQUEST_STAGE_PATH: [0, 1], "tokens": 7, "ok": True}
BODY = batch(RESOURCE, [(STAGE_REQUEST_SPAN, ATTRIBUTES)])


def as_otlp_json(body: bytes) -> bytes:
    """The same export in OTLP JSON: hex ids, 64-bit integers as strings."""
    document: dict[str, Any] = {"resourceSpans": []}
    for resource_spans in ExportTraceServiceRequest.FromString(body).resource_spans:
        spans = [
            {
                "traceId": span.trace_id.hex(),
                "spanId": span.span_id.hex(),
                "name": span.name,
                "attributes": [json_attribute(kv) for kv in span.attributes],
            }
            for span in resource_spans.scope_spans[0].spans
        ]
        document["resourceSpans"].append(
            {
                "resource": {
                    "attributes": [json_attribute(kv) for kv in resource_spans.resource.attributes]
                },
                "scopeSpans": [{"spans": spans}],
            }
        )
    return json.dumps(document).encode()


def json_attribute(kv: KeyValue) -> dict[str, Any]:
    return {"key": kv.key, "value": json_value(kv.value)}


def json_value(value: AnyValue) -> dict[str, Any]:
    which = value.WhichOneof("value")
    if which == "array_value":
        return {"arrayValue": {"values": [json_value(item) for item in value.array_value.values]}}
    if which == "int_value":
        return {"intValue": str(value.int_value)}
    return {"stringValue": value.string_value} if which == "string_value" else {"boolValue": True}


@pytest.mark.parametrize(
    ("media_type", "encoding", "body"),
    [
        (PROTOBUF, "", BODY),
        (PROTOBUF, "gzip", gzip.compress(BODY)),
        (JSON, "", as_otlp_json(BODY)),
        (JSON, "gzip", gzip.compress(as_otlp_json(BODY))),
    ],
)
def test_each_encoding_decodes_to_the_same_spans_and_attributes(
    media_type: str, encoding: str, body: bytes
) -> None:
    export = decode_export(body, media_type, encoding, limit=1 << 20)
    (resource_spans,) = export.request.resource_spans
    (span,) = resource_spans.scope_spans[0].spans
    assert (span.name, span.trace_id, span.span_id) == (
        STAGE_REQUEST_SPAN,
        bytes(15) + b"\x01",
        bytes(7) + b"\x01",
    )
    assert flat_attributes(span.attributes) == ATTRIBUTES
    assert bounded_attributes(resource_spans.resource.attributes) == RESOURCE
    assert WantedAttributes(export.wanted).of(span.attributes) == {
        REQUEST_ID: "r1",
        REQUEST_STAGE_PATH: [0, 1],
    }


def test_protobuf_wants_only_the_keys_the_body_holds_and_json_every_key() -> None:
    assert decode_export(BODY, PROTOBUF, "", 1 << 20).wanted == {
        STAGE_ID,
        REQUEST_ID,
        REQUEST_STAGE_PATH,
    }
    assert decode_export(as_otlp_json(BODY), JSON, "", 1 << 20).wanted == WANTED_KEYS


@pytest.mark.parametrize(
    ("body", "media_type", "encoding", "status", "message"),
    [
        (BODY[:-7], PROTOBUF, "", 400, "undecodable protobuf body"),
        (b'{"resourceSpans": [', JSON, "", 400, "undecodable JSON body"),
        (b"[1, 2]", JSON, "", 400, "undecodable JSON body: the body is not a JSON object"),
        (b'{"resourceSpans": [{"scopeSpans": 7}]}', JSON, "", 400, "undecodable JSON body"),
        (b"not gzip", PROTOBUF, "gzip", 400, "bad gzip body"),
        (gzip.compress(BODY)[:-20], PROTOBUF, "gzip", 400, "bad gzip body"),
        (BODY, PROTOBUF, "", 413, f"body is over {len(BODY) - 1} bytes"),
        (gzip.compress(BODY), PROTOBUF, "gzip", 413, "once decompressed"),
    ],
)
def test_a_body_that_cannot_be_decoded_is_a_clear_error(
    body: bytes, media_type: str, encoding: str, status: int, message: str
) -> None:
    with pytest.raises(OtlpError) as refused:
        decode_export(body, media_type, encoding, limit=len(BODY) - 1)
    assert refused.value.status == status
    assert refused.value.reason == ("decode_error" if status == 400 else "too_large")
    assert message in refused.value.message


@pytest.mark.parametrize(
    ("media_type", "encoding", "refused"),
    [
        (PROTOBUF, "", False),
        (JSON, "gzip", False),
        (PROTOBUF, "identity", False),
        ("text/plain", "", True),
        ("", "", True),
        (PROTOBUF, "br", True),
    ],
)
def test_only_protobuf_and_json_plain_or_gzipped_are_decoded(
    media_type: str, encoding: str, refused: bool
) -> None:
    if not refused:
        check_decodable(media_type, encoding)
        return
    with pytest.raises(OtlpError) as error:
        check_decodable(media_type, encoding)
    assert (error.value.status, error.value.reason) == (415, "unsupported_media_type")


def test_gunzip_joins_members_and_refuses_empty_or_oversized_streams() -> None:
    assert gunzip(gzip.compress(b"abc") + gzip.compress(b"def"), limit=6) == b"abcdef"
    for data, limit, status in ((b"", 10, 400), (gzip.compress(b"x" * 11), 10, 413)):
        with pytest.raises(OtlpError) as refused:
            gunzip(data, limit)
        assert refused.value.status == status


@pytest.mark.parametrize(
    ("trace_id", "span_id", "valid"),
    [
        (b"\x01" * 16, b"\x01" * 8, True),
        (b"\x01" * 15, b"\x01" * 8, False),
        (b"\x01" * 16, b"\x01" * 9, False),
        (bytes(16), b"\x01" * 8, False),
        (b"\x01" * 16, bytes(8), False),
    ],
)
def test_ids_must_have_their_sizes_and_not_be_zero(
    trace_id: bytes, span_id: bytes, valid: bool
) -> None:
    span = ExportTraceServiceRequest().resource_spans.add().scope_spans.add().spans.add()
    span.trace_id, span.span_id = trace_id, span_id
    assert has_valid_ids(span) is valid


def test_an_attribute_value_of_each_kind() -> None:
    kvlist = AnyValue()
    kvlist.kvlist_value.values.extend([key_value("a", 1), key_value("b", "x")])
    assert attribute_value(AnyValue(bytes_value=b"\x01\xff")) == "01ff"
    assert attribute_value(AnyValue(double_value=0.5)) == 0.5
    assert attribute_value(AnyValue()) is None
    assert flat_attributes([KeyValue(key="m", value=kvlist)]) == {"m.a": 1, "m.b": "x"}


def test_resource_attributes_are_bounded() -> None:
    huge = [key_value(f"k{n}", "v" * 1000) for n in range(100)]
    listed = [key_value("list", list(range(100)))]
    bounded = bounded_attributes(listed + huge)
    assert len(bounded) == 64
    assert bounded["list"] == list(range(16))
    assert max(len(str(value)) for value in bounded.values()) <= 256


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (3, 3),
        ("3", 3),
        (" -2 ", -2),
        (4.0, 4),
        ("¹", None),  # a superscript: str.isdigit() says yes, int() says no
        ("٣", None),  # an Arabic-Indic digit
        ("1" * 20, None),
        ("", None),
        ("-", None),
        (True, None),
        (4.5, None),
        (float("nan"), None),
        ([1], None),
    ],
)
def test_as_int_takes_only_plain_integers(value: object, expected: int | None) -> None:
    assert as_int(value) == expected


def test_request_ids_are_text_cut_to_their_bound_and_paths_are_lists_of_stage_ids() -> None:
    assert request_id({REQUEST_ID: "r" * 300}, REQUEST_ID) == "r" * 256
    assert request_id({REQUEST_ID: 7}, REQUEST_ID) == "7"
    assert request_id({"other": "x"}, REQUEST_ID, "other") == "x"
    assert request_id({}, REQUEST_ID) == ""
    assert stage_path([0, "1", 2]) == (0, 1, 2)
    assert stage_path([0, "first"]) == ()
    assert stage_path(list(range(65))) == ()
    assert stage_path("0,1") == ()


@pytest.mark.parametrize(
    ("found", "stage"),
    [
        ({}, StageRef(1, 0)),
        ({STAGE_ID: 2}, StageRef(2, 0)),
        ({STAGE_ID: 2, STAGE_REPLICA: 1}, StageRef(2, 1)),
        ({STAGE_REPLICA: 3}, StageRef(1, 3)),
        ({VLLM_OMNI_STAGE_ID: 4, VLLM_OMNI_STAGE_REPLICA: 1}, StageRef(4, 1)),
        ({STAGE_ID: 2, VLLM_OMNI_STAGE_ID: 4}, StageRef(2, 0)),
        ({STAGE_ID: "not a number"}, None),
        ({STAGE_ID: [1]}, None),
    ],
)
def test_a_span_s_own_stage_attributes_win_over_its_resource_s(
    found: dict[str, object], stage: StageRef | None
) -> None:
    (resource_spans,) = ExportTraceServiceRequest.FromString(BODY).resource_spans
    stages = StageRefs()
    resource = stages.resource(resource_spans)
    assert resource.stage == StageRef(1, 0)
    assert (resource.pid, resource.start_ticks) == (40, 900)
    assert stages.of_span(found, resource) == stage


def test_one_stage_is_one_object() -> None:
    stages = StageRefs()
    assert stages.named(1, 0) is stages.named(1, 0)
    assert stages.named("1", None) == StageRef(1, 0)
