#!/usr/bin/env python3
"""CPU seconds each service process spends from its start to ready, on the tiny test checkpoint.

The test suite starts dozens of stacks on a couple of cores, and ``epd up`` users wait for them: what a
process burns before it can serve is paid by every other process on the machine. CPU time (user + sys of
the process and its waited-for children, from ``/proc``), not wall time: it does not move when another
job shares the cores.

Each kind starts alone on a NATS server of its own (the environment is the tests': one intra-op thread,
Triton's interpreter without a GPU), and counts as ready once it answers the NATS service API's PING: a
service subscribes that only when it can serve. Its CPU time is read at that moment, and it is stopped.
The figure per kind is the median of ``--repeats`` starts.

    python bench/startup.py                       # every kind, 3 starts each
    python bench/startup.py --kinds encoder frontend --repeats 5 --out /tmp/startup.json
    python bench/startup.py --kinds encoder aggregated --env EPD_PREPROCESS=torch   # as on a GPU
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nats
from nats.errors import NoRespondersError, TimeoutError as NatsTimeout

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from launcher.natsserver import EmbeddedNats  # noqa: E402
from launcher.processes import die_with_parent  # noqa: E402
from launcher.topology import KINDS  # noqa: E402
from tools.bench.environment import hardware, versions  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")
POLL_SECONDS = 0.02  # between PINGs: the CPU a ready process spends idling this long is noise


def cpu_seconds(pid: int) -> float:
    """user + sys of ``pid`` and its reaped children (``/proc/<pid>/stat`` fields 14-17, in clock ticks)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": field 3 is fields[0]
    return sum(int(f) for f in fields[11:15]) / TICKS


async def wait_listed(nats_url: str, kind: str, process: subprocess.Popen, timeout: float) -> float:
    """Poll ``$SRV.PING.epd-<kind>`` until the process answers; its CPU seconds at that moment."""
    nc = await nats.connect(nats_url)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"the {kind} process exited with status {process.returncode}")
            try:
                await nc.request(f"$SRV.PING.epd-{kind}", b"", timeout=0.5)
                return cpu_seconds(process.pid)
            except (NoRespondersError, NatsTimeout):
                await asyncio.sleep(POLL_SECONDS)
        raise TimeoutError(f"the {kind} process was not ready in {timeout:g}s")
    finally:
        await nc.close()


def start_once(kind: str, env: dict[str, str], timeout: float) -> tuple[float, float]:
    """One process of ``kind`` from start to ready: (CPU seconds, wall seconds)."""
    started = time.monotonic()
    process = subprocess.Popen([sys.executable, "-m", f"services.{kind}"], env=env, cwd=ROOT,
                               preexec_fn=die_with_parent)
    try:
        cpu = asyncio.run(wait_listed(env["EPD_NATS_URL"], kind, process, timeout))
        return cpu, time.monotonic() - started
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def service_env(nats_url: str, model: Path, prefix: str, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    env.setdefault("OMP_NUM_THREADS", "1")  # as the tests run them
    env.update({"EPD_MODEL": str(model), "EPD_NATS_URL": nats_url, "EPD_SUBJECT_PREFIX": prefix,
                "EPD_KV_CACHE_MB": "64", "EPD_LOG_LEVEL": "warning", **extra})
    if not _cuda_available():
        env.setdefault("TRITON_INTERPRET", "1")
    return env


@functools.cache  # a child that imports torch: once a run, not once a start
def _cuda_available() -> bool:
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([sys.executable, "-c", probe]).returncode == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds one start may take")
    parser.add_argument("--env", nargs="*", default=[], metavar="EPD_X=VALUE",
                        help="settings for every process (EPD_PREPROCESS=torch: encoders as on a GPU)")
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = parser.parse_args()
    extra = dict(item.split("=", 1) for item in args.env)

    from shared.model.tiny import write_tiny_checkpoint

    with tempfile.TemporaryDirectory(prefix="epd-startup-") as tmp, EmbeddedNats() as server:
        model = write_tiny_checkpoint(Path(tmp) / "tiny")
        results = {}
        for kind in args.kinds:
            runs = [start_once(kind, service_env(server.url, model, f"s{kind[:3]}{i}", extra), args.timeout)
                    for i in range(args.repeats)]
            cpu = [c for c, _ in runs]
            results[kind] = {"cpu_s_median": round(statistics.median(cpu), 2), "cpu_s": [round(c, 2) for c in cpu],
                             "wall_s": [round(w, 2) for _, w in runs]}
            print(f"{kind:<11} CPU {statistics.median(cpu):5.2f} s (median of {cpu})", flush=True)
    report = {"hardware": hardware(), "versions": versions(), "repeats": args.repeats, "env": extra,
              "results": results}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
