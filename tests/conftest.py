"""The order `make test` runs in, and what a failed test prints.

`make test` spreads whole files over parallel workers (pytest-xdist, `--dist loadfile`),
handing them out in collection order (`--no-loadscope-reorder`), except the real
vLLM-Omni files: those go to one worker together, one after another. Their servers start
one at a time across the run (three stages, six processes, over a minute each on two
busy cores), and two workers that both needed one took turns, each idle through the
other's start; now one worker starts them while the other runs everything else. A
real-server file handed out last would run on alone long after the others are done, so
those go first.

A failed test's report carries the accounts of the servers and watchdogs it used
(`explain.py`): CI's log alone then says why it failed.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import explain
import pytest
from xdist.scheduler import LoadScopeScheduling

REAL_OMNI = "tests/real_omni/"
SLOWEST_FIRST = (REAL_OMNI, "tests/real_vllm/")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.nodeid
        return next((i for i, prefix in enumerate(SLOWEST_FIRST) if path.startswith(prefix)), 99)

    items.sort(key=rank)


class FilesWithRealOmniTogether(LoadScopeScheduling):  # type: ignore[misc]
    """`--dist loadfile`, the real vLLM-Omni files one unit of work."""

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return REAL_OMNI if path.startswith(REAL_OMNI) else path


def pytest_xdist_make_scheduler(
    config: pytest.Config, log: Any
) -> FilesWithRealOmniTogether | None:
    if config.getvalue("dist") != "loadfile":
        return None
    return FilesWithRealOmniTogether(config, log)


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
