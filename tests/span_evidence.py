"""The spans receiver's observations as its evidence tests read them.

Besides what its spans show, the receiver tells the process tracker each pid's stage a
resource teaches (PROCESS_STAGE); tests of their own check that news, and the tests of
what spans show leave it out.
"""

from __future__ import annotations

from collections.abc import Iterable

from omni_watchdog.types import Observation, ObservationKind


def evidence(observations: Iterable[Observation]) -> list[Observation]:
    """`observations` without the PROCESS_STAGE news, in order."""
    return [obs for obs in observations if obs.kind is not ObservationKind.PROCESS_STAGE]
