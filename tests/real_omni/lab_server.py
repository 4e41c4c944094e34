"""The real vLLM-Omni 0.30 (CPU) in the lab hosts of `netlab`, in place of the image.

The real counterparts of `netlab.lab.simulated` and `simulated_devices`: each host's
`vllm` container runs the `vllm serve` of `.venv-omni` on the tiny local model with the
harness's deploy file, keeping the manifest's flags that place it (`--host`, `--port`,
`--stage-id`, `--headless`, `--omni-master-address`, `--omni-master-port`) and the
manifest's environment (the plugin's endpoints and tokens), as `real_omni.server` and
`real_omni.headless` start it on loopback; the head's coordinator evicts a silent replica
after `evict_after`. No host has a GPU: each watchdog's GPU probe is off.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from netlab import scenarios
from netlab.lab import Lab, LabHost, ServerCommand, ServerFactory, running_lab
from netlab.layout import placing_flags
from real_omni.server import DEPLOY_FILE, omni_environment, omni_serve
from real_vllm.server import MODEL_NAME, POLLING_LINE, start_ready, worker_cpu


def real_omni(model: Path, evict_after: float, scratch: Path) -> ServerFactory:
    """vLLM-Omni 0.30 on `model` in each host; the head evicts a replica silent for
    `evict_after`; `scratch`: a short directory for each host's TMPDIR (vLLM puts ZMQ
    sockets there, whose paths must stay under 108 bytes)."""

    def server(host: LabHost, args: list[str], env: dict[str, str]) -> ServerCommand:
        flags = placing_flags(args)
        if "--headless" not in flags:
            flags += [
                "--served-model-name",
                MODEL_NAME,
                "--omni-heartbeat-timeout",
                f"{evict_after:g}",
            ]
        temporary = scratch / host.name
        temporary.mkdir(parents=True, exist_ok=True)
        # Beside the manifest's environment, which the lab keeps (the plugin's OTLP
        # endpoints and tokens, the host's name): what `real_vllm.server.launch` gives
        # every vLLM it starts, and the import shim. All but `VLLM_PORT`: each host is a
        # network namespace of its own, where no other test binds, and with `VLLM_PORT`
        # set the head's master cannot take a registration after an eviction. It draws
        # each new replica's three ports as the lowest free ones from `VLLM_PORT` up and
        # skips those it ever handed out; the evicted replica's three are free again and
        # lowest, so every draw is the same three, and after 64 the master's thread dies
        # ("Could not allocate 3 unique open ports"; `_alloc_unique_ports` in vLLM-Omni
        # 0.30's `engine/stage_engine_startup.py`): port 25000 refuses from then on. The
        # kernel's random ports never repeat so.
        extra = omni_environment(
            {
                "VLLM_CACHE_ROOT": str(host.workdir / "vllm-cache"),
                "TORCHINDUCTOR_CACHE_DIR": str(host.workdir / "inductor-cache"),
                "TMPDIR": str(temporary),
                "VLLM_CPU_OMP_THREADS_BIND": worker_cpu(),
                # The plugin's heartbeat, as fast as the tests' short heartbeat_timeout
                # needs (the simulated tier's SIM_ENV).
                "OMNI_WATCHDOG_HEARTBEAT_INTERVAL": "0.5",
            }
        )
        assert not set(extra) & set(env), f"would replace the manifest's {set(extra) & set(env)}"
        return ServerCommand(omni_serve(model, DEPLOY_FILE, *flags), extra)

    return server


def no_gpu(host: LabHost) -> dict[str, str]:
    """No host here has a GPU: the watchdog's GPU probe is off, as in every real-server
    test (`real_vllm.server.REAL_FAST`)."""
    return {"OMNI_WATCHDOG_PROBES_GPU_BACKEND": "none"}


@dataclass
class _StartingLab:
    """A lab whose servers are starting, in the shape `start_ready` takes."""

    lab: Lab
    stack: contextlib.ExitStack

    async def wait_ready(self, timeout: float) -> None:
        await scenarios.wait_well(self.lab, timeout)

    def stop(self) -> None:
        self.stack.close()


@contextlib.contextmanager
def real_lab(
    workdir: Path,
    settings: Mapping[str, Any],
    model: Path,
    evict_after: float,
    ready_timeout: float,
) -> Iterator[Lab]:
    """The shipped multi-host layout running the real vLLM-Omni, every host well (see
    `netlab.scenarios.everything_well`); started under the run's lock that real servers
    start under, since three of them starting at once starve whatever runs beside them.
    Everything of it is gone on exit, processes, namespaces and scratch directories."""
    scratch = Path(tempfile.mkdtemp(prefix="owd-lab-"))

    def start() -> _StartingLab:
        stack = contextlib.ExitStack()
        stack.callback(shutil.rmtree, scratch, ignore_errors=True)
        try:
            lab = stack.enter_context(
                running_lab(workdir, settings, real_omni(model, evict_after, scratch), no_gpu)
            )
        except BaseException:
            stack.close()
            raise
        return _StartingLab(lab, stack)

    started = start_ready(start, ready_timeout, alone=True)
    try:
        yield started.lab
    finally:
        started.stop()


def host_logs(lab: Lab, chars: int = 2500) -> str:
    """The tails of each host's logs and its init's events, for a failed test."""
    parts = []
    for host in lab.hosts:
        for name in ("events.jsonl", "watchdog.log", "server.log"):
            path = host.workdir / name
            lines = path.read_text(errors="replace").splitlines() if path.exists() else []
            # The watchdog's polling of /health and /metrics fills the server's log.
            told = "\n".join(line for line in lines if not POLLING_LINE.search(line))
            text = told[-chars:] or "(none)"
            parts.append(f"-- {host.name} {name}:\n{text}")
    return "\n".join(parts)


def run_scenario(lab: Lab, partition: scenarios.Partition, settle: float) -> scenarios.Outcome:
    return asyncio.run(scenarios.run(lab, partition, settle))
