"""The `sim` fixture: a simulated server whose whole process tree is killed at the end."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sim.sim_helpers import Sim


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[Sim]:
    """A not yet started simulated server; everything it starts is killed at the end."""
    server = Sim(tmp_path / "state", tmp_path / "sim.log")
    server.state_dir.mkdir()
    try:
        yield server
    finally:
        server.kill_everything()
