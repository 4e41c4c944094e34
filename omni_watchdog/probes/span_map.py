"""Spans as observations: each believed span, by its name, becomes what the detector reads,
and is filed in the store.

The receiver's third step, after decoding: for each resource of an export, `SenderTrust`
judges who sent it and `SpanVerdicts` whether each span may count for the stage it
names; a span that counts is mapped by its name (the plugin's `omni.*` spans, vLLM's
`llm_request`, vLLM-Omni's own stage and request spans) and kept. A resource's spans then
go to the `SpanStore`, or are held with their observations until their sender is
recorded (`HeldSpans`). A pid's stage that a resource teaches, when it is news, becomes a
PROCESS_STAGE observation for the process tracker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from omni_watchdog import pipeline_report
from omni_watchdog.probes.otlp_decode import (
    MAX_ATTRIBUTES,
    MAX_REQUEST_ID,
    STAGE_CACHE_SIZE,
    STATUS_CODE_ERROR,
    WANTED_KEYS,
    ResourceInfo,
    StageRefs,
    WantedAttributes,
    as_float,
    as_int,
    attribute_value,
    has_valid_ids,
    request_id,
    stage_path,
)
from omni_watchdog.probes.span_store import SpanStore, compacted
from omni_watchdog.probes.span_trust import (
    ConnectionSender,
    HeldSpans,
    SenderTrust,
    SpanVerdicts,
    Trust,
    Verdict,
)
from omni_watchdog.semconv import (
    DENOISE_STEP_COUNT,
    DENOISE_STEP_INDEX,
    DENOISE_STEP_SECONDS,
    DENOISE_STEP_SPAN,
    DIFFUSION_DENOISE_MS,
    DIFFUSION_REQUEST_SPAN,
    EXCEPTION_EVENT,
    EXCEPTION_MESSAGE,
    GEN_AI_REQUEST_ID,
    HEARTBEAT_SPAN,
    REQUEST_ABANDONED_SPAN,
    REQUEST_ADMITTED_SPAN,
    REQUEST_FINISHED_SPAN,
    REQUEST_ID,
    REQUEST_STAGE_PATH,
    STAGE_REQUEST_SPAN,
    TOPOLOGY_SPAN,
    VLLM_INSTRUMENTING_MODULE,
    VLLM_OMNI_DIFFUSION_STAGE_SPAN,
    VLLM_OMNI_INSTRUMENTING_MODULE,
    VLLM_OMNI_LLM_STAGE_SPAN,
    VLLM_OMNI_REQUEST_SPAN,
    VLLM_REQUEST_SPAN,
)
from omni_watchdog.topology import MAX_STAGES, TopologyError, reported_topology
from omni_watchdog.types import (
    Clock,
    Observation,
    ObservationKind,
    SpanOutcome,
    StageRef,
    Topology,
)

log = logging.getLogger(__name__)

# The plugin's spans, each with whether it shows the plugin at work on the stage it
# names. While they come, vLLM-Omni's own spans of that stage (of the pipeline, for its
# request span) would count the same work twice: they are only kept.
_PLUGIN_SPANS = {
    HEARTBEAT_SPAN: True,
    STAGE_REQUEST_SPAN: True,
    DENOISE_STEP_SPAN: True,
    DIFFUSION_REQUEST_SPAN: True,
    REQUEST_ADMITTED_SPAN: False,
    REQUEST_ABANDONED_SPAN: False,
    REQUEST_FINISHED_SPAN: False,
    TOPOLOGY_SPAN: False,
}
# The plugin's loops beat every second and it reports the topology every ten. vLLM-Omni's
# spans count again this long after the plugin's last span of their stage (its last span
# at all, for the request span).
PLUGIN_PRESENCE_SECONDS = 30.0

# Plain vLLM sets no stage attributes: it is one stage.
VLLM_DEFAULT_STAGE = StageRef(0, 0)

# A denoising loop of more steps than this is not one a server runs.
MAX_DENOISE_STEPS = 100_000

_SCALAR_KINDS = frozenset({"string_value", "int_value", "bool_value"})


class PluginPresence:
    """When the plugin's spans last spoke for each stage (None: for the pipeline)."""

    def __init__(self) -> None:
        self.heard: dict[StageRef | None, float] = {}

    def spoke(self, stage: StageRef | None, now: float) -> bool:
        """The plugin's spans spoke for `stage` (None: for the pipeline) lately."""
        heard = self.heard.get(stage)
        return heard is not None and now - heard < PLUGIN_PRESENCE_SECONDS

    def heard_at(self, stages: Iterable[StageRef | None], now: float) -> None:
        """The plugin's spans spoke for `stages` at `now`."""
        self.heard.update(dict.fromkeys(stages, now))


@dataclass
class _ResourceWalk:
    """What one resource's spans give while they are walked. Its observations and the
    stages its plugin spans speak for go to the body's (`observations`, the presence's
    `heard`), or are held back with its spans while its sender is not recorded."""

    now: float
    observations: list[Observation]
    heard: dict[StageRef | None, float]
    presence: PluginPresence
    # vLLM-Omni's tracer: its `llm_request`s repeat its `llm_processing` spans.
    omni_tracer: bool
    counted: int = 0
    kept: list[tuple[StageRef | None, Any]] = field(default_factory=list)
    # Spans that name a stage not known yet, and those stages.
    unplaced: list[Any] = field(default_factory=list)
    unplaced_stages: set[StageRef] = field(default_factory=set)
    beating: set[StageRef] = field(default_factory=set)
    spoke: bool = False
    noted: StageRef | None = None

    def note_plugin(self, name: str, stage: StageRef | None) -> None:
        """Note the stage a plugin span named `name` speaks for, if it is one."""
        plugin = _PLUGIN_SPANS.get(name)
        if plugin is None:
            return
        self.spoke = True
        # Once per run of one stage: hashing a StageRef costs.
        if plugin and stage is not None and stage is not self.noted:
            self.noted = stage
            if len(self.heard) >= STAGE_CACHE_SIZE:  # a remote stage's replicas
                self.heard.clear()
            self.heard[stage] = self.now


class SpanMapper:
    """Maps the spans of decoded exports to observations and files them in `store`; every
    span refused is counted in `rejected` under its reason, every one filed in `accepted`.

    vLLM-Omni's own spans are read beside the plugin's. A stage span of theirs counts as
    vLLM's `llm_request` does, except for a stage the plugin's spans spoke for in the last
    `PLUGIN_PRESENCE_SECONDS`: the plugin counts that work already, and theirs is only
    kept. Their request span ends a request only while no plugin span comes at all.
    vLLM-Omni's tracer also sends vLLM's `llm_request` for every LLM stage, naming none:
    that one is kept, never counted, never stage 0.
    """

    def __init__(
        self,
        clock: Clock,
        store: SpanStore,
        trust: SenderTrust,
        held: HeldSpans,
        rejected: dict[str, int],
    ) -> None:
        self._clock = clock
        self._store = store
        self._trust = trust
        self._held = held
        self._rejected = rejected
        self._stage_refs = StageRefs()
        self._presence = PluginPresence()
        self.accepted = 0

    def map(
        self,
        request: Any,
        wanted: frozenset[str],
        observations: list[Observation],
        sender: ConnectionSender | None = None,
        *,
        received: float | None = None,
        hold_unplaced: bool = True,
    ) -> tuple[int, int]:
        """File every valid span in the store and append its observations; (well-formed,
        malformed). A span refused for its sender or stage is well-formed, so the exporter
        is not told to fix it: it is counted under its own reason instead. A span of the
        target's that names a stage not known yet is held for `UNKNOWN_STAGE_GRACE_SECONDS`
        unless `hold_unplaced` is off (it is when the held ones are mapped again).

        Of span attributes only the `wanted` keys are read here; records read the rest later.
        `sender`: the process end of the connection the body came on, where it can be known;
        `received`: when the body came, when not now.
        """
        now = self._clock.monotonic() if received is None else received
        attributes = WantedAttributes(wanted)
        verdicts = self._trust.verdicts()
        well_formed = malformed = 0
        for resource_spans in request.resource_spans:
            resource = self._stage_refs.resource(resource_spans)
            trust = self._trust.judge(resource, sender)
            if trust is Trust.FOREIGN or trust is Trust.IMPOSTOR:
                count = sum(len(scope.spans) for scope in resource_spans.scope_spans)
                reason = "unknown_sender" if trust is Trust.FOREIGN else "unproven_sender"
                self._rejected[reason] += count
                well_formed += count
                continue
            unrecorded = trust is Trust.UNRECORDED
            tracer = resource.attributes.get(VLLM_INSTRUMENTING_MODULE)
            walk = _ResourceWalk(
                now,
                [] if unrecorded else observations,
                {} if unrecorded else self._presence.heard,
                self._presence,
                omni_tracer=tracer == VLLM_OMNI_INSTRUMENTING_MODULE,
            )
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    if not has_valid_ids(span):
                        malformed += 1
                        continue
                    well_formed += 1
                    self._take(span, resource, trust, attributes, verdicts, walk, hold_unplaced)
            self._finish(resource_spans, resource, trust, walk, observations)
        return well_formed, malformed

    @property
    def holds_spans(self) -> bool:
        """Whether spans wait for their sender or stage (see `settle`)."""
        return self._held.any

    def settle(self) -> list[Observation]:
        """Release the held spans of senders recorded since and of stages known since,
        refusing those past their grace; the observations they give."""
        now = self._clock.monotonic()
        released: list[Observation] = []
        if self._held.unplaced:
            for held, due in self._held.settle_unplaced(now, self._trust):
                if due:
                    self.map(
                        held.request,
                        WANTED_KEYS,
                        released,
                        received=held.received,
                        hold_unplaced=False,
                    )
                elif held.vouched(self._trust):
                    # The tracker maps the process from it at its next scan, and its stage
                    # is known then.
                    self._learn(held.resource, released, now)
        for waiting in self._held.settle_waiting(now, self._trust):
            self._file(waiting.resource, waiting.count, waiting.kept, waiting.observations, now)
            self._presence.heard_at(waiting.heard, now)
            released.extend(waiting.observations)
        return released

    def _take(
        self,
        span: Any,
        resource: ResourceInfo,
        trust: Trust,
        attributes: WantedAttributes,
        verdicts: SpanVerdicts,
        walk: _ResourceWalk,
        may_hold: bool,
    ) -> None:
        """Judge one well-formed span, and map and keep it when it counts."""
        found = attributes.of(span.attributes)
        stage = self._stage_refs.of_span(found, resource)
        name = span.name
        if stage is None and name == VLLM_REQUEST_SPAN and not walk.omni_tracer:
            stage = VLLM_DEFAULT_STAGE
        verdict = verdicts.of(trust, stage, name, may_hold)
        if verdict is not Verdict.TAKEN:
            if verdict is Verdict.HELD:
                assert stage is not None  # only a span naming a stage is held
                walk.unplaced.append(span)
                walk.unplaced_stages.add(stage)
            else:
                self._rejected[verdict.value] += 1
            return
        if name == TOPOLOGY_SPAN:
            topology = _reported_topology(span)
            if topology is None:
                self._rejected["malformed_topology"] += 1
                return
            walk.observations.append(
                Observation(ObservationKind.TOPOLOGY, walk.now, topology=topology)
            )
        walk.counted += 1
        walk.kept.append((stage, span))
        walk.note_plugin(name, stage)
        on_span = _ON_SPAN.get(name)
        if on_span is not None:
            on_span(span, stage, found, walk)

    def _finish(
        self,
        resource_spans: Any,
        resource: ResourceInfo,
        trust: Trust,
        walk: _ResourceWalk,
        observations: list[Observation],
    ) -> None:
        """Hold, or file, what one resource's spans gave."""
        now = walk.now
        if walk.spoke:
            walk.heard[None] = now
        if walk.unplaced:
            self._held.hold_unplaced(
                now, resource_spans, resource, walk.unplaced, walk.unplaced_stages
            )
        if not walk.counted:
            return
        if trust is Trust.UNRECORDED:
            self._held.wait(
                now,
                resource,
                walk.counted,
                walk.observations,
                compacted(walk.kept),
                tuple(walk.heard),
            )
            return
        remote = trust is Trust.REMOTE
        if remote and resource.stage is not None:
            self._trust.note_host(resource.stage.stage_id, resource)
        kept = compacted(walk.kept, self._store.ring_size)
        self._file(resource, walk.counted, kept, observations, now, learn=not remote)

    def _file(
        self,
        resource: ResourceInfo,
        count: int,
        kept: list[tuple[StageRef | None, bytes]],
        observations: list[Observation],
        now: float,
        learn: bool = True,
    ) -> None:
        """File one resource's spans (`count` of them, `kept` the ones the rings will hold),
        and, when `learn`, its pid's stage: its sender is the target's (a remote sender's
        pid is another host's and names nothing here)."""
        self.accepted += count
        self._store.file(resource, kept)
        if learn:
            self._learn(resource, observations, now)

    def _learn(self, resource: ResourceInfo, observations: list[Observation], now: float) -> None:
        """Learn the stage `resource` says its pid serves; a PROCESS_STAGE observation in
        `observations` when that is news."""
        pid, stage = resource.pid, resource.stage
        if pid is None or stage is None:
            return
        if self._store.learn_pid(pid, stage, resource.process_kind, resource.start_ticks):
            observations.append(
                Observation(
                    ObservationKind.PROCESS_STAGE,
                    now,
                    stage=stage,
                    pid=pid,
                    detail=resource.process_kind,
                )
            )


# --- each span name's observations --------------------------------------------------------

_OnSpan = Callable[[Any, StageRef | None, Mapping[str, Any], _ResourceWalk], None]


def _beat(stage: StageRef | None, walk: _ResourceWalk) -> None:
    # Heartbeats of one stage in one body say the same thing at `now`.
    if stage is not None and stage not in walk.beating:
        walk.beating.add(stage)
        walk.observations.append(Observation(ObservationKind.HEARTBEAT, walk.now, stage=stage))


def _on_heartbeat(
    span: Any, stage: StageRef | None, found: Mapping[str, Any], walk: _ResourceWalk
) -> None:
    _beat(stage, walk)


def _on_denoise_step(
    span: Any, stage: StageRef | None, found: Mapping[str, Any], walk: _ResourceWalk
) -> None:
    # A denoising step is a beat of the loop that runs it.
    _beat(stage, walk)
    if stage is not None:
        step = _denoise_step(stage, found, walk.now)
        if step is not None:
            walk.observations.append(step)


def _on_diffusion_request(
    span: Any, stage: StageRef | None, found: Mapping[str, Any], walk: _ResourceWalk
) -> None:
    # Its failure is counted from the orchestrator's stage span, once.
    if stage is not None:
        walk.observations.append(_denoise_done(stage, found, walk.now))


def _on_stage_request(
    span: Any, stage: StageRef | None, found: Mapping[str, Any], walk: _ResourceWalk
) -> None:
    if stage is not None:
        walk.observations.append(_stage_span(span, stage, found, walk.now))


def _on_llm_request(
    span: Any, stage: StageRef | None, found: Mapping[str, Any], walk: _ResourceWalk
) -> None:
    if stage is not None and not walk.omni_tracer:
        walk.observations.append(_stage_span(span, stage, found, walk.now))


def _on_request_admitted(
    span: Any, stage: StageRef | None, found: Mapping[str, Any], walk: _ResourceWalk
) -> None:
    walk.observations.append(
        Observation(
            ObservationKind.REQUEST_ADMITTED,
            walk.now,
            stage=stage,
            request_id=request_id(found, REQUEST_ID),
            path=stage_path(found.get(REQUEST_STAGE_PATH)),
        )
    )


def _request_end(kind: ObservationKind) -> _OnSpan:
    def on_request_end(
        span: Any, stage: StageRef | None, found: Mapping[str, Any], walk: _ResourceWalk
    ) -> None:
        walk.observations.append(
            Observation(kind, walk.now, stage=stage, request_id=request_id(found, REQUEST_ID))
        )

    return on_request_end


def _on_vllm_omni_stage(
    span: Any, stage: StageRef | None, found: Mapping[str, Any], walk: _ResourceWalk
) -> None:
    # Counted as `llm_request` is, unless the plugin speaks for the stage: its
    # `omni.stage.request` counts the same work.
    if stage is not None and not walk.presence.spoke(stage, walk.now):
        walk.observations.append(_stage_span(span, stage, found, walk.now))


def _on_vllm_omni_request(
    span: Any, stage: StageRef | None, found: Mapping[str, Any], walk: _ResourceWalk
) -> None:
    if not walk.presence.spoke(None, walk.now):
        walk.observations.append(_vllm_omni_request_end(span, found, walk.now))


# What each span name that counts gives besides being kept (a topology report is read
# before it counts: a malformed one does not).
_ON_SPAN: dict[str, _OnSpan] = {
    HEARTBEAT_SPAN: _on_heartbeat,
    DENOISE_STEP_SPAN: _on_denoise_step,
    DIFFUSION_REQUEST_SPAN: _on_diffusion_request,
    STAGE_REQUEST_SPAN: _on_stage_request,
    VLLM_REQUEST_SPAN: _on_llm_request,
    REQUEST_ADMITTED_SPAN: _on_request_admitted,
    REQUEST_ABANDONED_SPAN: _request_end(ObservationKind.REQUEST_ABANDONED),
    REQUEST_FINISHED_SPAN: _request_end(ObservationKind.REQUEST_FINISHED),
    VLLM_OMNI_LLM_STAGE_SPAN: _on_vllm_omni_stage,
    VLLM_OMNI_DIFFUSION_STAGE_SPAN: _on_vllm_omni_stage,
    VLLM_OMNI_REQUEST_SPAN: _on_vllm_omni_request,
}


def _vllm_omni_request_end(span: Any, found: Mapping[str, Any], now: float) -> Observation:
    """The end of the request an `omni_request` span covers: finished, or abandoned when
    the span failed (vLLM-Omni sends it only for a finished request, so far)."""
    failed = span.status.code == STATUS_CODE_ERROR
    return Observation(
        ObservationKind.REQUEST_ABANDONED if failed else ObservationKind.REQUEST_FINISHED,
        now,
        request_id=request_id(found, GEN_AI_REQUEST_ID),
    )


def _stage_span(span: Any, stage: StageRef, found: Mapping[str, Any], now: float) -> Observation:
    """The STAGE_SPAN observation of an `omni.stage.request` or `llm_request` span."""
    failed = span.status.code == STATUS_CODE_ERROR
    return Observation(
        ObservationKind.STAGE_SPAN,
        now,
        stage=stage,
        value=max(0, span.end_time_unix_nano - span.start_time_unix_nano) / 1e9,
        outcome=SpanOutcome.ERROR if failed else SpanOutcome.OK,
        detail=_error_detail(span)[:MAX_REQUEST_ID] if failed else "",
        request_id=request_id(found, REQUEST_ID, GEN_AI_REQUEST_ID),
    )


def _denoise_done(stage: StageRef, found: Mapping[str, Any], now: float) -> Observation:
    """The DENOISE_DONE observation of an `omni.diffusion.request` span, with the seconds
    its steps took on average where it says how many ran and how long they took: an image
    done within a heartbeat interval tells no step of its own."""
    steps = as_int(found.get(DENOISE_STEP_INDEX))
    denoise_ms = as_float(found.get(DIFFUSION_DENOISE_MS))
    seconds = 0.0
    if steps is not None and 1 <= steps <= MAX_DENOISE_STEPS and denoise_ms is not None:
        mean = denoise_ms / 1e3 / steps
        seconds = mean if 0.0 <= mean < float("inf") else 0.0
    return Observation(
        ObservationKind.DENOISE_DONE,
        now,
        stage=stage,
        request_id=request_id(found, REQUEST_ID),
        value=seconds,
    )


def _denoise_step(stage: StageRef, found: Mapping[str, Any], now: float) -> Observation | None:
    """The DENOISE_STEP observation of an `omni.diffusion.step` span; None when its step
    numbers are missing or make no sense (step 0, or past a count; a count of 0 is one the
    sender does not know)."""
    step = as_int(found.get(DENOISE_STEP_INDEX))
    steps = as_int(found.get(DENOISE_STEP_COUNT))
    if step is None or steps is None or not 1 <= step <= MAX_DENOISE_STEPS:
        return None
    if not (steps == 0 or step <= steps <= MAX_DENOISE_STEPS):
        return None
    previous = found.get(DENOISE_STEP_SECONDS)
    seconds = float(previous) if isinstance(previous, (int, float)) else 0.0
    return Observation(
        ObservationKind.DENOISE_STEP,
        now,
        stage=stage,
        request_id=request_id(found, REQUEST_ID),
        value=seconds if 0.0 <= seconds < float("inf") else 0.0,
        step=step,
        steps=steps,
    )


def _reported_topology(span: Any) -> Topology | None:
    """The topology an `omni.pipeline.topology` span reports, or None when it is malformed:
    a list longer than `MAX_STAGES` is refused before a value of it is read."""
    values: dict[str, object] = {}
    for kv in span.attributes[:MAX_ATTRIBUTES]:
        if kv.key not in pipeline_report.KEYS:
            continue
        if kv.value.WhichOneof("value") != "array_value":
            return None
        items = kv.value.array_value.values
        if len(items) > MAX_STAGES:
            return None
        values[kv.key] = [
            attribute_value(item) if item.WhichOneof("value") in _SCALAR_KINDS else None
            for item in items
        ]
    try:
        return reported_topology(values)
    except TopologyError as error:
        log.debug("topology report refused: %s", error)
        return None


def _error_detail(span: Any) -> str:
    """The status message, else the message of the span's exception event."""
    if span.status.message:
        return str(span.status.message)
    for event in span.events:
        if event.name == EXCEPTION_EVENT:
            for kv in event.attributes:
                if kv.key == EXCEPTION_MESSAGE:
                    return str(attribute_value(kv.value))
    return ""
