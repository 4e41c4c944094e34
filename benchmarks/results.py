"""Writes benchmark figures into `benchmarks/RESULTS.md`, one `## section` per benchmark."""

from __future__ import annotations

import datetime
import os
import platform
import re
from pathlib import Path

RESULTS_PATH = Path(__file__).resolve().parent / "RESULTS.md"
TITLE = "# Benchmark results"
_SECTION = re.compile(r"^## (.+)$", re.MULTILINE)


def cpu_model() -> str:
    """The CPU's model name as the kernel reports it, else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine_line() -> str:
    """CPU model, cores, Python version and date, for the header of the results."""
    today = datetime.date.today().isoformat()
    return (
        f"Machine: {cpu_model()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()} ({platform.python_implementation()}), {today}"
    )


def render_section(section: str, rows: list[tuple[str, str, str, str]], note: str = "") -> str:
    """One `## section` with its table of figure | measured | target | verdict."""
    lines = [f"## {section}", ""]
    if note:
        lines += [note, ""]
    lines += ["| figure | measured | target | verdict |", "| --- | --- | --- | --- |"]
    lines += [f"| {' | '.join(cell.replace('|', '/') for cell in row)} |" for row in rows]
    return "\n".join(lines) + "\n"


def split_sections(text: str) -> dict[str, str]:
    """The `## ` sections of a results file by title, each with its own text."""
    matches = list(_SECTION.finditer(text))
    sections: dict[str, str] = {}
    for index, match in enumerate(matches):
        end = matches[index + 1].start() if index + 1 < len(matches) else len(text)
        sections[match.group(1).strip()] = text[match.start() : end].rstrip() + "\n"
    return sections


def record(
    section: str,
    rows: list[tuple[str, str, str, str]],
    note: str = "",
    path: Path = RESULTS_PATH,
) -> None:
    """Rewrite `section` of the results file (others are kept) and refresh its header."""
    sections = split_sections(path.read_text()) if path.exists() else {}
    sections[section] = render_section(section, rows, note)
    parts = [TITLE, "", machine_line(), ""]
    parts += list(sections.values())
    path.write_text("\n".join(parts))
