"""The stage config a running vLLM-Omni server was started with, read from outside it.

vLLM-Omni 0.11 takes its stage graph from a file: the one named on its command line
(`--stage-configs-path`), else the model's default inside the installed package
(`vllm_omni/model_executor/stage_configs/<model_type>.yaml`). vLLM-Omni 0.30 names a deploy
file (`--deploy-config`); the simulated server names either schema with `--stage-config`.
Every path is read as the server sees it, through `/proc/<pid>/root` and `/proc/<pid>/cwd`,
so a server in another container (with the PID namespace shared) is read all the same.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from omni_watchdog.topology import TopologyError, load_topology
from omni_watchdog.types import Topology, TopologyOrigin

log = logging.getLogger(__name__)

CONFIG_FLAGS = ("--stage-configs-path", "--deploy-config", "--stage-config")
PACKAGE_CONFIGS = Path("vllm_omni/model_executor/stage_configs")
_PACKAGE_ROOTS = ("/site-packages/", "/dist-packages/")
_MODEL_TYPE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# A model's config.json, the server's environment and memory map are read up to this.
_MAX_READ_BYTES = 1 << 20


def flag_value(argv: Sequence[str], flags: Sequence[str]) -> str | None:
    """The value of the first of `flags` on the command line (`--flag v` or `--flag=v`)."""
    for index, argument in enumerate(argv):
        name, equals, value = argument.partition("=")
        if name not in flags:
            continue
        if equals:
            return value or None
        following = argv[index + 1] if index + 1 < len(argv) else ""
        return following if following and not following.startswith("-") else None
    return None


def model_argument(argv: Sequence[str]) -> str | None:
    """The served model: `--model M`, else the first argument after `serve`."""
    named = flag_value(argv, ("--model",))
    if named:
        return named
    if "serve" in argv:
        following = argv[argv.index("serve") + 1 :]
        if following and not following[0].startswith("-"):
            return following[0]
    return None


class ServerConfigReader:
    """Reads the topology of the server process `pid` from its stage config, if it has one."""

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self._proc = proc

    def read(self, pid: int) -> Topology | None:
        """The server's stage config as a topology (SERVER_CONFIG origin), or None. A
        headless stage server (`--headless --stage-id N`) runs stage N only: the other
        stages of its config run on other hosts and are not its watchdog's."""
        try:
            argv = self._read(pid, "cmdline").decode(errors="replace").split("\0")
        except OSError:
            return None
        topology = self._read_topology(pid, argv)
        stage_id = flag_value(argv, ("--stage-id",))
        if topology is None or "--headless" not in argv or stage_id is None:
            return topology
        own = tuple(stage for stage in topology.stages if str(stage.stage_id) == stage_id)
        if not own:
            return None
        # Its neighbours are elsewhere: edges to them name nothing this host runs.
        alone = replace(own[0], upstream=(), downstream=())
        return replace(topology, stages=(alone,))

    def _read_topology(self, pid: int, argv: Sequence[str]) -> Topology | None:
        named = flag_value(argv, CONFIG_FLAGS)
        if named is not None:
            return self._load(pid, named, f"cmdline:{named}")
        if "--omni" not in argv:
            return None
        model = model_argument(argv)
        model_type = self._model_type(pid, model) if model else None
        if model_type is None:
            return None
        for packages in self._package_dirs(pid):
            path = f"{packages}/{PACKAGE_CONFIGS}/{model_type}.yaml"
            if self._in_server(pid, path).is_file():
                return self._load(pid, path, f"package:{path}")
        return None

    def _load(self, pid: int, path: str, source: str) -> Topology | None:
        try:
            topology = load_topology(self._in_server(pid, path), source=source)
        except TopologyError as error:
            log.warning("the server's stage config is not usable: %s", error)
            return None
        return replace(topology, origin=TopologyOrigin.SERVER_CONFIG)

    def _in_server(self, pid: int, path: str) -> Path:
        """`path` as the server process sees it, from this side."""
        if path.startswith("/"):
            return self._proc / str(pid) / "root" / path.lstrip("/")
        return self._proc / str(pid) / "cwd" / path

    def _read(self, pid: int, name: str) -> bytes:
        with (self._proc / str(pid) / name).open("rb") as file:
            return file.read(_MAX_READ_BYTES)

    def _model_type(self, pid: int, model: str) -> str | None:
        """`model_type` of the model's config.json: a local directory, else the Hugging
        Face cache named by the server's environment."""
        candidates = [self._in_server(pid, f"{model}/config.json")]
        cache = self._hub_cache(pid)
        if cache is not None and not model.startswith((".", "/")):
            snapshots = self._in_server(pid, f"{cache}/models--{model.replace('/', '--')}")
            candidates.extend(sorted((snapshots / "snapshots").glob("*/config.json")))
        for candidate in candidates:
            try:
                with candidate.open("rb") as file:
                    document = json.loads(file.read(_MAX_READ_BYTES))
            except (OSError, ValueError):
                continue
            model_type = document.get("model_type") if isinstance(document, dict) else None
            if isinstance(model_type, str) and _MODEL_TYPE.fullmatch(model_type):
                return model_type
        return None

    def _hub_cache(self, pid: int) -> str | None:
        try:
            entries = self._read(pid, "environ").decode(errors="replace").split("\0")
        except OSError:
            return None
        environ = dict(entry.partition("=")[::2] for entry in entries if "=" in entry)
        if environ.get("HF_HUB_CACHE"):
            return environ["HF_HUB_CACHE"]
        if environ.get("HF_HOME"):
            return f"{environ['HF_HOME']}/hub"
        if environ.get("HOME"):
            return f"{environ['HOME']}/.cache/huggingface/hub"
        return None

    def _package_dirs(self, pid: int) -> list[str]:
        """The package directories the server loaded native code from (vLLM's and torch's
        extensions are mapped), where an installed vLLM-Omni sits beside them."""
        try:
            maps = self._read(pid, "maps").decode(errors="replace")
        except OSError:
            return []
        found: list[str] = []
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)
            path = fields[5] if len(fields) == 6 else ""
            for marker in _PACKAGE_ROOTS:
                if marker in path:
                    packages = path[: path.index(marker) + len(marker) - 1]
                    if packages not in found:
                        found.append(packages)
        return found
