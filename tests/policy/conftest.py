"""Fixtures of the policy tests."""

from __future__ import annotations

import pytest
from fakes import FakePsutil


@pytest.fixture
def fake_psutil() -> FakePsutil:
    return FakePsutil()
