"""How long one host-side torch operation takes beside busy processes, in torch's default threads and in one.

A GPU machine's host is shared by every process of a stack: the frontend's media threads, the encoders,
the language workers, each with its own threads. torch runs a large CPU operation as a parallel region
over ``torch.get_num_threads()`` threads (by default one per core), and the region ends when its
slowest thread does: a thread the kernel has descheduled for another process stalls it. On the H200
machine an E/PD encoder's host-side stack of ten pulled 448² images took 77-86 ms a forward under a
Dynamo-1024 load (``vit_forward_prep``), against ~5 ms for the whole launch before it stacked them.

Here the same operation (``torch.stack`` of ten [448, 448, 3] uint8 images, 6 MB) is timed alone and
beside ``--busy`` processes that spin on the CPU, in torch's default threads and in one (what a service
on a GPU now runs with: ``EPD_TORCH_THREADS``).

    python bench/busy_host_threads.py --out bench/results/busy_host_threads-cpu.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

MEASURE = """
import sys, time, torch
threads = int(sys.argv[1])
if threads:
    torch.set_num_threads(threads)
images = [torch.randint(0, 256, (448, 448, 3), dtype=torch.uint8) for _ in range(10)]
for _ in range(3):
    torch.stack(images)
ms = []
for _ in range(int(sys.argv[2])):
    started = time.perf_counter()
    torch.stack(images)
    ms.append((time.perf_counter() - started) * 1e3)
    time.sleep(0.01)  # as a service between forwards: its threads go idle
print(torch.get_num_threads(), *ms)
"""


def _spin() -> None:
    while True:
        pass


def _measure(threads: int, repeats: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run([sys.executable, "-c", MEASURE, str(threads), str(repeats)], capture_output=True,
                          text=True, check=True, env=env, timeout=600)
    used, *ms = done.stdout.split()
    ms = sorted(float(x) for x in ms)
    return {"threads": int(used), "median_ms": statistics.median(ms), "p90_ms": ms[int(len(ms) * 0.9)],
            "max_ms": ms[-1]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--busy", type=int, default=0, help="spinning processes beside (default: 2 per core)")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    busy = args.busy or 2 * (os.cpu_count() or 1)
    rows = []
    for load in (0, busy):
        spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(load)]
        for p in spinners:
            p.start()
        try:
            for threads in (0, 1):
                row = {"busy_processes": load, **_measure(threads, args.repeats)}
                rows.append(row)
                print(f"busy {load:3d}  threads {row['threads']:3d}  median {row['median_ms']:7.2f} ms  "
                      f"p90 {row['p90_ms']:7.2f}  max {row['max_ms']:7.2f}", flush=True)
        finally:
            for p in spinners:
                p.kill()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        import torch

        Path(args.out).write_text(json.dumps({"cpus": os.cpu_count(), "platform": platform.platform(),
                                              "python": platform.python_version(), "torch": torch.__version__,
                                              "command": " ".join(sys.argv), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
