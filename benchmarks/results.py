"""Writes benchmark figures into `benchmarks/RESULTS.md`, one `## section` per benchmark."""

from __future__ import annotations

import datetime
import os
import platform
import re
import textwrap
from pathlib import Path

RESULTS_PATH = Path(__file__).resolve().parent / "RESULTS.md"
README_PATH = Path(__file__).resolve().parent.parent / "README.md"
TITLE = "# Benchmark results"
_SECTION = re.compile(r"^## (.+)$", re.MULTILINE)
_MACHINE = re.compile(r"^Machine: (.+)$", re.MULTILINE)
# The README's summary of the results (how many figures met their target) lies between
# these two lines.
README_START = "<!-- benchmark table: written by make bench from benchmarks/RESULTS.md -->"
README_END = "<!-- end of benchmark table -->"


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
    """Rewrite `section` of the results file (others are kept), its header and the README's
    copy of the table."""
    sections = split_sections(path.read_text()) if path.exists() else {}
    sections[section] = render_section(section, rows, note)
    parts = [TITLE, "", machine_line(), ""]
    parts += list(sections.values())
    path.write_text("\n".join(parts))
    if path == RESULTS_PATH:
        update_readme()


def table_rows(text: str) -> list[tuple[str, str, str, str]]:
    """The figure | measured | target | verdict rows of a section's table."""
    rows = []
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not line.startswith("|") or cells[0] in ("figure", "---"):
            continue
        rows.append((cells[0], cells[1], cells[2], cells[3]))
    return rows


def recorded_rows(section: str, path: Path = RESULTS_PATH) -> list[tuple[str, str, str, str]]:
    """The rows `section` of the results file holds now; none if it has no such section."""
    sections = split_sections(path.read_text()) if path.exists() else {}
    return table_rows(sections.get(section, ""))


def readme_table(results: str) -> str:
    """The README's summary of `results`: the machine and how many figures met their
    target, with a link to the figures themselves (the README copies none of them)."""
    machine = _MACHINE.search(results)
    verdicts = [
        row[3]
        for text in split_sections(results).values()
        for row in table_rows(text)
        if row[2] not in ("information", "-")
    ]
    failed = sum(1 for verdict in verdicts if verdict != "pass")
    return textwrap.fill(
        f"Last run on {machine.group(1) if machine else 'an unknown machine'}: of"
        f" {len(verdicts)} figures with a target, {len(verdicts) - failed} pass and"
        f" {failed} fail. Every figure, its target and verdict, and each benchmark's"
        " method are in [`benchmarks/RESULTS.md`](benchmarks/RESULTS.md).",
        width=90,
        break_on_hyphens=False,
        break_long_words=False,
    )


def with_readme_table(readme: str, results: str) -> str:
    """`readme` with the text between its benchmark-table markers rewritten from `results`."""
    start = readme.index(README_START) + len(README_START)
    end = readme.index(README_END)
    return readme[:start] + "\n" + readme_table(results) + "\n" + readme[end:]


def update_readme(readme_path: Path = README_PATH, results_path: Path = RESULTS_PATH) -> None:
    readme = readme_path.read_text()
    readme_path.write_text(with_readme_table(readme, results_path.read_text()))


if __name__ == "__main__":
    update_readme()
