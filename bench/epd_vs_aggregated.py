#!/usr/bin/env python3
"""EPD against the aggregated baseline, same engine and model code, one run: a request-rate sweep per
workload and topology, one markdown table, one plot, and `epd plan`'s predicted mean TTFT beside the
measured one.

Workloads (Qwen2.5-VL-7B architecture by default, `--model qwen3-vl-30b-a3b` for the MoE model the
references run EPD on; `--load-format dummy`, output forced with ignore_eos):
  image-heavy   1-8 x 1080p images (uniform), 128 text tokens in, 256 out
  mixed         50 % text only, 50 % 1-4 x 1080p; 128 in, 128 out
  image-light   1 x 1080p, 128 in, 1024 out
  video-heavy   1 x 20 s 720p clip (30 fps, 2 frames/s sampled: 40 frames), 128 in, 128 out

Topologies, by the GPUs visible (rates are scaled by the GPU count: every topology uses all of them):
  1 GPU    aggregated; colocated (encoder, prefill and decode processes sharing the GPU)
  2 GPUs   aggregated x2; colocated x2 (an encoder, a prefill and a decode process on each GPU);
           disaggregated: the encoder on GPU 1, prefill + decode on GPU 0
  3+ GPUs  aggregated xN; colocated xN; disaggregated: encoders on GPUs 2.., prefill on GPU 0, decode on GPU 1

Each stack is started with `python -m launcher.cli up` (a subprocess, like a user would) and driven over
HTTP only by `epd bench`'s load generator. Every LM process gets the same KV pool (`--kv-cache-mb`):
processes that share a GPU start at the same time, and a pool sized from free memory would race.

    python bench/epd_vs_aggregated.py --out results/ [--quick] [--gpus N] [--model qwen3-vl-30b-a3b]
    python bench/epd_vs_aggregated.py --out /tmp/smoke --tiny      # CPU smoke test, built-in tiny model
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared.model.presets import PRESETS  # noqa: E402
from tools.plan.costs import Costs  # noqa: E402
from tools.plan.plan import Layout, Planner, traffic  # noqa: E402
from tools.bench.plot import plot  # noqa: E402
from tools.bench.runner import bench  # noqa: E402
from tools.bench.settings import BenchSettings, Workload  # noqa: E402


@dataclass(frozen=True)
class Case:
    name: str
    workload: dict  # Workload fields
    rates: tuple[float, ...]  # per GPU
    quick_rates: tuple[float, ...]


CASES = [
    Case("image-heavy", dict(image_count=8, random_image_count=True, image_resolution="1080p", input_len=128,
                             output_len=256), (0.5, 1.0, 1.5, 2.0, 2.5), (0.75, 1.5, 2.5)),
    Case("mixed", dict(image_count=4, random_image_count=True, text_ratio=0.5, image_resolution="1080p",
                       input_len=128, output_len=128), (1.0, 2.0, 4.0, 6.0), (3.0,)),
    Case("image-light", dict(image_count=1, image_resolution="1080p", input_len=128, output_len=1024),
         (1.0, 2.0, 4.0, 8.0), (2.0,)),
    # one 20 s 720p clip a request (30 fps source, 2 frames a second sampled: 40 frames, --video-seconds)
    Case("video-heavy", dict(image_count=0, video_count=1, video_seconds=20.0, video_resolution="720p",
                             video_fps=30.0, input_len=128, output_len=128), (0.1, 0.25, 0.5, 1.0), (0.25,)),
]
TINY = dict(image_resolution="224x224", input_len=32)  # and counts/outputs cut down, below
TINY_VIDEO = dict(video_seconds=2.0, video_resolution="160x120", video_fps=10.0)


@dataclass(frozen=True)
class Topology:
    label: str
    args: tuple[str, ...]  # to `epd up`
    layout: Layout  # the planner's view of it


def topologies(gpus: int) -> list[Topology]:
    if gpus <= 1:
        return [Topology("aggregated", ("--topology", "aggregated"), Layout("aggregated", 1)),
                Topology("colocated", ("--topology", "colocated"), Layout("colocated", 1))]
    every = ",".join(str(g) for g in range(gpus))
    if gpus == 2:
        epd = Topology("disaggregated", ("--encoder-gpus", "1", "--prefill-gpus", "0", "--decode-gpus", "0"),
                       Layout("disaggregated", 2, 1, shared_lm=True))
    else:
        encoders = ",".join(str(g) for g in range(2, gpus))
        epd = Topology("disaggregated", ("--encoders", str(gpus - 2), "--encoder-gpus", encoders,
                                         "--prefill-gpus", "0", "--decode-gpus", "1"),
                       Layout("disaggregated", gpus, gpus - 2, 1, 1))
    # every GPU runs an encoder, a prefill and a decode process: the LM capacity of aggregated, with
    # images encoded in processes of their own
    colocated = Topology(f"colocated x{gpus}", ("--encoders", str(gpus), "--prefills", str(gpus), "--decodes", str(gpus),
                                               "--encoder-gpus", every, "--prefill-gpus", every, "--decode-gpus", every),
                         Layout("colocated", gpus))
    return [Topology(f"aggregated x{gpus}", ("--topology", "aggregated", "--aggregated", str(gpus), "--gpus", every),
                     Layout("aggregated", gpus)), colocated, epd]


class StackProcess:
    """`python -m launcher.cli up` in a subprocess; its log is drained by a thread (a full pipe would block it)."""

    def __init__(self, args: list[str], env: dict[str, str]):
        self.process = subprocess.Popen([sys.executable, "-m", "launcher.cli", "up", "--port", "0", *args],
                                        cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True,
                                        start_new_session=True)
        self.tail: deque[str] = deque(maxlen=40)
        self.api = ""
        self.ready = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.process.stderr:
            self.tail.append(line.rstrip())
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == "stack.ready":
                self.api = event["api"]
                self.ready.set()
        self.ready.set()

    def wait_ready(self, timeout: float) -> str:
        self.ready.wait(timeout)
        if not self.api:
            self.stop()
            raise RuntimeError("stack did not come up:\n" + "\n".join(self.tail))
        return self.api

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def stack_env(args) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    env.update(EPD_LOG_FORMAT="json", EPD_LOG_LEVEL="info", EPD_TRANSPORT=args.transport,
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    if not args.tiny:
        env.update(EPD_MODEL=args.model, EPD_LOAD_FORMAT="dummy", EPD_KV_CACHE_MB=str(args.kv_cache_mb),
                   EPD_MAX_MODEL_LEN="32768")
    else:
        env.update(EPD_KV_CACHE_MB="64")
    return env


def case_workload(case: Case, tiny: bool, video_seconds: float = 0) -> dict:
    if video_seconds and case.workload.get("video_count"):
        case = Case(case.name, {**case.workload, "video_seconds": video_seconds}, case.rates, case.quick_rates)
    if not tiny:
        return dict(case.workload)
    out = {**case.workload, **TINY, **(TINY_VIDEO if case.workload.get("video_count") else {})}
    out["image_count"] = min(out["image_count"], 3)
    out["output_len"] = max(8, out["output_len"] // 32)
    return out


def tokenizer_dir(tiny: bool, model: str) -> str:
    from shared.model.presets import materialize_preset
    from shared.model.tiny import default_tiny_checkpoint

    return str(default_tiny_checkpoint() if tiny else materialize_preset(model))


def run_plan(args, out: Path) -> dict:
    """`epd plan` for the heaviest workload (its costs cover the others: same resolution, fewer images)."""
    heavy = case_workload(CASES[0], args.tiny)
    cmd = [sys.executable, "-m", "launcher.cli", "plan", "--gpus", str(max(1, args.gpus)), "--out", str(out),
           "--image-count", str(heavy["image_count"]), "--random-image-count", "--image-resolution",
           heavy["image_resolution"], "--input-len", str(heavy["input_len"]), "--output-len", str(heavy["output_len"]),
           "--request-rate", ",".join(str(r * max(1, args.gpus)) for r in CASES[0].quick_rates)]
    if not args.tiny:
        cmd += ["--model", args.model, "--load-format", "dummy", "--max-model-len", "32768"]
    else:
        cmd += ["--max-model-len", "1024", "--decode-batch", "4"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    subprocess.run(cmd, cwd=ROOT, env={**env, "PYTHONPATH": path}, check=True)
    return json.loads(out.read_text())


def predicted_ttft(plan: dict, layout: Layout, workload: dict, rate: float) -> float | None:
    planner = Planner(Costs.from_json(plan["costs"]), plan["data_plane_gbs"], plan["embedding_bytes"])
    prediction = planner.predict(layout, traffic(Workload(**workload), rate))
    return prediction.ttft_ms if prediction.stable else None


def sweep(args, topology: Topology, plan: dict, tokenizer: str) -> list[dict]:
    stack = StackProcess(list(topology.args), stack_env(args))
    runs = []
    try:
        api = stack.wait_ready(900)
        print(f"\n## {topology.label}: {api}", flush=True)
        chosen = [c for c in CASES if not args.workloads or c.name in args.workloads.split(",")]
        points = [(case, rate) for case in chosen for rate in rates(args, case)]
        for number, (case, rate) in enumerate(points):
            run = measure(args, api, topology, case, rate, tokenizer, seed=args.seed + 100 * number)
            video = bool(case.workload.get("video_count"))  # `epd plan` models images, not clips
            run["predicted_ttft_ms"] = (predicted_ttft(plan, topology.layout, case_workload(case, args.tiny), rate)
                                        if plan and not video else None)
            runs.append(run)
            print(row(run), flush=True)
    finally:
        stack.stop()
    return runs


def measure(args, api: str, topology: Topology, case: Case, rate: float, tokenizer: str, seed: int) -> dict:
    """One point of the sweep. Each point has its own seed: images never repeat across points, so no
    embedding cache serves a later point from an earlier one."""
    if args.num_prompts:
        prompts = args.num_prompts
    elif args.tiny:
        prompts = 4
    else:
        seconds, least = (10, 8) if args.quick else (20, 16)
        prompts = max(least, min(100, round(rate * seconds)))
    settings = BenchSettings(base_url=api, label=topology.label, num_prompts=prompts, request_rate=rate, seed=seed,
                             warmup=2, tokenizer=tokenizer, progress=False, timeout=300,
                             **case_workload(case, args.tiny, args.video_seconds))
    run = asyncio.run(bench_with_stages(settings))
    run.update(workload=case.name, topology=topology.label)
    return run


async def bench_with_stages(settings: BenchSettings) -> dict:
    """A bench run, plus where its requests' time went: the frontend's per-stage histograms
    (``epd_stage_seconds``) read before the measured requests and after them."""
    before: dict[str, tuple[float, float]] = {}

    async def mark() -> None:
        before.update(await stage_totals(settings.base_url))

    run = await bench(settings, before_measured=mark)
    after = await stage_totals(settings.base_url)
    run["stages_ms"] = {stage: (total - before.get(stage, (0, 0))[0]) / count * 1e3
                        for stage, (total, seen) in after.items()
                        if (count := seen - before.get(stage, (0, 0))[1]) > 0}
    return run


async def stage_totals(api: str) -> dict[str, tuple[float, float]]:
    """{stage: (seconds summed, requests)} from the frontend's /metrics."""
    async with httpx.AsyncClient(timeout=30) as client:
        text = (await client.get(api.removesuffix("/v1") + "/metrics")).text
    totals: dict[str, list[float]] = {}
    for kind, stage, value in re.findall(r'^epd_stage_seconds_(sum|count)\{stage="(\w+)"\} (\S+)$', text, re.M):
        totals.setdefault(stage, [0.0, 0.0])[kind == "count"] = float(value)
    return {stage: (total, count) for stage, (total, count) in totals.items()}


def rates(args, case: Case) -> list[float]:
    if args.rates:
        return [float(r) for r in args.rates.split(",")]
    per_gpu = case.quick_rates if args.quick or args.tiny else case.rates
    return [r * max(1, args.gpus) for r in per_gpu]


HEADER = ("| workload | topology | rate (req/s) | achieved (req/s) | TTFT mean / p99 (ms) | predicted TTFT (ms) "
          "| text / image (video) TTFT mean (ms) | media / encode / to first token (ms) | TPOT mean / p99 (ms) | E2E mean (ms) "
          "| output tok/s | failed |\n|---|---|---|---|---|---|---|---|---|---|---|---|")


def row(run: dict) -> str:
    s = run["summary"]
    predicted = f"{run['predicted_ttft_ms']:.0f}" if run.get("predicted_ttft_ms") is not None else \
        "-" if run["workload"] == "video-heavy" else "unstable"  # the planner models images, not clips
    stages = run.get("stages_ms", {})
    split = " / ".join(f"{stages[k]:.0f}" if k in stages else "-" for k in ("media", "encode", "first_token"))
    classes = run.get("classes", {})
    media = "video" if "video" in classes else "image"  # the media column: clips where the load sends them
    by_kind = " / ".join(f"{classes[k]['ttft_ms']['mean']:.0f}" if k in classes else "-" for k in ("text", media))
    return (f"| {run['workload']} | {run['topology']} | {run['request_rate']:g} | {s['request_throughput']:.2f} "
            f"| {s['ttft_ms']['mean']:.0f} / {s['ttft_ms']['p99']:.0f} | {predicted} | {by_kind} | {split} "
            f"| {s['tpot_ms']['mean']:.1f} / {s['tpot_ms']['p99']:.1f} | {s['e2e_ms']['mean']:.0f} "
            f"| {s['output_throughput']:.0f} | {s['failed']} |")


def table(runs: list[dict]) -> str:
    ordered = sorted(runs, key=lambda r: ([c.name for c in CASES].index(r["workload"]), r["topology"],
                                          r["request_rate"]))
    return "\n".join([HEADER, *(row(r) for r in ordered)])


def hardware() -> str:
    if shutil.which("nvidia-smi"):
        found = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True).stdout.strip()
        if found:
            return found.replace("\n", "; ")
    return f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("torch", "triton", "transformers", "httpx", "nats-py", "pyzmq"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def visible_gpus() -> int:
    if not shutil.which("nvidia-smi"):
        return 0
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    count = len(re.findall(r"^GPU \d+", listed, flags=re.M))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return min(count, len(visible.split(","))) if visible else count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/epd_vs_aggregated", help="directory for results")
    parser.add_argument("--quick", action="store_true", help="fewer rates (image-heavy: 3, others: 1) and prompts "
                                                             "(10 s of arrivals per point; ~7 min on two GPUs)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test on the built-in tiny model")
    parser.add_argument("--model", default="qwen2.5-vl-7b", choices=sorted(PRESETS),
                        help="the preset every stack runs (random weights)")
    parser.add_argument("--gpus", type=int, default=-1, help="GPUs to use (default: every visible one)")
    parser.add_argument("--topologies", default="", help="comma-separated labels to run (default: all)")
    parser.add_argument("--rates", default="", help="override every workload's rates, e.g. 1,2")
    parser.add_argument("--num-prompts", type=int, default=0, help="override the prompts per point")
    parser.add_argument("--kv-cache-mb", type=int, default=20480, help="KV pool of every LM process (MiB)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workloads", default="", help="comma-separated workloads to run (default: all)")
    parser.add_argument("--no-plan", action="store_true", help="skip `epd plan` (no predicted TTFT column)")
    parser.add_argument("--plan", default="", help="predict from this earlier `epd plan` JSON instead of measuring")
    parser.add_argument("--transport", default="zmq", choices=("zmq", "ucx"), help="the stacks' data plane")
    parser.add_argument("--video-seconds", type=float, default=0,
                        help="video-heavy's clip length (default 20 s; the issue's range is 10-30 s)")
    args = parser.parse_args()
    args.gpus = visible_gpus() if args.gpus < 0 else args.gpus
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    if args.plan:
        plan = json.loads(Path(args.plan).read_text())
    else:
        plan = None if args.no_plan else run_plan(args, out / "plan.json")
    tokenizer = tokenizer_dir(args.tiny, args.model)
    runs = []
    for topology in topologies(args.gpus):
        if args.topologies and topology.label not in args.topologies.split(","):
            continue
        runs.extend(sweep(args, topology, plan, tokenizer))
    model = "tiny" if args.tiny else args.model
    markdown = (f"Model: {model}\nHardware: {hardware()}\nVersions: {json.dumps(versions())}\n"
                f"Command: {' '.join(sys.argv)}\nWall time: {time.time() - started:.0f} s\n\n{table(runs)}\n")
    (out / "results.md").write_text(markdown)
    (out / "results.json").write_text(json.dumps({"model": model, "hardware": hardware(), "versions": versions(),
                                                  "command": sys.argv, "runs": runs}, indent=1))
    print("\n" + markdown)
    try:
        plot(runs, str(out / "latency_vs_rate.png"), "EPD vs aggregated" + (" (tiny, CPU)" if args.tiny else ""))
    except ImportError:  # no matplotlib here: draw it elsewhere from results.json
        print(f"matplotlib missing: run `epd bench plot {out / 'results.json'}` where it is installed")
    return 0 if all(r["summary"]["failed"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
