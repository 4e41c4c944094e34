"""`make bench`: every benchmark, one after another; each writes its section of RESULTS.md."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHMARKS = [
    "bench_ingest.py",
    "bench_scrape.py",
    "bench_detection.py",
    "bench_remote_stage.py",
    # Needs root: lab hosts in network namespaces.
    "bench_partitions.py",
    "bench_soak.py",
    "bench_overhead.py",
    "bench_memory.py",
    "bench_idle.py",
    "bench_hostile.py",
    "bench_hostile_stalls.py",
    # The real servers, about 40 minutes on two cores; skipped without their environments.
    "bench_real_omni.py",
    "bench_real_diffusion.py",
]


def main() -> int:
    missed = []
    for name in BENCHMARKS:
        print(f"== {name}", flush=True)
        if subprocess.call([sys.executable, str(HERE / name)], cwd=HERE) != 0:
            missed.append(name)
    print((HERE / "RESULTS.md").read_text())
    if missed:
        print(f"targets missed in: {', '.join(missed)}", file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
