"""OTLP export bodies as the tests build them: attributes, and one resource's spans."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import KeyValue


def key_value(key: str, value: object) -> KeyValue:
    """An OTLP attribute; a list becomes an array of its items (bools, ints or texts)."""
    kv = KeyValue(key=key)
    if isinstance(value, bool):
        kv.value.bool_value = value
    elif isinstance(value, int):
        kv.value.int_value = value
    elif isinstance(value, float):
        kv.value.double_value = value
    elif isinstance(value, list):
        for item in value:
            kv.value.array_value.values.append(key_value("", item).value)
    else:
        kv.value.string_value = str(value)
    return kv


def batch(
    resource: Mapping[str, object], spans: Sequence[tuple[str, Mapping[str, object]]]
) -> bytes:
    """One resource's spans, named and attributed as given, with ids 1, 2, 3..."""
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    resource_spans.resource.attributes.extend(key_value(k, v) for k, v in resource.items())
    scope_spans = resource_spans.scope_spans.add()
    for index, (name, attributes) in enumerate(spans, start=1):
        span = scope_spans.spans.add(
            name=name, trace_id=index.to_bytes(16, "big"), span_id=index.to_bytes(8, "big")
        )
        span.attributes.extend(key_value(k, v) for k, v in attributes.items())
    return request.SerializeToString()
