"""The wire format of the plugin's topology report: one `omni.pipeline.topology` span.

vLLM-Omni 0.30 keeps its stage graph in code, so the watchdog cannot read it from a file;
the instrument plugin reads the pipeline running in the API server and sends it as a span
whose attributes are parallel lists, one item per stage, in stage order. OpenTelemetry
attributes hold no nested lists, so each stage's inputs are one text, "0,1". Kept free of
heavy imports: the plugin loads it inside vLLM processes.
"""

from __future__ import annotations

from collections.abc import Sequence

from omni_watchdog.semconv import (
    PIPELINE_STAGE_FINAL_OUTPUT,
    PIPELINE_STAGE_IDS,
    PIPELINE_STAGE_INPUTS,
    PIPELINE_STAGE_NAMES,
    PIPELINE_STAGE_REPLICAS,
    PIPELINE_STAGE_TYPES,
)
from omni_watchdog.types import Stage

KEYS = frozenset(
    {
        PIPELINE_STAGE_IDS,
        PIPELINE_STAGE_NAMES,
        PIPELINE_STAGE_REPLICAS,
        PIPELINE_STAGE_INPUTS,
        PIPELINE_STAGE_FINAL_OUTPUT,
        PIPELINE_STAGE_TYPES,
    }
)
# Stage names become metric labels; the watchdog refuses a report with a longer one.
MAX_STAGE_NAME = 64


def encode_report(stages: Sequence[Stage]) -> dict[str, list[int] | list[str] | list[bool]]:
    """The span attributes that describe these stages (their ids, names, replica counts,
    input stage ids, whether they give the request's output, and what runs them)."""
    return {
        PIPELINE_STAGE_IDS: [stage.stage_id for stage in stages],
        PIPELINE_STAGE_NAMES: [stage.name[:MAX_STAGE_NAME] for stage in stages],
        PIPELINE_STAGE_REPLICAS: [stage.replicas for stage in stages],
        PIPELINE_STAGE_INPUTS: [
            ",".join(str(source) for source in stage.upstream) for stage in stages
        ],
        PIPELINE_STAGE_FINAL_OUTPUT: [stage.final_output for stage in stages],
        PIPELINE_STAGE_TYPES: [stage.stage_type for stage in stages],
    }
