"""The incident report's small pieces of markup, shared by its page and its drawings:
escaping, times as UTC with their offsets, the colours of outcomes and states, tables.

Every string from a bundle goes through `escape` before it reaches the page.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone

# Outcome and state names, by the colour family that carries them; the text is always shown
# beside the colour, so the page reads the same in grey or without its CSS.
_GOOD = frozenset(
    {
        "ok",
        "recovered",
        "recovered_by_shutdown",
        "recovered_by_term",
        "recovered_by_kill",
        "healthy",
        "accepted",
    }
)
_INFO = frozenset({"planned", "observed", "starting"})
_WARN = frozenset(
    {
        "not_recovered",
        "timeout",
        "unreachable",
        "refused",
        "crashed",
        "degraded",
        "stalled",
        "bad_request",
        "unauthorized",
        "forbidden",
    }
)
_BAD = frozenset({"failed", "leaked", "unkillable", "dead"})
_FILL = {
    "good": "#2e7d32",
    "info": "#1565c0",
    "warn": "#ef6c00",
    "bad": "#c62828",
    "neutral": "#757575",
}
# A degraded stage is still serving: a lighter warning than stalled.
_STATE_FILL = {"degraded": "#f9a825", "stalled": "#ef6c00"}

_MIB = float(2**20)


def escape(text: str) -> str:
    """Escaped for text and for quoted attribute values alike; characters that do not print
    (an escape sequence or a bidi override in the target's command line, saved as is)
    shown as U+FFFD, line breaks kept for the stacks."""
    if not text.isprintable():
        text = "".join(c if c.isprintable() or c == "\n" else "\ufffd" for c in text)
    return html.escape(text, quote=True)


def iso(time: float) -> str:
    try:
        # Rounded to the millisecond shown, so that 12.0599999 reads 12.060.
        moment = datetime.fromtimestamp(round(time, 3), tz=timezone.utc)
    except (OverflowError, OSError, ValueError):
        return f"{time:.3f}"
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def seconds(value: float) -> str:
    return f"{value:.2f} s"


def offset(time: float, reference: float | None) -> str:
    if reference is None:
        return ""
    # Rounded first, so that half a millisecond before the opening reads +0.00, not -0.00.
    return f"{round(time - reference, 2) + 0.0:+.2f} s"


def time_html(time: float | None, reference: float | None) -> str:
    """A wall time as UTC ISO-8601 with its offset from the reference, or a dash."""
    if time is None:
        return '<span class="muted">unknown</span>'
    shown_offset = offset(time, reference)
    shown = f' <span class="offset">({escape(shown_offset)})</span>' if shown_offset else ""
    return f'<time datetime="{escape(iso(time))}">{escape(iso(time))}</time>{shown}'


def time_plain(time: float, reference: float | None) -> str:
    shown_offset = offset(time, reference)
    return f"{iso(time)} ({shown_offset})" if shown_offset else iso(time)


def _tone(name: str) -> str:
    if name in _GOOD:
        return "good"
    if name in _INFO:
        return "info"
    if name in _WARN:
        return "warn"
    if name in _BAD:
        return "bad"
    return "neutral"


def fill(name: str) -> str:
    return _STATE_FILL.get(name, _FILL[_tone(name)])


def badge(name: str) -> str:
    label = name or "unknown"
    return (
        f'<span class="outcome tone-{_tone(name)}" data-outcome="{escape(name)}">'
        f"{escape(label)}</span>"
    )


def mib(value: float) -> str:
    return f"{value / _MIB:,.0f} MiB"


def problem(message: str) -> str:
    return f'<p class="problem">{escape(message)}</p>'


def table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A table of already escaped cells; a cell starting with a `<td` is taken whole."""
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>"
        + "".join(cell if cell.startswith("<td") else f"<td>{cell}</td>" for cell in row)
        + "</tr>\n"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>\n{body}</tbody></table>\n"


def num_cell(text: str) -> str:
    return f'<td class="num">{escape(text)}</td>'


def wrap_cell(text: str) -> str:
    return f'<td class="wrap">{escape(text)}</td>'


def svg_text(x: float, y: float, text: str, anchor: str = "start", weight: str = "") -> str:
    weight_attr = f' font-weight="{weight}"' if weight else ""
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}"{weight_attr}>{escape(text)}</text>'
    )


def natural_key(text: str) -> tuple[tuple[int, float, str], ...]:
    """Sort "2.0" before "10.0" and numbers before words."""
    parts = re.split(r"(\d+)", text)
    return tuple((0, float(p), "") if p.isdecimal() else (1, 0.0, p) for p in parts if p)
