"""The stage topology reader on the shipped examples and on broken files."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

import pytest

from omni_watchdog import pipeline_report, semconv
from omni_watchdog.topology import (
    MAX_CONFIG_BYTES,
    MAX_REPLICAS,
    MAX_STAGE_REPLICAS,
    MAX_STAGES,
    TopologyError,
    default_topology,
    load_topology,
    observed_topology,
    replaces,
    reported_topology,
)
from omni_watchdog.types import Stage, StageRef, Topology, TopologyOrigin

EXAMPLES = resources.files("omni_watchdog") / "examples"


def example(name: str) -> Path:
    return Path(str(EXAMPLES / name))


def write(tmp_path: Path, text: str, name: str = "talker.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_the_reports_0_11_config_is_three_stages_in_a_chain() -> None:
    topology = load_topology(example("qwen2_5_omni_0.11.yaml"))
    assert [(s.stage_id, s.name) for s in topology.stages] == [
        (0, "thinker"),
        (1, "talker"),
        (2, "code2wav"),
    ]
    assert [s.gpu_memory_utilization for s in topology.stages] == [0.1, 0.7, 0.1]
    assert [s.devices for s in topology.stages] == [(0,), (0,), (0,)]
    assert [(s.upstream, s.downstream) for s in topology.stages] == [
        ((), (1,)),
        ((0,), (2,)),
        ((1,), ()),
    ]
    assert [s.final_output for s in topology.stages] == [True, False, True]
    assert topology.default_path() == (0, 1, 2)
    assert topology.source.endswith("qwen2_5_omni_0.11.yaml")


def test_the_0_30_deploy_example_takes_names_and_edges_from_its_pipeline() -> None:
    topology = load_topology(example("qwen2_5_omni_0.30.yaml"))
    assert [(s.name, s.replicas) for s in topology.stages] == [
        ("thinker", 1),
        ("talker", 2),
        ("code2wav", 1),
    ]
    assert topology.default_path() == (0, 1, 2)
    assert topology.refs() == (StageRef(0), StageRef(1, 0), StageRef(1, 1), StageRef(2))
    assert [s.gpu_memory_utilization for s in topology.stages] == [0.3, 0.25, 0.1]


def test_a_deploy_file_without_pipeline_or_edges_chains_stages_in_id_order(
    tmp_path: Path,
) -> None:
    path = write(tmp_path, "stages:\n  - stage_id: 1\n  - stage_id: 0\n    devices: '0,1'\n")
    topology = load_topology(path)
    assert [(s.stage_id, s.name, s.devices) for s in topology.stages] == [
        (0, "stage0", (0, 1)),
        (1, "stage1", ()),
    ]
    assert topology.default_path() == (0, 1)
    assert [s.final_output for s in topology.stages] == [False, True]


def test_deploy_edges_override_the_chain(tmp_path: Path) -> None:
    text = (
        "stages: [{stage_id: 0}, {stage_id: 1}, {stage_id: 2}]\n"
        "edges: [{from: 0, to: 2, window_size: -1}]\n"
    )
    topology = load_topology(write(tmp_path, text))
    assert topology.default_path() == (0, 2)
    assert topology.stage(1) is not None and topology.stage(1).upstream == ()  # type: ignore[union-attr]


def test_default_topology_is_one_engine_stage() -> None:
    topology = default_topology()
    assert topology.refs() == (StageRef(0, 0),)
    assert topology.stages[0].name == "engine"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "stage_args:\n  - stage_id: 0\n  - engine_args: {model_stage: talker}\n",
            "talker.yaml: stage_args[1].stage_id: missing",
        ),
        (
            "stage_args: [{stage_id: 0}, {stage_id: 1}]\nruntime:\n  edges:\n"
            "    - {from: 0, to: 1}\n    - {from: 1, to: 7}\n",
            "talker.yaml: runtime.edges[1].to: unknown stage 7",
        ),
        (
            "stage_args: [{stage_id: 0}, {stage_id: 1, engine_input_source: [5]}]\n",
            "talker.yaml: stage_args[1].engine_input_source[0]: unknown stage 5",
        ),
        (
            "stage_args:\n  - stage_id: 0\n    engine_args: {gpu_memory_utilization: x}\n",
            "talker.yaml: stage_args[0].engine_args.gpu_memory_utilization: "
            "expected a number, got 'x'",
        ),
        (
            "stage_args:\n  - stage_id: '0'\n",
            "talker.yaml: stage_args[0].stage_id: expected an integer, got '0'",
        ),
        (
            "stage_args:\n  - stage_id: 0\n    runtime: {devices: 'gpu0'}\n",
            "talker.yaml: stage_args[0].runtime.devices: expected device indexes",
        ),
        (
            "stages: [{stage_id: 0, num_replicas: two}]\n",
            "talker.yaml: stages[0].num_replicas: expected an integer, got 'two'",
        ),
        (
            "stages: [{stage_id: 0, num_replicas: 0}]\n",
            "talker.yaml: stages[0].num_replicas: must be from 1 to 64",
        ),
        (
            "stages: [{stage_id: 0, gpu_memory_utilization: 1.5}]\n",
            "talker.yaml: stages[0].gpu_memory_utilization: expected a fraction",
        ),
        (
            "stage_args: [{stage_id: 0}, {stage_id: 0}]\n",
            "talker.yaml: stage_args[1].stage_id: duplicate stage id 0 (also stage_args[0])",
        ),
        ("- stage_id: 0\n", "talker.yaml: top level: expected a mapping"),
        ("stage_args: {stage_id: 0}\n", "talker.yaml: stage_args: expected a list"),
        ("stage_args: [7]\n", "talker.yaml: stage_args[0]: expected a mapping, got 7"),
        ("stage_args: []\n", "talker.yaml: stages: no stage defined"),
        (
            "stages: [{stage_id: 0, num_replicas: 65}]\n",
            "talker.yaml: stages[0].num_replicas: must be from 1 to 64",
        ),
        (
            "stages:\n" + "".join(f"  - stage_id: {n}\n" for n in range(65)),
            "talker.yaml: stages: 65 stages; at most 64 are watched",
        ),
        (
            "stages:\n" + "".join(f"  - {{stage_id: {n}, num_replicas: 50}}\n" for n in range(6)),
            "talker.yaml: stages: more than 256 stage replicas in all are not watched",
        ),
        ("model: x\n", "talker.yaml: top level: expected 'stage_args' (0.11) or 'stages'"),
        ("stage_args: [\n", "talker.yaml: not valid YAML"),
    ],
)
def test_broken_files_name_the_file_and_the_field(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(TopologyError) as raised:
        load_topology(write(tmp_path, text))
    assert str(raised.value).startswith(message)


def test_a_missing_file_is_a_topology_error(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match=r"^absent\.yaml: cannot read"):
        load_topology(tmp_path / "absent.yaml")


# ---- topologies learned from a running server -------------------------------------------

PLUGIN_REPORT = {
    semconv.PIPELINE_STAGE_IDS: [0, 1, 2],
    semconv.PIPELINE_STAGE_NAMES: ["thinker", "talker", "code2wav"],
    semconv.PIPELINE_STAGE_REPLICAS: [1, 2, 1],
    semconv.PIPELINE_STAGE_INPUTS: ["", "0", "1"],
    semconv.PIPELINE_STAGE_FINAL_OUTPUT: [True, False, True],
}


def learned(origin: TopologyOrigin, *replicas: int) -> Topology:
    stages = tuple(Stage(i, f"stage{i}", replicas=n) for i, n in enumerate(replicas))
    return Topology(stages=stages, source=origin.name.lower(), origin=origin)


@pytest.mark.parametrize(
    ("current", "offered", "replaced"),
    [
        (default_topology(), learned(TopologyOrigin.METRICS, 1, 1), True),
        (learned(TopologyOrigin.METRICS, 1, 1), learned(TopologyOrigin.TITLES, 1, 1), True),
        # Titles of an LLM → DiT pipeline name the LLM stage; the DiT's title names none.
        (learned(TopologyOrigin.METRICS, 1, 1), learned(TopologyOrigin.TITLES, 1), False),
        (learned(TopologyOrigin.TITLES, 1, 1), learned(TopologyOrigin.METRICS, 1, 2), False),
        (learned(TopologyOrigin.TITLES, 1), learned(TopologyOrigin.SERVER_CONFIG, 1), True),
        (learned(TopologyOrigin.SERVER_CONFIG, 1), learned(TopologyOrigin.PLUGIN, 1), True),
        (learned(TopologyOrigin.PLUGIN, 1, 1), learned(TopologyOrigin.SERVER_CONFIG, 1), False),
        (learned(TopologyOrigin.PLUGIN, 1, 1), learned(TopologyOrigin.PLUGIN, 1, 1), False),
        (learned(TopologyOrigin.PLUGIN, 1, 1), learned(TopologyOrigin.PLUGIN, 1, 2), True),
        (learned(TopologyOrigin.TITLES, 1), learned(TopologyOrigin.TITLES, 1, 1), True),
        (learned(TopologyOrigin.EXPLICIT, 1), learned(TopologyOrigin.PLUGIN, 1, 1), False),
        (learned(TopologyOrigin.EXPLICIT, 1), default_topology(), False),
        (learned(TopologyOrigin.METRICS, 1), default_topology(), False),
    ],
)
def test_a_better_informed_topology_replaces_a_poorer_one_never_a_given_one(
    current: Topology, offered: Topology, replaced: bool
) -> None:
    assert replaces(current, offered) is replaced


def test_a_config_file_is_given_unless_said_otherwise() -> None:
    assert load_topology(example("qwen2_5_omni_0.11.yaml")).origin is TopologyOrigin.EXPLICIT
    assert default_topology().origin is TopologyOrigin.DEFAULT


def test_observed_stages_count_replicas_up_to_the_highest_and_guess_no_edges() -> None:
    refs = [StageRef(1, 1), StageRef(0, 0), StageRef(1, 0), StageRef(1, 1)]
    topology = observed_topology(refs, TopologyOrigin.TITLES, "titles")
    assert topology is not None
    assert topology.source == "titles"
    assert topology.origin is TopologyOrigin.TITLES
    assert [(s.stage_id, s.name, s.replicas) for s in topology.stages] == [
        (0, "stage0", 1),
        (1, "stage1", 2),
    ]
    assert all(not s.upstream and not s.downstream for s in topology.stages)


@pytest.mark.parametrize(
    "refs",
    [
        [],
        [StageRef(-1)],
        [StageRef(0, MAX_REPLICAS)],
        [StageRef(stage) for stage in range(MAX_STAGES + 1)],
        [StageRef(stage, MAX_REPLICAS - 1) for stage in range(MAX_STAGE_REPLICAS // 64 + 1)],
    ],
    ids=["none", "negative id", "replica past the bound", "too many stages", "too many replicas"],
)
def test_observed_stages_past_the_bounds_make_no_topology(refs: list[StageRef]) -> None:
    assert observed_topology(refs, TopologyOrigin.METRICS, "metrics") is None


def test_a_plugin_report_becomes_the_pipelines_graph() -> None:
    topology = reported_topology(PLUGIN_REPORT)
    assert topology.source == "plugin"
    assert topology.origin is TopologyOrigin.PLUGIN
    assert [(s.stage_id, s.name, s.replicas, s.final_output) for s in topology.stages] == [
        (0, "thinker", 1, True),
        (1, "talker", 2, False),
        (2, "code2wav", 1, True),
    ]
    assert [(s.upstream, s.downstream) for s in topology.stages] == [
        ((), (1,)),
        ((0,), (2,)),
        ((1,), ()),
    ]


def test_the_plugins_encoding_reads_back_as_the_same_stages() -> None:
    topology = reported_topology(PLUGIN_REPORT)
    assert reported_topology(pipeline_report.encode_report(topology.stages)) == topology


def _report(**changes: object) -> dict[str, object]:
    keys = {
        "ids": semconv.PIPELINE_STAGE_IDS,
        "names": semconv.PIPELINE_STAGE_NAMES,
        "replicas": semconv.PIPELINE_STAGE_REPLICAS,
        "inputs": semconv.PIPELINE_STAGE_INPUTS,
        "finals": semconv.PIPELINE_STAGE_FINAL_OUTPUT,
    }
    report: dict[str, object] = dict(PLUGIN_REPORT)
    for short, value in changes.items():
        if value is None:
            del report[keys[short]]
        else:
            report[keys[short]] = value
    return report


@pytest.mark.parametrize(
    ("report", "message"),
    [
        (_report(ids=None), "stage_ids: expected a list"),
        (_report(ids=[]), "expected 1 to 64 stages"),
        (_report(ids=list(range(MAX_STAGES + 1))), "expected 1 to 64 stages"),
        (_report(names=["a", "b"]), "stage_names: 2 items for 3 stages"),
        (_report(ids=[0, 1, 1]), "duplicate stage id 1"),
        (_report(ids=[0, -1, 2]), "stages[1].stage_id: expected a stage id"),
        (_report(ids=[0, "1", 2]), "stages[1].stage_id: expected an integer"),
        (_report(names=["thinker", "", "x"]), "stages[1].name"),
        (_report(names=["thinker", "t" * 65, "x"]), "stages[1].name"),
        (_report(names=["thinker", "a\nb", "x"]), "stages[1].name: expected printable"),
        (_report(replicas=[1, 0, 1]), "stages[1].num_replicas: must be from 1 to 64"),
        (_report(replicas=[1, MAX_REPLICAS + 1, 1]), "must be from 1 to 64"),
        (_report(inputs=["", "7", "1"]), "unknown stage 7"),
        (_report(inputs=["", "0;1", "1"]), "expected stage ids like '0,1'"),
        (_report(inputs=["", "0," * 200, "1"]), "expected stage ids like '0,1'"),
        (_report(finals=[True, "yes", True]), "stages[1].final_output"),
    ],
)
def test_a_malformed_plugin_report_names_what_is_wrong(
    report: dict[str, object], message: str
) -> None:
    with pytest.raises(TopologyError, match=re.escape(message)):
        reported_topology(report)


def test_a_stage_config_past_the_size_bound_is_not_read(tmp_path: Path) -> None:
    path = write(tmp_path, "stage_args: []\n" + "#" * MAX_CONFIG_BYTES)
    with pytest.raises(TopologyError, match=r"talker\.yaml: over"):
        load_topology(path)


def test_a_config_read_for_the_server_names_where_it_came_from() -> None:
    topology = load_topology(example("qwen2_5_omni_0.11.yaml"), source="cmdline:/cfg.yaml")
    assert topology.source == "cmdline:/cfg.yaml"
