"""Where a benchmark ran: the machine, the versions of what it ran with, the GPUs it may use."""

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
