"""Reading an HTTP answer's body with a bound: the watchdog reads what a server it does not
trust sends (the target's pages, a watchdog the CLI was pointed at), and a body is never
allowed to cost it more memory or time than the bound."""

from __future__ import annotations

import aiohttp

_CHUNK = 64 * 1024


async def read_at_most(response: aiohttp.ClientResponse, limit: int) -> tuple[bytes, bool]:
    """Up to `limit` bytes of the body, and whether there was more (left unread: the
    connection is then closed, not reused)."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_chunked(_CHUNK):
        room = limit - size
        if len(chunk) > room:
            chunks.append(chunk[:room])
            return b"".join(chunks), True
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks), False
