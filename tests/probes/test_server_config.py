"""The server's own stage config, read through a fake /proc as if from another container."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest

from omni_watchdog.probes.server_config import ServerConfigReader, flag_value, model_argument
from omni_watchdog.types import TopologyOrigin

PID = 4242
EXAMPLE = Path(str(resources.files("omni_watchdog") / "examples" / "qwen2_5_omni_0.11.yaml"))
SITE = "/opt/venv/lib/python3.11/site-packages"
PACKAGE_CONFIG = f"{SITE}/vllm_omni/model_executor/stage_configs/qwen2_5_omni.yaml"


class FakeProc:
    """`/proc/<pid>` of one server: its command line, environment, memory map, and its
    root and working directory as directories of their own (another mount namespace)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.process = base / str(PID)
        (self.process / "root").mkdir(parents=True)
        (self.process / "cwd").mkdir()
        self.set_environ({})
        (self.process / "maps").write_text(
            f"7f00-7f01 r-xp 00000000 08:01 12 {SITE}/vllm/_C.abi3.so\n"
            "7f02-7f03 r-xp 00000000 08:01 13 /usr/lib/libc.so.6\n"
            "7f04-7f05 rw-p 00000000 00:00 0 \n"
        )

    def set_argv(self, *argv: str) -> None:
        (self.process / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")

    def set_environ(self, environ: dict[str, str]) -> None:
        text = "\0".join(f"{k}={v}" for k, v in environ.items())
        (self.process / "environ").write_text(text)

    def put(self, path: str, text: str, where: str = "root") -> None:
        target = self.process / where / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)


@pytest.fixture
def proc(tmp_path: Path) -> FakeProc:
    return FakeProc(tmp_path / "proc")


def read(proc: FakeProc) -> tuple[str, list[str]] | None:
    topology = ServerConfigReader(proc.base).read(PID)
    if topology is None:
        return None
    assert topology.origin is TopologyOrigin.SERVER_CONFIG
    return topology.source, [stage.name for stage in topology.stages]


STAGES = ["thinker", "talker", "code2wav"]


@pytest.mark.parametrize(
    ("argv", "placed", "expected"),
    [
        (
            ("vllm", "serve", "m", "--omni", "--stage-configs-path", "/etc/omni/s.yaml"),
            ("/etc/omni/s.yaml", "root"),
            ("cmdline:/etc/omni/s.yaml", STAGES),
        ),
        (
            ("vllm", "serve", "m", "--omni", "--stage-configs-path=configs/s.yaml"),
            ("configs/s.yaml", "cwd"),
            ("cmdline:configs/s.yaml", STAGES),
        ),
        (
            ("vllm", "serve", "m", "--omni", "--deploy-config", "/d.yaml"),
            ("/d.yaml", "root"),
            ("cmdline:/d.yaml", STAGES),
        ),
        (
            ("python", "-m", "omni_watchdog.sim", "--stage-config", "/s.yaml"),
            ("/s.yaml", "root"),
            ("cmdline:/s.yaml", STAGES),
        ),
        (("vllm", "serve", "m", "--omni", "--stage-configs-path", "/nowhere.yaml"), None, None),
        (("vllm", "serve", "m", "--omni", "--stage-configs-path"), ("/s.yaml", "root"), None),
    ],
    ids=["absolute", "relative", "0.30 deploy", "simulator", "missing file", "no value"],
)
def test_the_config_named_on_the_command_line_is_read_where_the_server_sees_it(
    proc: FakeProc,
    argv: tuple[str, ...],
    placed: tuple[str, str] | None,
    expected: tuple[str, list[str]] | None,
) -> None:
    proc.set_argv(*argv)
    if placed is not None:
        proc.put(placed[0], EXAMPLE.read_text(), placed[1])
    assert read(proc) == expected


def test_a_broken_config_on_the_command_line_is_no_topology(proc: FakeProc) -> None:
    proc.set_argv("vllm", "serve", "m", "--omni", "--stage-configs-path", "/s.yaml")
    proc.put("/s.yaml", "stage_args: [{engine_args: {}}]")
    assert read(proc) is None


def test_the_models_default_config_in_the_installed_package(proc: FakeProc) -> None:
    proc.set_argv("vllm", "serve", "/models/omni", "--omni", "--port", "8000")
    proc.put("/models/omni/config.json", json.dumps({"model_type": "qwen2_5_omni"}))
    proc.put(PACKAGE_CONFIG, EXAMPLE.read_text())
    assert read(proc) == (f"package:{PACKAGE_CONFIG}", STAGES)


@pytest.mark.parametrize(
    ("environ", "cache"),
    [
        ({"HF_HUB_CACHE": "/hub"}, "/hub"),
        ({"HF_HOME": "/hf"}, "/hf/hub"),
        ({"HOME": "/home/u"}, "/home/u/.cache/huggingface/hub"),
    ],
)
def test_a_hub_models_type_is_read_from_the_servers_cache(
    proc: FakeProc, environ: dict[str, str], cache: str
) -> None:
    proc.set_argv("vllm", "serve", "--model", "Qwen/Qwen2.5-Omni-7B", "--omni")
    proc.set_environ(environ)
    snapshot = f"{cache}/models--Qwen--Qwen2.5-Omni-7B/snapshots/abc123/config.json"
    proc.put(snapshot, json.dumps({"model_type": "qwen2_5_omni"}))
    proc.put(PACKAGE_CONFIG, EXAMPLE.read_text())
    assert read(proc) == (f"package:{PACKAGE_CONFIG}", STAGES)


@pytest.mark.parametrize(
    ("argv", "model_type"),
    [
        (("vllm", "serve", "/models/omni", "--port", "8000"), "qwen2_5_omni"),
        (("vllm", "serve", "/models/omni", "--omni"), "llama"),
        (("vllm", "serve", "/models/omni", "--omni"), "../../../etc/x"),
        (("vllm", "serve", "/models/absent", "--omni"), "qwen2_5_omni"),
    ],
    ids=["plain vllm", "no default for the model", "a type that is a path", "no model config"],
)
def test_no_package_default_without_an_omni_server_and_a_known_model(
    proc: FakeProc, argv: tuple[str, ...], model_type: str
) -> None:
    proc.set_argv(*argv)
    proc.put("/models/omni/config.json", json.dumps({"model_type": model_type}))
    proc.put(PACKAGE_CONFIG, EXAMPLE.read_text())
    assert read(proc) is None


def test_a_process_that_cannot_be_read_is_no_topology(tmp_path: Path) -> None:
    assert ServerConfigReader(tmp_path).read(PID) is None


@pytest.mark.parametrize(
    ("argv", "value"),
    [
        (["x", "--stage-config", "a.yaml"], "a.yaml"),
        (["x", "--stage-config=a.yaml"], "a.yaml"),
        (["x", "--stage-config", "--port"], None),
        (["x", "--stage-config="], None),
        (["x", "--stage-configs"], None),
    ],
)
def test_flag_values(argv: list[str], value: str | None) -> None:
    assert flag_value(argv, ("--stage-config",)) == value


@pytest.mark.parametrize(
    ("argv", "model"),
    [
        (["vllm", "serve", "org/m", "--omni"], "org/m"),
        (["vllm", "serve", "--omni", "--model", "org/m"], "org/m"),
        (["vllm", "serve", "--omni"], None),
        (["python", "-m", "server"], None),
    ],
)
def test_the_served_model(argv: list[str], model: str | None) -> None:
    assert model_argument(argv) == model


@pytest.mark.parametrize(
    ("stage_id", "names"),
    [("1", ["talker"]), ("2", ["code2wav"]), ("7", None)],
)
def test_a_headless_stage_server_runs_only_the_stage_it_names(
    proc: FakeProc, stage_id: str, names: list[str] | None
) -> None:
    """The other stages of its config run on other hosts: they are not its watchdog's."""
    proc.put("/srv/stages.yaml", EXAMPLE.read_text())
    proc.set_argv(
        "vllm", "serve", "m", "--omni", "--stage-configs-path", "/srv/stages.yaml",
        "--stage-id", stage_id, "--headless", "--omni-master-address", "10.0.0.1",
    )  # fmt: skip
    found = read(proc)
    assert (found[1] if found else None) == names
    topology = ServerConfigReader(proc.base).read(PID)
    if topology is not None:
        (stage,) = topology.stages
        assert stage.upstream == () and stage.downstream == ()
