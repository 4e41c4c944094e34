"""Chromium for the tests: where it is, how it is run, and what it laid out of a report.

The product page has no script (its CSP forbids one), so a page is measured through a
copy without the CSP and with a small script of the tests' own appended.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

BROWSER_TIMEOUT_SECONDS = 60
# Every g.step's bar as the browser laid it out, and the timeline's own size.
MEASURE = """
<script>
window.addEventListener("load", function () {
  var steps = Array.prototype.map.call(document.querySelectorAll("g.step"), function (group) {
    var box = group.querySelector("rect").getBoundingClientRect();
    return [group.getAttribute("data-step"), box.width, box.height];
  });
  var timeline = document.querySelector("#timeline svg.timeline").getBoundingClientRect();
  document.body.dataset.rendered = JSON.stringify(
    {steps: steps, timeline: [timeline.width, timeline.height]}
  );
});
</script>
"""
_CSP = re.compile(r'<meta http-equiv="Content-Security-Policy"[^>]*>\n?')
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def chromium() -> str:
    """Chromium's binary; skips locally and fails in CI when missing."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        message = "chromium not found: `make tools` installs Debian's chromium package"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found


def run_chromium(profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [
        chromium(),
        "--headless",
        # The tests run as root in CI, where Chromium refuses its sandbox.
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--no-default-browser-check",
        f"--user-data-dir={profile}",
        *args,
    ]
    # A HOME of its own keeps the browser's caches and crash reports out of the user's.
    environment = {**os.environ, "HOME": str(profile)}
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=BROWSER_TIMEOUT_SECONDS,
        check=False,
        env=environment,
    )


class BodyData(HTMLParser):
    """The `data-rendered` attribute of the dumped page's body."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.rendered: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "body":
            self.rendered = dict(attrs).get("data-rendered")


def laid_out(document: str, workdir: Path) -> dict[str, Any]:
    """What Chromium laid out of a report page: each step's bar and the timeline's size."""
    assert "<script" not in document
    # The page's CSP would block the measuring script: the copy drops it, nothing else.
    measured, removed = _CSP.subn("", document)
    assert removed == 1
    copy = workdir / "measured.html"
    copy.write_text(measured.replace("</body>", MEASURE + "</body>"), encoding="utf-8")
    result = run_chromium(
        workdir / "profile-dom", "--virtual-time-budget=5000", "--dump-dom", copy.as_uri()
    )
    assert result.returncode == 0, result.stderr[-4000:]
    body = BodyData()
    body.feed(result.stdout)
    assert body.rendered, f"the measuring script did not run: {result.stderr[-4000:]}"
    rendered: dict[str, Any] = json.loads(body.rendered)
    return rendered
