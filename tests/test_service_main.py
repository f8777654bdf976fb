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
        print(sys.getswitchinterval())

service_main(Probe, CommonSettings, sys.argv[1:])
"""


def _interval(*args: str, env: dict | None = None) -> float:
    done = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr[-2000:]
    return float(done.stdout.split()[-1])


def test_the_switch_interval_comes_from_the_settings():
    """EPD_SWITCH_INTERVAL_MS (or --switch-interval-ms) sets how often the interpreter hands the GIL over;
    by default CPython's own 5 ms."""
    assert abs(_interval() - 0.005) < 1e-9
    assert abs(_interval(env={"EPD_SWITCH_INTERVAL_MS": "0.5"}) - 0.0005) < 1e-9
    assert abs(_interval("--switch-interval-ms", "1") - 0.001) < 1e-9
