"""The plugin's CPU per image of a diffusion stage, measured in one process.

Run by `bench_real_diffusion.py` with the real vLLM-Omni environment's Python (torch, the
plugin, the OpenTelemetry SDK), exporting to a watchdog's receiver of its own. An image
is what the plugin sees of one on a one-stage server: the request admitted, a batch begun,
one call of the DiT a step through its pre-hook, the batch ended (its request span), the
stage's span and the request finished; the bare image is the same DiT calls with no hook
and no span. Blocks of each alternate; the figure is the median of the per-block
differences of the process's CPU time (all its threads: the telling thread, the span
processor and the exporter's) per image, in microseconds, printed as JSON.

    python diffusion_plugin_cost.py STEPS IMAGES BLOCKS
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
from torch import nn

from omni_watchdog.instrument.diffusion import DenoisingProgress
from omni_watchdog.instrument.hooks import HookContext, ProcessIdentity
from omni_watchdog.instrument.telemetry import SCHEDULE_DELAY_S, StageTelemetry


class TinyDiT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(16, 16)
        self.outer = nn.Linear(16, 16)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        return self.outer(torch.relu(self.inner(latents)))


def images(dit: TinyDiT, steps: int, count: int, telemetry: StageTelemetry | None) -> float:
    """CPU seconds of the process for `count` images of `steps` DiT calls, and for as long
    after them as the span processor takes to export what they queued (its schedule, and
    a margin): a block's spans are paid for in that block."""
    progress = getattr(dit, "progress", None)
    latents = torch.zeros(1, 16)
    began = time.process_time()
    for index in range(count):
        request_id = f"img-{index}"
        start_ns = time.time_ns()
        if telemetry is not None and progress is not None:
            telemetry.request_admitted(request_id, [0])
            progress.begin([(request_id, steps)])
        for _ in range(steps):
            dit(latents)
        if telemetry is not None and progress is not None:
            progress.end(None)
            telemetry.record_stage_request(request_id, start_ns, time.time_ns(), stage_id=0)
            telemetry.request_finished(request_id)
    time.sleep(SCHEDULE_DELAY_S + 0.5)
    return time.process_time() - began


def main() -> None:
    steps, count, blocks = (int(argument) for argument in sys.argv[1:4])
    torch.set_num_threads(1)
    telemetry = StageTelemetry.from_environment(process_kind="stage", stage_id=0, replica=0)
    if not telemetry.enabled:
        raise SystemExit("no receiver configured: OMNI_WATCHDOG_OTLP_ENDPOINT")
    identity = ProcessIdentity("stage", 0, 0)
    context = HookContext(lambda _: telemetry, lambda: identity)
    hooked, bare = TinyDiT(), TinyDiT()
    progress = DenoisingProgress(telemetry, context)
    hooked.progress = progress  # type: ignore[assignment]
    hooked.register_forward_pre_hook(lambda _module, _arguments: progress.count_step())
    images(hooked, steps, count, telemetry)  # warm both
    images(bare, steps, count, None)
    differences = []
    for block in range(blocks):
        if block % 2 == 0:
            with_plugin = images(hooked, steps, count, telemetry)
            without = images(bare, steps, count, None)
        else:
            without = images(bare, steps, count, None)
            with_plugin = images(hooked, steps, count, telemetry)
        differences.append((with_plugin - without) / count * 1e6)
    telemetry.shutdown()
    print(json.dumps({"plugin_us_per_image": statistics.median(differences)}))


if __name__ == "__main__":
    main()
