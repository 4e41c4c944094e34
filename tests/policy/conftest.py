"""Fixtures of the policy tests."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from fakes import FakePsutil


@pytest.fixture
def fake_psutil() -> FakePsutil:
    return FakePsutil()


class PolicyEvents(logging.Handler):
    """Keeps every log event of the policy."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def named(self, event: str) -> list[dict[str, Any]]:
        """The fields of every event of that name."""
        return [r.__dict__["fields"] for r in self.records if r.getMessage() == event]


@pytest.fixture
def policy_events() -> Iterator[PolicyEvents]:
    """The policy's log events, whatever an earlier test made of the loggers above it."""
    logger = logging.getLogger("omni_watchdog.policy")
    events = PolicyEvents()
    level = logger.level
    logger.addHandler(events)
    logger.setLevel(logging.DEBUG)
    try:
        yield events
    finally:
        logger.removeHandler(events)
        logger.setLevel(level)
