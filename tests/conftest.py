"""The order `make test` runs in, and what a failed test prints.

`make test` spreads whole files over parallel workers (pytest-xdist, `--dist loadfile`),
handing them out in collection order (`--no-loadscope-reorder`), except the real
vLLM-Omni files: those go to one worker together, one after another (all but the
diffusion servers' file, which the other worker takes first). Their servers start
one at a time across the run (three stages, six processes, over a minute each on two
busy cores), and two workers that both needed one took turns, each idle through the
other's start; now one worker starts them while the other runs everything else. A
real-server file handed out last would run on alone long after the others are done, so
those go first.

A failed test's report carries the accounts of the servers and watchdogs it used
(`explain.py`): CI's log alone then says why it failed, and its last lines say it in brief.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import explain
import pytest
from xdist.scheduler import LoadScopeScheduling

REAL_OMNI = "tests/real_omni/"
# Its own unit beside them: one-stage diffusion servers start in seconds, not minutes, and
# the other worker has room for them (the real vLLM-Omni unit is the run's longest).
REAL_OMNI_DIFFUSION = REAL_OMNI + "test_omni_diffusion.py"
SLOWEST_FIRST = (REAL_OMNI, "tests/real_vllm/")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.nodeid
        return next((i for i, prefix in enumerate(SLOWEST_FIRST) if path.startswith(prefix)), 99)

    items.sort(key=rank)


class FilesWithRealOmniTogether(LoadScopeScheduling):  # type: ignore[misc]
    """`--dist loadfile`, the real vLLM-Omni files one unit of work (the diffusion file
    apart)."""

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return REAL_OMNI if path.startswith(REAL_OMNI) and path != REAL_OMNI_DIFFUSION else path


def pytest_xdist_make_scheduler(
    config: pytest.Config, log: Any
) -> FilesWithRealOmniTogether | None:
    if config.getvalue("dist") != "loadfile":
        return None
    return FilesWithRealOmniTogether(config, log)


# The briefs of this run's failures, gathered where the reports arrive (with xdist, the
# controller) and printed last.
_briefs: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not report.failed:
        return
    crash = getattr(report.longrepr, "reprcrash", None)
    message = crash.message if crash is not None else str(report.longrepr)
    accounts = [
        (title.removeprefix("account of "), text)
        for title, text in report.sections
        if title.startswith("account of ")
    ]
    _briefs.append(explain.brief(report.nodeid, report.when, message, accounts))


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _briefs:
        terminalreporter.section("failures in brief")
        for told in _briefs:
            terminalreporter.line(told)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed:
        for title, text in explain.accounts():
            report.sections.append((f"account of {title}", text))
    if report.when == "teardown":
        explain.test_ended()
    return report
