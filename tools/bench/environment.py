"""Where a benchmark ran: the machine, how fast its host is, the versions of what it ran with, the GPUs it may
use."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from importlib import metadata


def hardware() -> str:
    """The GPUs (name, memory, driver) nvidia-smi lists, else the CPU."""
    if shutil.which("nvidia-smi"):
        found = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True).stdout.strip()
        if found:
            return found.replace("\n", "; ")
    return f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def host() -> dict:
    """The host beside the GPUs, and how fast it is now. Two machines of the same kind (same GPU, driver and
    core count) ran the same stack 45–55 % apart, the frontend's image decode twice as long on the slower
    (docs/benchmarks.md, "Machines, models, reading the figures"): so a run records its CPU, the cores it may use, the GPU's clocks
    and two single-thread probes, a pure-Python loop and the floor's own media probe (the frontend's decoder
    on one 448² JPEG), to tell the machines of two runs apart."""
    import torch

    from tools.plan.costs import Timer, measure_media

    loop_ms = Timer(torch.device("cpu")).ms(lambda: sum(i * i for i in range(1_000_000)), repeat=5)
    out = {"cpu": _cpu_model(), "cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
           "probe_ms": {"python_loop_1e6": round(loop_ms, 3),
                        "jpeg_decode_448": round(measure_media(448, 448, "jpeg"), 3)}}
    if shutil.which("nvidia-smi"):
        out["gpu_clocks"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm,clocks.mem,clocks_throttle_reasons.active",
             "--format=csv,noheader"], capture_output=True, text=True).stdout.strip().replace("\n", "; ")
    return out


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or platform.machine()


def versions() -> dict[str, str]:
    """Python and the packages whose versions move the figures."""
    out = {"python": platform.python_version()}
    for name in ("torch", "triton", "transformers", "httpx", "nats-py", "pyzmq", "ucxx-cu13", "ucxx-cu12"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def visible_gpus() -> int:
    """GPUs this process may use (nvidia-smi's, within CUDA_VISIBLE_DEVICES); 0 without a GPU."""
    if not shutil.which("nvidia-smi"):
        return 0
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    count = len(re.findall(r"^GPU \d+", listed, flags=re.M))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return min(count, len(visible.split(","))) if visible else count
