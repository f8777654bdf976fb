#!/usr/bin/env python3
"""The path a user takes, checked: each layout started with default flags on empty caches, a client that
sends the moment ``/v1/models`` answers, mixed traffic, then Ctrl-C. One line per check.

For each layout (``aggregated``; ``joined``: colocated E/PD, the default; ``split``: colocated E/P/D):
1. ``epd up`` starts in a process group of its own, as a terminal starts it, with only ``--model`` (and
   ``--load-format dummy`` for a preset) and a port: no tuning flag. ``--cold`` (the default) gives every
   layout fresh cache directories (``XDG_CACHE_HOME``, ``TRITON_CACHE_DIR``), as on a fresh machine.
2. A client polls ``/v1/models`` every 0.1 s and fires a burst (text and image requests) the moment it
   answers: every one must succeed.
3. Two windows of Poisson mixed traffic (a chat app's: 40 % text, 60 % one or two images, 30 % of images
   repeated), the same arrival times and request shapes in both, other images and text in the second (no
   cache hit across them): the first window's p99 TTFT within 1.3× of the second's says nothing compiles
   or plans while serving; Triton compiles logged after the API answered are counted too (none expected).
4. The GPU memory each process took (its own ``service.ready`` line, and nvidia-smi where it answers).
5. SIGINT to the whole process group (Ctrl-C): the launcher exits 0, every service logged
   ``service.stopped``, nothing aborted, no process of the group is left.
``--warm-restart joined`` starts that layout once more on the caches its first start filled (the warm start).

    python bench/gpu_smoke.py --model qwen2.5-vl-7b --out /tmp/smoke
    python bench/gpu_smoke.py --model qwen3-vl-30b-a3b --layouts joined,split --warm-restart joined
    python bench/gpu_smoke.py --tiny --layouts joined      # CPU, the built-in model (tests/test_bench_scripts.py)

``--tiny`` reports the window ratio without judging it: four requests a window, their TTFTs tens of ms on a
shared CPU, measure the machine's noise (37 / 26 ms once), not a warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.bench.environment import hardware, versions  # noqa: E402
from tools.bench.dataset import build_requests  # noqa: E402
from tools.bench.metrics import summarize  # noqa: E402
from tools.bench.runner import LoadGenerator, arrival_times, prepare  # noqa: E402
from tools.bench.settings import BenchSettings  # noqa: E402
from tools.bench.stack import StackProcess  # noqa: E402

LAYOUTS = {"aggregated": ["--topology", "aggregated"], "joined": [], "split": ["--pd", "split"]}
ABORTS = ("terminate called", "Aborted", "core dumped", "Traceback", "cudaErrorMpsRpcFailure")
WINDOW_RATIO = 1.3  # the first window's p99 TTFT over the second's, at most


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stack_env(cache: Path | None) -> dict[str, str]:
    env = {**os.environ, "EPD_LOG_FORMAT": "json", "PYTHONUNBUFFERED": "1"}
    env.pop("EPD_GPU_MEMORY_UTILIZATION", None)  # defaults, as a user starts it
    if cache is not None:
        env.update(XDG_CACHE_HOME=str(cache), TRITON_CACHE_DIR=str(cache / "triton"))
    return env


async def wait_models(base: str, process: subprocess.Popen, timeout: float) -> float:
    """Poll /v1/models as a client does; the monotonic time it first answered 200."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=2) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"epd up exited with status {process.returncode} before serving")
            try:
                if (await client.get(f"{base}/models")).status_code == 200:
                    return time.monotonic()
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"/v1/models did not answer within {timeout:g} s")


def load(base: str, args, count: int, rate: float, seed: int) -> BenchSettings:
    return BenchSettings(base_url=base, num_prompts=count, request_rate=rate, warmup=0, seed=seed,
                         input_len=args.input_len, output_len=args.output_len, image_count=2,
                         random_image_count=True, image_resolution=args.resolution, text_ratio=0.4,
                         repeat_ratio=0.3, timeout=args.request_timeout)


async def run_load(settings: BenchSettings, content_seed: int | None = None) -> dict:
    """``settings``' requests at their arrival times; ``content_seed``: the same arrivals and shapes (text or
    images, how many, which repeat), with images and text drawn from this seed instead."""
    pool, _, specs = prepare(settings)
    if content_seed is not None and content_seed != settings.seed:
        specs = recontent(settings, pool, specs, content_seed)
    generator = LoadGenerator(settings)
    try:
        await generator.resolve_model()
        results, duration = await generator.run(pool, specs, arrival_times(len(specs), settings.request_rate,
                                                                            settings.seed))
    finally:
        await generator.close()
    summary = summarize(results, duration)
    summary["errors"] = sorted({r.error for r in results if r.error})[:5]
    summary["slowest"] = slowest(results, specs)
    return summary


def recontent(settings: BenchSettings, pool, specs: list, seed: int) -> list:
    """``specs`` with their text, and ``pool`` with its images, drawn from ``seed``: the same shapes."""
    texts, _ = build_requests(settings, len(specs), seed)
    pool.seed = seed
    pool.generate(len(pool.urls))
    return [replace(spec, prompt=text.prompt) for spec, text in zip(specs, texts)]


def slowest(results: list, specs: list, count: int = 3) -> list[dict]:
    """The window's slowest first tokens, each with when it was sent and what it carried (an outlier's
    cause is in the stack's log at that time)."""
    seen: set[int] = set()
    new = {}
    for spec in specs:
        new[spec.index] = sum(i not in seen for i in spec.image_ids)
        seen.update(spec.image_ids)
    done = sorted((r for r in results if r.ok), key=lambda r: r.ttft, reverse=True)[:count]
    return [{"ttft_ms": round(r.ttft * 1e3, 1), "sent_at_s": round(r.sent_at, 3), "kind": r.kind,
             "images": r.images, "new_images": new.get(r.index, 0), "prompt_tokens": r.prompt_tokens,
             "cached_tokens": r.cached_tokens} for r in done]


def gpu_memory() -> dict[int, int]:
    """MiB of GPU memory per process id, as nvidia-smi lists them ({} without nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    rows = [line.split(",") for line in out.splitlines() if line.count(",") == 1]
    return {int(pid): int(mib) for pid, mib in rows if pid.strip().isdigit() and mib.strip().isdigit()}


def session_processes(sid: int) -> list[str]:
    """Processes still in the session ``sid`` (the group Ctrl-C reached): ``pid command`` each."""
    left = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            if int(stat[stat.rindex(")") + 2:].split()[3]) == sid:
                command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                left.append(f"{proc.name} {command[:80]}")
        except (OSError, ValueError, IndexError):
            continue
    return left


def log_events(path: Path) -> list[dict]:
    events = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


def check(layout: str, name: str, ok: bool | None, detail: str) -> dict:
    """One check's line; ``ok`` None: reported, not judged (printed INFO, never a failure)."""
    print(f"[{layout}] {name:<22} {({True: 'PASS', False: 'FAIL', None: 'INFO'})[ok]}  {detail}", flush=True)
    return {"layout": layout, "check": name, "ok": ok, "detail": detail}


def since(iso: str | None, wall: float) -> float:
    """Seconds from ``wall`` (time.time()) to a log line's ISO timestamp (nan without one)."""
    from datetime import datetime

    return datetime.fromisoformat(iso).timestamp() - wall if iso else float("nan")


async def start(args, layout: str, cache: Path | None, log: Path) -> tuple[StackProcess, str, float, float]:
    port = free_port()
    model = ["--model", args.model, "--load-format", "dummy"] if args.model else []
    begun = time.monotonic()
    stack = StackProcess([*model, *LAYOUTS[layout]], stack_env(cache), ROOT, log, port=port)
    base = f"http://127.0.0.1:{port}/v1"
    answered = await wait_models(base, stack.process, args.start_timeout)
    return stack, base, begun, answered


def interrupt(stack: StackProcess, timeout: float) -> tuple[int | None, list[str]]:
    """Ctrl-C: SIGINT to the whole group. The launcher's status, and what of the group is left after it."""
    sid = stack.process.pid
    os.killpg(sid, signal.SIGINT)
    try:
        status = stack.process.wait(timeout)
    except subprocess.TimeoutExpired:
        status = None
    time.sleep(1.0)
    left = session_processes(sid)
    if left:
        os.killpg(sid, signal.SIGKILL)
    return status, left


async def smoke(args, layout: str, out: Path) -> list[dict]:
    cache = Path(tempfile.mkdtemp(prefix=f"smoke-{layout}-")) if args.cold else None
    log = out / f"{layout}.log"
    checks = []
    wall = time.time()
    try:
        stack, base, begun, answered = await start(args, layout, cache, log)
        answered_at = time.time() - (time.monotonic() - answered)
    except RuntimeError as err:
        return [check(layout, "start", False, str(err))]
    try:
        burst = await run_load(load(base, args, args.burst, float("inf"), seed=1))
        await asyncio.to_thread(stack.ready_within, 10.0)  # the launcher logs stack.ready just after opening the API
        checks.append(check(layout, "api after start", True, f"{answered - begun:.1f} s (stack.ready after "
                            f"{since(stack.ready_event.get('timestamp'), wall):.1f} s)"))
        checks.append(check(layout, "burst at first answer", burst["failed"] == 0,
                            f"{burst['completed']}/{args.burst} ok, TTFT p99 {burst['ttft_ms']['p99']:.0f} ms "
                            f"{burst['errors']}"))
        windows = [await run_load(load(base, args, int(args.rate * args.window), args.rate, seed=2),
                                  content_seed=2 + w) for w in range(2)]
        p99 = [w["ttft_ms"]["p99"] for w in windows]
        failed = sum(w["failed"] for w in windows)
        ratio = p99[0] / p99[1] if p99[1] else float("inf")
        checks.append(check(layout, "traffic", failed == 0, f"{sum(w['completed'] for w in windows)} ok, "
                            f"{failed} failed {windows[0]['errors'] + windows[1]['errors']}"))
        checks.append(check(layout, "first window p99 TTFT", None if args.tiny else ratio <= WINDOW_RATIO,
                            f"{p99[0]:.0f} / {p99[1]:.0f} ms = {ratio:.2f}x (ITL p99 "
                            f"{windows[0]['itl_ms']['p99']:.0f} / {windows[1]['itl_ms']['p99']:.0f} ms); first window's "
                            f"slowest {windows[0]['slowest']}"))
        # by the compile's own time: the burst fired at the first answer counts (a compile it reaches is one
        # a user's first requests wait for), however late its log line is read
        late = [c for c in stack.compiles if not since(c["timestamp"], answered_at) < 0]
        checks.append(check(layout, "compiles after ready", not late,
                            f"{len(late)} after the API answered, {len(stack.compiles) - len(late)} before; "
                            + "; ".join(sorted({f"{c['kernel'] or '?'} in the {c['service'] or '?'} "
                                                f"({c['specialization'] or ''})" for c in late}))[:1200]))
        memory = gpu_memory()
        took = {e["kind"]: e["gpu_mib"] for e in log_events(log) if e.get("event") == "service.ready" and "gpu_mib" in e}
        checks.append(check(layout, "gpu memory", None, f"logged {took}; nvidia-smi {sorted(memory.values())} MiB"))
    finally:
        status, left = interrupt(stack, args.stop_timeout)
    events = log_events(log)
    started = sum(e.get("event") == "service.ready" for e in events)
    stopped = sum(e.get("event") == "service.stopped" for e in events)
    text = log.read_text(errors="replace")
    aborts = [a for a in ABORTS if a in text]
    checks.append(check(layout, "ctrl-c", status == 0 and not left and stopped >= started and not aborts,
                        f"launcher status {status}, {stopped}/{started} services stopped, left {left}, "
                        f"aborts {aborts}"))
    if layout in args.warm_restart and cache is not None:
        try:
            stack, _, begun, answered = await start(args, layout, cache, out / f"{layout}-warm.log")
            checks.append(check(layout, "warm restart", True, f"API after {answered - begun:.1f} s"))
            interrupt(stack, args.stop_timeout)
        except RuntimeError as err:
            checks.append(check(layout, "warm restart", False, str(err)))
    return checks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-vl-7b", help="a preset (random weights); '' or --tiny: the "
                                                                 "built-in tiny model")
    parser.add_argument("--tiny", action="store_true", help="the built-in tiny model, small CPU-sized load")
    parser.add_argument("--layouts", default="aggregated,joined,split", help="comma separated: " + ", ".join(LAYOUTS))
    parser.add_argument("--cold", action=argparse.BooleanOptionalAction, default=True,
                        help="fresh cache directories per layout (as on a fresh machine)")
    parser.add_argument("--warm-restart", default="", help="layouts (comma separated) to start once more on the "
                                                            "caches their first start filled")
    parser.add_argument("--burst", type=int, default=16, help="requests fired when /v1/models first answers")
    parser.add_argument("--rate", type=float, default=8.0, help="requests per second of the traffic windows")
    parser.add_argument("--window", type=float, default=30.0, help="seconds of each of the two traffic windows")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--resolution", default="720p", help="image size (360p, 720p, 1080p or WxH)")
    parser.add_argument("--start-timeout", type=float, default=300.0, help="seconds for /v1/models to answer")
    parser.add_argument("--stop-timeout", type=float, default=60.0, help="seconds for the stack to stop on Ctrl-C")
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--out", default="", help="directory for the stacks' logs and results.json")
    args = parser.parse_args()
    if args.tiny:
        args.model = ""
        args.burst, args.rate, args.window = min(args.burst, 4), min(args.rate, 1.0), min(args.window, 4.0)
        args.output_len, args.input_len, args.resolution = min(args.output_len, 8), min(args.input_len, 16), "64x64"
    layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    args.warm_restart = [name.strip() for name in args.warm_restart.split(",") if name.strip()]
    if unknown := [name for name in layouts + args.warm_restart if name not in LAYOUTS]:
        parser.error(f"unknown layout {unknown[0]!r}: use {', '.join(LAYOUTS)}")
    out = Path(args.out or tempfile.mkdtemp(prefix="gpu-smoke-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"# {args.model or 'tiny'} on {hardware()}; logs in {out}", flush=True)
    checks = [c for layout in layouts for c in asyncio.run(smoke(args, layout, out))]
    (out / "results.json").write_text(json.dumps({"model": args.model or "tiny", "hardware": hardware(),
                                                  "versions": versions(), "args": vars(args),
                                                  "checks": checks}, indent=1))
    failed = [c for c in checks if c["ok"] is False]
    judged = [c for c in checks if c["ok"] is not None]
    print(f"# {len(judged) - len(failed)}/{len(judged)} checks passed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
