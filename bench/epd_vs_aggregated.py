#!/usr/bin/env python3
"""Every topology against its floor, one run: each workload at rates set from its floor, each topology
started once with every point on it, `epd plan`'s prediction beside every measurement.

Workloads (Qwen2.5-VL-7B architecture, `--load-format dummy`, output forced with ignore_eos; JPEG images):
  image-heavy   1-8 x 1080p images (uniform), 128 text tokens in, 256 out
  mixed         50 % text only, 50 % 1-4 x 1080p; 128 in, 128 out
  image-light   1 x 1080p, 128 in, 1024 out
  dynamo-1024   NVIDIA Dynamo's shape: 10 x 448x448 (258 tokens each), 128 in, 1024 out
  dynamo-128    the same requests, 128 out
  dynamo-mix    Dynamo's 50:50 mix: 50 % text only, 50 % 10 x 448x448; 128 in, 128 out
  video-heavy   1 x 20 s 720p clip (30 fps, 2 frames/s sampled: 40 frames; `--video-seconds`), 128 in, 128 out;
                run only when named (`--workloads video-heavy`)

Topologies (`tools/plan/layouts.py` names them and gives their `epd up` flags):
  1 GPU    aggregated (ViT, prefill, decode in one engine thread); E/PD and E/PD+MPS (an encoder beside a
           language worker that prefills and decodes, time-sliced or under CUDA MPS); E/P/D and E/P/D+MPS
           (an encoder, a prefill and a decode worker)
  N GPUs   aggregated xN, E/PD xN+MPS, E/P/D xN+MPS, and encoders on GPUs of their own (E/PD disagg, E/P/D
           disagg: P+D sharing GPU 0 on two GPUs, P on GPU 0 and D on GPU 1 on more)

The run:
1. floor: `python -m tools.plan.floor` measures, in-process on the GPU, every request shape's own compute,
   each part alone: the frontend's decode of its images, one ViT forward over them, the prefill of its
   prompt (and the decode steps, and how a ViT and the language model slow each other on one GPU: two
   streams of a process, as under MPS, and two processes, time-sliced); for a clip, the frontend's PyAV
   decode of it, the ViT over its sampled frames, the prefill with its video placeholders. A request's
   floor is media + ViT + prefill. The same numbers are `epd plan`'s costs (images only).
2. rates: a workload's capacity is the request rate one GPU would sustain doing nothing but that
   compute (`Planner.capacity`; video: 1 / (ViT + prefill) of its clip, the decode running on the
   frontend's CPU); its points are fractions of it (`--quick`: 0.5, and 0.8 too for image-heavy; else
   0.25/0.5/0.75/0.9), the same rates for every topology.
3. per topology, one `epd up`: unloaded TTFT (warm stack, one request at a time, 5 per request class:
   text, and each workload's image requests, 4 tokens out: TTFT alone does not depend on the output
   length), then every loaded point (Poisson arrivals for `--seconds`, each point its own images: no
   cache hits across points). Per point: TTFT mean/p99, ITL p99 (pooled gaps), TPOT, achieved req/s,
   goodput at the SLO (TTFT <= 2 s and each request's own p99 inter-token gap <= 100 ms), failed, and
   resumed requests (the stack's `request.resume` log lines); the frontend's stage means (media / encode /
   to first token) and the encoders' own split (ViT queue / forward, pixel pull / job encode, per image).
4. `epd plan`: each point predicted for every topology from the floor's costs, with each topology's
   fixed costs calibrated from its own unloaded TTFT (measured minus the model's no-load TTFT, per
   request class); the plan's pick is its lowest predicted TTFT. Video points have no prediction
   (`epd plan` models images, not clips).
   `--saturate 0.9`: per topology, each workload's points are fractions of the rate that stack sustains,
   measured on it first: a burst of requests sent at once (`--saturation-requests`; by default ~40 s of
   the floor capacity), the requests it completed over the time to the last completion (`burst_rate`).
   `--saturation-from` takes an earlier run's measured rates instead (the same rates for a setting on and off).
5. results.md (a table per workload, floor and unloaded rows beside the loaded ones; the plan against
   the measurements; the issue's targets measured/target/met), results.json, latency_vs_rate.png —
   rewritten after every loaded point, so a run cut short keeps what it measured.

Every topology on one GPU takes longer than one 10-minute call (`--dry-run` estimates it and proposes a
split): run some topologies, then the rest with `--floor` from the first run (the same rates), and merge
the two with `--report-from` (no GPU needed; it also re-predicts with today's planner; .json.gz files too).
`bench/plan_accuracy.py` scores that re-prediction over any number of recorded runs.

    python bench/epd_vs_aggregated.py --quick --dry-run                  # what would run, how long
    python bench/epd_vs_aggregated.py --quick --topologies aggregated,E/PD+MPS,E/P/D+MPS --deadline 560 --out A
    python bench/epd_vs_aggregated.py --quick --topologies E/PD,E/P/D --floor A/results.json --out B
    python bench/epd_vs_aggregated.py --report-from A/results.json B/results.json --out merged/
    python bench/epd_vs_aggregated.py --tiny --out /tmp/smoke            # CPU: the same path, tiny model
    python bench/epd_vs_aggregated.py --workloads video-heavy --video-seconds 10 --out V   # clips
    python bench/epd_vs_aggregated.py --saturate 0.9 --stack-env EPD_TARGET_ITL_MS=0 --out off  # at 90 % of each
    python bench/epd_vs_aggregated.py --saturate 0.9 --saturation-from off/results.json --out on  # stack's saturation
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared.model.presets import PRESETS  # noqa: E402
from tools.bench import scrape  # noqa: E402
from tools.bench.environment import hardware, host, versions, visible_gpus  # noqa: E402,F401 - other scripts import them here
from tools.bench.measure import StackMeter, as_result  # noqa: E402
from tools.bench.metrics import Slo, summarize  # noqa: E402
from tools.bench.settings import BenchSettings, Workload, parse_resolution  # noqa: E402
from tools.bench.stack import StackProcess  # noqa: E402
from tools.bench.tables import HEADER, ms, ordered_labels, row_text, stages  # noqa: E402
from tools.plan.cost_table import Costs  # noqa: E402
from tools.plan.floor import shape_label  # noqa: E402
from tools.plan.layouts import Layout, bench_layouts  # noqa: E402
from tools.plan.model import DATA_PLANE_GBS, Planner, Prediction, traffic  # noqa: E402
from tools.plan.plan import json_default, recommend  # noqa: E402


@dataclass(frozen=True)
class Case:
    name: str
    workload: dict  # Workload (and VideoWorkload) fields

    @property
    def video(self) -> bool:
        return bool(self.workload.get("video_count"))


CASES = [
    Case("image-heavy", dict(image_count=8, random_image_count=True, image_resolution="1080p", input_len=128,
                             output_len=256)),
    Case("mixed", dict(image_count=4, random_image_count=True, text_ratio=0.5, image_resolution="1080p",
                       input_len=128, output_len=128)),
    Case("image-light", dict(image_count=1, image_resolution="1080p", input_len=128, output_len=1024)),
    Case("dynamo-1024", dict(image_count=10, image_resolution="448x448", input_len=128, output_len=1024)),
    Case("dynamo-128", dict(image_count=10, image_resolution="448x448", input_len=128, output_len=128)),
    Case("dynamo-mix", dict(image_count=10, text_ratio=0.5, image_resolution="448x448", input_len=128,
                            output_len=128)),
    # one 20 s 720p clip a request (30 fps source, 2 frames a second sampled: 40 frames; --video-seconds)
    Case("video-heavy", dict(image_count=0, video_count=1, video_seconds=20.0, video_resolution="720p",
                             video_fps=30.0, input_len=128, output_len=128)),
]
TINY_RESOLUTION = {"1080p": "224x224", "448x448": "112x112"}  # two sizes still: costs are per resolution
TINY_VIDEO = dict(video_seconds=2.0, video_resolution="160x120", video_fps=10.0)  # 4 frames sampled
VIDEO_SECONDS = (10.0, 30.0)  # the range of clip lengths
SLO = Slo(ttft_ms=2000, itl_ms=100)
UNLOADED_TOKENS = 4
QUICK_FRACTIONS = {"image-heavy": (0.5, 0.8)}  # others: (0.5,)
FULL_FRACTIONS = (0.25, 0.5, 0.75, 0.9)
TIE = 0.10  # the plan's pick counts as the measured best when its measured TTFT is within this of the best


def case_workload(case: Case, tiny: bool) -> dict:
    if not tiny:
        return dict(case.workload)
    out = dict(case.workload)
    if case.video:
        out.update(TINY_VIDEO)
    else:
        out.update(image_resolution=TINY_RESOLUTION[out["image_resolution"]], image_count=min(out["image_count"], 3))
    out.update(input_len=32, output_len=max(4, out["output_len"] // 64))
    return out


def workload_cases(video_seconds: float = 0) -> list[Case]:
    """Every workload, video-heavy's clips ``video_seconds`` long (0: its own 20 s)."""
    if not video_seconds:
        return list(CASES)
    return [Case(c.name, {**c.workload, "video_seconds": float(video_seconds)}) if c.video else c for c in CASES]


@dataclass(frozen=True)
class Topology:
    label: str
    layout: Layout
    args: tuple[str, ...]  # to `epd up`


def topologies(gpus: int, tiny: bool) -> list[Topology]:
    return [Topology(layout.label(), layout, tuple(layout.up_args("auto" if tiny else "on")))
            for layout in bench_layouts(max(1, gpus))]


# -- request classes measured unloaded --------------------------------------------------------------------
@dataclass(frozen=True)
class RequestClass:
    """Requests of one kind, sent one at a time: text only, or one workload's image (or clip) requests."""

    key: str
    workload: dict


def request_classes(cases: list[Case], tiny: bool) -> list[RequestClass]:
    out: dict[str, RequestClass] = {}
    for case in cases:
        w = case_workload(case, tiny)
        if w.get("text_ratio", 0) > 0:
            key = f"text {w['input_len']}"
            out.setdefault(key, RequestClass(key, {**w, "image_count": 0, "text_ratio": 0,
                                                   "random_image_count": False}))
        if w.get("text_ratio", 0) < 1 and (w["image_count"] or w.get("video_count")):
            key = media_class(w)
            out.setdefault(key, RequestClass(key, {**w, "text_ratio": 0}))
    return list(out.values())


def clip_label(w: dict) -> str:
    return f"{w['video_seconds']:g} s {w['video_resolution']} clip at {w['video_fps']:g} fps"


def media_class(w: dict) -> str:
    if w.get("video_count"):
        return f"{w['video_count']} x {clip_label(w)}, {w['input_len']} in"
    counts = f"1-{w['image_count']}" if w.get("random_image_count") else str(w["image_count"])
    return f"{counts} x {w['image_resolution']}, {w['input_len']} in"


def media_kind(w: dict) -> str:
    """The kind ``epd bench`` records a workload's requests that are not text only as."""
    return "video" if w.get("video_count") else "image"


def class_keys(w: dict) -> dict[str, str]:
    """{"text"/"image"/"video": request-class key} of a workload's requests."""
    keys = {}
    if w.get("text_ratio", 0) > 0:
        keys["text"] = f"text {w['input_len']}"
    if w.get("text_ratio", 0) < 1 and (w["image_count"] or w.get("video_count")):
        keys[media_kind(w)] = media_class(w)
    return keys


# warm-up requests a resolution gets before its unloaded ones: the encoders capture a batch layout's graph at
# its second forward (shared.model.pieces.LayoutGraphs, ~0.2 s once), which the unloaded TTFT must not carry
WARM_UPS = 2


def warm_shape(w: dict) -> str:
    """What a stack's first request of a kind warms up: text, a resolution's images, a clip size."""
    if w.get("video_count"):
        return f"clip {w['video_resolution']}"
    return w["image_resolution"] if w["image_count"] else "text"


# -- the floor --------------------------------------------------------------------------------------------
def measure_floor(args, cases: list[Case], out: Path) -> dict:
    shapes = [case_workload(c, args.tiny) for c in cases]
    cmd = [sys.executable, "-m", "tools.plan.floor", "--shapes", json.dumps(shapes), "--out", str(out)]
    if args.tiny:
        cmd += ["--max-model-len", "1024", "--decode-batch", "4", "--kv-cache-mb", "64", "--corun-seconds", "0.2"]
    else:
        cmd += ["--model", args.model, "--load-format", "dummy", "--max-model-len", str(args.max_model_len)]
    print("floor:", " ".join(cmd[:3]), "...", flush=True)
    subprocess.run(cmd, cwd=ROOT, env=child_env(args.tiny), check=True)
    return json.loads(out.read_text())


PARTS = ("media_ms", "vit_ms", "prefill_ms", "floor_ms")


def shape_key(w: dict, images: int = 0) -> tuple:
    """The floor row of a workload's request with ``images`` images (a video workload's: its one clip)."""
    if w.get("video_count"):
        return "clip", w["video_resolution"], float(w["video_seconds"]), float(w["video_fps"]), w["input_len"]
    return w["image_resolution"], w["input_len"], images


def row_key(row: dict) -> tuple:
    """``shape_key`` of a floor row (``tools.plan.floor``'s: a clip's row has ``video_seconds``)."""
    if "video_seconds" in row:
        return "clip", row["resolution"], float(row["video_seconds"]), float(row["video_fps"]), row["input_len"]
    return row["resolution"], row["input_len"], row["images"]


class Floor:
    """A request's floor from the floor file: media + ViT + prefill of its shape; and the planner on the
    same costs (images only: ``epd plan`` models images, not clips)."""

    def __init__(self, data: dict, transport: str = "zmq"):
        self.data = data
        self.transport = transport
        self.rows = {row_key(r): r for r in data["shapes"]}
        self.costs = {res: Costs.from_json(c) for res, c in data["costs"].items()}

    def missing(self, w: dict) -> list[str]:
        """The workload's request shapes this floor has not measured (a floor from another run's workloads)."""
        if w.get("video_count"):
            return [] if shape_key(w) in self.rows else [f"{clip_label(w)}, {w['input_len']} in"]
        counts = {0, *Workload(**w).image_counts()}
        return [f"{n} x {w['image_resolution']}, {w['input_len']} in" for n in sorted(counts)
                if shape_key(w, n) not in self.rows]

    def of(self, w: dict, images: int = 0) -> dict:
        return self.rows[shape_key(w, images)]

    def mean(self, w: dict, requests: list[dict]) -> dict[str, float]:
        """Mean floor parts over these requests (each by its image count; a video workload's are alike)."""
        rows = [self.of(w, r["images"]) for r in requests]
        if not rows:
            return {}
        return {k: sum(r[k] for r in rows) / len(rows) for k in PARTS}

    def expected(self, w: dict) -> dict[str, float]:
        """Mean floor parts over the workload's distribution of requests."""
        if w.get("video_count"):
            return {k: self.of(w)[k] for k in PARTS}
        t = traffic(Workload(**w), 1.0)
        return {k: sum(p * self.of(w, n)[k] for p, n in t.classes()) for k in PARTS}

    def planner(self, w: dict) -> Planner:
        return Planner(self.costs[w["image_resolution"]], DATA_PLANE_GBS.get(self.transport, 1.7),
                       self.data.get("hidden_bytes", 0))

    def capacity(self, w: dict) -> float:
        """Requests/s one GPU sustains doing only the workload's GPU work. A clip: its ViT and its
        prefill (its decode runs in the frontend's CPU pool; 128 tokens of batched decode are left out
        beside a prefill of thousands of tokens)."""
        if w.get("video_count"):
            row = self.of(w)
            return 1e3 / (row["vit_ms"] + row["prefill_ms"])
        return self.planner(w).capacity(traffic(Workload(**w), 1.0))


def rates_of(args, case: Case, floor: Floor | None) -> list[tuple[float | None, float]]:
    """[(fraction of capacity or None, rate)] of a workload's points (--saturate: the floor capacity's
    fractions stand in until each stack's saturation is measured)."""
    if args.saturate:
        capacity = capacity_of(args, case, floor)
        return [(f, round_rate(f * capacity)) for f in fractions_of(args.saturate)]
    if args.rates:
        named = [r.split("=", 1) for r in args.rates.split(",") if "=" in r]
        if not named:
            return [(None, float(r)) for r in args.rates.split(",")]
        return [(None, float(rate)) for name, rate in named if name == case.name]
    fractions = fractions_of(args.fractions) if args.fractions else \
        QUICK_FRACTIONS.get(case.name, (0.5,)) if args.quick or args.tiny else FULL_FRACTIONS
    capacity = capacity_of(args, case, floor)
    return [(f, round_rate(f * capacity * max(1, args.gpus))) for f in fractions]


def capacity_of(args, case: Case, floor: Floor | None) -> float:
    """A workload's floor capacity (req/s, one GPU); without a floor, the nominal H200 guess (--dry-run)."""
    return floor.capacity(case_workload(case, args.tiny)) if floor else NOMINAL_CAPACITY[case.name]


def round_rate(rate: float) -> float:
    return float(f"{rate:.2g}")


def fractions_of(text: str) -> list[float]:
    return [float(f) for f in text.split(",") if f.strip()]


BURST_TIMEOUT_S = 300.0  # a saturation burst's last request waits for every one before it
SATURATION_SECONDS = 40.0  # a burst's default size: this many seconds of the workload's floor capacity
SATURATION_REQUESTS = (48, 240)  # ... within these bounds, under the frontend's 256 in flight (more get 429)
TINY_SATURATION_REQUESTS = 48  # a queue even where a tiny CPU stack batches many at once


def saturation_requests(args, case: Case, floor: Floor | None) -> int:
    """Requests in a workload's saturation burst: ``--saturation-requests``, else ~40 s of its floor capacity."""
    if args.saturation_requests:
        return args.saturation_requests
    if args.tiny:
        return TINY_SATURATION_REQUESTS
    capacity = capacity_of(args, case, floor)
    low, high = SATURATION_REQUESTS
    return max(low, min(high, round(capacity * SATURATION_SECONDS)))


def burst_rate(requests: list[dict]) -> dict:
    """What a stack sustains, from a burst of requests sent at once: those it completed over the time from the
    send to the last completion (``makespan_s``). All their work falls inside it, and the stack ran full but for
    the drain after the last first token (``tail_s``: the last requests decoding), so the rate errs low, by that
    share and a little more (on an H100 the TTFT trend at 1.1× of it put it a few to ~10 % low, likely as a
    burst holds more sequences decoding at once than a stack at its rate). A window inside the burst errs high
    instead, by work done ahead of it: counting the completions that came while requests still waited read 3.6
    req/s image-heavy on an H100 (7B, budget off), where 90 % of it (3.2 req/s) left the stack 15 s of mean TTFT
    behind and ~1.4 held; its ViT had encoded the waiting requests' images ahead, and thirty sequences decoding
    together finished together. ``rate`` None, with the reason, when every request had its first token before
    the first finished: the burst fit in the stack's batch, and a larger one would read more."""
    done = [r for r in requests if r["ok"]]
    out = {"requests": len(requests), "failed": len(requests) - len(done), "rate": None}
    if not done:
        return {**out, "why": "no request of the burst succeeded"}
    sent = min(r["sent_at"] for r in requests)
    ends = [r["sent_at"] + r["e2e"] - sent for r in done]
    last_first = max(r["sent_at"] + r["ttft"] for r in done) - sent
    out.update(makespan_s=round(max(ends), 3), tail_s=round(max(ends) - last_first, 3))
    if last_first <= min(ends):
        return {**out, "why": f"all {len(done)} had their first token before the first finished: the burst fit "
                              "in the stack's batch (give --saturation-requests more)"}
    return {**out, "rate": len(done) / max(ends)}


# Capacities (req/s, one H200) estimated from BASELINES.md's costs, only for --dry-run without --floor
# (video-heavy: a guess from FLOPs, ~1.5 s of ViT + prefill per 20 s clip; no H200 figure yet).
NOMINAL_CAPACITY = {"image-heavy": 1.8, "mixed": 6.5, "image-light": 6.0, "dynamo-1024": 5.0, "dynamo-128": 9.0,
                    "dynamo-mix": 16.0, "video-heavy": 0.6}


# -- one topology ------------------------------------------------------------------------------------------
def child_env(tiny: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_") or k == "EPD_CACHE_DIR"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    if tiny:  # a dozen CPU processes: torch's intra-op threads would spin against each other (100x slower)
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def stack_setting(text: str) -> tuple[str, str]:
    """``--stack-env``'s EPD_NAME=VALUE."""
    name, sep, value = text.partition("=")
    if not sep or not name.startswith("EPD_") or not name[4:].replace("_", "").isalnum():
        raise argparse.ArgumentTypeError(f"expected EPD_NAME=VALUE, got {text!r}")
    return name, value


def stack_env(args) -> dict[str, str]:
    env = child_env(args.tiny)
    env.update(EPD_LOG_FORMAT="json", EPD_LOG_LEVEL="info", EPD_TRANSPORT=args.transport)
    if args.max_batched_tokens:
        env["EPD_MAX_BATCHED_TOKENS"] = str(args.max_batched_tokens)
    env.update(getattr(args, "stack_env", ()))
    if not args.tiny:
        env.update(EPD_MODEL=args.model, EPD_LOAD_FORMAT="dummy")
        if args.kv_cache_mb:  # 0: sized from the share of the GPU, as a user's stack is
            env["EPD_KV_CACHE_MB"] = str(args.kv_cache_mb)
        if getattr(args, "max_model_len", 0):  # bench/multi_turn_chat.py's stacks keep the model's own
            env["EPD_MAX_MODEL_LEN"] = str(args.max_model_len)
    else:
        env.update(EPD_KV_CACHE_MB="64")
    return env


@dataclass(frozen=True)
class Point:
    case: Case
    fraction: float | None
    rate: float  # saturation: the floor's estimate until the stack's own saturation is measured
    seed: int
    saturation: bool = False  # fraction is of the saturation measured on each stack (--saturate)


class TopologyRun:
    """Everything measured on one stack: its unloaded request classes, then its loaded points."""

    def __init__(self, args, topology: Topology, stack: StackProcess, tokenizer: str):
        self.args, self.topology, self.tokenizer = args, topology, tokenizer
        self.meter = StackMeter(stack)
        self.timings: dict[str, float] = {}
        self.errors: list[str] = []
        self.saturation: dict[str, dict] = {}  # workload → what burst_rate measured on this stack (or was given)

    async def run(self, classes: list[RequestClass], points: list[Point],
                  measured=lambda unloaded, runs: None) -> tuple[list[dict], list[dict]]:
        """The unloaded classes, then the points; ``measured(unloaded, runs)`` after each loaded point (so that
        a run cut short mid-stack keeps what it measured)."""
        await self.meter.start()
        unloaded, warm = [], set()
        for number, cls in enumerate(classes):
            started = time.monotonic()
            shape = warm_shape(cls.workload)
            if shape not in warm:  # warm-up: the stack's first requests of this resolution
                warm.add(shape)
                await self.meter.measure(self._settings(cls.workload, self.args.seed + 10_000 + 2 * number,
                                                        WARM_UPS, math.inf, UNLOADED_TOKENS), details=False)
            prompts = 2 if self.args.tiny else self.args.unloaded
            record = await self.meter.measure(self._settings(cls.workload, self.args.seed + 10_001 + 2 * number,
                                                             prompts, math.inf, UNLOADED_TOKENS))
            record.update(request_class=cls.key, topology=self.topology.label)
            self.timings[f"unloaded {cls.key}"] = time.monotonic() - started
            unloaded.append(record)
            print(f"  unloaded {cls.key}: TTFT {record['summary']['ttft_ms']['mean']:.0f} ms "
                  f"(stages {stages(record['stages_ms'])})", flush=True)
        runs = []
        for point in points:
            if point.saturation:
                rate = await self.saturated(point.case)
                if rate is None:
                    continue
                point = replace(point, rate=round_rate(point.fraction * rate))
            started = time.monotonic()
            prompts = 3 if self.args.tiny else max(self.args.min_prompts, min(150, round(point.rate * self.args.seconds)))
            try:
                record = await self.meter.measure(self._settings(case_workload(point.case, self.args.tiny),
                                                                 point.seed, prompts, point.rate))
            except Exception as err:  # e.g. the frontend gone: the other points may still run
                self.errors.append(f"{point.case.name} @ {point.rate:g}: {type(err).__name__}: {err}"[:500])
                print(f"  {self.errors[-1]}", flush=True)
                continue
            record.update(workload=point.case.name, topology=self.topology.label, fraction=point.fraction,
                          of_saturation=point.saturation)
            self.timings[f"{point.case.name} @ {point.rate:g}"] = time.monotonic() - started
            runs.append(record)
            print(row_text(record), flush=True)
            measured(unloaded, runs)
        return unloaded, runs

    async def saturated(self, case: Case) -> float | None:
        """The rate this stack sustains on ``case``: given (--saturation-from), or measured once with a burst
        (``burst_rate``); None, with the point's error, when it could not be measured."""
        if case.name not in self.saturation:
            given = self.args.saturation_given.get((case.name, self.topology.label))
            if given is not None:
                self.saturation[case.name] = given
            else:
                started = time.monotonic()
                prompts = self.args.saturation_n[case.name]
                settings = self._settings(case_workload(case, self.args.tiny), self.args.seed + 50_000 + len(
                    self.saturation), prompts, math.inf, burst=True)
                try:
                    burst = await self.meter.measure(settings, details=False)
                    self.saturation[case.name] = burst_rate(burst["requests"])
                except Exception as err:
                    self.saturation[case.name] = {"requests": prompts, "rate": None,
                                                  "why": f"{type(err).__name__}: {err}"[:500]}
                self.timings[f"{case.name} saturation"] = time.monotonic() - started
            found = self.saturation[case.name]
            print(f"  {case.name} saturation: " + (f"{found['rate']:.3g} req/s ({found['requests']} sent at once, "
                  f"done in {found['makespan_s']:.1f} s, {found['tail_s']:.1f} s of it after the last first token)"
                  if found["rate"] else
                  f"not measured: {found.get('why')}"), flush=True)
            if found["rate"] is None:
                self.errors.append(f"{case.name}: no saturation, so no point: {found.get('why')}"[:500])
        return self.saturation[case.name]["rate"]

    def _settings(self, w: dict, seed: int, prompts: int, rate: float, tokens: int | None = None,
                  burst: bool = False) -> BenchSettings:
        """A point: Poisson arrivals at ``rate``, or (inf) one request at a time, ``tokens`` out if given;
        ``burst``: every request at once (a saturation burst: the last waits for all before it)."""
        workload = dict(w) if tokens is None else {**w, "output_len": tokens}
        return BenchSettings(base_url=self.meter.stack.api, label=self.topology.label, num_prompts=prompts,
                             request_rate=rate, max_concurrency=0 if burst else 1 if math.isinf(rate) else 0,
                             seed=seed, warmup=0, tokenizer=self.tokenizer,
                             timeout=max(self.args.request_timeout, BURST_TIMEOUT_S if burst else 0),
                             goodput=f"ttft:{SLO.ttft_ms:g},itl:{SLO.itl_ms:g}", **workload)


def start_stacks(args, chosen: list[Topology]) -> dict[str, tuple[StackProcess, float]]:
    """Tiny: every stack at once, up front, while the floor is measured (CPU smoke runs are dominated by
    process start-up; on GPUs each stack starts in turn, after the floor, which is measured alone)."""
    env = stack_env(args)
    return {t.label: (StackProcess(list(t.args), env, ROOT, stack_log(args, t)), time.monotonic()) for t in chosen}


def stack_log(args, topology: Topology) -> Path | None:
    """``--stack-log``: the file a topology's stack writes its log lines to (``E/PD+MPS`` → ``E-PD-MPS.log``:
    letters, digits, ``.``, ``_`` and ``-`` only, as copying tools accept)."""
    if not getattr(args, "stack_log", ""):
        return None
    folder = Path(args.stack_log)
    folder.mkdir(parents=True, exist_ok=True)
    return folder / (re.sub(r"[^A-Za-z0-9._-]", "-", topology.label) + ".log")


def sweep(args, chosen: list[Topology], classes: list[RequestClass], todo: list[Point], tokenizer: str,
          checkpoint, started: dict[str, tuple[StackProcess, float]] | None = None) -> tuple[list, list, list]:
    """Each topology's stack started once, measured, stopped, and ``checkpoint(unloaded, runs, stacks)``
    called after each of its loaded points and after it (so a run cut short keeps what it measured). With
    ``--deadline``, a topology is not started when the previous one's time would take the run past it.
    ``started``: stacks already starting (tiny: ``start_stacks``); those are stopped in the background."""
    unloaded, runs, stacks_info = [], [], []
    env = stack_env(args)
    started = dict(started or {})
    stoppers, last = [], 0.0
    for topology in chosen:
        info = {"topology": topology.label, "args": list(topology.args), "layout": asdict(topology.layout)}
        stacks_info.append(info)
        if args.deadline and time.monotonic() - args.started + last > args.deadline:
            info["error"] = f"skipped: the previous topology took {last:.0f} s and --deadline is {args.deadline:g} s"
            print(f"## {topology.label} {info['error']}", flush=True)
            continue
        stack, t0 = started.pop(topology.label, None) or (StackProcess(list(topology.args), env, ROOT,
                                                                       stack_log(args, topology)), time.monotonic())
        try:
            api = stack.wait_ready(900)
            info.update(ready=stack.ready_event, start_s=time.monotonic() - t0)
            print(f"\n## {topology.label}: {api} (mps={stack.ready_event.get('mps')}, "
                  f"up in {info['start_s']:.0f} s)", flush=True)
            measured = TopologyRun(args, topology, stack, tokenizer)

            def keep(u: list[dict], r: list[dict], final: bool = False) -> None:
                info["timings_s"] = measured.timings
                if measured.saturation:
                    info["saturation"] = measured.saturation
                if not final:  # mid-stack: what it measured so far, should the run be cut short
                    checkpoint(unloaded + u, runs + r, stacks_info)

            u, r = asyncio.run(measured.run(classes, todo, keep))
            unloaded += u
            runs += r
            keep(u, r, final=True)
            if measured.errors:
                info["point_errors"] = measured.errors
        except Exception as err:  # one topology failing must not cost the others their GPU time
            info["error"] = f"{type(err).__name__}: {err}"[:3000]
            print(f"## {topology.label} failed: {info['error']}", flush=True)
        finally:
            stopper = threading.Thread(target=stack.stop, daemon=True)
            stopper.start()
            if not args.tiny:
                stopper.join()
            stoppers.append(stopper)
        last = time.monotonic() - t0
        info["total_s"] = last
        checkpoint(unloaded, runs, stacks_info)
    for stopper in stoppers:
        stopper.join()
    return unloaded, runs, stacks_info


# -- the plan against the measurements ---------------------------------------------------------------------
def overheads(floor: Floor, unloaded: list[dict], topology: Topology, w: dict):
    """images → seconds this stack adds to a request beyond the model's no-load TTFT, from its unloaded
    requests: the least over text ones; over image ones of this resolution the lower line o0 + o1·images
    (the per-image fixed costs: jobs, pulls, replies). The least, not the median: a request can only pay
    more than the fixed costs, and the first of its kind on a fresh stack pays a one-time cost besides
    (a cuDNN plan, a Triton compile: 841 against 22 ms for two text requests, 1,075 against 317 ms for
    two image ones), which a median of two or three takes in and adds to every loaded request."""
    planner = floor.planner(w)
    samples: dict[str, list[tuple[int, float]]] = {"text": [], "image": []}
    for record in unloaded:
        if record["topology"] != topology.label:
            continue
        cw = record["config"]
        if cw.get("video_count") or cw["image_count"] and cw["image_resolution"] != w["image_resolution"]:
            continue  # the plan models images, not clips
        t = traffic(Workload(**{k: cw[k] for k in Workload.model_fields}), 1e-9)
        base = planner.predict(topology.layout, t).ttft_by_images_ms
        for r in record["requests"]:
            if r["ok"] and r["images"] in base:
                samples["text" if r["images"] == 0 else "image"].append((r["images"],
                                                                         r["ttft"] - base[r["images"]] / 1e3))
    text = min((y for _, y in samples["text"]), default=0.0)
    o0, o1 = lower_line(samples["image"])
    return lambda n: text if n == 0 else o0 + o1 * n


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def lower_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope ≥ 0) of the line under ``points``: the slope is the median of the pairwise
    slopes (Theil-Sen: one slow point does not tilt it), the intercept the least residual, so that the
    line passes through the cheapest point. Fewer than three distinct x give a flat line at the least: two
    image counts make one pairwise slope, which a single stalled request sets (in
    bench/results/serving/qwen3-image-heavy-mixed a two-image request's 824 ms ViT forward against one
    image's 62 made it ~800 ms an image, and every aggregated prediction 3-4x the measurement)."""
    if not points:
        return 0.0, 0.0
    slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(points) for x2, y2 in points[i + 1:] if x2 != x1]
    slope = max(0.0, _median(slopes)) if len({x for x, _ in points}) >= 3 else 0.0
    return min(y - slope * x for x, y in points), slope


def sent_traffic(workload: Workload, rate: float, requests: list[dict]):
    """The traffic a point's requests were, for the model: its own share of image requests and their image
    counts (a point draws 8-30 requests, whose mix can stray far from the workload's nominal one — a mixed
    point of 26 had 4 image requests — and every topology of the point got the same ones)."""
    nominal = traffic(workload, rate)
    counts = [r["images"] for r in requests if r["images"] > 0]
    if not requests:
        return nominal
    return replace(nominal, image_share=len(counts) / len(requests), counts=counts or nominal.counts)


def plan_points(floor: Floor, runs: list[dict], unloaded: list[dict], chosen: list[Topology], cases: list[Case],
                tiny: bool) -> list[dict]:
    """Per point: each measured topology's predicted TTFT (calibrated, and the bare model's), the plan's
    pick among them, the measured best; the predictions are also written into the runs. Video points
    are not predicted: `epd plan` models images, not clips."""
    by_label = {t.label: t for t in chosen}
    out = []
    for case in cases:
        mine = [r for r in runs if r["workload"] == case.name]
        if case.video:
            for r in mine:
                r["predicted_ttft_ms"] = r["predicted_model_ttft_ms"] = None
        if case.video or not mine:  # (a floor has the costs of the workloads it measured, only)
            continue
        w = case_workload(case, tiny)
        planner = floor.planner(w)
        for rate in sorted({r["request_rate"] for r in mine}):
            here = [r for r in runs if r["workload"] == case.name and r["request_rate"] == rate]
            t = sent_traffic(Workload(**w), rate, here[0]["requests"])
            predictions: dict[str, Prediction] = {}
            for r in here:
                topology = by_label[r["topology"]]
                predictions[topology.label] = planner.predict(topology.layout, t,
                                                              overheads(floor, unloaded, topology, w))
                r["predicted_ttft_ms"] = predictions[topology.label].ttft_ms
                r["predicted_model_ttft_ms"] = planner.predict(topology.layout, t).ttft_ms
            pick = recommend(list(predictions.values()), {label: by_label[label].layout for label in predictions})
            measured = best_run(here)
            entry = {"workload": case.name, "rate": rate, "fraction": here[0].get("fraction"),
                     "plan_pick": pick.layout if pick else None,
                     "measured_best": measured["topology"] if measured else None,
                     "measured_best_ttft_ms": measured["summary"]["ttft_ms"]["mean"] if measured else None,
                     "predictions": {r["topology"]: {"ttft_ms": r["predicted_ttft_ms"],
                                                     "model_ttft_ms": r["predicted_model_ttft_ms"],
                                                     "tpot_ms": predictions[r["topology"]].tpot_ms,
                                                     "by_images_ms": predictions[r["topology"]].ttft_by_images_ms,
                                                     "stages_ms": predictions[r["topology"]].stages_ms}
                                     for r in here}}
            if measured and pick:
                picked = next(r for r in here if r["topology"] == pick.layout)["summary"]["ttft_ms"]["mean"]
                best_ms = entry["measured_best_ttft_ms"]
                entry["pick_right"] = pick.layout == measured["topology"] or picked <= (1 + TIE) * best_ms
                predicted = predictions[measured["topology"]].ttft_ms
                entry["prediction_error"] = predicted / best_ms - 1 if math.isfinite(predicted) else None
            out.append(entry)
    return out


def best_run(runs: list[dict], among=None) -> dict | None:
    """The run with the lowest mean TTFT, among those that lost no request (if any did not)."""
    candidates = [r for r in runs if among is None or r["topology"] in among]
    clean = [r for r in candidates if r["summary"]["failed"] == 0 and r["summary"]["completed"]] or \
        [r for r in candidates if r["summary"]["completed"]]
    return min(clean, key=lambda r: r["summary"]["ttft_ms"]["mean"]) if clean else None


# -- targets -----------------------------------------------------------------------------------------------
def targets(runs: list[dict], plan: list[dict]) -> list[dict]:
    out = []

    def add(name: str, measured: str, target: str, met: bool | None) -> None:
        out.append({"target": name, "measured": measured, "target_value": target, "met": met})

    epd = lambda r: not r["topology"].startswith("aggregated")  # noqa: E731
    for case in CASES:
        half = [r for r in runs if r["workload"] == case.name and r.get("fraction") == 0.5]
        best = best_run(half)
        if best and best.get("floor_ms"):
            ratio = best["summary"]["ttft_ms"]["mean"] / best["floor_ms"]["floor_ms"]
            f = best["floor_ms"]
            add(f"{case.name} @ 50 % ({best['request_rate']:g} req/s): best mean TTFT ≤ 1.5× floor",
                f"{best['topology']}: {best['summary']['ttft_ms']['mean']:.0f} ms = {ratio:.2f}× floor "
                f"{f['floor_ms']:.0f} ms; stages media / encode / to first token {stages(best['stages_ms'])} against "
                f"media / ViT / prefill {f['media_ms']:.0f} / {f['vit_ms']:.0f} / {f['prefill_ms']:.0f}",
                "≤ 1.5×", ratio <= 1.5)
    half = [r for r in runs if r["workload"] == "dynamo-1024" and r.get("fraction") == 0.5]
    agg, best = best_run([r for r in half if not epd(r)]), best_run([r for r in half if epd(r)])
    if agg and best:
        ratio = agg["summary"]["ttft_ms"]["mean"] / best["summary"]["ttft_ms"]["mean"]
        add("dynamo-1024 @ 50 %: EPD TTFT ≥ 2.5× lower than aggregated (Dynamo: −58 %)",
            f"aggregated {agg['summary']['ttft_ms']['mean']:.0f} ms / {best['topology']} "
            f"{best['summary']['ttft_ms']['mean']:.0f} ms = {ratio:.2f}×", "≥ 2.5×", ratio >= 2.5)
    half = [r for r in runs if r["workload"] == "dynamo-mix" and r.get("fraction") == 0.5]
    agg, best = best_run([r for r in half if not epd(r)]), best_run([r for r in half if epd(r)])
    if agg and best and {"text", "image"} <= set(agg["classes"]) & set(best["classes"]):
        text = [x["classes"]["text"]["ttft_ms"]["mean"] for x in (agg, best)]
        image = [x["classes"]["image"]["ttft_ms"]["mean"] for x in (agg, best)]
        add("dynamo-mix @ 50 %: EPD text TTFT ≤ aggregated's (Dynamo: −42 %)",
            f"{best['topology']} {text[1]:.0f} ms vs aggregated {text[0]:.0f} ms", "≤ aggregated", text[1] <= text[0])
        cut = 1 - image[1] / image[0]
        add("dynamo-mix @ 50 %: EPD image TTFT ≥ 31 % lower (Dynamo: −31 %)",
            f"{best['topology']} {image[1]:.0f} ms vs aggregated {image[0]:.0f} ms = {cut:+.0%} lower",
            "≥ 31 % lower", cut >= 0.31)
    for rate in sorted({r["request_rate"] for r in runs if r["workload"] == "image-heavy"}):
        here = [r for r in runs if r["workload"] == "image-heavy" and r["request_rate"] == rate]
        agg = next((r for r in here if not epd(r)), None)
        others = [r for r in here if epd(r)]
        if agg and others:
            top = max(others, key=lambda r: r["summary"]["goodput"])
            add(f"image-heavy @ {rate:g} req/s: EPD goodput ≥ aggregated's",
                f"{top['topology']} {top['summary']['goodput']:.2f} vs aggregated {agg['summary']['goodput']:.2f} req/s",
                "≥ aggregated", top["summary"]["goodput"] >= agg["summary"]["goodput"])
    judged = [p for p in plan if "pick_right" in p]
    if judged:
        right = sum(p["pick_right"] for p in judged)
        add("epd plan names the measured-best layout at every point",
            f"{right} of {len(judged)} points (a pick within {TIE:.0%} of the best's TTFT counts)",
            "every point", right == len(judged))
        close = [p for p in judged if p.get("prediction_error") is not None and abs(p["prediction_error"]) <= 0.25]
        add("epd plan predicts the measured best's TTFT within 25 %", f"{len(close)} of {len(judged)} points",
            "every point", len(close) == len(judged))
    return out


# -- tables ------------------------------------------------------------------------------------------------
def unloaded_row(topology: str, w: dict, unloaded: list[dict]) -> dict | None:
    """A workload's unloaded figures for one topology: its classes' requests pooled with the workload's
    text share as weights (means weighted, p99 over the pooled requests)."""
    keys = class_keys(w)
    records = {kind: next((u for u in unloaded if u["topology"] == topology and u["request_class"] == key), None)
               for kind, key in keys.items()}
    if any(r is None for r in records.values()):
        return None
    share = {kind: w.get("text_ratio", 0) if kind == "text" else 1 - w.get("text_ratio", 0) for kind in keys}
    results = [as_result(q) for r in records.values() for q in r["requests"]]
    summary = summarize(results, 1.0)
    summary["ttft_ms"]["mean"] = sum(share[k] * r["summary"]["ttft_ms"]["mean"] for k, r in records.items())
    means = {}
    for stage in ("media", "encode", "first_token"):  # as the frontend's: over the requests that have the stage
        having = {k: r["stages_ms"][stage] for k, r in records.items() if stage in r["stages_ms"]}
        if having:
            means[stage] = sum(share[k] * v for k, v in having.items()) / sum(share[k] for k in having)
    media = records.get(media_kind(w), {}).get("encoder_ms", {})
    encoder = {k: media[k] for k in (*scrape.ENCODER_STAGES, *scrape.ENCODER_COUNTS) if k in media}
    parts = next(iter(records.values()))["floor_ms"]
    floor = {k: sum(share[kind] * r["floor_ms"][k] for kind, r in records.items()) for k in parts}
    return {"topology": topology, "request_rate": None, "summary": summary,
            "classes": {k: r["summary"] for k, r in records.items()} if len(records) > 1 else {},
            "stages_ms": means, "encoder_ms": encoder, "floor_ms": floor,
            "resumed": sum(r["resumed"] for r in records.values())}


def report(meta: dict, floor: Floor, runs: list[dict], unloaded: list[dict], plan: list[dict],
           goals: list[dict], stacks: list[dict], cases: list[Case], tiny: bool) -> str:
    lines = [f"Hardware: {meta['hardware']}", f"Host: {json.dumps(meta.get('host'))}",
             f"Versions: {json.dumps(meta['versions'])}",
             f"Command: {' '.join(meta['command'])}", f"Wall time: {meta['wall_s']:.0f} s (floor measured in "
             f"{floor.data.get('seconds', 0):.0f} s)", "",
             f"SLO for goodput: TTFT ≤ {SLO.ttft_ms:g} ms and each request's own p99 inter-token gap ≤ "
             f"{SLO.itl_ms:g} ms. ITL p99: over the pooled gaps of a point. Floor: a request's media decode + ViT "
             "forward + prefill, each measured alone in-process (means over the point's own requests); "
             f"unloaded: one request at a time on the warm stack ({UNLOADED_TOKENS} tokens out). Rates: "
             + ("fractions of the rate each stack sustained (## Saturation)."
                if any(r.get("of_saturation") for r in runs)
                else "fractions of the workload's floor capacity (one GPU doing nothing but its compute)."), ""]
    for info in stacks:
        if "error" in info:
            lines.append(f"**{info['topology']} did not run**: {info['error'].splitlines()[0]}")
        for error in info.get("point_errors", []):
            lines.append(f"**{info['topology']}, point lost**: {error}")
        if info["topology"].endswith("+MPS") and not info.get("ready", {}).get("mps"):
            lines.append(f"**{info['topology']} ran without an MPS daemon** (`stack.ready` says mps=false"
                         + (": no GPU here)" if tiny else ")"))
    lines.append(f"Transport: {meta.get('transport', '?')}; stacks: " + "; ".join(
        f"{info['topology']} up in {info.get('start_s', 0):.0f} s" for info in stacks if "start_s" in info))
    lines += saturation_table(stacks)
    lines += ["", "## Floor", "", "| shape | prompt tokens | media (ms) | ViT (ms) | prefill (ms) | floor (ms) |",
              "|---|---|---|---|---|---|"]
    for r in floor.data["shapes"]:
        lines.append(f"| {shape_label(r)} | {r['prompt_tokens']} | "
                     f"{r['media_ms']:.1f} | {r['vit_ms']:.1f} | {r['prefill_ms']:.1f} | {r['floor_ms']:.1f} |")
    for case in cases:
        mine = [r for r in runs if r["workload"] == case.name]
        if not mine:
            continue
        w = case_workload(case, tiny)
        expected = floor.expected(w)
        rates = ", ".join(f"{rate:g}" + (f" ({fraction:.0%}{' of saturation' if sat else ''})" if fraction else "")
                          for rate, fraction, sat in sorted({(r["request_rate"], r.get("fraction"),
                                                              bool(r.get("of_saturation"))) for r in mine}))
        lines += ["", f"## {case.name}: {describe(w)}", "",
                  f"Floor over the workload's requests: media {expected['media_ms']:.0f} + ViT {expected['vit_ms']:.0f} "
                  f"+ prefill {expected['prefill_ms']:.0f} = **{expected['floor_ms']:.0f} ms**; capacity "
                  f"{floor.capacity(w):.2f} req/s per GPU; rates {rates}.", "", HEADER]
        for topology in ordered_labels(r["topology"] for r in mine):
            idle = unloaded_row(topology, w, unloaded)
            if idle:
                lines.append(row_text(idle))
            lines += [row_text(r) for r in sorted(mine, key=lambda r: r["request_rate"]) if r["topology"] == topology]
    lines += ["", "## epd plan against the measurements", ""]
    if clips := [c.name for c in cases if c.video and any(r["workload"] == c.name for r in runs)]:
        lines += [f"Not predicted: {', '.join(clips)} (`epd plan` models images, not clips).", ""]
    lines += ["| workload | rate (req/s) | measured best (TTFT ms) | plan's pick | right | predicted TTFT of the best (error) "
              "| every topology: predicted (model alone) / measured (ms) |", "|---|---|---|---|---|---|---|"]
    for p in plan:
        measured = {r["topology"]: r["summary"]["ttft_ms"]["mean"] for r in runs
                    if r["workload"] == p["workload"] and r["request_rate"] == p["rate"]}
        each = "; ".join(f"{label} {ms(q['ttft_ms'])} ({ms(q['model_ttft_ms'])}) / {ms(measured.get(label))}"
                         for label, q in p["predictions"].items())
        best = p["measured_best"]
        err = p.get("prediction_error")
        lines.append(f"| {p['workload']} | {p['rate']:g} | {best} ({ms(p['measured_best_ttft_ms'])}) | {p['plan_pick']} "
                     f"| {'yes' if p.get('pick_right') else 'no'} | "
                     f"{ms(p['predictions'][best]['ttft_ms']) if best else '-'}"
                     f"{f' ({err:+.0%})' if err is not None else ''} | {each} |")
    lines += ["", "## Targets", "", "| target | measured | target | met |", "|---|---|---|---|"]
    lines += [f"| {g['target']} | {g['measured']} | {g['target_value']} | {'yes' if g['met'] else 'no'} |" for g in goals]
    return "\n".join(lines) + "\n"



def saturation_table(stacks: list[dict]) -> list[str]:
    """results.md's rates each stack sustained (``--saturate``), measured or given."""
    found = [(name, info["topology"], sat) for info in stacks for name, sat in info.get("saturation", {}).items()]
    if not found:
        return []
    lines = ["", "## Saturation", "", "Each stack's own: a burst of requests sent at once, those completed over "
             "the time from the send to the last completion; the stack ran full but for the tail after the last "
             "first token, so the rate errs low (by the tail's share and a little more).", "",
             "| workload | topology | sustained (req/s) | done in (s) | tail (s) | burst: sent, failed | from |",
             "|---|---|---|---|---|---|---|"]
    for name, topology, sat in found:
        rate = f"{sat['rate']:.3g}" if sat.get("rate") else f"not measured: {sat.get('why', '?')}"
        span, tail = (f"{sat[k]:.1f}" if k in sat else "-" for k in ("makespan_s", "tail_s"))
        burst = f"{sat['requests']}, {sat.get('failed', 0)}" if "requests" in sat else "-"
        lines.append(f"| {name} | {topology} | {rate} | {span} | {tail} | {burst} | {sat.get('from', 'measured')} |")
    return lines


def describe(w: dict) -> str:
    if w.get("video_count"):
        return f"{w['video_count']} x {clip_label(w)}; {w['input_len']} text tokens in, {w['output_len']} out"
    images = (f"1-{w['image_count']}" if w.get("random_image_count") else str(w["image_count"])) + \
        f" x {w['image_resolution']}"
    text = f"{w['text_ratio']:.0%} text only, the rest " if w.get("text_ratio") else ""
    return f"{text}{images}; {w['input_len']} text tokens in, {w['output_len']} out"


# -- the whole run -----------------------------------------------------------------------------------------
def tokenizer_dir(tiny: bool, model: str = "qwen2.5-vl-7b") -> str:
    from shared.model.presets import materialize_preset
    from shared.model.tiny import default_tiny_checkpoint

    return str(default_tiny_checkpoint() if tiny else materialize_preset(model))


CONTEXT = 32768  # the stacks' and the floor's max_model_len, unless a clip's prompt needs more


def context_length(checkpoint: str, cases: list[Case]) -> int:
    """The stacks' (and the floor's) max_model_len: ``CONTEXT``, or more where a clip's prompt needs it (a
    30 s 720p clip is ~36k placeholder tokens on Qwen2.5-VL), in steps of 8192."""
    from shared.model.config import ModelConfig
    from shared.model.video import VideoGeometry

    longest = 0
    for case in (c for c in cases if c.video):
        w = case_workload(case, False)
        geometry = VideoGeometry.from_checkpoint(checkpoint, ModelConfig.from_checkpoint(checkpoint).family)
        width, height = parse_resolution(w["video_resolution"])
        frames = geometry.sampled_count(round(w["video_seconds"] * w["video_fps"]), w["video_fps"])
        longest = max(longest, geometry.num_tokens(frames, height, width) + 1024)  # + text, timestamps, output
    return max(CONTEXT, -(-longest // 8192) * 8192)


def chosen_cases(args) -> list[Case]:
    """``--workloads``, by default every image workload (clips only when named: a sweep of every
    topology on one GPU already takes more than one call)."""
    cases = workload_cases(args.video_seconds)
    names = [c.name for c in cases]
    wanted = args.workloads.split(",") if args.workloads else [c.name for c in cases if not c.video]
    if unknown := set(wanted) - set(names):
        raise SystemExit(f"unknown workload(s) {', '.join(sorted(unknown))}; choose from {', '.join(names)}")
    return [c for c in cases if c.name in wanted]


def chosen_topologies(args) -> list[Topology]:
    every = topologies(args.gpus, args.tiny)
    # on CPU there is no MPS daemon: a +MPS stack (--mps auto) would be its plain twin, started again
    default = [t.label for t in every if not (args.tiny and t.layout.mps)]
    wanted = args.topologies.split(",") if args.topologies else default
    if unknown := set(wanted) - {t.label for t in every}:
        raise SystemExit(f"unknown topolog(ies) {', '.join(sorted(unknown))}; on {max(1, args.gpus)} GPU(s): "
                         f"{', '.join(t.label for t in every)}")
    return [t for t in every if t.label in wanted]


def points(args, cases: list[Case], floor: Floor | None) -> list[Point]:
    out = []
    for case in cases:
        for fraction, rate in rates_of(args, case, floor):
            out.append(Point(case, fraction, rate, args.seed + 100 * len(out), saturation=bool(args.saturate)))
    return out


def clip_s(w: dict) -> tuple[float, float]:
    """(seconds of one clip request alone, seconds to make its clip) on one H200 and its host: guesses
    for --dry-run, scaled from a 20 s 720p clip (decode ~1 s, ViT + prefill ~1.5 s; x264 ~4 CPU-seconds,
    8 encoding threads); (0, 0) for a workload without clips."""
    scale = w["video_seconds"] / 20 if w.get("video_count") else 0.0
    return 2.5 * scale, 4.0 / 8 * scale


def estimate(args, chosen: list[Topology], classes: list[RequestClass], todo: list[Point],
             floor: Floor | None = None) -> dict[str, float]:
    """Seconds each part should take on one H200 (from BASELINES.md-like costs): for --dry-run."""
    warm_ups = {warm_shape(c.workload): c.workload for c in classes}
    requests = [(c.workload, args.unloaded) for c in classes] + [(w, WARM_UPS) for w in warm_ups.values()]
    unloaded = sum(n * (0.5 + sum(clip_s(w))) for w, n in requests)
    loaded = 0.0
    for p in todo:  # arrivals, the last request's decode (~10 ms a token), reading the metrics; making clips
        w = case_workload(p.case, False)
        prompts = max(args.min_prompts, min(150, round(p.rate * args.seconds)))
        loaded += prompts / p.rate + w["output_len"] * 0.010 + 1.0 + prompts * clip_s(w)[1]
    if args.saturate and not args.saturation_from:  # a burst: its requests at the floor capacity, the last decode
        for case in {p.case.name: p.case for p in todo}.values():
            last_decode = case_workload(case, False)["output_len"] * 0.010
            loaded += saturation_requests(args, case, floor) / capacity_of(args, case, floor) + last_decode
    per_stack = 30 + 8 + unloaded + loaded  # start (7B, dummy weights; measured ~30 s) + stop + measuring
    # the floor: load the 7B once, capture graphs, time every shape; a clip: made, decoded 4 times, 4 ViT
    # forwards, 3 prefills
    clips = sum(10 * clip_s(case_workload(c, False))[0] for c in {p.case.name: p.case for p in todo}.values())
    floor = 0.0 if args.floor else 75.0 + clips
    return {"floor": floor, "per topology": per_stack, "total": floor + per_stack * len(chosen)}


def dry_run(args, chosen, classes, todo, floor: Floor | None) -> int:
    print(f"floor: python -m tools.plan.floor (in-process, every shape of {len({p.case.name for p in todo})} "
          f"workload(s)) {'— from ' + args.floor if args.floor else ''}")
    print(f"rates from {'the floor file' if floor else 'nominal H200 capacities (the real run sets them from the floor)'}")
    for p in todo:
        prompts = 3 if args.tiny else max(args.min_prompts, min(150, round(p.rate * args.seconds)))
        print(f"  point {p.case.name:12} {p.rate:6g} req/s" + (
            f" ({p.fraction:.0%} of the saturation measured on each stack; the floor capacity's here)" if p.saturation
            else f" ({p.fraction:.0%} of capacity)" if p.fraction else "") + f", {prompts} requests, seed {p.seed}")
    if args.saturate:
        source = f"given by {args.saturation_from}" if args.saturation_from else "measured on each stack, a burst of"
        print("saturation " + source + ("" if args.saturation_from else ": " + "; ".join(
            f"{case.name} {saturation_requests(args, case, floor)} requests" for case in
            {p.case.name: p.case for p in todo}.values())))
    print(f"unloaded classes (one request at a time; {WARM_UPS} warm-up requests per resolution first): "
          + "; ".join(c.key for c in classes))
    for t in chosen:
        settings = "".join(f"{name}={value} " for name, value in args.stack_env)
        print(f"stack {t.label:12} {settings}python -m launcher.cli up --port 0 {' '.join(t.args)}")
    if not args.tiny:
        times = estimate(args, chosen, classes, todo, floor)
        print(f"estimated: floor ~{times['floor']:.0f} s, ~{times['per topology']:.0f} s per topology, "
              f"total ~{times['total'] / 60:.1f} min")
        fit = max(1, int((540 - times["floor"]) // times["per topology"]))  # topologies per 10-minute call
        if len(chosen) > fit:  # the baseline and the MPS layouts first: the likeliest best
            ranked = sorted(chosen, key=lambda t: (t.layout.topology != "aggregated", not t.layout.mps))
            print(f"more than one 10-minute call: run --topologies {','.join(t.label for t in ranked[:fit])} "
                  f"--deadline 560, then --topologies {','.join(t.label for t in ranked[fit:])} --floor <the "
                  f"first's floor.json> (the same rates), and merge them with --report-from A/results.json "
                  f"B/results.json")
    return 0


def finish(args, out: Path, meta: dict, floor: Floor, runs, unloaded, stacks, chosen, partial: bool = False) -> int:
    cases = workload_cases(args.video_seconds)
    by_name = {c.name: c for c in cases}
    for run in runs:
        run["floor_ms"] = floor.mean(case_workload(by_name[run["workload"]], args.tiny), run["requests"])
    for record in unloaded:  # its own settings name its shape
        record["floor_ms"] = floor.mean(record["config"], record["requests"])
    plan = plan_points(floor, runs, unloaded, chosen, cases, args.tiny)
    goals = targets(runs, plan)
    markdown = report(meta, floor, runs, unloaded, plan, goals, stacks, cases, args.tiny)
    (out / "results.md").write_text(markdown)
    (out / "results.json").write_text(json.dumps({**meta, "gpus": args.gpus, "tiny": args.tiny,
                                                  "video_seconds": args.video_seconds, "floor": floor.data,
                                                  "stacks": stacks, "unloaded": unloaded, "runs": runs, "plan": plan,
                                                  "targets": goals, "partial": partial}, indent=1, default=json_default))
    if partial:
        return 0
    print("\n" + markdown)
    if not runs:  # no stack came up: results.md says why, there is nothing to draw
        return 1
    try:
        from tools.bench.plot import plot

        plot(runs, str(out / "latency_vs_rate.png"), "Every topology against its floor" + (" (tiny, CPU)" if args.tiny else ""))
    except ImportError:  # no matplotlib here: draw it elsewhere from results.json
        print(f"matplotlib missing: run `epd bench plot {out / 'results.json'}` where it is installed")
    lost = sum(r["summary"]["failed"] for r in runs)
    return 0 if not lost and all("error" not in s for s in stacks) else 1


def read_results(path: str) -> dict:
    """One earlier results.json (gzipped or not: bench/results/ keeps large ones as .json.gz)."""
    raw = Path(path).read_bytes()
    return json.loads(gzip.decompress(raw) if path.endswith(".gz") else raw)


def load_results(paths: list[str]) -> dict:
    """Earlier results.json files as one run: the first one's floor and settings, every file's stacks,
    unloaded records and runs; ``chosen`` the topologies they ran."""
    loaded = [read_results(f) for f in paths]
    first = loaded[0]
    stacks = [s for data in loaded for s in data["stacks"]]
    labels = [s["topology"] for s in stacks]
    chosen = [Topology(label, Layout(**next(s["layout"] for s in stacks if s["topology"] == label)), ())
              for label in dict.fromkeys(labels)]
    runs = [r for d in loaded for r in d["runs"]]
    for run in runs:
        run.setdefault("floor_ms", {})
    return {"meta": {**{k: first[k] for k in ("hardware", "versions")}, "host": first.get("host"),
                     "transport": first.get("transport"),
                     "wall_s": sum(d["wall_s"] for d in loaded)},
            "tiny": first["tiny"], "gpus": first["gpus"], "video_seconds": first.get("video_seconds", 0),
            "floor": Floor(first["floor"], first.get("transport", "zmq")), "stacks": stacks, "chosen": chosen,
            "runs": runs, "unloaded": [u for d in loaded for u in d["unloaded"]]}


def report_from(args, out: Path) -> int:
    """Rebuild the report from earlier results.json files (merged; the first one's floor), with today's planner."""
    data = load_results(args.report_from)
    args.tiny, args.gpus, args.video_seconds = data["tiny"], data["gpus"], data["video_seconds"]
    return finish(args, out, {**data["meta"], "command": sys.argv}, data["floor"], data["runs"], data["unloaded"],
                  data["stacks"], data["chosen"])


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/epd_vs_aggregated", help="directory for results")
    parser.add_argument("--quick", action="store_true", help="one point per workload at 50 %% of its capacity "
                                                             "(image-heavy: 50 and 80 %%)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test of the same path on the built-in tiny model")
    parser.add_argument("--dry-run", "--plan-only", action="store_true", help="print what would run and how long")
    parser.add_argument("--gpus", type=int, default=-1, help="GPUs to use (default: every visible one)")
    parser.add_argument("--topologies", default="", help="comma-separated labels to run (default: all)")
    parser.add_argument("--workloads", default="", help="comma-separated workloads to run (default: all)")
    parser.add_argument("--fractions", default="", help="points as fractions of each workload's capacity, e.g. 0.5,0.8")
    parser.add_argument("--rates", default="", help="absolute rates instead (req/s): for every workload, e.g. 1,2; "
                        "or per workload, e.g. image-heavy=0.86,mixed=4.4,mixed=3 (a workload not named is not run)")
    parser.add_argument("--saturate", default="", metavar="FRACTIONS",
                        help="points as fractions of the rate each stack sustains, measured on it first with a "
                             "burst, e.g. 0.9 (instead of --fractions/--rates)")
    parser.add_argument("--saturation-requests", type=int, default=0,
                        help="requests of a saturation burst (0: ~%g s of the workload's floor capacity, %d-%d)"
                             % (SATURATION_SECONDS, *SATURATION_REQUESTS))
    parser.add_argument("--saturation-from", default="", metavar="RESULTS_JSON",
                        help="with --saturate: the rates an earlier run measured (per workload and topology) "
                             "instead of measuring them, e.g. the same rates with a setting on and off")
    parser.add_argument("--seconds", type=float, default=8.0, help="seconds of arrivals per loaded point")
    parser.add_argument("--min-prompts", type=int, default=8, help="requests per loaded point at least")
    parser.add_argument("--unloaded", type=int, default=5, help="requests per class measured one at a time")
    parser.add_argument("--request-timeout", type=float, default=60.0, help="seconds one request may take (a "
                        "collapsed point must not eat the GPU time of the rest)")
    parser.add_argument("--kv-cache-mb", type=int, default=0, help="KV pool of every LM process (MiB; 0: sized "
                        "from each process's share of the GPU, as a user's stack is)")
    parser.add_argument("--max-batched-tokens", type=int, default=0,
                        help="every LM worker's step budget (EPD_MAX_BATCHED_TOKENS; 0: the engine's default)")
    parser.add_argument("--stack-env", action="append", default=[], metavar="EPD_NAME=VALUE", type=stack_setting,
                        help="a setting for every process of every stack (repeatable; the stacks see no other EPD_ "
                             "variable of this shell), e.g. EPD_TARGET_ITL_MS=0")
    parser.add_argument("--stack-log", default="", metavar="DIR",
                        help="keep every stack's log lines, one file per topology in DIR")
    parser.add_argument("--model", default="qwen2.5-vl-7b", choices=sorted(PRESETS),
                        help="the preset every stack serves with dummy weights (qwen3-vl-30b-a3b: the MoE model the "
                             "references run EPD on)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deadline", type=float, default=0, help="seconds: start no topology that would end the "
                                                                  "run past this (judged by the previous one's time)")
    parser.add_argument("--floor", default="", help="reuse an earlier run's floor (its floor.json, or results.json[.gz]) "
                                                    "instead of measuring it: the same rates, e.g. to split a sweep")
    parser.add_argument("--transport", default="auto", choices=("auto", "zmq", "ucx"),
                        help="the stacks' data plane; auto: ucx where ucxx is installed (GPU to GPU), else zmq")
    parser.add_argument("--report-from", nargs="+", default=[], metavar="RESULTS_JSON",
                        help="no measuring: rebuild results.md/json from earlier results.json files (merged; "
                             "gzipped ones too)")
    parser.add_argument("--video-seconds", type=float, default=0,
                        help="video-heavy's clip length, %g-%g s (default 20 s; --tiny: a 2 s clip)" % VIDEO_SECONDS)
    args = parser.parse_args(argv)
    if args.video_seconds and not VIDEO_SECONDS[0] <= args.video_seconds <= VIDEO_SECONDS[1]:
        parser.error(f"--video-seconds {args.video_seconds:g}: the issue's clips are {VIDEO_SECONDS[0]:g}-"
                     f"{VIDEO_SECONDS[1]:g} s long")
    named = [r.split("=", 1)[0] for r in args.rates.split(",") if "=" in r]
    if named and (unknown := set(named) - {c.name for c in workload_cases(VIDEO_SECONDS[0])}):
        parser.error(f"--rates names unknown workload(s) {', '.join(sorted(unknown))}")
    if named and len(named) < len(args.rates.split(",")):
        parser.error("--rates: give every rate as workload=rate, or none")
    if args.saturate:
        if args.rates or args.fractions or args.quick:
            parser.error("--saturate sets the points: leave out --rates, --fractions and --quick")
        try:
            wrong = [f for f in fractions_of(args.saturate) if not 0 < f <= 1.5]
        except ValueError:
            wrong = [args.saturate]
        if wrong or not fractions_of(args.saturate):
            parser.error(f"--saturate {args.saturate}: fractions of the saturation, each in (0, 1.5], e.g. 0.9")
    elif args.saturation_from:
        parser.error("--saturation-from goes with --saturate (the fractions of those rates)")
    if args.saturation_requests and not 8 <= args.saturation_requests <= 256:
        parser.error("--saturation-requests: 8-256 (the burst must outlast the stack's batch, and the frontend "
                     "answers more than 256 in flight with 429)")
    args.saturation_given = saturation_given(args.saturation_from) if args.saturation_from else {}
    if args.transport == "auto":
        args.transport = "ucx" if not args.tiny and ucx_works() else "zmq"
    return args


def saturation_given(path: str) -> dict[tuple[str, str], dict]:
    """(workload, topology) → the saturation an earlier run measured (``--saturation-from``)."""
    try:
        stacks = read_results(path)["stacks"]
    except (OSError, ValueError, KeyError) as err:
        raise SystemExit(f"--saturation-from {path}: not a results.json of this script ({err})")
    given = {(name, info["topology"]): {**found, "from": path} for info in stacks
             for name, found in info.get("saturation", {}).items() if found.get("rate")}
    if not given:
        raise SystemExit(f"--saturation-from {path}: it measured no saturation (run it with --saturate)")
    return given


def ucx_works() -> bool:
    """Whether ucxx imports (in a child: a broken UCX install must not take this process with it)."""
    if importlib.util.find_spec("ucxx") is None:
        return False
    return subprocess.run([sys.executable, "-c", "import ucxx"], capture_output=True, timeout=120).returncode == 0


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report_from:
        return report_from(args, out)
    args.gpus = (0 if args.tiny else visible_gpus()) if args.gpus < 0 else args.gpus
    cases, chosen = chosen_cases(args), chosen_topologies(args)
    if args.saturation_from and (missing := [f"{c.name} on {t.label}" for t in chosen for c in cases
                                             if (c.name, t.label) not in args.saturation_given]):
        raise SystemExit(f"--saturation-from {args.saturation_from} measured no saturation of {', '.join(missing)}: "
                         "run those with --saturate alone, or leave them out")
    classes = request_classes(cases, args.tiny)
    floor = None
    if args.floor:  # a floor.json, or an earlier run's results.json (its floor)
        data = read_results(args.floor)
        floor = Floor(data.get("floor", data), args.transport)
        if missing := [shape for case in cases for shape in floor.missing(case_workload(case, args.tiny))]:
            raise SystemExit(f"--floor {args.floor} did not measure {', '.join(missing)}: take the floor of a run "
                             "with these workloads (and --tiny alike)")
    if args.dry_run:
        return dry_run(args, chosen, classes, points(args, cases, floor), floor)
    args.started = time.monotonic()
    tokenizer = tokenizer_dir(args.tiny, args.model)
    args.max_model_len = CONTEXT if args.tiny else context_length(tokenizer, cases)
    started = start_stacks(args, chosen) if args.tiny else {}
    try:
        floor = floor or Floor(measure_floor(args, cases, out / "floor.json"), args.transport)
    except BaseException:
        for stack, _ in started.values():
            stack.stop()
        raise
    todo = points(args, cases, floor)
    args.saturation_n = {case.name: saturation_requests(args, case, floor) for case in cases}
    meta = {"hardware": hardware(), "host": host(), "versions": versions(), "command": sys.argv,
            "transport": args.transport}

    def checkpoint(unloaded, runs, stacks, partial=True) -> int:
        meta["wall_s"] = time.monotonic() - args.started
        return finish(args, out, meta, floor, runs, unloaded, stacks, chosen, partial)

    unloaded, runs, stacks = sweep(args, chosen, classes, todo, tokenizer, checkpoint, started)
    return checkpoint(unloaded, runs, stacks, partial=False)


if __name__ == "__main__":
    sys.exit(main())
