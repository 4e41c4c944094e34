"""Read vLLM-Omni stage configs (the 0.11 `stage_args` schema and the 0.30 deploy schema),
and the topologies learned from a running server (the plugin's report, titles, metrics).

All become one `Topology`. Every error names the file and the field path, like
`talker.yaml: stage_args[1].stage_id: missing`. Which of several topologies is believed
is decided here too (`replaces`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from omni_watchdog import semconv
from omni_watchdog.pipeline_report import MAX_STAGE_NAME
from omni_watchdog.types import STAGE_TYPES, Stage, StageRef, Topology, TopologyOrigin


class TopologyError(ValueError):
    """A stage config that cannot be read, naming the file and the field."""


# The 0.30 deploy schema leaves names and edges to vLLM-Omni's pipeline registry, keyed by
# the `pipeline` field (or the model type); these are the registry's entries we know:
# (model_stage, input stage ids, final_output) per stage id.
KNOWN_PIPELINES: Mapping[str, tuple[tuple[str, tuple[int, ...], bool], ...]] = {
    "qwen2_5_omni": (("thinker", (), True), ("talker", (0,), False), ("code2wav", (1,), True)),
    "qwen2_5_omni_thinker_only": (("thinker", (), True),),
}

DEFAULT_STAGE_NAME = "engine"
# Every stage replica makes its own series; these bound them whatever a config says.
MAX_STAGES = 64
MAX_REPLICAS = 64
MAX_STAGE_REPLICAS = 256
# Stage configs are a few kilobytes; a bigger file is not one (and is not read whole).
MAX_CONFIG_BYTES = 1 << 20
# Every stage may read from every other, written as "0,1,...": no more text than that.
_MAX_INPUTS_TEXT = MAX_STAGES * 4


class TopologySenders:
    """Whom spans may speak for when no process table is in view (without the server's PID
    namespace): any sender, since none can be checked, but only the topology's stages."""

    def __init__(self, topology: Topology) -> None:
        self._refs = frozenset(topology.refs())

    def set_topology(self, topology: Topology) -> None:
        self._refs = frozenset(topology.refs())

    def owns(self, pid: int | None, start_ticks: int | None) -> bool:
        return True

    def knows(self, stage: StageRef) -> bool:
        return stage in self._refs

    def maps(self, stage: StageRef) -> bool:
        return stage in self._refs

    def live_pids(self) -> list[int]:
        return []


def default_topology() -> Topology:
    """Plain vLLM: one stage 0 named "engine"."""
    return Topology(
        stages=(Stage(0, DEFAULT_STAGE_NAME, final_output=True),),
        source="default",
        origin=TopologyOrigin.DEFAULT,
    )


def load_topology(path: str | Path, source: str = "") -> Topology:
    """The stage graph of a 0.11 (`stage_args`) or 0.30 (`stages`) stage config file;
    `source` names it in the topology (default: the path)."""
    file_path = Path(path)
    origin = file_path.name
    try:
        with file_path.open("rb") as config_file:
            data = config_file.read(MAX_CONFIG_BYTES + 1)
        if len(data) > MAX_CONFIG_BYTES:
            raise TopologyError(f"{origin}: over {MAX_CONFIG_BYTES} bytes; not a stage config")
        document = yaml.safe_load(data)
    except OSError as error:
        raise TopologyError(f"{origin}: cannot read: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise TopologyError(f"{origin}: not valid YAML: {error}") from None
    return parse_topology(document, origin, source=source or str(file_path))


def parse_topology(document: Any, origin: str, source: str = "") -> Topology:
    """The stage graph of an already-parsed stage config; `origin` names it in errors."""
    reader = _Reader(origin)
    if not isinstance(document, Mapping):
        raise TopologyError(f"{origin}: top level: expected a mapping, got {_kind(document)}")
    if "stage_args" in document:
        return reader.read_v011(document, source or origin)
    if "stages" in document:
        return reader.read_v030(document, source or origin)
    raise TopologyError(f"{origin}: top level: expected 'stage_args' (0.11) or 'stages' (0.30)")


def with_remote_stages(topology: Topology, remote_stages: Iterable[int]) -> Topology:
    """`topology` with every remote stage in it: one that runs on another host has no
    process here to name it, so a topology learned from this host's titles or metrics
    would leave it out. Added ones are named like any unnamed stage."""
    known = {stage.stage_id for stage in topology.stages}
    added = tuple(
        Stage(stage_id, f"stage{stage_id}") for stage_id in sorted(set(remote_stages) - known)
    )
    if not added:
        return topology
    stages = tuple(sorted(topology.stages + added, key=lambda stage: stage.stage_id))
    return replace(topology, stages=stages)


def replaces(current: Topology, offered: Topology) -> bool:
    """Whether a topology learned from the server replaces the one in use.

    A given stage config is never replaced. Otherwise a better-informed origin wins, and
    a newer reading of the same origin wins when its stages differ (a replica added).
    Titles name every LLM stage's processes but no diffusion stage's (`vLLM-Omni::
    DiffusionWorker` names none): they do not replace metrics that name a stage they miss.
    """
    if current.origin is TopologyOrigin.EXPLICIT:
        return False
    if offered.origin is TopologyOrigin.TITLES and current.origin is TopologyOrigin.METRICS:
        named = {stage.stage_id for stage in offered.stages}
        if any(stage.stage_id not in named for stage in current.stages):
            return False
    if offered.origin != current.origin:
        return offered.origin > current.origin
    return offered.stages != current.stages


def observed_topology(
    refs: Iterable[StageRef], origin: TopologyOrigin, source: str
) -> Topology | None:
    """The stages that process titles or metrics labels name; None when they name none, or
    more than the bounds allow (the default stays then).

    Names are unknown (`stage{S}`), replicas count up to the highest index seen. Edges are
    unknown too and left empty, not guessed: a chain by stage id would show as fact in
    /v1/status, and detection never follows edges (a request's path comes with it).
    """
    highest: dict[int, int] = {}
    for ref in refs:
        if ref.stage_id < 0 or not 0 <= ref.replica < MAX_REPLICAS:
            return None
        highest[ref.stage_id] = max(highest.get(ref.stage_id, 0), ref.replica)
    if not highest or len(highest) > MAX_STAGES:
        return None
    if sum(replica + 1 for replica in highest.values()) > MAX_STAGE_REPLICAS:
        return None
    stages = tuple(
        Stage(stage_id, f"stage{stage_id}", replicas=replica + 1)
        for stage_id, replica in sorted(highest.items())
    )
    return Topology(stages=stages, source=source, origin=origin)


def reported_topology(attributes: Mapping[str, object], source: str = "plugin") -> Topology:
    """The topology of the plugin's `omni.pipeline.topology` span (its attributes as
    values), checked like a config file: parallel lists of one length, bounded, no
    duplicate ids, no input from an unknown stage. TopologyError names what is wrong."""
    reader = _Reader(source)
    ids = reader.sequence(attributes.get(semconv.PIPELINE_STAGE_IDS), semconv.PIPELINE_STAGE_IDS)
    if not ids or len(ids) > MAX_STAGES:
        raise reader.fail(semconv.PIPELINE_STAGE_IDS, f"expected 1 to {MAX_STAGES} stages")
    columns = {
        key: reader.sequence(attributes.get(key), key)
        for key in (
            semconv.PIPELINE_STAGE_NAMES,
            semconv.PIPELINE_STAGE_REPLICAS,
            semconv.PIPELINE_STAGE_INPUTS,
            semconv.PIPELINE_STAGE_FINAL_OUTPUT,
        )
    }
    for key, column in columns.items():
        if len(column) != len(ids):
            raise reader.fail(key, f"{len(column)} items for {len(ids)} stages")
    # Added in a later plugin: a report without it is whole; a type not known is unsaid.
    types = attributes.get(semconv.PIPELINE_STAGE_TYPES)
    stage_types = reader.sequence(types, semconv.PIPELINE_STAGE_TYPES) if types is not None else []
    if stage_types and len(stage_types) != len(ids):
        problem = f"{len(stage_types)} items for {len(ids)} stages"
        raise reader.fail(semconv.PIPELINE_STAGE_TYPES, problem)
    drafts: list[_Draft] = []
    for index, raw_id in enumerate(ids):
        where = f"stages[{index}]"
        stage_id = reader.as_integer(raw_id, f"{where}.stage_id")
        if stage_id < 0:
            raise reader.fail(f"{where}.stage_id", f"expected a stage id, got {stage_id}")
        name = columns[semconv.PIPELINE_STAGE_NAMES][index]
        if not isinstance(name, str) or not 0 < len(name) <= MAX_STAGE_NAME:
            raise reader.fail(f"{where}.name", f"expected 1 to {MAX_STAGE_NAME} characters")
        if not name.isprintable():
            raise reader.fail(f"{where}.name", "expected printable characters")
        final_output = columns[semconv.PIPELINE_STAGE_FINAL_OUTPUT][index]
        if not isinstance(final_output, bool):
            problem = f"expected true or false, got {_kind(final_output)}"
            raise reader.fail(f"{where}.final_output", problem)
        drafts.append(
            _Draft(
                stage_id=stage_id,
                where=where,
                name=name,
                replicas=reader.as_integer(
                    columns[semconv.PIPELINE_STAGE_REPLICAS][index], f"{where}.num_replicas"
                ),
                devices=(),
                memory=None,
                inputs=reader.input_list(
                    columns[semconv.PIPELINE_STAGE_INPUTS][index], f"{where}.engine_input_source"
                ),
                final_output=final_output,
                stage_type=next(
                    (t for t in STAGE_TYPES if stage_types and stage_types[index] == t), ""
                ),
            )
        )
    topology = reader.assemble(drafts, [], source, chain_by_default=False)
    return replace(topology, origin=TopologyOrigin.PLUGIN)


def _kind(value: Any) -> str:
    return "nothing" if value is None else repr(value)


class _Reader:
    """Field readers that raise `TopologyError` naming the file and the field path."""

    def __init__(self, origin: str) -> None:
        self.origin = origin

    def fail(self, where: str, problem: str) -> TopologyError:
        return TopologyError(f"{self.origin}: {where}: {problem}")

    def mapping(self, value: Any, where: str) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            raise self.fail(where, f"expected a mapping, got {_kind(value)}")
        return value

    def sequence(self, value: Any, where: str) -> Sequence[Any]:
        if not isinstance(value, list):
            raise self.fail(where, f"expected a list, got {_kind(value)}")
        return value

    def integer(self, container: Mapping[str, Any], key: str, where: str) -> int:
        if key not in container:
            raise self.fail(f"{where}.{key}", "missing")
        return self.as_integer(container[key], f"{where}.{key}")

    def as_integer(self, value: Any, where: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(where, f"expected an integer, got {_kind(value)}")
        return value

    def fraction(self, container: Mapping[str, Any], key: str, where: str) -> float | None:
        value = container.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(f"{where}.{key}", f"expected a number, got {_kind(value)}")
        if not 0 < value <= 1:
            raise self.fail(f"{where}.{key}", f"expected a fraction in (0, 1], got {value!r}")
        return float(value)

    def flag(self, container: Mapping[str, Any], key: str, where: str) -> bool | None:
        value = container.get(key)
        if value is None or isinstance(value, bool):
            return value
        raise self.fail(f"{where}.{key}", f"expected true or false, got {_kind(value)}")

    def name(self, container: Mapping[str, Any], key: str, where: str) -> str | None:
        value = container.get(key)
        if value is None or (isinstance(value, str) and value):
            return value
        raise self.fail(f"{where}.{key}", f"expected a name, got {_kind(value)}")

    def devices(self, value: Any, where: str) -> tuple[int, ...]:
        """`"0"`, `"0,1"`, `0` or `[0, 1]`, as CUDA_VISIBLE_DEVICES-style indexes."""
        if value is None:
            return ()
        if isinstance(value, bool):
            raise self.fail(where, f"expected device indexes like '0,1', got {value!r}")
        if isinstance(value, int):
            items: list[Any] = [value]
        elif isinstance(value, str):
            items = [item.strip() for item in value.split(",") if item.strip()]
        elif isinstance(value, list):
            items = list(value)
        else:
            raise self.fail(where, f"expected device indexes like '0,1', got {value!r}")
        indexes: list[int] = []
        for item in items:
            text = str(item)
            if isinstance(item, bool) or not text.isdigit():
                raise self.fail(where, f"expected device indexes like '0,1', got {value!r}")
            indexes.append(int(text))
        return tuple(indexes)

    def stage_ids(self, value: Any, where: str) -> tuple[int, ...]:
        if value is None:
            return ()
        if isinstance(value, int) and not isinstance(value, bool):
            return (value,)
        items = self.sequence(value, where)
        return tuple(self.as_integer(item, f"{where}[{i}]") for i, item in enumerate(items))

    def input_list(self, value: Any, where: str) -> tuple[int, ...]:
        """Stage ids written as `"0,1"` (OpenTelemetry attributes hold no nested lists)."""
        if not isinstance(value, str) or len(value) > _MAX_INPUTS_TEXT:
            raise self.fail(where, f"expected stage ids like '0,1', got {_kind(value)}")
        items = [item.strip() for item in value.split(",") if item.strip()]
        if not all(item.isascii() and item.isdigit() for item in items):
            raise self.fail(where, f"expected stage ids like '0,1', got {value!r}")
        return tuple(int(item) for item in items)

    def edges(self, value: Any, where: str) -> list[tuple[int, int, str]]:
        """(from, to, field path of `to`) for each edge of a `edges:` list."""
        if value is None:
            return []
        found: list[tuple[int, int, str]] = []
        for index, item in enumerate(self.sequence(value, where)):
            edge_where = f"{where}[{index}]"
            edge = self.mapping(item, edge_where)
            source = self.integer(edge, "from", edge_where)
            target = self.integer(edge, "to", edge_where)
            window = edge.get("window_size")
            if window is not None:
                self.as_integer(window, f"{edge_where}.window_size")
            found.append((source, target, edge_where))
        return found

    def read_v011(self, document: Mapping[str, Any], source: str) -> Topology:
        entries = self.sequence(document["stage_args"], "stage_args")
        drafts: list[_Draft] = []
        for index, item in enumerate(entries):
            where = f"stage_args[{index}]"
            entry = self.mapping(item, where)
            stage_id = self.integer(entry, "stage_id", where)
            engine_args = self.mapping(entry.get("engine_args") or {}, f"{where}.engine_args")
            runtime = self.mapping(entry.get("runtime") or {}, f"{where}.runtime")
            replicas = runtime.get("num_replicas", 1)
            drafts.append(
                _Draft(
                    stage_id=stage_id,
                    where=where,
                    name=self.name(engine_args, "model_stage", f"{where}.engine_args"),
                    replicas=self.as_integer(replicas, f"{where}.runtime.num_replicas"),
                    devices=self.devices(runtime.get("devices"), f"{where}.runtime.devices"),
                    memory=self.fraction(
                        engine_args, "gpu_memory_utilization", f"{where}.engine_args"
                    ),
                    inputs=self.stage_ids(
                        entry.get("engine_input_source"), f"{where}.engine_input_source"
                    ),
                    final_output=self.flag(entry, "final_output", where),
                )
            )
        runtime = self.mapping(document.get("runtime") or {}, "runtime")
        edges = self.edges(runtime.get("edges"), "runtime.edges")
        return self.assemble(drafts, edges, source, chain_by_default=False)

    def read_v030(self, document: Mapping[str, Any], source: str) -> Topology:
        entries = self.sequence(document["stages"], "stages")
        pipeline_name = self.name(document, "pipeline", "top level")
        if pipeline_name is None:
            pipeline_name = Path(source).stem
        pipeline = KNOWN_PIPELINES.get(pipeline_name, ())
        drafts: list[_Draft] = []
        for index, item in enumerate(entries):
            where = f"stages[{index}]"
            entry = self.mapping(item, where)
            stage_id = self.integer(entry, "stage_id", where)
            runtime = self.mapping(entry.get("runtime") or {}, f"{where}.runtime")
            engine_args = self.mapping(entry.get("engine_args") or {}, f"{where}.engine_args")
            flat = {**entry, **engine_args}
            replicas_where = f"{where}.num_replicas"
            replicas = runtime.get("num_replicas", entry.get("num_replicas", 1))
            known = pipeline[stage_id] if 0 <= stage_id < len(pipeline) else None
            drafts.append(
                _Draft(
                    stage_id=stage_id,
                    where=where,
                    name=self.name(flat, "model_stage", where) or (known[0] if known else None),
                    replicas=self.as_integer(replicas, replicas_where),
                    devices=self.devices(
                        runtime.get("devices", entry.get("devices")), f"{where}.devices"
                    ),
                    memory=self.fraction(flat, "gpu_memory_utilization", where),
                    inputs=known[1] if known else (),
                    final_output=self.flag(flat, "final_output", where)
                    if "final_output" in flat
                    else (known[2] if known else None),
                )
            )
        edges = self.edges(document.get("edges"), "edges")
        return self.assemble(drafts, edges, source, chain_by_default=not pipeline)

    def assemble(
        self,
        drafts: list[_Draft],
        edges: list[tuple[int, int, str]],
        source: str,
        chain_by_default: bool,
    ) -> Topology:
        if not drafts:
            raise self.fail("stages", "no stage defined")
        if len(drafts) > MAX_STAGES:
            raise self.fail("stages", f"{len(drafts)} stages; at most {MAX_STAGES} are watched")
        if sum(draft.replicas for draft in drafts) > MAX_STAGE_REPLICAS:
            raise self.fail(
                "stages", f"more than {MAX_STAGE_REPLICAS} stage replicas in all are not watched"
            )
        seen: dict[int, str] = {}
        for draft in drafts:
            if draft.stage_id in seen:
                raise self.fail(
                    f"{draft.where}.stage_id",
                    f"duplicate stage id {draft.stage_id} (also {seen[draft.stage_id]})",
                )
            if not 1 <= draft.replicas <= MAX_REPLICAS:
                raise self.fail(f"{draft.where}.num_replicas", f"must be from 1 to {MAX_REPLICAS}")
            seen[draft.stage_id] = draft.where
        links: set[tuple[int, int]] = set()
        for draft in drafts:
            for index, upstream in enumerate(draft.inputs):
                if upstream not in seen:
                    raise self.fail(
                        f"{draft.where}.engine_input_source[{index}]",
                        f"unknown stage {upstream}",
                    )
                links.add((upstream, draft.stage_id))
        for source_id, target_id, where in edges:
            if source_id not in seen:
                raise self.fail(f"{where}.from", f"unknown stage {source_id}")
            if target_id not in seen:
                raise self.fail(f"{where}.to", f"unknown stage {target_id}")
            links.add((source_id, target_id))
        if not links and chain_by_default:
            # No registry entry and no edges: vLLM-Omni pipelines run stages in id order.
            ordered = sorted(seen)
            links = set(itertools.pairwise(ordered))
        downstream_ids = {source_id for source_id, _ in links}
        stages = tuple(
            Stage(
                stage_id=draft.stage_id,
                name=(draft.name or f"stage{draft.stage_id}")[:MAX_STAGE_NAME],
                replicas=draft.replicas,
                devices=draft.devices,
                gpu_memory_utilization=draft.memory,
                upstream=tuple(sorted(a for a, b in links if b == draft.stage_id)),
                downstream=tuple(sorted(b for a, b in links if a == draft.stage_id)),
                final_output=draft.final_output
                if draft.final_output is not None
                else draft.stage_id not in downstream_ids,
                stage_type=draft.stage_type,
            )
            for draft in sorted(drafts, key=lambda d: d.stage_id)
        )
        return Topology(stages=stages, source=source)


@dataclass(frozen=True)
class _Draft:
    """One stage as read, before edges are checked against the other stages."""

    stage_id: int
    where: str
    name: str | None
    replicas: int
    devices: tuple[int, ...]
    memory: float | None
    inputs: tuple[int, ...]
    final_output: bool | None
    stage_type: str = ""
