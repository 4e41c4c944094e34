"""The stage topology reader on the shipped examples and on broken files."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest

from omni_watchdog.topology import TopologyError, default_topology, load_topology
from omni_watchdog.types import StageRef

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
