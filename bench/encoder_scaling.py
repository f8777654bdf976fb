#!/usr/bin/env python3
"""Encoder-tier scaling: vision-encoder images/s with 1, 2, ... N encoder processes, each on its own GPU.

The issue's target: throughput grows by at least 0.9x one encoder's for every encoder process added (up
to 4), i.e. scaling efficiency throughput(N) / (N x throughput(1)) >= 0.9.

For each N in ``--counts``: a fresh embedded nats-server (loopback, no auth), N encoder processes
(``python -m services.encoder``, encoder i on GPU i via CUDA_VISIBLE_DEVICES, embedding cache off so
every image runs the ViT), ready once the NATS service API lists all N. Then N client processes (one per
encoder, each with its own NATS connection and data plane) do what the frontend and prefill do for an
image: publish its pixels on the data plane, send an ``EncodeJob`` (``--concurrency`` jobs in flight per
client) and pull the embeddings back. ``--routing least-loaded`` (default, as the frontend's router
spreads new images): each job goes to the encoder with the fewest of this client's jobs in flight, on
its own subject ``<prefix>.encode.<instance>``; ``--routing queue``: the plain queue group
``<prefix>.encode``, where NATS picks an encoder at random (the frontend's fallback without discovery).

- Images: ``--images`` distinct random-pixel images per client (each its own content hash), made
  before anything is timed. Warm-up: ``--warmup`` more per client, sent straight to "its" encoder
  (``<prefix>.encode.<instance>``) so every encoder has compiled and warmed up, not timed.
- Throughput: completions (embeddings pulled) per second in the steady window, from the moment the
  first N x concurrency images are done (the pipeline is full) to the moment the first client has sent
  its last image (from then on load falls off). ``overall``: every image over the whole run, ramp-up
  and drain included.
- Latency per image: send of the job to the end of the embedding pull (mean, p50, p99); pull: its
  last part. Per encoder (NATS service STATS, change over the timed run): ViT images, batches, mean
  batch and the batch-size histogram (cumulative, ``le_k``: batches of at most k images). A mean batch
  near 1 with several jobs in flight means the ViT waits for its inputs (pixel pulls, preprocessing on
  the CPU) rather than the jobs waiting for the ViT.
- Client check: the busy share of each client's event loop (its thread's CPU time over the run); near
  100 % means the client, not the encoders, may set the pace, and the run says so.

    python3 bench/encoder_scaling.py --out $OUT/encoder_scaling.json --counts 1,2 \
        --model qwen2.5-vl-7b --load-format dummy
    python bench/encoder_scaling.py --tiny --counts 1,2 --images 12 --out /tmp/scaling.json   # CPU smoke test

``--tiny``: the built-in tiny model on CPU with 224x224 images. ``--encoder-args`` passes more flags to
every encoder (e.g. ``"--preprocess-threads 4"``). The JSON is rewritten after every count, so a later
failure keeps the counts measured. Every process is stopped at the end (SIGTERM, then SIGKILL after a
grace period), on errors too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import queue
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import nats
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.epd_vs_aggregated import versions  # noqa: E402
from tools.bench.settings import parse_resolution  # noqa: E402
from services.frontend.media import content_hash  # noqa: E402
from launcher.stack import Stack  # noqa: E402
from shared.bus.calls import call, endpoint_data, service_stats  # noqa: E402
from shared.bus.subjects import Subjects  # noqa: E402
from shared.dataplane.plane import DataPlane  # noqa: E402
from shared.messages import pack, unpack  # noqa: E402
from shared.messages.encode import EncodeJob, EncodeResult  # noqa: E402
from launcher.processes import die_with_parent  # noqa: E402
from shared.settings import CommonSettings  # noqa: E402

TARGET = 0.9  # scaling efficiency the issue asks for
PREFIX = "scaling"
CLIENT_BUSY_WARNING = 0.8  # a client's event loop busier than this may be the limit


@dataclass(frozen=True)
class ClientSpec:
    index: int
    nats_url: str
    warm_on: str  # the encoder instance this client warms up
    images: int
    warmup: int
    concurrency: int
    width: int
    height: int
    transport: str
    timeout: float
    targets: tuple[str, ...]  # encoders' own subjects to spread jobs over; empty: the queue group


class Record(NamedTuple):
    """One image as a client saw it (``time.monotonic()``, one clock for every process of the host)."""

    sent: float  # pixels published, job sent
    replied: float  # the encoder's answer
    pulled: float  # embeddings pulled
    cached: bool
    tokens: int  # embedding rows (1080p: 2,691)


# -- the client processes ----------------------------------------------------------------------------------


def client_main(spec: ClientSpec, barrier, results) -> None:
    """Entry point of a client process: its records on ``results``, or its error (and the barrier broken)."""
    die_with_parent()
    try:
        results.put(asyncio.run(drive(spec, barrier)))
    except BaseException as err:
        results.put({"index": spec.index, "error": f"{type(err).__name__}: {err}"})
        barrier.abort()


async def drive(spec: ClientSpec, barrier) -> dict:
    pixels = [random_image(spec, i) for i in range(spec.warmup + spec.images)]
    hashes = [content_hash(p) for p in pixels]
    subjects = Subjects(PREFIX)
    nc = await nats.connect(spec.nats_url, name=f"scaling-client-{spec.index}")
    plane = DataPlane(spec.transport)
    await plane.start()
    try:
        warm = range(spec.warmup)
        await encode_all(nc, plane, spec, Router((subjects.encode_on(spec.warm_on),)),
                         [(pixels[i], hashes[i]) for i in warm])
        await asyncio.to_thread(barrier.wait)  # every encoder warmed up: the parent reads their stats
        await asyncio.to_thread(barrier.wait)  # go
        busy, started = time.thread_time(), time.monotonic()
        timed = range(spec.warmup, len(pixels))
        records = await encode_all(nc, plane, spec, Router(spec.targets or (subjects.encode,), spec.index),
                                   [(pixels[i], hashes[i]) for i in timed])
        ended = time.monotonic()
        return {"index": spec.index, "started": started, "ended": ended, "records": records,
                "loop_cpu_s": time.thread_time() - busy}
    finally:
        await plane.stop()
        await nc.close()


def random_image(spec: ClientSpec, number: int) -> np.ndarray:
    rng = np.random.default_rng([spec.index, number])
    return rng.integers(0, 256, (spec.height, spec.width, 3), dtype=np.uint8)


class Router:
    """Picks the subject with the fewest of this client's jobs in flight (ties: the next in turn)."""

    def __init__(self, subjects: tuple[str, ...], offset: int = 0):
        self.in_flight = dict.fromkeys(subjects, 0)
        self.turn = offset

    def take(self) -> str:
        order = list(self.in_flight)
        self.turn += 1
        rotated = order[self.turn % len(order):] + order[:self.turn % len(order)]
        subject = min(rotated, key=self.in_flight.__getitem__)
        self.in_flight[subject] += 1
        return subject

    def done(self, subject: str) -> None:
        self.in_flight[subject] -= 1


async def encode_all(nc, plane: DataPlane, spec: ClientSpec, router: Router, images: list) -> list[Record]:
    slots = asyncio.Semaphore(spec.concurrency)

    async def one(pixels: np.ndarray, digest: str) -> Record:
        async with slots:
            subject = router.take()
            try:
                return await encode_one(nc, plane, spec, subject, pixels, digest)
            finally:
                router.done(subject)

    return list(await asyncio.gather(*(one(p, h) for p, h in images)))


async def encode_one(nc, plane: DataPlane, spec: ClientSpec, subject: str, pixels: np.ndarray,
                     digest: str) -> Record:
    """One image, as the frontend and prefill handle it: pixels published, job answered, embeddings pulled."""
    sent = time.monotonic()
    handle = plane.publish(torch.from_numpy(pixels), consumers=None, lease=spec.timeout + 30)
    try:
        job = EncodeJob(request_id=uuid.uuid4().hex, image=handle, content_hash=digest)
        result = unpack(EncodeResult, await call(nc, subject, pack(job), spec.timeout, "encoder"))
    finally:
        plane.release(handle)
    replied = time.monotonic()
    await plane.pull(result.embedding)
    return Record(sent, replied, time.monotonic(), result.cached, result.embedding.shape[0])


# -- one measurement: N encoders, N clients ----------------------------------------------------------------


def measure(args, count: int) -> dict:
    stack = Stack.start_nats(encoder_env())
    clients: list = []
    patience = 2 * args.timeout + 120  # for a client's warm-up, or its run, to end
    try:
        gpu_of = spawn_encoders(stack, args, count)
        asyncio.run(stack.wait_ready({"encoder": count}, args.ready_timeout, PREFIX))
        instances = [s["instance"] for s in encoder_stats(stack.nats_url, count)]
        context = mp.get_context("spawn")
        barrier = context.Barrier(count + 1, timeout=patience)
        results = context.Queue()
        clients = [context.Process(target=client_main, args=(client_spec(args, stack, i, instances), barrier,
                                                              results), daemon=True) for i in range(count)]
        for client in clients:
            client.start()
        rendezvous(barrier, results)  # warmed up
        before = encoder_stats(stack.nats_url, count)
        rendezvous(barrier, results)  # go
        outcomes = collect(results, clients, stack, count, patience)
        after = encoder_stats(stack.nats_url, count)
        return summarize(args, count, outcomes, before, after, gpu_of)
    finally:
        stop_clients(clients)
        stack.stop(grace=30)


def encoder_env() -> dict[str, str]:
    """The encoders' environment: this one without EPD_* settings (the flags decide; EPD_CACHE_DIR stays:
    where the built-in model and presets are written), quiet logs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_") or k == "EPD_CACHE_DIR"}
    env.update(EPD_SUBJECT_PREFIX=PREFIX, EPD_LOG_LEVEL="warning", EPD_DRAIN_SECONDS="10",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    return env


def spawn_encoders(stack: Stack, args, count: int) -> dict[int, str | None]:
    """Start ``count`` encoders, encoder i on GPU ``args.gpus[i]`` (none on CPU); returns pid → GPU."""
    flags = ["--model", args.encoder_model, "--load-format", args.load_format, "--device", args.device,
             "--encoder-cache-mb", "0", "--transport", args.transport, *shlex.split(args.encoder_args)]
    gpu_of = {}
    for i in range(count):
        gpu = args.gpus[i] if args.device.startswith("cuda") else None
        process = stack.spawn("encoder", *flags, env={"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {})
        gpu_of[process.pid] = gpu
    return gpu_of


def client_spec(args, stack: Stack, index: int, instances: list[str]) -> ClientSpec:
    width, height = parse_resolution(args.resolution)
    subjects = Subjects(PREFIX)
    targets = tuple(subjects.encode_on(i) for i in instances) if args.routing == "least-loaded" else ()
    return ClientSpec(index=index, nats_url=stack.nats_url, warm_on=instances[index], images=args.images,
                      warmup=args.warmup, concurrency=args.concurrency, width=width, height=height,
                      transport=args.transport, timeout=args.timeout, targets=targets)


def encoder_stats(nats_url: str, count: int) -> list[dict]:
    """Every encoder's own figures (the ``data`` of its STATS) and its metadata, ordered by pid."""

    async def query() -> list[dict]:
        nc = await nats.connect(nats_url)
        try:
            return await service_stats(nc, "epd-encoder", wait=0.5)
        finally:
            await nc.close()

    mine = [s for s in asyncio.run(query()) if (s.get("metadata") or {}).get("prefix") == PREFIX]
    found = [{**endpoint_data(s), "pid": int(s["metadata"]["pid"]), "metadata": s["metadata"]} for s in mine]
    if len(found) != count:
        raise RuntimeError(f"{len(found)} of {count} encoders answered the STATS request")
    return sorted(found, key=lambda s: s["pid"])


def rendezvous(barrier, results) -> None:
    try:
        barrier.wait()
    except threading.BrokenBarrierError:
        raise RuntimeError("a client failed: " + first_error(results)) from None


def first_error(results) -> str:
    try:
        while True:
            outcome = results.get(timeout=5)
            if "error" in outcome:
                return f"client {outcome['index']}: {outcome['error']}"
    except queue.Empty:
        return "no error reported (timed out or killed)"


def collect(results, clients: list, stack: Stack, count: int, timeout: float) -> list[dict]:
    """Every client's outcome, failing early if a client or an encoder died."""
    outcomes, deadline = [], time.monotonic() + timeout
    while len(outcomes) < count:
        try:
            outcome = results.get(timeout=1)
        except queue.Empty:
            stack.check_alive()
            if any(c.exitcode not in (None, 0) for c in clients) or time.monotonic() > deadline:
                raise RuntimeError("a client died or timed out: " + first_error(results)) from None
            continue
        if "error" in outcome:
            raise RuntimeError(f"client {outcome['index']}: {outcome['error']}")
        outcomes.append(outcome)
    return outcomes


def stop_clients(clients: list, grace: float = 10.0) -> None:
    """SIGTERM to the clients still running (their results, if any, are in already), SIGKILL after ``grace``."""
    for client in clients:
        if client.is_alive():
            client.terminate()
    for client in clients:
        client.join(grace)
        if client.is_alive():
            client.kill()
            client.join()


# -- figures ---------------------------------------------------------------------------------------------


def summarize(args, count: int, outcomes: list[dict], before: list[dict], after: list[dict],
              gpu_of: dict[int, str | None]) -> dict:
    records = [r for o in outcomes for r in o["records"]]
    done = sorted(r.pulled for r in records)
    go = min(o["started"] for o in outcomes)
    window = (done[count * args.concurrency - 1], min(max(r.sent for r in o["records"]) for o in outcomes))
    wall = [o["ended"] - o["started"] for o in outcomes]
    return {
        "encoders": count,
        "images": len(records),
        "throughput": steady_rate(done, *window),
        "overall_throughput": len(records) / (done[-1] - go),
        "steady_window_s": window[1] - window[0],
        "latency_ms": percentiles([(r.pulled - r.sent) * 1e3 for r in records]),
        "pull_ms": percentiles([(r.pulled - r.replied) * 1e3 for r in records]),
        "tokens_per_image": sorted({r.tokens for r in records}),
        "cached": sum(r.cached for r in records),  # with the cache off: 0
        "client_loop_busy": [o["loop_cpu_s"] / w for o, w in zip(outcomes, wall)],
        "client_loop_ms_per_image": 1e3 * sum(o["loop_cpu_s"] for o in outcomes) / len(records),
        "per_encoder": [encoder_delta(b, a, gpu_of.get(a["pid"])) for b, a in zip(before, after)],
    }


def steady_rate(done: list[float], start: float, end: float) -> float:
    finished = sum(1 for t in done if start < t <= end)
    if end <= start or not finished:
        raise RuntimeError("no steady window (the load fell off before the pipeline was full): "
                           "raise --images or lower --concurrency")
    return finished / (end - start)


def percentiles(values: list[float]) -> dict[str, float]:
    return {"mean": float(np.mean(values)), "p50": float(np.percentile(values, 50)),
            "p99": float(np.percentile(values, 99))}


def encoder_delta(before: dict, after: dict, gpu: str | None) -> dict:
    """One encoder's figures over the timed run (the STATS counters after minus before)."""
    images, batches = after["images"] - before["images"], after["batches"] - before["batches"]
    histogram = {k.removeprefix("batch_size_"): after[k] - before[k] for k in after if k.startswith("batch_size_le_")}
    return {"gpu": gpu, "pid": after["pid"], "images": images, "batches": batches,
            "mean_batch": images / batches if batches else 0.0, "batch_sizes": histogram,
            "errors": after["errors"] - before["errors"], "images_total": after["images"],
            "metadata": after["metadata"]}


def add_scaling(runs: list[dict]) -> None:
    """Efficiency against the smallest count (throughput(N) / (N x throughput(1)) when it is 1), and the
    throughput each added encoder brought, in units of one encoder's."""
    base = min(runs, key=lambda r: r["encoders"])
    per_encoder = base["throughput"] / base["encoders"]
    previous = base
    for run in sorted(runs, key=lambda r: r["encoders"]):
        run["efficiency"] = run["throughput"] / (run["encoders"] * per_encoder)
        added = run["encoders"] - previous["encoders"]
        run["added_per_encoder"] = ((run["throughput"] - previous["throughput"]) / (added * per_encoder)
                                    if added else None)
        previous = run


HEADER = ("| encoders | images | img/s (steady) | img/s (overall) | efficiency | added / encoder "
          "| latency mean / p50 / p99 (ms) | pull mean (ms) | ViT images per encoder | mean batch "
          "| client loop busy |\n|---|---|---|---|---|---|---|---|---|---|---|")


def row(run: dict) -> str:
    lat, encoders = run["latency_ms"], run["per_encoder"]
    added = "-" if run["added_per_encoder"] is None else f"{run['added_per_encoder']:.2f}"
    return (f"| {run['encoders']} | {run['images']} | {run['throughput']:.2f} | {run['overall_throughput']:.2f} "
            f"| {run['efficiency']:.2f} | {added} | {lat['mean']:.0f} / {lat['p50']:.0f} / {lat['p99']:.0f} "
            f"| {run['pull_ms']['mean']:.1f} | {' / '.join(str(e['images']) for e in encoders)} "
            f"| {' / '.join(format(e['mean_batch'], '.1f') for e in encoders)} "
            f"| {max(run['client_loop_busy']):.0%} |")


def client_warning(run: dict) -> str:
    busiest = max(run["client_loop_busy"])
    if busiest < CLIENT_BUSY_WARNING:
        return ""
    return (f"warning: with {run['encoders']} encoder(s) a client's event loop was busy {busiest:.0%} of the run "
            f"({run['client_loop_ms_per_image']:.1f} ms of its CPU per image): the clients may be the limit")


def hardware() -> dict:
    out = {"cpu": cpu_name(), "cores": os.cpu_count()}
    if shutil.which("nvidia-smi"):
        found = subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version",
                                "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
        out["gpus"] = found.splitlines()
    return out


def cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
                platform.machine())


# -- command line ----------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/encoder_scaling.json", help="JSON results file")
    parser.add_argument("--counts", default="1,2", help="encoder process counts to measure, e.g. 1,2,3,4")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: built-in tiny model, 224x224 images")
    parser.add_argument("--model", default="", help="checkpoint directory, or a preset with --load-format dummy, "
                                                    "as `epd up --model` (default: qwen2.5-vl-7b, dummy)")
    parser.add_argument("--load-format", default="auto", choices=("auto", "dummy"), help="as `epd up`")
    parser.add_argument("--device", default="", help="encoders' torch device (default: cuda, cpu with --tiny); "
                                                     "with cuda encoder i gets CUDA_VISIBLE_DEVICES=<i-th of --gpus>")
    parser.add_argument("--gpus", default="", help="GPU ids for encoders 1..N (default: 0,1,...)")
    parser.add_argument("--resolution", default="", help="1080p (default), 720p, 4k or WIDTHxHEIGHT (tiny: 224x224)")
    parser.add_argument("--images", type=int, default=0, help="timed images per client (default 64; tiny: 24)")
    parser.add_argument("--warmup", type=int, default=0, help="untimed images per encoder first (default 16; tiny: 4)")
    parser.add_argument("--concurrency", type=int, default=0, help="jobs in flight per client (default 8; tiny: 4)")
    parser.add_argument("--transport", default="zmq", choices=("zmq", "ucx"), help="data plane")
    parser.add_argument("--routing", default="least-loaded", choices=("least-loaded", "queue"),
                        help="spread jobs over the encoders' own subjects (as the frontend), or the queue group")
    parser.add_argument("--encoder-args", default="", help="more flags for every encoder, "
                                                           "e.g. '--preprocess-threads 4'")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one encode job may take")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds for the encoders to come up")
    args = parser.parse_args()
    if args.tiny and args.model:
        parser.error("--tiny runs the built-in tiny model: leave out --model")
    if not args.tiny and not args.model:
        args.model, args.load_format = "qwen2.5-vl-7b", "dummy"
    defaults = dict(device="cpu", resolution="224x224", images=24, warmup=4, concurrency=4) if args.tiny else \
        dict(device="cuda", resolution="1080p", images=64, warmup=16, concurrency=8)
    for name, value in defaults.items():
        if not getattr(args, name):
            setattr(args, name, value)
    args.counts = sorted({int(c) for c in args.counts.split(",")})
    args.gpus = args.gpus.split(",") if args.gpus else [str(i) for i in range(max(args.counts))]
    try:
        parse_resolution(args.resolution)
    except ValueError as err:
        parser.error(str(err))
    if min(args.counts) < 1 or len(args.gpus) < max(args.counts):
        parser.error("--counts must be positive, with a GPU id in --gpus for every encoder")
    if args.images < 3 * args.concurrency or args.warmup < 1:
        parser.error("--images must be at least 3 x --concurrency (for a steady window), --warmup at least 1")
    return args


def resolve_model(args) -> Path:
    """The checkpoint, resolved as `epd up` resolves it: written once here (the built-in model, a preset)
    before the encoders race for it; the encoders get the preset's name with --load-format dummy, else the
    directory."""
    settings = CommonSettings(model=args.model, load_format=args.load_format)
    path = settings.model_path()
    args.encoder_model = str(path) if not settings.model or settings.load_format != "dummy" else settings.model
    return path


def write_results(args, checkpoint: Path, runs: list[dict], started: float) -> dict:
    result = {
        "hardware": hardware(), "versions": versions(), "command": shlex.join([sys.executable, *sys.argv]),
        "environment": {k: os.environ[k] for k in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS") if k in os.environ},
        "settings": {k: v for k, v in vars(args).items() if k != "out"}, "checkpoint": str(checkpoint),
        "target_efficiency": TARGET, "meets_target": all(r["efficiency"] >= TARGET for r in runs),
        "wall_s": time.time() - started, "runs": runs, "table": "\n".join([HEADER, *(row(r) for r in runs)]),
        "warnings": [w for w in map(client_warning, runs) if w],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return result


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # so the cleanup below runs
    started = time.time()
    try:
        checkpoint = resolve_model(args)
    except ValueError as err:  # neither a checkpoint directory nor a preset with --load-format dummy
        sys.exit(f"encoder_scaling.py: {err}")
    print(f"model {args.encoder_model} (--load-format {args.load_format}), device {args.device}, "
          f"{args.resolution} images, {args.images} timed + {args.warmup} warm-up per encoder, "
          f"{args.concurrency} in flight per encoder\n\n{HEADER}", flush=True)
    runs: list[dict] = []
    for count in args.counts:
        runs.append(measure(args, count))
        add_scaling(runs)
        print(row(runs[-1]), flush=True)
        result = write_results(args, checkpoint, runs, started)  # after every count: a later failure keeps it
    verdict = f"scaling efficiency target {TARGET}: {'met' if result['meets_target'] else 'NOT met'}"
    print(f"\n{result['table']}\n\n{verdict}", *result["warnings"], f"results: {args.out}", sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
