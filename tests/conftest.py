"""The order `make test` runs in, and what a failed test prints.

`make test` spreads whole files over parallel workers (pytest-xdist, `--dist loadfile`),
handing them out in collection order (`--no-loadscope-reorder`); a real-server file
handed out last would run on alone long after the others are done, so those go first.

A failed test's report carries the accounts of the servers and watchdogs it used
(`explain.py`): CI's log alone then says why it failed.
"""

from __future__ import annotations

from collections.abc import Generator

import explain
import pytest

SLOWEST_FIRST = ("tests/real_omni/", "tests/real_vllm/")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.nodeid
        return next((i for i, prefix in enumerate(SLOWEST_FIRST) if path.startswith(prefix)), 99)

    items.sort(key=rank)


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
