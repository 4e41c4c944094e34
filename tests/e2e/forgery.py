"""A forger of spans, for the tests that the watchdog is not blinded by what it hears:
OTLP bodies of heartbeats, stage spans and admissions in any sender's name, posted on a
loop, with or without the receiver's token."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Mapping
from typing import Any

import aiohttp
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from omni_watchdog.process_start import sender_attributes
from omni_watchdog.semconv import (
    HEARTBEAT_SPAN,
    PROCESS_PID,
    REQUEST_ADMITTED_SPAN,
    REQUEST_ID,
    REQUEST_STAGE_PATH,
    STAGE_ID,
    STAGE_REQUEST_SPAN,
)

PROTOBUF = {"Content-Type": "application/x-protobuf"}


def _value(value: object) -> AnyValue:
    if isinstance(value, int):
        return AnyValue(int_value=value)
    return AnyValue(string_value=str(value))


def forged_body(sender: Mapping[str, object], stages: list[int], serial: int) -> bytes:
    """What a forger posts: heartbeats, stage spans and admissions for `stages`."""
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    resource_spans.resource.attributes.extend(
        KeyValue(key=key, value=_value(value)) for key, value in sender.items()
    )
    spans = resource_spans.scope_spans.add().spans
    for index, stage in enumerate(stages):
        for offset, name in enumerate((HEARTBEAT_SPAN, STAGE_REQUEST_SPAN, REQUEST_ADMITTED_SPAN)):
            number = serial * 100_000 + index * 3 + offset + 1
            span = spans.add(
                name=name,
                trace_id=number.to_bytes(16, "big"),
                span_id=number.to_bytes(8, "big"),
            )
            span.attributes.extend(
                [
                    KeyValue(key=STAGE_ID, value=_value(stage)),
                    KeyValue(key=REQUEST_ID, value=_value(f"forged-{number}")),
                ]
            )
            if name == REQUEST_ADMITTED_SPAN:
                path = KeyValue(key=REQUEST_STAGE_PATH)
                path.value.array_value.values.extend([_value(0), _value(1)])
                span.attributes.append(path)
    return request.SerializeToString()


def outsider() -> dict[str, object]:
    """This test process: on the same host, outside the target's tree."""
    return {PROCESS_PID: os.getpid(), **sender_attributes(os.getpid())}


async def forge(
    url: str,
    sender: Mapping[str, object],
    stages: list[int],
    stop: asyncio.Event,
    token: str = "",
) -> int:
    """Post forged spans every 0.2 s until `stop`, with the OTLP `token` where one is
    given; the number of bodies the receiver took."""
    taken = 0
    serial = 0
    headers = {**PROTOBUF, **({"Authorization": f"Bearer {token}"} if token else {})}
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            serial += 1
            body = forged_body(sender, stages, serial)
            async with session.post(url, data=body, headers=headers) as response:
                await response.read()
                taken += response.status == 200
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)
    return taken


def traces_url(watchdog: Any) -> str:
    return f"http://127.0.0.1:{watchdog.otlp_port}/v1/traces"
