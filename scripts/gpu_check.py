"""The GPU check: real NVML attributes a hung child's CUDA memory, the ladder frees it.

A stand-in server (an HTTP front like vLLM's whose work never progresses) starts a child
that allocates CUDA memory with torch and blocks forever on a queue, the way a vLLM-Omni
0.11 stage worker does after its engine died. The watchdog, with the real pynvml, must
attribute the memory to that child, judge the stage stalled, kill the tree, and see the
memory come back. Needs an NVIDIA GPU, torch with CUDA, and this project's dependencies.

    python scripts/gpu_check.py            # run the check; exit 0 only when memory came back
    python scripts/gpu_check.py --serve P  # (internal) the stand-in server on port P
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omni_watchdog.app import Watchdog

HOLD_BYTES = 2 * 2**30


def hold_cuda_memory(ready: multiprocessing.Queue, never: multiprocessing.Queue) -> None:
    import torch

    block = torch.empty(HOLD_BYTES, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    ready.put(block.numel())
    never.get()  # blocks forever, holding the memory, like a stage worker after its engine died


def serve(port: int) -> None:
    from aiohttp import web

    context = multiprocessing.get_context("spawn")
    ready, never = context.Queue(), context.Queue()
    context.Process(target=hold_cuda_memory, args=(ready, never), daemon=False).start()
    ready.get(timeout=120)
    page = (
        '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0"} 1\n'
        "# TYPE vllm:generation_tokens_total counter\n"
        'vllm:generation_tokens_total{engine="0"} 5\n'
    )

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=page)

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "hung", "object": "model"}]})

    async def chat(_: web.Request) -> web.Response:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    web.run_app(app, host="127.0.0.1", port=port, print=None)


async def check() -> int:
    import subprocess

    from omni_watchdog.app import Watchdog
    from omni_watchdog.clock import SystemClock
    from omni_watchdog.config import load_config
    from omni_watchdog.demo import closed_incident, timeline, wait_for
    from omni_watchdog.sim.launcher import free_port

    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="omni-watchdog-gpu-check-"))
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(port)], start_new_session=True
    )
    config = load_config(
        environ={},
        overrides={
            "target": f"http://127.0.0.1:{port}",
            "mode": "enforce",
            "listen": "127.0.0.1:0",
            "state_dir": str(workdir),
            "spans": {"otlp_listen": "127.0.0.1:0"},
            "probes": {"gpu_backend": "nvml", "canary_interval": "2s", "canary_deadline": "2s"},
            "detection": {"startup_grace": "1s", "progress_timeout": "3s"},
        },
    )
    watchdog = Watchdog(config, SystemClock())
    await watchdog.start()
    try:
        holder = await wait_for(lambda: _holder(watchdog), 180)
        print(f"NVML: pid {holder[0]} holds {holder[1] / 2**20:.0f} MiB, attributed to {holder[2]}")
        incident = await wait_for(lambda: closed_incident(watchdog), 60)
        for line in timeline(incident, None, "hung CUDA child"):
            print(line)
        after = await watchdog.read_gpu()
        still = after.used_by_pid.get(holder[0], 0.0) if after else None
        print(json.dumps({"outcome": incident.outcome.value, "pid_memory_after": still}))
        released = incident.outcome.value.startswith("recovered") and not still
        return 0 if released else 1
    finally:
        await watchdog.stop()
        if server.poll() is None:
            server.kill()  # only if the ladder failed: the check's own child
        server.wait(timeout=10)


def _holder(watchdog: Watchdog) -> tuple[int, float, str] | None:
    if watchdog.gpu is None:
        return None
    reading = watchdog.gpu.last_snapshot()
    for device in reading.get("devices", []):
        for process in device["processes"]:
            if process["used_bytes"] >= HOLD_BYTES and process["stage"]:
                return process["pid"], process["used_bytes"], process["stage"]
    return None


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--serve":
        serve(int(sys.argv[2]))
    else:
        started = time.monotonic()
        code = asyncio.run(check())
        print(
            f"gpu check {'passed' if code == 0 else 'FAILED'} in {time.monotonic() - started:.1f}s"
        )
        sys.exit(code)
