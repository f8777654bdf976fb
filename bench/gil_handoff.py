"""How long a service's event loop waits for the interpreter while an engine thread beside it runs Python.

A process with an engine thread (the aggregated worker, the language workers) hands every result to its
asyncio loop through ``call_soon_threadsafe``; each hop — a ViT result settled, an encode job's reply
sent, the prompt received — needs the GIL. While the engine thread runs Python (scheduling, staging,
eager launches) without a blocking call, CPython hands the GIL over only every ``sys.getswitchinterval()``
(5 ms by default). Here a thread stands in for the engine: ``busy`` ms of Python, then ``wait`` ms in a
call that releases the GIL (the step's GPU sync); the loop times a hop from another thread's
``call_soon_threadsafe`` to its coroutine resuming, at several switch intervals (``EPD_SWITCH_INTERVAL_MS``).

    python bench/gil_handoff.py --out bench/results/gil_handoff-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path


def _engine(stop: threading.Event, busy_s: float, wait_s: float) -> None:
    while not stop.is_set():
        started = time.perf_counter()
        while time.perf_counter() - started < busy_s:
            sum(range(200))  # Python work: holds the GIL
        if wait_s:
            time.sleep(wait_s)  # releases it, as a CUDA sync does


async def _hops(busy_s: float, wait_s: float, hops: int) -> list[float]:
    loop = asyncio.get_running_loop()
    stop = threading.Event()
    engine = threading.Thread(target=_engine, args=(stop, busy_s, wait_s), daemon=True)
    engine.start()
    ms = []
    try:
        for _ in range(hops):
            future, sent = loop.create_future(), time.perf_counter()
            threading.Thread(target=loop.call_soon_threadsafe, args=(future.set_result, None)).start()
            await future
            ms.append((time.perf_counter() - sent) * 1e3)
            await asyncio.sleep(0.003)
    finally:
        stop.set()
        engine.join()
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--intervals", default="5,1,0.5,0.2", help="switch intervals to try (ms)")
    parser.add_argument("--loads", default="2/8,8/2,10/0", help="engine thread's busy/wait ms per step")
    parser.add_argument("--hops", type=int, default=200)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    before, rows = sys.getswitchinterval(), []
    try:
        for interval in (float(v) for v in args.intervals.split(",")):
            sys.setswitchinterval(interval / 1e3)
            for load in args.loads.split(","):
                busy, wait = (float(v) for v in load.split("/"))
                ms = sorted(asyncio.run(_hops(busy / 1e3, wait / 1e3, args.hops)))
                row = {"switch_interval_ms": interval, "busy_ms": busy, "wait_ms": wait,
                       "hop_mean_ms": statistics.mean(ms), "hop_p90_ms": ms[int(0.9 * len(ms))]}
                rows.append(row)
                print(f"switch interval {interval:g} ms, engine thread {busy:g} ms busy / {wait:g} ms waiting: "
                      f"hop mean {row['hop_mean_ms']:.2f} ms, p90 {row['hop_p90_ms']:.2f} ms", flush=True)
    finally:
        sys.setswitchinterval(before)
    if args.out:
        Path(args.out).write_text(json.dumps({"python": sys.version.split()[0], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
