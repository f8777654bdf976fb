"""``service_main``, the entry point of every service process: what it sets up before the service runs."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = """
import sys
from shared.service import service_main
from shared.settings import CommonSettings

class Probe:
    kind = "probe"
    uses_torch = True

    def __init__(self, settings):
        pass

    async def run(self):
        import torch

        print(torch.get_num_threads())

service_main(Probe, CommonSettings, sys.argv[1:])
"""


def _threads(env: dict) -> int:
    """The probe service's torch threads (the suite's OMP_NUM_THREADS left out)."""
    base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60,
                          env={**base, **env})
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split()[-1])


def test_a_gpu_service_runs_torch_in_one_cpu_thread_unless_told():
    """On a GPU a service's torch runs one CPU thread an operation (its compute is on the device; a parallel
    region stalls on a busy host); on a CPU torch keeps its own default; OMP_NUM_THREADS says otherwise."""
    def plain(env: dict) -> int:  # torch's own choice, no service around it
        base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        return int(subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                                  capture_output=True, text=True, timeout=60, env={**base, **env}).stdout)

    assert _threads({"EPD_DEVICE": "cuda"}) == 1  # the device is only named: the probe starts no CUDA
    assert _threads({"EPD_DEVICE": "cpu"}) == plain({})
    omp = {"OMP_NUM_THREADS": "2"}
    assert _threads({"EPD_DEVICE": "cuda", **omp}) == plain(omp) > 1
