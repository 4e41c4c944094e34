"""The README's benchmark summary is generated from `benchmarks/RESULTS.md` and kept fresh."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def results_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("results", ROOT / "benchmarks" / "results.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_table_is_what_make_bench_would_write() -> None:
    results = results_module()
    readme = (ROOT / "README.md").read_text()
    fresh = results.with_readme_table(readme, (ROOT / "benchmarks" / "RESULTS.md").read_text())
    assert readme == fresh, "run `python benchmarks/results.py` or `make bench` to refresh"


def test_the_readme_counts_the_figures_with_a_target_and_links_them(tmp_path: Path) -> None:
    results = results_module()
    rendered = "\n".join(
        [
            results.TITLE,
            "",
            "Machine: a test CPU, 2 cores, Python 3.12.1 (CPython), 2026-01-01",
            "",
            results.render_section(
                "Scrape",
                [
                    ("render", "3.2 ms", "<= 20 ms", "pass"),
                    ("series", "3,539", "information", "-"),
                    ("other fault | timing", "4.8 s", "-", "-"),
                ],
                note="A note | with a bar.",
            ),
        ]
    )
    summary = results.readme_table(rendered)
    assert summary.startswith("Last run on a test CPU, 2 cores")
    assert "of 1 figures with a target, 1 pass and 0 fail" in " ".join(summary.split())
    assert "(benchmarks/RESULTS.md)" in summary
    # The README links the figures and copies none of them.
    assert "3.2 ms" not in summary and "3,539" not in summary and "4.8 s" not in summary
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{results.README_START}\nold\n{results.README_END}\nafter\n")
    (tmp_path / "RESULTS.md").write_text(rendered)
    results.update_readme(readme, tmp_path / "RESULTS.md")
    text = readme.read_text()
    assert "old" not in text and text.endswith(f"{results.README_END}\nafter\n")
    assert "1 pass and 0 fail" in " ".join(text.split())
