"""The HTML incident report in a real browser: Chromium lays out the timeline and the page.

The unit tests read the markup; only a browser says whether the SVG actually takes space
and every ladder step gets a bar one can see.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from exporters.browser import PNG_MAGIC, laid_out, run_chromium
from exporters.report_bundle import LADDER, sample_files, sample_incident

from omni_watchdog.exporters.report.page import render_incident_report

pytestmark = pytest.mark.e2e


@pytest.fixture
def report_page(tmp_path: Path) -> Path:
    """The product page for an incident that climbed the whole ladder, with both timelines."""
    incident = sample_incident()
    document = render_incident_report(incident, sample_files(incident))
    page = tmp_path / "report.html"
    page.write_text(document, encoding="utf-8")
    return page


def test_every_ladder_step_is_laid_out_with_a_visible_bar(
    report_page: Path, tmp_path: Path
) -> None:
    rendered = laid_out(report_page.read_text(encoding="utf-8"), tmp_path)
    width, height = rendered["timeline"]
    assert width > 0 and height > 0
    steps = {name: (bar_width, bar_height) for name, bar_width, bar_height in rendered["steps"]}
    assert list(steps) == [step.value for step, _, _, _ in LADDER]
    for name, (bar_width, bar_height) in steps.items():
        assert bar_width > 0 and bar_height > 0, name


def test_the_product_page_renders_to_a_screenshot(report_page: Path, tmp_path: Path) -> None:
    screenshot = tmp_path / "report.png"

    result = run_chromium(
        tmp_path / "profile-shot",
        f"--screenshot={screenshot}",
        "--window-size=1280,2000",
        report_page.as_uri(),
    )

    assert result.returncode == 0, result.stderr[-4000:]
    image = screenshot.read_bytes()
    assert image.startswith(PNG_MAGIC)
    # A blank page of this size is about 12 KB; the report's text and charts are far more.
    assert len(image) > 50_000, len(image)
