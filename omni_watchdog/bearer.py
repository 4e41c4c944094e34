"""The one check of a bearer token, for every door that takes one: the API's operator
actions, the span receiver and the plugin's shutdown route."""

from __future__ import annotations

import hmac


def bearer_matches(authorization: str | None, token: bytes) -> bool:
    """Whether an `Authorization` header value is `Bearer <token>`.

    Compared in constant time, so that a token cannot be guessed a byte at a time from
    answer delays. Header bytes that are not text (aiohttp keeps them as lone surrogates)
    are never the token: they are a refusal like any other, not an error."""
    scheme, _, presented = (authorization or "").partition(" ")
    try:
        presented_bytes = presented.strip().encode()
    except UnicodeEncodeError:
        presented_bytes = b""
    matches = hmac.compare_digest(presented_bytes, token)
    return matches and scheme.lower() == "bearer"
