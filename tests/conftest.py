"""The order `make test` runs in: the files that start real servers first.

`make test` spreads whole files over parallel workers (pytest-xdist, `--dist loadfile`),
handing them out in collection order (`--no-loadscope-reorder`); a real-server file
handed out last would run on alone long after the others are done.
"""

from __future__ import annotations

import pytest

SLOWEST_FIRST = ("tests/real_omni/", "tests/real_vllm/")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.nodeid
        return next((i for i, prefix in enumerate(SLOWEST_FIRST) if path.startswith(prefix)), 99)

    items.sort(key=rank)
