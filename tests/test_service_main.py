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

    def __init__(self, settings):
        pass

    async def run(self):
        import torch

        print(sys.getswitchinterval(), torch.get_num_threads())

service_main(Probe, CommonSettings, sys.argv[1:])
"""


def _probe(*args: str, env: dict | None = None) -> tuple[float, int]:
    """The probe service's switch interval and torch threads (the suite's OMP_NUM_THREADS left out)."""
    base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=60,
                          env={**base, **(env or {})})
    assert done.returncode == 0, done.stderr[-2000:]
    interval, threads = done.stdout.split()[-2:]
    return float(interval), int(threads)


def _interval(*args: str, env: dict | None = None) -> float:
    return _probe(*args, env=env)[0]


def test_the_switch_interval_comes_from_the_settings():
    """EPD_SWITCH_INTERVAL_MS (or --switch-interval-ms) sets how often the interpreter hands the GIL over;
    by default CPython's own 5 ms."""
    assert abs(_interval() - 0.005) < 1e-9
    assert abs(_interval(env={"EPD_SWITCH_INTERVAL_MS": "0.5"}) - 0.0005) < 1e-9
    assert abs(_interval("--switch-interval-ms", "1") - 0.001) < 1e-9


def test_a_gpu_service_runs_torch_in_one_cpu_thread_unless_told():
    """On a GPU a service's torch runs one CPU thread an operation (its compute is on the device; a parallel
    region stalls on a busy host); on a CPU torch keeps its own default; EPD_TORCH_THREADS and
    OMP_NUM_THREADS say otherwise."""
    def plain(env: dict) -> int:  # torch's own choice, no service around it
        base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        return int(subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                                  capture_output=True, text=True, timeout=60, env={**base, **env}).stdout)

    assert _probe(env={"EPD_DEVICE": "cuda"})[1] == 1  # the device is only named: the probe starts no CUDA
    assert _probe(env={"EPD_DEVICE": "cpu"})[1] == plain({})
    assert _probe("--torch-threads", "3", env={"EPD_DEVICE": "cuda"})[1] == 3
    omp = {"OMP_NUM_THREADS": "2"}
    assert _probe(env={"EPD_DEVICE": "cuda", **omp})[1] == plain(omp) > 1
