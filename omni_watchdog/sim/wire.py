"""What a head and its headless stages say to each other: JSON lines over TCP, bounded.

A headless stage's root opens one connection per replica and sends `register` (stage,
replica, the replica's pid, host name), then the replica's `heartbeat`, `started`,
`token`, `done` and `error` messages; the head sends `request`s. Light on purpose: the
simulator's command line reads its constants.
"""

from __future__ import annotations

import asyncio
import json

from omni_watchdog.sim.engine import Message

# Where the head's coordinator listens (in the head's state dir), and a headless stage's
# own state (in the stage's).
MASTER_FILE = "master.json"
HEADLESS_FILE = "headless.json"
# vLLM-Omni 0.30's `--omni-heartbeat-timeout` default.
DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0
MASTER_HEARTBEAT_S = 1.0
MAX_LINE_BYTES = 64 * 1024
# How much of a peer's text goes into a log line.
QUOTE_CHARS = 40


class ProtocolError(ValueError):
    """A line that breaks the protocol; `kind` names the breach for the counters."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


def encode(message: Message) -> bytes:
    """One message as a JSON line."""
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


async def read_message(reader: asyncio.StreamReader) -> Message | None:
    """The next line as a JSON object with a "type", or None at the end of the stream.

    The reader's limit bounds a line: open it with `limit=MAX_LINE_BYTES`."""
    try:
        line = await reader.readline()
    except ValueError:
        raise ProtocolError("oversized", f"a line over {MAX_LINE_BYTES} bytes") from None
    if not line.endswith(b"\n"):
        return None  # the end, perhaps after a partial line that counts for nothing
    try:
        message = json.loads(line)
    except (ValueError, RecursionError):
        raise ProtocolError("garbage", "a line that is not JSON") from None
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise ProtocolError("garbage", "a line that is not a JSON object with a type")
    return message
