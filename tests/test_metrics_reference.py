"""The metrics reference, docs/metrics.md: generated from the exposition and kept fresh."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from omni_watchdog.exporters.prometheus import FAMILIES, FAMILY_NAMES

ROOT = Path(__file__).resolve().parents[1]
GENERATOR = ROOT / "scripts" / "gen_metrics_reference.py"
REFERENCE = ROOT / "docs" / "metrics.md"
REGENERATE = "python scripts/gen_metrics_reference.py"


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("metrics_reference_generator", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Its dataclass looks its module up by name.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run_generator(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(GENERATOR), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_committed_reference_is_what_the_generator_writes() -> None:
    assert REFERENCE.read_text() == generator().render(), f"stale: run `{REGENERATE}`"
    result = run_generator("--check")
    assert result.returncode == 0, result.stderr


def test_check_fails_on_a_stale_reference(tmp_path: Path) -> None:
    stale = tmp_path / "metrics.md"
    stale.write_text(REFERENCE.read_text().replace("| gauge |", "| counter |", 1))
    result = run_generator("--check", "--output", str(stale))
    assert result.returncode == 1
    assert "stale" in result.stderr and REGENERATE in result.stderr
    assert run_generator("--output", str(stale)).returncode == 0
    assert stale.read_text() == REFERENCE.read_text()


def test_every_family_is_in_the_reference_with_its_type_and_help() -> None:
    rows = {
        cells[0].strip("`"): cells
        for line in REFERENCE.read_text().splitlines()
        if line.startswith("| `omni_watchdog_")
        for cells in [[cell.strip() for cell in line.strip("|").split(" | ")]]
    }
    assert set(rows) == set(FAMILY_NAMES)
    for (_, kind, text), full in zip(FAMILIES, FAMILY_NAMES, strict=True):
        assert rows[full][1] == kind
        assert rows[full][3].startswith(text.replace("|", "\\|"))


def test_the_readme_links_the_reference() -> None:
    assert "(docs/metrics.md)" in (ROOT / "README.md").read_text()
