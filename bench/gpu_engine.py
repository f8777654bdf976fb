#!/usr/bin/env python3
"""Engine and vision-tower benchmark on the GPU machine, side by side with HF transformers in one run.

Measures, for a preset's shapes (default Qwen2.5-VL-7B; ``--preset qwen3-vl-30b-a3b`` for the MoE
model) with random bf16 weights (timing does not depend on weight values):
  ceilings    device copy bandwidth and bf16 matmul rate (this run's own roofline)
  check       our GPU path (Triton kernels) against the torch reference path, same inputs
  decode1     decode step at batch 1 (128-token context; more with --decode1-contexts): CUDA-graph replay and a
              whole engine step, against the bytes it reads / bandwidth (MoE: attention, routers, head and the experts
              its token routes to, counted; bench/roofline.py); MoE on a GPU: one token's experts a
              layer on the small path (GEMVs) and on the sorted path (grouped GEMMs), each forced
  decode64    decode step at batch 64 with 2,048-token contexts, against weights (MoE: the experts the
              batch touches) + KV bytes / bandwidth
  prefill     prefill of the four-1080p-image prompt (10,903 tokens), against FLOPs (active parameters)
              / matmul rate
  prefill_sizes  prefills of text prompts of --prefill-lengths tokens (chat-sized to image-sized): each against
              both floors (FLOPs / matmul rate; bytes of the weights it reads — MoE: the experts its tokens
              touched, counted — / bandwidth) and its kernels' time by kernel name (torch.profiler)
  chunked     that prefill at several step budgets (chunked prefill) against unchunked; a mixed step
              (64 decode rows at 2k context + a prompt chunk) against a pure decode step and the chunk
              alone; the repeated prompt served by the prefix cache; prefill attention after a prefix:
              the paged Triton kernel against gathering the KV for SDPA, and both on a chunk with no prefix
  memory      1,000 requests through the engine: KV pool and allocator do not grow
  hf          HF generate() decode step (t(65 tokens) - t(1 token)) / 64, 128-token prompt
  vit         vision tower, 1 and 4 x 1080p (and 8), ours against HF's
  sampling    decode step at batch 64 (2,048-token contexts): every row greedy, then one row with every sampling
              option (penalties, bias, top-k/p, min-p, seed, logprobs), one row under a JSON-schema grammar, every
              row with every option: what one request's options cost the others' steps
  vit_graphs  the vision tower through CUDA graphs between its attentions (--vit-graph-patches, as
              EPD_VIT_GRAPH_PATCHES) and through a graph of each layout's whole forward (EPD_VIT_LAYOUT_GRAPHS)
              against eager: 1, 4, 10 x 448x448, 1 and 2 x 1080p; also beside a thread of pure Python
  preprocess  one 1080p image to patches: HF's PIL processor on one CPU thread against the torch path on
              the GPU (pixels copied over included), and how far apart their patches are
  video       10 s and 30 s 720p clips (2 sampled frames a second, the video processor's token budget):
              frames → patches on the GPU, the ViT over one clip and four (patches/s, frames/s), HF's tower
              on the 10 s clip, and the frontend's PyAV decode of the 30 fps source per frame decoded
              (needs PyAV on the GPU machine: carry its wheel)
  timeline    the batch-1 decode replay (decode1's first context) under torch.profiler: each kernel name's share
              of the step's critical path (PDL overlaps kernels), duration and gaps a step, and a decoder layer's;
              raw trace in --out/timeline-trace.json.gz

    python bench/gpu_engine.py --out results/ [--sections decode1,hf] [--preset qwen3-vl-30b-a3b] [--tiny]

``--tiny`` runs every section on a tiny random model (CPU works) as a smoke test of this script; its
family is ``--tiny-family`` (qwen3_vl_moe for the MoE sections' paths).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.roofline import (TouchedExperts, decode_bytes, expert_bytes, prefill_flops,  # noqa: E402
                            shared_weight_bytes, vit_flops)

from shared.engine.engine import Engine  # noqa: E402
from shared.engine.kv_cache import KVCache  # noqa: E402
from shared.engine.runner import ModelRunner  # noqa: E402
from shared.engine.sampling import SamplingParams  # noqa: E402
from shared.engine.sequence import ImageInput, Sequence  # noqa: E402
from shared.model.config import QWEN3_FAMILIES, ModelConfig  # noqa: E402
from shared.model.geometry import ImageGeometry  # noqa: E402
from shared.model import pieces  # noqa: E402
from shared.model.loader import load_language_model, load_vision_tower  # noqa: E402
from shared.model.presets import PRESETS, materialize_preset  # noqa: E402

SECTIONS = ["ceilings", "check", "decode1", "decode64", "sampling", "prefill", "prefill_sizes", "chunked", "memory", "hf", "vit",
            "vit_graphs", "preprocess", "encode_path", "video", "profile", "timeline"]
RESULTS: dict = {}


def log(*args):
    print(*args, flush=True)


class Timer:
    """Median milliseconds of ``fn`` over ``repeat`` runs (CUDA events on GPU, perf_counter on CPU)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def ms(self, fn, repeat: int = 20, warmup: int = 3) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeat):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)


def preset_config(name: str) -> ModelConfig:
    raw = dict(PRESETS[name])
    raw.update(eos_token_id=2, image_token_id=6, video_token_id=7, vision_start_token_id=3, vision_end_token_id=4)
    return ModelConfig.from_dict(raw)


def lm_bytes(lm) -> int:
    return sum(p.numel() * p.element_size() for p in lm.parameters())


def new_seq(rid: str, tokens: list[int], max_tokens: int, images=None) -> Sequence:
    return Sequence(rid, tokens, len(tokens), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                    images=images or [])


# ------------------------------------------------------------------------------------------------
def ceilings(ctx):
    dev, timer = ctx["device"], ctx["timer"]
    n = (4 << 30) // 2 if dev.type == "cuda" else 1 << 24
    a = torch.randn(n, dtype=torch.bfloat16, device=dev)
    b = torch.empty_like(a)
    ms = timer.ms(lambda: b.copy_(a), repeat=5)
    bw = 2 * a.numel() * 2 / (ms / 1e3)
    size = 8192 if dev.type == "cuda" else 512
    x = torch.randn(size, size, dtype=torch.bfloat16, device=dev)
    y = torch.randn(size, size, dtype=torch.bfloat16, device=dev)
    mm = timer.ms(lambda: x @ y, repeat=10)
    rate = 2 * size**3 / (mm / 1e3)
    del a, b, x, y
    RESULTS["ceilings"] = {"copy_bandwidth_TBps": bw / 1e12, "bf16_matmul_TFLOPs": rate / 1e12}
    ctx["bandwidth"], ctx["matmul_rate"] = bw, rate
    log(f"ceilings: copy {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s")


def build_lm(ctx):
    if "engine" in ctx:
        return
    cfg, dev = ctx["config"], ctx["device"]
    t = time.perf_counter()
    lm = load_language_model(None, cfg, dev, ctx["dtype"], load_format="dummy")
    ctx["lm"] = lm
    blocks = ctx["kv_blocks"]
    cache = KVCache(cfg.text, blocks, 16, ctx["dtype"], dev)
    runner = ModelRunner(lm, cache, cfg.vision.merge_size)
    ctx["engine"] = Engine(runner, (2,), ctx["max_len"], "both", max_num_seqs=ctx["max_batch"],
                           max_batched_tokens=16384, prefix_caching=False)  # repeated prompts compute each time
    if dev.type == "cuda":
        runner.capture_graphs(ctx["max_batch"], ctx["max_len"])
        if ctx["prefill_graph_tokens"]:  # as a serving worker does (EngineSettings.prefill_graph_tokens)
            before, started = torch.cuda.memory_reserved(dev), time.perf_counter()
            pieces.capture(lm, ctx["prefill_graph_tokens"])
            RESULTS["prefill_graphs"] = {"max_tokens": ctx["prefill_graph_tokens"],
                                         "seconds": round(time.perf_counter() - started, 1),
                                         "reserved_MB": (torch.cuda.memory_reserved(dev) - before) / 2**20}
            log(f"prefill graphs: {RESULTS['prefill_graphs']}")
    started = time.perf_counter()  # what a worker's engine thread does before serving (this thread steps here)
    RESULTS["warm_thread"] = {"attention_plans": ctx["engine"].warm_thread(),
                              "ms": round((time.perf_counter() - started) * 1e3, 1)}
    ctx["weights_bytes"] = lm_bytes(lm) - lm.embed_tokens.weight.numel() * lm.embed_tokens.weight.element_size() \
        * (0 if cfg.text.tie_word_embeddings else 1)
    log(f"built LM ({lm_bytes(lm) / 1e9:.2f} GB, KV pool {cache.nbytes / 1e9:.1f} GB) in {time.perf_counter() - t:.1f}s")


def _forced_logits(engine: Engine, prompt: list[int], forced: list[int]) -> list[torch.Tensor]:
    """Logits of a prefill and of decode steps fed ``forced`` tokens (the same inputs for every variant)."""
    runner = engine.runner
    logits: list[torch.Tensor] = []
    sample = runner.sampler.sample
    runner.sampler.sample = lambda lg, *a: logits.append(lg[-1].float().cpu()) or sample(lg, *a)
    try:
        seq = new_seq(f"forced-{id(engine)}-{len(logits)}", list(prompt), len(forced) + 1)
        engine.add_prompt(seq)
        engine.step()
        for token in forced:
            seq.token_ids[-1] = token
            engine.step()
        engine.abort(seq.request_id)
    finally:
        runner.sampler.sample = sample
    return logits


def check(ctx):
    """Our GPU path (graphs, and eager) and the torch path in bf16, each against an fp32 reference,
    teacher-forced so every variant sees the same tokens."""
    from shared.engine.attention import TorchAttention

    build_lm(ctx)
    engine, lm, cfg, dev = ctx["engine"], ctx["lm"], ctx["config"], ctx["device"]
    if dev.type != "cuda":
        RESULTS["check"] = {"skipped": "no GPU: the torch path is the only path"}
        return
    if 2 * lm_bytes(lm) > torch.cuda.mem_get_info(dev)[0]:  # its fp32 copy would not fit: check 4 layers
        engine, lm, cfg = _shallow_engine(ctx, layers=4)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, ctx["vocab"], (300,), generator=gen).tolist()
    forced = torch.randint(10, ctx["vocab"], (6,), generator=gen).tolist()

    def torch_engine(model, dtype):
        cache = KVCache(cfg.text, 64, 16, dtype, dev)
        return Engine(ModelRunner(model, cache, 2, backend=TorchAttention(cache)), (2,), 1000)

    runner = engine.runner
    results = {"graphs": _forced_logits(engine, prompt, forced)}
    graphs, runner.graphs = runner.graphs, None
    results["eager"] = _forced_logits(engine, prompt, forced)
    runner.graphs = graphs
    from shared.kernels import ENABLED

    switches = ("fused", "moe", "gemv")
    for path in switches:  # the pure torch path
        ENABLED[path] = False
    try:
        results["torch_bf16"] = _forced_logits(torch_engine(lm, ctx["dtype"]), prompt, forced)
        lm32 = load_language_model(None, cfg, dev, torch.float32, load_format="dummy")
        lm32.load_state_dict({k: v.float() for k, v in lm.state_dict().items()})
        results["fp32"] = _forced_logits(torch_engine(lm32, torch.float32), prompt, forced)
        del lm32
    finally:
        for path in switches:
            ENABLED[path] = True
    torch.cuda.empty_cache()
    report = {}
    for name in ("graphs", "eager", "torch_bf16"):
        errors = [(torch.linalg.norm(a - b) / torch.linalg.norm(b)).item() for a, b in zip(results[name], results["fp32"])]
        report[name] = errors
        log(f"check {name} vs fp32: rel. error per step {['%.1e' % e for e in errors]}")
    RESULTS["check"] = {"rel_error_vs_fp32": report}
    worst_torch = max(report["torch_bf16"])
    if max(max(report["graphs"]), max(report["eager"])) > max(2 * worst_torch, 1e-2):
        raise AssertionError("GPU path is less accurate than the bf16 torch path")


def _shallow_engine(ctx, layers: int):
    """The preset's architecture cut to its first ``layers`` decoder layers, with its own engine and graphs."""
    from dataclasses import replace

    cfg, dev = ctx["config"], ctx["device"]
    moe = cfg.text.moe and replace(cfg.text.moe, layers=tuple(i for i in cfg.text.moe.layers if i < layers))
    cfg = replace(cfg, text=replace(cfg.text, num_layers=layers, moe=moe))
    lm = load_language_model(None, cfg, dev, ctx["dtype"], load_format="dummy")
    cache = KVCache(cfg.text, 256, 16, ctx["dtype"], dev)
    engine = Engine(ModelRunner(lm, cache, cfg.vision.merge_size), (2,), 1024, "both", max_num_seqs=8)
    engine.runner.capture_graphs(8, 1024)
    return engine, lm, cfg


def _experts_read(ctx, seqs: list[Sequence]) -> int:
    """Experts one decode step of ``seqs`` reads (summed over MoE layers), from an eager step (a count
    syncs, so not in the graph); 0 for a dense model."""
    lm, runner = ctx["lm"], ctx["engine"].runner
    if not expert_bytes(lm):
        return 0
    graphs, runner.graphs = runner.graphs, None
    try:
        with TouchedExperts(lm) as touched:
            runner.decode(seqs)
    finally:
        runner.graphs = graphs
    return touched.per_step()


def profile(ctx):
    """Kernel time tables (torch.profiler) for an eager decode step, the 10,903-token prefill, one ViT image."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    if ctx["device"].type != "cuda":
        return
    build_lm(ctx)
    engine, runner, cfg = ctx["engine"], ctx["engine"].runner, ctx["config"]
    tables = {}

    def table(name, fn):
        fn()
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        text = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60)
        tables[name] = text
        log(f"--- profile {name}\n{text}")

    seq = new_seq("prof", list(range(100, 228)), 10_000)
    engine.add_prompt(seq)
    engine.step()
    graphs, runner.graphs = runner.graphs, None
    engine.blocks.may_append(seq)
    table("decode_b1_eager", lambda: runner.decode([seq]))
    runner.graphs = graphs
    engine.abort("prof")
    tokens, images = _prefill_prompt(ctx)
    table("prefill_10903", lambda: _run_prefill(engine, tokens, images))
    tower = ctx.get("tower") or load_vision_tower(None, cfg, ctx["device"], ctx["dtype"], load_format="dummy")
    grid = ctx["grid_1080p"]
    patches = torch.randn(grid[1] * grid[2], cfg.vision.patch_dim, dtype=ctx["dtype"], device=ctx["device"])
    with torch.inference_mode():
        table("vit_1080p", lambda: tower(patches, [grid]))
    RESULTS["profile"] = tables


def timeline(ctx):
    """Where the batch-1 decode step's time goes, kernel by kernel: ``decode1``'s CUDA-graph replay (its first
    context; 32 tokens on a tiny model), 20 replays under torch.profiler, the first 2 dropped. A kernel's share is
    how far its end extends the step's critical path past the kernels before it (under programmatic dependent
    launch a kernel starts before the one ahead ends, so its duration counts waiting); the same 20 replays timed
    without the profiler beside it. The raw trace goes to ``--out``/timeline-trace.json.gz."""
    import gzip
    import tempfile

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    if ctx["device"].type != "cuda":
        RESULTS["timeline"] = {"skipped": "no GPU: no CUDA graph to replay"}
        log("timeline: skipped (no GPU)")
        return
    build_lm(ctx)
    engine, cfg, timer = ctx["engine"], ctx["config"], ctx["timer"]
    runner = engine.runner
    if runner.graphs is None:
        RESULTS["timeline"] = {"skipped": "no CUDA graphs captured"}
        log("timeline: skipped (no CUDA graphs)")
        return
    prompt = (ctx["decode1_contexts"] if ctx["big"] else [32])[0]
    seq = new_seq("timeline", list(range(100, 100 + prompt)), 10_000)
    n, drop = 20, 2

    def replays():
        for _ in range(n):
            runner.graphs.replay(rows)

    engine.add_prompt(seq)
    try:
        engine.step()  # prefill
        for _ in range(3):
            engine.step()
        engine.blocks.may_append(seq)  # room for the token a replay computes
        rows = runner.stage_decode([seq])
        for _ in range(10):
            runner.graphs.replay(rows)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            replays()
            torch.cuda.synchronize()
        replay_ms = timer.ms(replays, repeat=5, warmup=1) / n  # the same back-to-back replays, unprofiled
    finally:
        engine.abort("timeline")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        raw = path.read_bytes()
    if ctx.get("out") is not None:
        ctx["out"].mkdir(parents=True, exist_ok=True)
        (ctx["out"] / "timeline-trace.json.gz").write_bytes(gzip.compress(raw))
    result = _timeline_from_events(json.loads(raw)["traceEvents"], n, drop=drop, layers=cfg.text.num_layers)
    RESULTS["timeline"] = {"replay_ms": replay_ms, "context": prompt, **result}
    if result["split"] != "gap":
        log(f"timeline: replays not separated by gaps > 20 µs; split by {result['split']}")
    log(f"timeline: replay {replay_ms:.3f} ms unprofiled, profiled span {result['profiled_span_ms']:.3f} ms "
        f"(start to start {result['profiled_period_ms']:.3f} ms), {result['replays']} replays of "
        f"{result['kernels_per_step']} kernels, {result['layers']} layers: "
        f"{result['per_layer_us']:.1f} µs a layer, {result['outside_layers_us']:.1f} µs outside")
    log(f"  {'kernel':<60} {'n/step':>6} {'path µs':>8} {'dur µs':>8} {'gap µs':>7} {'path/layer':>10}")
    for k in result["by_kernel"]:
        per_layer = k.get("contribution_per_layer_us")
        log(f"  {k['name']:<60} {k['launches']:>6g} {k['contribution_us']:>8.1f} {k['duration_us']:>8.1f} "
            f"{k['gap_us']:>7.1f} {'' if per_layer is None else f'{per_layer:.2f}':>10}")


def _kernel_name(name: str) -> str:
    """A trace kernel name made short: a Triton kernel's is its function's name already; others (cuBLAS,
    torch's own) lose ``void ``, their argument list and torch's namespaces, and are cut to 60 characters."""
    if name.isidentifier():
        return name
    name = name.removeprefix("void ")
    if name.endswith(")"):  # the argument list: from the "(" that closes at the end
        depth = 0
        for i in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                name = name[:i] or name
                break
    for noise in ("at::native::", "(anonymous namespace)::"):
        name = name.replace(noise, "")
    return name[:60]


def _split_replays(kernels: list[dict], replays: int, gap_us: float) -> tuple[list[list[dict]], str]:
    """``kernels`` (sorted by start) cut into ``replays`` groups of equal count: where the GPU idled more than
    ``gap_us`` since the latest end; else by the launch each kernel's correlation id names (a graph's kernels
    share its launch's); else ``replays`` equal consecutive chunks (graph replays run in stream order)."""
    groups: list[list[dict]] = []
    latest = -math.inf
    for k in kernels:
        if k["ts"] - latest > gap_us:
            groups.append([])
        groups[-1].append(k)
        latest = max(latest, k["ts"] + k["dur"])
    if len(groups) == replays and len({len(g) for g in groups}) == 1:
        return groups, "gap"
    if all("correlation" in k.get("args", {}) for k in kernels):
        by_launch: dict = {}
        for k in kernels:
            by_launch.setdefault(k["args"]["correlation"], []).append(k)
        groups = sorted(by_launch.values(), key=lambda g: g[0]["ts"])
        if len(groups) == replays and len({len(g) for g in groups}) == 1:
            return groups, "correlation"
    if len(kernels) % replays:
        raise ValueError(f"{len(kernels)} kernels do not split into {replays} equal replays")
    size = len(kernels) // replays
    return [kernels[i:i + size] for i in range(0, len(kernels), size)], "equal chunks"


def _timeline_from_events(events: list[dict], replays: int, drop: int = 2, layers: int | None = None,
                          gap_us: float = 20.0) -> dict:
    """The ``timeline`` numbers from a Chrome trace's events (``cat`` "kernel": ``ts``, ``dur`` in µs) of
    ``replays`` consecutive graph replays, the first ``drop`` left out. Per replay, kernel by kernel in start
    order: its path share (its end past the latest end before it, or the replay's start; these sum to the
    replay's span), its duration, and its gap (idle time before it starts). Per short name, means a step; with
    ``layers``, the path share a layer of names launched at least once a layer."""
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: (e["ts"], e["ts"] + e["dur"]))
    if not kernels:
        raise ValueError("no kernel events in the trace")
    groups, split = _split_replays(kernels, replays, gap_us)
    kept = groups[drop:]
    if not kept:
        raise ValueError(f"{len(groups)} replays, all dropped")
    totals: dict[str, dict] = {}
    spans = []
    for group in kept:
        start = latest = group[0]["ts"]
        for k in group:
            end = k["ts"] + k["dur"]
            row = totals.setdefault(_kernel_name(k["name"]), {"launches": 0, "contribution_us": 0.0,
                                                               "duration_us": 0.0, "gap_us": 0.0})
            row["launches"] += 1
            row["contribution_us"] += max(0.0, end - latest)
            row["duration_us"] += k["dur"]
            row["gap_us"] += max(0.0, k["ts"] - latest)
            latest = max(latest, end)
        spans.append(latest - start)
    by_kernel = []
    for name, row in totals.items():
        entry = {"name": name, "launches": row["launches"] / len(kept)}
        entry.update({key: round(row[key] / len(kept), 2) for key in ("contribution_us", "duration_us", "gap_us")})
        if layers and entry["launches"] >= layers:
            entry["contribution_per_layer_us"] = round(entry["contribution_us"] / layers, 2)
        by_kernel.append(entry)
    by_kernel.sort(key=lambda e: -e["contribution_us"])
    path_us = sum(row["contribution_us"] for row in totals.values()) / len(kept)
    in_layers = sum(e["contribution_us"] for e in by_kernel if "contribution_per_layer_us" in e)
    period = (kept[-1][0]["ts"] - kept[0][0]["ts"]) / (len(kept) - 1) if len(kept) > 1 else None
    return {"split": split, "replays": len(kept), "kernels_per_step": len(kept[0]),
            "profiled_span_ms": statistics.mean(spans) / 1e3,
            "profiled_span_ms_range": [min(spans) / 1e3, max(spans) / 1e3],
            "profiled_period_ms": period and period / 1e3, "contribution_sum_ms": path_us / 1e3,
            "layers": layers, "per_layer_us": in_layers / layers if layers else None,
            "outside_layers_us": path_us - in_layers, "by_kernel": by_kernel}


def decode1(ctx):
    build_lm(ctx)
    contexts = ctx["decode1_contexts"] if ctx["big"] else [32]
    _decode1_at(ctx, contexts[0])
    for context in contexts[1:]:  # the replay alone at longer contexts (the decode attention's splits)
        RESULTS["decode1"][f"graph_replay_ms_at_{context}"] = _decode1_replay(ctx, context)
    if ctx["decode1_parts"]:
        RESULTS["decode1"].update(_moe_layer_paths(ctx))
        RESULTS["decode1"].update(_projection_paths(ctx))


def _decode1_replay(ctx, context: int) -> float | None:
    engine, runner = ctx["engine"], ctx["engine"].runner
    seq = new_seq("b1", [100 + i % 800 for i in range(context)], 10_000)
    engine.add_prompt(seq)
    while seq.num_output < 2:
        engine.step()
    engine.blocks.may_append(seq)
    rows = runner.stage_decode([seq])
    replay = ctx["timer"].ms(lambda: runner.graphs.replay(rows), repeat=200, warmup=10) if runner.graphs else None
    log(f"decode b1 at a {context}-token context: graph replay {replay and round(replay, 3)} ms")
    if runner.graphs is not None:
        for blocks in ctx["min_blocks_ab"]:
            ms = _replay_with_min_blocks(ctx, seq, blocks)
            RESULTS.setdefault("decode1_min_blocks", {}).setdefault(str(blocks), {})[context] = ms
            log(f"decode b1 at a {context}-token context, decode attention MIN_BLOCKS={blocks}: graph replay "
                f"{ms:.3f} ms")
    engine.abort("b1")
    return replay


def _replay_with_min_blocks(ctx, seq: Sequence, blocks: int) -> float:
    """The batch-1 replay with a graph captured for the decode attention's ``MIN_BLOCKS`` = ``blocks`` (the
    fewest KV blocks a split of the context takes: fewer splits, so less to merge, on short contexts)."""
    from shared.kernels import decode_attention

    runner = ctx["engine"].runner
    graphs, inputs, before = runner.graphs, runner.inputs, decode_attention.MIN_BLOCKS
    decode_attention.MIN_BLOCKS = blocks
    try:
        runner.capture_graphs(1, ctx["max_len"])
        rows = runner.stage_decode([seq])
        return ctx["timer"].ms(lambda: runner.graphs.replay(rows), repeat=200, warmup=10)
    finally:
        decode_attention.MIN_BLOCKS = before
        runner.graphs, runner.inputs = graphs, inputs
        torch.cuda.empty_cache()


def _decode1_at(ctx, prompt: int) -> None:
    engine, timer = ctx["engine"], ctx["timer"]
    runner = engine.runner
    seq = new_seq("b1", list(range(100, 100 + prompt)), 10_000)
    engine.add_prompt(seq)
    engine.step()  # prefill
    for _ in range(3):
        engine.step()
    engine.blocks.may_append(seq)  # room for the token a replay computes
    experts = _experts_read(ctx, [seq])
    rows = runner.stage_decode([seq])
    replay = None
    if runner.graphs is not None:
        replay = timer.ms(lambda: runner.graphs.replay(rows), repeat=200, warmup=10)
    variants = _decode_variants(ctx, seq) if runner.graphs is not None and ctx["decode1_parts"] else {}
    walls = []
    for _ in range(100):
        t = time.perf_counter()
        engine.step()
        walls.append((time.perf_counter() - t) * 1e3)
    engine.abort("b1")
    step = statistics.median(walls)
    moved = decode_bytes(ctx["lm"], experts, len(seq) * KVCache.bytes_per_block(ctx["config"].text, 1, ctx["dtype"]))
    floor = moved / ctx.get("bandwidth", math.inf) * 1e3
    RESULTS["decode1"] = {"graph_replay_ms": replay, "engine_step_ms": step, "bandwidth_floor_ms": floor,
                          "weights_GB": ctx["weights_bytes"] / 1e9, "bytes_read_GB": moved / 1e9,
                          "experts_read": experts, "ratio_to_floor": replay / floor if replay and floor else None,
                          "replay_ms_variants": variants}
    log(f"decode b1: graph replay {replay and round(replay, 3)} ms, engine step {step:.3f} ms, floor {floor:.2f} ms "
        f"({moved / 1e9:.2f} GB read, {experts} experts)")


def _decode_variants(ctx, seq: Sequence) -> dict:
    """The batch-1 graph replay with one part switched, on the same staged inputs (a graph of bucket 1
    captured for each): off, the few-rows layer (``shared.kernels.gemv``: norms fused into GEMVs),
    programmatic dependent launch (``shared.kernels.launch``), both, and the MoE down GEMV's loads before
    its wait (``moe_small.EARLY_DOWN``) and one-row GEMVs loading all their weights before their wait
    (``gemv.PRELOAD_BYTES``: 0; 16 KB a program covers q|k|v and the router, 32 KB o too); on, each kernel
    letting the next launch from its start (``launch.TRIGGER_FIRST``). A variant that is today's setting
    is skipped."""
    from shared.kernels import ENABLED, gemv, launch, moe_small

    runner, timer = ctx["engine"].runner, ctx["timer"]
    graphs, inputs = runner.graphs, runner.inputs
    switches = {"gemv": (ENABLED, "gemv"), "pdl": (launch, "ENABLED"), "early_down": (moe_small, "EARLY_DOWN"),
                "trigger_first": (launch, "TRIGGER_FIRST"), "preload": (gemv, "PRELOAD_BYTES")}
    variants = {"without_pdl": {"pdl": False}, "without_gemv": {"gemv": False},
                "without_gemv_and_pdl": {"gemv": False, "pdl": False}, "without_early_down": {"early_down": False},
                "trigger_first": {"trigger_first": True}, "without_preload": {"preload": 0},
                "preload_16k": {"preload": 16 << 10},
                "preload_32k": {"preload": 32 << 10}, "trigger_first_preload_32k": {"trigger_first": True,
                                                                                    "preload": 32 << 10}}

    def setting(key):
        owner, name = switches[key]
        return owner[name] if isinstance(owner, dict) else getattr(owner, name)

    def put(key, value):
        owner, name = switches[key]
        if isinstance(owner, dict):
            owner[name] = value
        else:
            setattr(owner, name, value)

    before = {key: setting(key) for key in switches}
    out = {}
    for name, changes in variants.items():
        if all(setting(key) == value for key, value in changes.items()):
            continue  # today's default: the main figure
        for key, value in changes.items():
            put(key, value)
        try:
            runner.capture_graphs(1, ctx["max_len"])
            rows = runner.stage_decode([seq])
            out[name] = timer.ms(lambda: runner.graphs.replay(rows), repeat=200, warmup=10)
        finally:
            for key, value in before.items():
                put(key, value)
            runner.graphs, runner.inputs = graphs, inputs
            torch.cuda.empty_cache()
        log(f"decode b1 {name}: graph replay {out[name]:.3f} ms")
    return out


def _graph_replay_ms(ctx, fn) -> float:
    """``fn`` run once (its kernels compile outside the capture), captured in a CUDA graph, and that graph's
    median replay in ms."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return ctx["timer"].ms(graph.replay, repeat=50, warmup=5)


def _moe_layer_paths(ctx) -> dict:
    """``moe()`` for one random hidden row, small path against sorted path, in µs a layer (MoE on a GPU
    only; else nothing). Every MoE layer's weights in turn, in one CUDA graph: launches cost what they
    cost in a captured step, and one layer's experts (75 MB at Qwen3-VL-30B-A3B, more than the 60 MB
    L2) are not still cached when the same layer runs again, as repeating layer 0 alone would have
    them partly."""
    from shared.kernels import moe as moe_kernels
    from shared.model.moe import SparseMoeBlock

    blocks = [m for m in ctx["lm"].modules() if isinstance(m, SparseMoeBlock)]
    if not blocks or ctx["device"].type != "cuda":
        return {}
    with torch.inference_mode():
        x = torch.randn(1, ctx["config"].text.hidden_size, dtype=ctx["dtype"], device=ctx["device"],
                        generator=torch.Generator(ctx["device"]).manual_seed(0))
        logits = [block.gate(x) for block in blocks]
        per_layer = {}
        for path in moe_kernels.PATHS:
            def layers(path=path):
                for block, lg in zip(blocks, logits):
                    experts = block.experts
                    moe_kernels.moe(x, lg, experts.gate_up_proj, experts.down_proj, block.top_k, block.norm_topk_prob,
                                    path=path)

            per_layer[path] = _graph_replay_ms(ctx, layers) * 1e3 / len(blocks)
    log(f"decode b1 MoE layer (1 token, {len(blocks)} layers in a graph): "
        + ", ".join(f"{k} {v:.1f} µs" for k, v in per_layer.items()))
    return {f"moe_layer_{k}_us": v for k, v in per_layer.items()} | {"moe_layers_timed": len(blocks)}


def _projection_paths(ctx) -> dict:
    """A decoder layer's projections with the norms before them, for one row, in µs a layer: residual add +
    RMSNorm kernels and cuBLAS against the GEMVs with the norms fused in (``shared.kernels.gemv``), with
    and without PDL. Every layer's own weights in turn, in one CUDA graph (as ``_moe_layer_paths``)."""
    from shared.kernels import gemv, launch

    if ctx["device"].type != "cuda":
        return {}
    layers = ctx["lm"].layers
    hidden = ctx["config"].text.hidden_size
    gen = torch.Generator(ctx["device"]).manual_seed(0)
    x, res = (torch.randn(1, hidden, dtype=ctx["dtype"], device=ctx["device"], generator=gen) for _ in range(2))

    def unfused():
        for layer in layers:
            attn = layer.self_attn
            h, r = layer.input_layernorm.add_forward(x, res.clone())
            o = attn.o_proj(attn.qkv_proj(h)[:, :attn.q_size])
            h, r = layer.post_attention_layernorm.add_forward(o, r)
            layer.mlp.first(h)

    def fused():
        for layer in layers:
            attn, norm = layer.self_attn, layer.input_layernorm
            qkv, r, _ = gemv.norm_linear(x, res, norm.weight, norm.eps, attn.qkv_proj.weight, attn.qkv_proj.bias)
            o = gemv.linear(qkv[:, :attn.q_size], attn.o_proj.weight)
            norm = layer.post_attention_layernorm
            gemv.norm_linear(o, r, norm.weight, norm.eps, layer.mlp.first.weight, keep=layer.mlp.finish_reads_input)

    per_layer = {}
    with torch.inference_mode():
        for name, fn, pdl in (("cublas", unfused, False), ("gemv_pdl", fused, True), ("gemv", fused, False)):
            launch.ENABLED = pdl
            try:
                per_layer[name] = _graph_replay_ms(ctx, fn) * 1e3 / len(layers)
            finally:
                launch.ENABLED = True
    first = layers[0].mlp.first.weight
    moved = sum(m.numel() * m.element_size() for m in (layers[0].self_attn.qkv_proj.weight,
                                                       layers[0].self_attn.o_proj.weight, first))
    floor = moved / ctx.get("bandwidth", math.inf) * 1e6
    log("decode b1 projections a layer (norms included): " + ", ".join(f"{k} {v:.1f} µs" for k, v in per_layer.items())
        + f"; their weights' bandwidth floor {floor:.1f} µs")
    return ({f"projections_{k}_us": v for k, v in per_layer.items()} | {"projections_floor_us": floor}
            | _projection_shapes(ctx))


def _projection_shapes(ctx) -> dict:
    """Each projection of one row alone, cuBLAS against ``gemv.linear`` (with PDL), every layer's weight in
    turn in one CUDA graph: µs a layer and the bandwidth each reaches, by weight."""
    from shared.kernels import gemv

    layers = ctx["lm"].layers
    named = {"qkv": lambda l: l.self_attn.qkv_proj.weight, "o": lambda l: l.self_attn.o_proj.weight,
             "first": lambda l: l.mlp.first.weight}
    if hasattr(layers[0].mlp, "down_proj"):
        named["down"] = lambda l: l.mlp.down_proj.weight
    gen = torch.Generator(ctx["device"]).manual_seed(0)
    out = {}
    with torch.inference_mode():
        for name, weight_of in named.items():
            weights = [weight_of(layer) for layer in layers]
            x = torch.randn(1, weights[0].shape[1], dtype=ctx["dtype"], device=ctx["device"], generator=gen)
            for kind, fn in (("cublas", lambda: [torch.nn.functional.linear(x, w) for w in weights]),
                             ("gemv", lambda: [gemv.linear(x, w) for w in weights])):
                us = _graph_replay_ms(ctx, fn) * 1e3 / len(layers)
                nbytes = weights[0].numel() * weights[0].element_size()
                out[f"{name}_{kind}"] = {"us": us, "TBps": nbytes / us / 1e6, "MB": nbytes / 1e6,
                                         "tiles": gemv.tiles(*weights[0].shape) if kind == "gemv" else None}
    log("decode b1 each projection a layer: " + ", ".join(
        f"{k} {v['us']:.1f} µs ({v['MB']:.0f} MB, {v['TBps']:.2f} TB/s)" for k, v in out.items()))
    return {"projection_shapes": out}


def _decode_batch(ctx, name: str) -> list[Sequence]:
    """A running batch of sequences whose 2,047-token KV was written straight into the pool (random values)."""
    engine, cfg = ctx["engine"], ctx["config"]
    runner = engine.runner
    batch, context = (64, 2048) if ctx["big"] else (8, 64)
    seqs = []
    for i in range(batch):  # KV of 2,047 tokens written straight into the pool (random values)
        token = 10 + (i * 7919) % (ctx["vocab"] - 10)  # distinct tokens: a MoE batch routes as real ones do
        seq = Sequence(f"{name}-{i}", [token] * context, context - 1,
                       SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True), num_computed=context - 1)
        engine.reserve(seq)
        slots = torch.tensor(runner.cache.slots(seq.block_table, 0, context - 1))
        runner.cache.scatter(slots, torch.randn(cfg.text.num_layers, 2, context - 1, cfg.text.num_kv_heads,
                                                cfg.text.head_dim, dtype=ctx["dtype"]))
        engine.activate(seq.request_id)
        seqs.append(seq)
    return seqs


def sampling(ctx):
    """Engine decode steps at batch 64 with sampling options on none, one or every row."""
    import msgspec
    from transformers import AutoTokenizer

    from shared.engine.grammar import Grammars
    from shared.engine.sampling import Constraint, Sampler
    from shared.model.presets import materialize_preset

    build_lm(ctx)
    engine, cfg = ctx["engine"], ctx["config"]
    runner = engine.runner
    tokenizer = AutoTokenizer.from_pretrained(ctx.get("tiny_path") or materialize_preset(ctx["preset"]))
    plain_sampler = runner.sampler
    runner.sampler = Sampler(ctx["device"], seed=0, eos_token_ids=(2,),
                             grammars=lambda: Grammars(tokenizer, cfg.text.vocab_size, (2,)))
    seqs = _decode_batch(ctx, "smp")
    plain = seqs[0].sampling
    everything = msgspec.structs.replace(plain, temperature=0.8, top_k=50, top_p=0.9, min_p=0.02, seed=1,
                                         repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3,
                                         logit_bias=((11, 2.0), (12, -5.0)), logprobs=5)
    grammar = msgspec.structs.replace(plain, ignore_eos=False, constraint=Constraint("json", json.dumps({
        "type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "array", "items": {"type": "integer"}}},
        "required": ["a", "b"]})))
    variants = {"all_greedy": {}, "one_row_every_option": {0: everything}, "one_row_json_schema": {0: grammar},
                "every_row_every_option": {i: everything for i in range(len(seqs))}}
    out = {}
    try:
        for _ in range(10):  # warm-up: kernels, allocator, graph buckets
            engine.step()
        for name, special in variants.items():
            for i, seq in enumerate(seqs):
                seq.sampling = special.get(i, plain)
            for _ in range(3):
                engine.step()
            walls = []
            for _ in range(20):
                if ctx["device"].type == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                engine.step()
                walls.append((time.perf_counter() - t) * 1e3)
            out[name] = statistics.median(walls)
    finally:
        for seq in seqs:
            engine.abort(seq.request_id)
        runner.sampler = plain_sampler
    base = out["all_greedy"]
    RESULTS["sampling"] = {"batch": len(seqs), "engine_step_ms": out,
                           "extra_ms_vs_greedy": {k: v - base for k, v in out.items()}}
    log("sampling: " + ", ".join(f"{k} {v:.2f} ms" for k, v in out.items()))


def decode64(ctx):
    build_lm(ctx)
    engine, timer, cfg = ctx["engine"], ctx["timer"], ctx["config"]
    runner = engine.runner
    batch, context = (64, 2048) if ctx["big"] else (8, 64)
    seqs = _decode_batch(ctx, "d64")
    engine.step()
    for seq in seqs:
        engine.blocks.may_append(seq)
    experts = _experts_read(ctx, seqs)
    rows = runner.stage_decode(seqs)
    if runner.graphs is not None:
        replay = timer.ms(lambda: runner.graphs.replay(rows), repeat=50, warmup=5)
    else:
        replay = timer.ms(lambda: runner.decode(seqs), repeat=3, warmup=1)
    walls = []
    for _ in range(20):
        t = time.perf_counter()
        engine.step()
        walls.append((time.perf_counter() - t) * 1e3)
    kv_bytes = batch * context * KVCache.bytes_per_block(cfg.text, 1, ctx["dtype"])
    moved = decode_bytes(ctx["lm"], experts, kv_bytes)
    floor = moved / ctx.get("bandwidth", math.inf) * 1e3
    for seq in seqs:
        engine.abort(seq.request_id)
    RESULTS["decode64"] = {"batch": batch, "context": context, "graph_replay_ms": replay,
                           "engine_step_ms": statistics.median(walls), "bytes_GB": moved / 1e9, "experts_read": experts,
                           "bandwidth_floor_ms": floor, "share_of_bandwidth_limit": floor / replay,
                           "tokens_per_s": batch / (statistics.median(walls) / 1e3)}
    log(f"decode b{batch}@{context}: replay {replay:.2f} ms (floor {floor:.2f} ms, {floor / replay:.0%} of limit), "
        f"engine step {statistics.median(walls):.2f} ms")


def _prefill_prompt(ctx):
    cfg = ctx["config"]
    grid, images = (ctx["grid_1080p"], 4) if ctx["big"] else ((1, 8, 8), 2)
    per_image = grid[1] * grid[2] // 4
    text = 10_903 - images * per_image if ctx["big"] else 40
    tokens = [11] * (text // 2)
    slots = []
    for _ in range(images):  # as encoders ship them: Qwen3-VL rows carry the deepstack levels too
        slots.append(ImageInput(len(tokens), grid, torch.randn(per_image, cfg.embedding_width, dtype=ctx["dtype"],
                                                               device=ctx["device"])))
        tokens += [6] * per_image
    tokens += [12] * (text - text // 2)
    return tokens, slots


def _run_prefill(engine: Engine, tokens, images) -> None:
    seq = new_seq("prefill", list(tokens), 1, images=images)
    engine.add_prompt(seq)
    while engine.has_work():  # one step, or one per chunk
        engine.step()


def prefill(ctx):
    build_lm(ctx)
    engine, cfg, timer = ctx["engine"], ctx["config"], ctx["timer"]
    tokens, images = _prefill_prompt(ctx)
    ms = timer.ms(lambda: _run_prefill(engine, tokens, images), repeat=3, warmup=1)
    t = len(tokens)
    flops = prefill_flops(cfg, t)  # active parameters per token (MoE: top-k experts), causal attention
    floor = flops / ctx.get("matmul_rate", math.inf) * 1e3
    RESULTS["prefill"] = {"tokens": t, "ms": ms, "TFLOP": flops / 1e12, "compute_floor_ms": floor,
                          "ratio_to_floor": ms / floor if floor else None}
    log(f"prefill {t} tokens: {ms:.1f} ms, {flops / 1e12:.0f} TFLOP, floor {floor:.1f} ms ({ms / max(floor, 1e-9):.2f}x)")


@contextlib.contextmanager
def _without_pieces(model):
    """``model`` (a language model or a tower) runs its plain forward inside the block."""
    held, model.pieces = model.pieces, None
    try:
        yield
    finally:
        model.pieces = held


@contextlib.contextmanager
def _without_layouts(tower):
    """``tower``'s forwards skip its layout graphs inside the block (the pieces alone)."""
    held = tower.pieces.layouts if tower.pieces is not None else None
    if held is not None:
        tower.pieces.layouts = None
    try:
        yield
    finally:
        if held is not None:
            tower.pieces.layouts = held


def _layout_captured(tower, grids) -> bool:
    layouts = tower.pieces.layouts if tower.pieces is not None else None
    return layouts is not None and tuple(map(tuple, grids)) in layouts.entries


@contextlib.contextmanager
def _busy_interpreter():
    """A thread of pure Python beside the block (at the default switch interval): a host-bound forward
    waits for the GIL as it would beside a serving process's event loop."""
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            sum(range(2000))

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def prefill_sizes(ctx):
    """Text prefills from chat-sized to image-sized prompts: time, both floors, kernels by name."""
    build_lm(ctx)
    engine, cfg, timer, lm = ctx["engine"], ctx["config"], ctx["timer"], ctx["lm"]
    lengths = ctx["prefill_lengths"] if ctx["big"] else [24, 96]
    rows = []
    for length in lengths:
        tokens = [100 + (i * 7919) % (ctx["vocab"] - 100) for i in range(length)]  # spread over the vocabulary
        ms = timer.ms(lambda: _run_prefill(engine, tokens, []), repeat=5, warmup=2)
        eager_ms, agreement = None, None
        if lm.pieces is not None:  # the same prefill without the graphs, and how far apart their logits are
            with_pieces = _forced_logits(engine, tokens, [])[0]
            with _without_pieces(lm):
                eager_ms = timer.ms(lambda: _run_prefill(engine, tokens, []), repeat=5, warmup=2)
                eager = _forced_logits(engine, tokens, [])[0]
            agreement = {"same_argmax": bool(with_pieces.argmax() == eager.argmax()),
                         "max_abs_diff": float((with_pieces - eager).abs().max()),
                         "logit_scale": float(eager.abs().max())}
        with _without_pieces(lm), TouchedExperts(lm) as touched:  # graph replays do not call back into Python
            _run_prefill(engine, tokens, [])
        experts = touched.per_step()
        if expert_bytes(lm) and not experts:  # a MoE forward that no layer counted: the floor would omit experts
            log(f"prefill_sizes {length} tokens: no MoE layer counted its experts; the bytes floor leaves them out")
        read = shared_weight_bytes(lm) + experts * expert_bytes(lm)
        bytes_ms = read / ctx.get("bandwidth", math.inf) * 1e3
        flop_ms = prefill_flops(cfg, length) / ctx.get("matmul_rate", math.inf) * 1e3
        table, kernel_us = _kernel_table(ctx, lambda: _run_prefill(engine, tokens, []))
        if length == lengths[0]:  # where the host's time goes: the step waits on the launches, not the GPU
            _host_profile(ctx, lambda: _run_prefill(engine, tokens, []), f"prefill_{length}")
        row = {"tokens": length, "ms": ms, "eager_ms": eager_ms, "graphs_vs_eager_logits": agreement,
               "floor_flops_ms": flop_ms, "floor_bytes_ms": bytes_ms,
               "experts_touched": experts, "GB_read": read / 1e9,
               "ratio_to_floor": ms / max(flop_ms, bytes_ms, 1e-9),
               "kernels": table, "kernel_us_total": kernel_us}
        rows.append(row)
        if eager_ms is not None:
            log(f"prefill_sizes {length} tokens: eager (no prefill graphs) {eager_ms:.1f} ms; logits {agreement}")
        log(f"prefill_sizes {length} tokens: {ms:.1f} ms; floors: FLOPs {flop_ms:.1f} ms, bytes {bytes_ms:.1f} ms "
            f"({read / 1e9:.1f} GB, {experts} experts) -> {row['ratio_to_floor']:.2f}x; kernels {row['kernel_us_total'] / 1e3:.1f} ms")
        for k in row["kernels"]:
            log(f"    {k['name']:<60} {k['launches']:>5} {k['us']:>10.1f} us")
    RESULTS["prefill_sizes"] = {"prompts": rows, "moe_tiles": _moe_tiles(ctx, lengths)}


def _kernel_table(ctx, fn, rows: int = 14) -> tuple[list[dict], float]:
    """The GPU kernels of one call of ``fn`` (torch.profiler), by name: the ``rows`` longest (launches, µs)
    and the total µs of all of them; empty off CUDA."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    kernels: dict[str, list[float]] = {}
    if ctx["device"].type != "cuda":
        return [], 0.0
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    for event in prof.events():
        if event.device_type.name == "CUDA":
            row = kernels.setdefault(_kernel_name(event.name), [0, 0.0])
            row[0] += 1
            row[1] += event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:rows]
    return ([{"name": n, "launches": c, "us": round(t, 1)} for n, (c, t) in top],
            round(sum(t for _, t in kernels.values()), 1))


def _host_profile(ctx, fn, name: str, rows: int = 40) -> None:
    """``fn`` once under cProfile (after a warm run): the Python functions its host time goes to, by own time
    and by cumulative time, into the log and RESULTS["host_profile"][name]."""
    import cProfile
    import io
    import pstats

    fn()
    if ctx["device"].type == "cuda":
        torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    if ctx["device"].type == "cuda":
        torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats(rows)
    RESULTS.setdefault("host_profile", {})[name] = text.getvalue()
    log(f"--- host profile {name}\n{text.getvalue()}")


MOE_TILES = [(16, 32, 128, 4, 4), (16, 64, 128, 4, 4), (16, 128, 128, 4, 3), (32, 64, 128, 4, 4),
             (32, 128, 64, 4, 4), (64, 64, 64, 4, 4), (64, 128, 64, 8, 3), (128, 128, 64, 8, 3)]


def _moe_tiles(ctx, lengths: list[int]) -> list[dict]:
    """The sorted path's experts (``fused_experts``: align, gate|up, down, top-k sum) for ``T`` random rows
    through every MoE layer's weights in turn, per tile shape of ``MOE_TILES`` (block_m, block_n, block_k,
    warps, stages), in µs a layer, against the layer's floors (the touched experts' bytes / bandwidth; the
    active FLOPs / matmul rate); ``kernel_config``'s pick marked."""
    from shared.kernels import moe as moe_kernels
    from shared.model.moe import SparseMoeBlock

    blocks = [m for m in ctx["lm"].modules() if isinstance(m, SparseMoeBlock)]
    if not blocks or ctx["device"].type != "cuda":
        return []
    out = []
    hidden = ctx["config"].text.hidden_size
    for length in lengths:
        with torch.inference_mode():
            x = torch.randn(length, hidden, dtype=ctx["dtype"], device=ctx["device"],
                            generator=torch.Generator(ctx["device"]).manual_seed(length))
            routed = [block.route(block.gate(x)) for block in blocks]
            touched = statistics.mean(ids.unique().numel() for _, ids in routed)
            experts0 = blocks[0].experts
            per_expert = (experts0.gate_up_proj[0].numel() + experts0.down_proj[0].numel()) * x.element_size()
            floor_bytes_us = touched * per_expert / ctx["bandwidth"] * 1e6
            floor_flops_us = 2 * length * blocks[0].top_k * 3 * hidden * experts0.intermediate / ctx["matmul_rate"] * 1e6
            picked = moe_kernels.kernel_config(length * blocks[0].top_k, experts0.gate_up_proj.shape[0])
            row = {"tokens": length, "experts_touched": touched, "floor_bytes_us": floor_bytes_us,
                   "floor_flops_us": floor_flops_us, "picked": [picked.block_m, picked.block_n, picked.block_k,
                                                                picked.num_warps, picked.num_stages], "tiles": {}}
            for tile in MOE_TILES:
                config = moe_kernels.KernelConfig(*tile)

                def layers(config=config):
                    for block, (weights, ids) in zip(blocks, routed):
                        moe_kernels.fused_experts(x, block.experts.gate_up_proj, block.experts.down_proj, ids,
                                                  weights, config=config, path="sorted")
                try:
                    us = ctx["timer"].ms(layers, repeat=5, warmup=1) * 1e3 / len(blocks)
                except Exception as err:  # a tile that does not fit (shared memory) is skipped
                    log(f"moe tiles {length} tokens {tile}: {type(err).__name__}: {err}")
                    continue
                row["tiles"]["x".join(map(str, tile))] = round(us, 1)
            out.append(row)
            best = min(row["tiles"].items(), key=lambda kv: kv[1])
            log(f"moe tiles {length} tokens ({touched:.0f} experts; floors: bytes {floor_bytes_us:.0f} µs, FLOPs "
                f"{floor_flops_us:.0f} µs; picked {row['picked']}): " + ", ".join(f"{k} {v}" for k, v in row["tiles"].items())
                + f"; best {best[0]} {best[1]} µs")
    return out


def _engine_like(ctx, **options) -> Engine:
    """Another engine on the built runner (its graphs, its KV pool): one engine holds sequences at a time."""
    return Engine(ctx["engine"].runner, (2,), ctx["max_len"], "both", **{"max_num_seqs": ctx["max_batch"], **options})


def _synced_ms(ctx, fn) -> float:
    t = time.perf_counter()
    fn()
    if ctx["device"].type == "cuda":
        torch.cuda.synchronize()  # steps that sample nothing (a chunk mid-prompt) return before the GPU is done
    return (time.perf_counter() - t) * 1e3


def chunked(ctx):
    build_lm(ctx)
    out = {"budgets": _prefill_at_budgets(ctx), "mixed": _mixed_steps(ctx), "prefix_hit": _prefix_hit(ctx)}
    out["attention"] = _prefill_attention_kernels(ctx)
    RESULTS["chunked"] = out


def _prefill_at_budgets(ctx) -> dict:
    """Time to the first token of the 10,903-token prompt when prefilled in chunks of each budget."""
    tokens, images = _prefill_prompt(ctx)
    budgets = (1024, 2048, 4096, 8192, 16384) if ctx["big"] else (16, 32, 64, 128)
    runs = {"unchunked": _engine_like(ctx, max_batched_tokens=len(tokens), chunked_prefill=False, prefix_caching=False)}
    runs.update({str(b): _engine_like(ctx, max_batched_tokens=b, prefix_caching=False) for b in budgets})
    backend = ctx["engine"].runner.backend
    ways = ["split", "paged"] if getattr(backend, "prefix_chunks", None) else [None]  # chunks after a prefix
    result = {}
    for name, engine in runs.items():
        for way in ways if name != "unchunked" else ways[:1]:
            if way:
                backend.prefix_chunks = way
            ms = ctx["timer"].ms(lambda: _run_prefill(engine, tokens, images), repeat=3, warmup=1)
            key = name if way in (None, "split") or name == "unchunked" else f"{name}_{way}"
            result[key] = {"ms": ms, "tokens_per_s": len(tokens) / (ms / 1e3), "prefix_chunks": way}
    if ways[0]:
        backend.prefix_chunks = "split"
        result["split_chunks"] = backend.split_chunks
    base = result["unchunked"]["ms"]
    for name, row in result.items():
        if not isinstance(row, dict):
            continue
        row["vs_unchunked"] = base / row["ms"]
        log(f"chunked prefill {len(tokens)} tokens, budget {name}: {row['ms']:.1f} ms, "
            f"{row['tokens_per_s']:.0f} tokens/s ({row['vs_unchunked']:.2f}x unchunked)")
    return result


def _mixed_steps(ctx) -> dict:
    """Decode rows at 2k context: a pure decode step (graph replay), the same rows with a prompt chunk
    riding along (one eager step), and that chunk alone (after an equal prefix)."""
    cfg = ctx["config"]
    rows, context = (64, 2048) if ctx["big"] else (8, 64)
    chunk_sizes = (256, 1024, 2048, 4096) if ctx["big"] else (16, 32)
    result = {}
    for chunk in chunk_sizes:
        # room for one sequence beside the rows: with max_num_seqs taken, the prompt would never join a step
        engine = _engine_like(ctx, max_batched_tokens=rows + chunk, prefix_caching=False, max_num_seqs=rows + 1)
        seqs = _reserve_with_random_kv(engine, cfg, rows, context, ctx["dtype"], ctx["device"])
        decode_ms = statistics.median(_synced_ms(ctx, engine.step) for _ in range(10))
        prompt = new_seq("mixed", [11] * (chunk * 3 + 1), 1)
        engine.add_prompt(prompt)
        engine.step()  # first chunk (no prefix); the next ones read a prefix like a continuing prompt
        mixed_ms = statistics.median(_synced_ms(ctx, engine.step) for _ in range(2))
        for seq in seqs + [prompt]:
            engine.abort(seq.request_id)
        alone = _engine_like(ctx, max_batched_tokens=chunk, prefix_caching=False)
        prompt = new_seq("alone", [11] * (chunk * 3 + 1), 1)
        alone.add_prompt(prompt)
        alone.step()
        chunk_ms = statistics.median(_synced_ms(ctx, alone.step) for _ in range(2))
        alone.abort(prompt.request_id)
        result[chunk] = {"decode_step_ms": decode_ms, "mixed_step_ms": mixed_ms, "chunk_alone_ms": chunk_ms,
                         "decode_rows_in_mixed_ms": mixed_ms - chunk_ms}
        log(f"mixed step: {rows} decode rows @{context} + {chunk}-token chunk {mixed_ms:.2f} ms; pure decode "
            f"{decode_ms:.2f} ms, chunk alone {chunk_ms:.2f} ms (rows add {mixed_ms - chunk_ms:.2f} ms)")
    return {"rows": rows, "context": context, "by_chunk": result}


def _reserve_with_random_kv(engine: Engine, cfg, rows: int, context: int, dtype, device) -> list[Sequence]:
    seqs = []
    for i in range(rows):
        seq = Sequence(f"rows-{i}", [7] * context, context - 1, SamplingParams(temperature=0, max_tokens=10_000,
                                                                                ignore_eos=True),
                       num_computed=context - 1)
        engine.reserve(seq)
        engine.write_kv(seq.request_id, torch.randn(cfg.text.num_layers, 2, context - 1, cfg.text.num_kv_heads,
                                                    cfg.text.head_dim, dtype=dtype, device=device))
        engine.activate(seq.request_id)
        seqs.append(seq)
    engine.step()  # settle: every row has generated once
    return seqs


def _prefix_hit(ctx) -> dict:
    """The image prompt twice (images named by content hash): computed, then from the prefix cache."""
    tokens, images = _prefill_prompt(ctx)
    for i, image in enumerate(images):
        image.content_hash = f"bench-image-{i}"
    engine = _engine_like(ctx, max_batched_tokens=16384 if ctx["big"] else 128)
    cold = _synced_ms(ctx, lambda: _run_prefill(engine, tokens, images))
    hit = statistics.median(_synced_ms(ctx, lambda: _run_prefill(engine, tokens, images)) for _ in range(3))
    log(f"prefix cache: {len(tokens)}-token prompt {cold:.1f} ms computed, {hit:.1f} ms from the cache "
        f"({engine.cached_prompt_tokens} cached tokens over 4 runs)")
    return {"tokens": len(tokens), "computed_ms": cold, "cached_ms": hit, "cached_tokens": engine.cached_prompt_tokens}


def _prefill_attention_kernels(ctx) -> dict:
    """One layer's prefill attention for a chunk after a prefix (paged kernel vs gather + SDPA with a
    lower-right causal mask) and for a chunk with no prefix (the kernel vs SDPA, which the GPU path uses)."""
    if ctx["device"].type != "cuda":
        return {"skipped": "no GPU (tests/test_kernels.py checks the kernel in Triton's interpreter)"}
    from torch.nn.attention.bias import causal_lower_right

    from shared.engine.attention import causal_attention, split_chunk_attention
    from shared.kernels.attention import paged_prefill_attention

    cfg, dev, dtype, timer = ctx["config"], ctx["device"], ctx["dtype"], ctx["timer"]
    heads, kv_heads, dim, bs = cfg.text.num_heads, cfg.text.num_kv_heads, cfg.text.head_dim, 16
    result = {}
    for prefix, chunk in ((0, 2048), (2048, 2048), (8192, 2048), (8192, 2711), (8192, 512), (4096, 256)):
        ctx_len = prefix + chunk
        blocks = (ctx_len + bs - 1) // bs
        k_cache = torch.randn(blocks + 1, bs, kv_heads, dim, device=dev, dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        table = torch.randperm(blocks, device=dev).add(1).to(torch.int32)[None]
        q = torch.randn(chunk, heads, dim, device=dev, dtype=dtype)
        cu = torch.tensor([0, chunk], dtype=torch.int32, device=dev)
        lens = torch.tensor([ctx_len], dtype=torch.int32, device=dev)
        slots = (table[0].long()[:, None] * bs + torch.arange(bs, device=dev)).flatten()[:ctx_len]
        kernel = timer.ms(lambda: paged_prefill_attention(q, k_cache, v_cache, table, cu, lens, dim ** -0.5, chunk))

        def gathered():
            k, v = k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots]
            if prefix == 0:
                return causal_attention(q, k, v)
            qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            ks, vs = ks.repeat_interleave(heads // kv_heads, 1), vs.repeat_interleave(heads // kv_heads, 1)
            return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=causal_lower_right(chunk, ctx_len))

        sdpa = timer.ms(gathered)
        flops = 4 * chunk * (prefix + chunk / 2) * heads * dim
        row = {"triton_ms": kernel, "gather_sdpa_ms": sdpa, "triton_TFLOPs": flops / kernel / 1e9}
        if prefix:  # what the engine runs: gather, two fused calls, the merge
            new = torch.randn(chunk, kv_heads, dim, device=dev, dtype=dtype)
            pool_k, pool_v = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
            row["split_ms"] = timer.ms(lambda: split_chunk_attention(
                q, pool_k[slots[:prefix]], pool_v[slots[:prefix]], new, new))
            row["split_TFLOPs"] = flops / row["split_ms"] / 1e9
        result[f"prefix{prefix}_chunk{chunk}"] = row
        log(f"prefill attention, chunk {chunk} after {prefix}: paged Triton {kernel:.3f} ms "
            f"({flops / kernel / 1e9:.0f} TFLOP/s), gather + SDPA {sdpa:.3f} ms, split {row.get('split_ms')}")
    return result


def memory(ctx):
    build_lm(ctx)
    engine, dev = ctx["engine"], ctx["device"]
    n = 1000 if ctx["big"] else 100
    gen = torch.Generator().manual_seed(1)

    def wave(start: int, count: int):
        for i in range(start, start + count):
            length = int(torch.randint(16, 200, (1,), generator=gen))
            engine.add_prompt(new_seq(f"m{i}", torch.randint(10, ctx["vocab"], (length,), generator=gen).tolist(), 8))
        while engine.has_work():
            engine.step()

    wave(0, 100)  # warm the allocator
    if dev.type == "cuda":
        import gc

        gc.collect()  # earlier sections' leftovers must not count as "before"
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    peak_before = torch.cuda.max_memory_reserved(dev) if dev.type == "cuda" else 0
    t = time.perf_counter()
    for start in range(0, n, 200):
        wave(start + 100, min(200, n - start))
    elapsed = time.perf_counter() - t
    after = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    RESULTS["memory"] = {"requests": n, "allocated_before_MB": before / 2**20, "allocated_after_MB": after / 2**20,
                         "reserved_peak_before_MB": peak_before / 2**20,
                         "reserved_peak_after_MB": (torch.cuda.max_memory_reserved(dev) if dev.type == "cuda" else 0) / 2**20,
                         "kv_blocks_free_after": engine.blocks.num_free, "kv_blocks_total": engine.blocks.num_blocks,
                         "seconds": elapsed}
    log(f"memory: {n} requests in {elapsed:.1f}s, allocated {before / 2**20:.0f} -> {after / 2**20:.0f} MB, "
        f"blocks free {engine.blocks.num_free}/{engine.blocks.num_blocks}")


def hf(ctx):
    from transformers import AutoConfig, AutoModelForImageTextToText

    dev, cfg_name = ctx["device"], ctx["preset"]
    needed = 1.1 * lm_bytes(ctx["lm"]) if "lm" in ctx else 0
    if dev.type == "cuda" and needed > torch.cuda.mem_get_info(dev)[0]:
        RESULTS["hf"] = {"skipped": f"HF's copy of the model ({needed / 1e9:.0f} GB) does not fit beside ours; "
                                    "run --sections hf alone"}
        log("hf: skipped (memory)")
        return
    if ctx["big"]:
        config = AutoConfig.for_model(**{k: v for k, v in PRESETS[cfg_name].items()})
    else:
        config = AutoConfig.from_pretrained(ctx["tiny_path"])
    with torch.device(dev):
        model = AutoModelForImageTextToText.from_config(config, dtype=ctx["dtype"]).eval()
    prompt = torch.randint(10, ctx["vocab"], (1, 128 if ctx["big"] else 16), device=dev)

    def generate(n):
        with torch.no_grad():
            model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False)
        if dev.type == "cuda":
            torch.cuda.synchronize()

    generate(4)
    times = {}
    for n in (1, 65):
        t = time.perf_counter()
        generate(n)
        times[n] = time.perf_counter() - t
    step = (times[65] - times[1]) / 64 * 1e3
    RESULTS["hf"] = {"decode_step_ms": step}
    log(f"hf generate: decode step {step:.2f} ms")
    ctx["hf_vision"] = model.model.visual if ctx.get("keep_hf_vision") else None
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _hf_vision(ctx):
    """HF's vision tower of the same architecture (random weights), without building its language model
    where the family allows (Qwen3-VL's is a model of its own)."""
    from transformers import AutoConfig, AutoModel, AutoModelForImageTextToText

    dev, cfg = ctx["device"], ctx["config"]
    if ctx["big"]:
        config = AutoConfig.for_model(**{k: v for k, v in PRESETS[ctx["preset"]].items()})
    else:
        config = AutoConfig.from_pretrained(ctx["tiny_path"])
    with torch.device(dev):
        if cfg.family in QWEN3_FAMILIES:
            return AutoModel.from_config(config.vision_config, dtype=ctx["dtype"]).eval()
        return AutoModelForImageTextToText.from_config(config, dtype=ctx["dtype"]).model.visual.eval()


def vit(ctx):
    dev, cfg, timer = ctx["device"], ctx["config"], ctx["timer"]
    tower = load_vision_tower(None, cfg, dev, ctx["dtype"], load_format="dummy")
    grid = ctx["grid_1080p"] if ctx["big"] else (1, 8, 12)
    n = grid[1] * grid[2]
    hf_visual = _hf_vision(ctx)
    out = {"grid": grid}
    for images in (1, 4, 8):
        patches = torch.randn(images * n, cfg.vision.patch_dim, dtype=ctx["dtype"], device=dev)
        grids = [grid] * images
        with torch.inference_mode():
            ours = timer.ms(lambda: tower(patches, grids), repeat=5 if ctx["big"] else 2, warmup=2)
            theirs = None
            if images <= 4:
                thw = torch.tensor(grids, device=dev)
                theirs = timer.ms(lambda: hf_visual(patches, grid_thw=thw), repeat=3 if ctx["big"] else 1, warmup=1)
        # full attention in every block (Qwen2-VL, Qwen3-VL): the FLOPs are exact; windowed towers do fewer
        floor = vit_flops(cfg.vision, n, images) / ctx.get("matmul_rate", math.inf) * 1e3 \
            if cfg.vision.window_size == 0 else None
        out[images] = {"ours_ms": ours, "ours_ms_per_image": ours / images, "hf_ms": theirs,
                       "compute_floor_ms": floor, "ratio_to_floor": ours / floor if floor else None}
        log(f"vit {images} image(s): ours {ours:.1f} ms ({ours / images:.1f}/image), hf {theirs and round(theirs, 1)} ms"
            f", floor {floor and round(floor, 1)} ms")
    with torch.inference_mode():  # agreement with HF on one image (same weights copied over)
        patches = torch.randn(n, cfg.vision.patch_dim, dtype=ctx["dtype"], device=dev)
        _copy_vision_weights(hf_visual, tower)
        a = tower(patches, [grid]).float()
        hf_out = hf_visual(patches, grid_thw=torch.tensor([grid], device=dev))
        b = torch.cat([hf_out.pooler_output, *(getattr(hf_out, "deepstack_features", None) or [])], -1).float()
        out["rel_error_vs_hf"] = (torch.linalg.norm(a - b) / torch.linalg.norm(b)).item()
    log(f"vit rel. error vs HF: {out['rel_error_vs_hf']:.1e}")
    RESULTS["vit"] = out


def vit_graphs(ctx):
    """The vision tower through ``shared.model.pieces`` (``EPD_VIT_GRAPH_PATCHES``) against eager, on the
    shapes an encoder's batch takes: 1, 4 and 10 images of 448x448 (Dynamo's shape), one and two 1080p
    images; with each forward's largest difference from eager (max abs, and the eager output's scale)."""
    dev, cfg, timer = ctx["device"], ctx["config"], ctx["timer"]
    tower = load_vision_tower(None, cfg, dev, ctx["dtype"], load_format="dummy")
    geometry = ctx["geometry"]
    small, large = geometry.grid(448, 448), ctx["grid_1080p"]
    shapes = [("448x448", small, 1), ("448x448", small, 4), ("448x448", small, 10), ("1080p", large, 1),
              ("1080p", large, 2)] if ctx["big"] else [("tiny", (1, 8, 12), 1), ("tiny", (1, 8, 12), 3)]
    limit = ctx["vit_graph_patches"]
    started = time.perf_counter()
    if dev.type == "cuda":
        pieces.capture(tower, limit, layouts=8)
    else:  # the same pieces, eagerly
        tower.pieces = pieces.vision_pieces(tower, limit)
    capture_s = time.perf_counter() - started
    rows = []
    for label, grid, images in shapes:
        patches = torch.randn(images * grid[1] * grid[2], cfg.vision.patch_dim, dtype=ctx["dtype"], device=dev)
        grids = [grid] * images
        with torch.inference_mode():
            with _without_pieces(tower):
                eager_ms = timer.ms(lambda: tower(patches, grids), repeat=5 if ctx["big"] else 2, warmup=2)
                eager = tower(patches, grids).float()
            with _without_layouts(tower):
                graphs_ms = timer.ms(lambda: tower(patches, grids), repeat=5 if ctx["big"] else 2, warmup=2)
                pieced = tower(patches, grids).float()
                with _busy_interpreter():  # another thread wants the GIL, as a serving process's event loop
                    graphs_busy_ms = timer.ms(lambda: tower(patches, grids), repeat=5 if ctx["big"] else 2, warmup=1)
            layout_ms = timer.ms(lambda: tower(patches, grids), repeat=5 if ctx["big"] else 2, warmup=2)
            whole = tower(patches, grids).float()
            with _busy_interpreter():
                layout_busy_ms = timer.ms(lambda: tower(patches, grids), repeat=5 if ctx["big"] else 2, warmup=1)
            with _without_pieces(tower):  # where each path's GPU time goes, kernel by kernel
                eager_kernels, eager_us = _kernel_table(ctx, lambda: tower(patches, grids))
            with _without_layouts(tower):
                graph_kernels, graph_us = _kernel_table(ctx, lambda: tower(patches, grids))
        covered = tower.pieces.bucket(patches.shape[0]) is not None
        # full attention in every block (Qwen2-VL, Qwen3-VL): the FLOPs are exact; windowed towers do fewer
        # (None without the ceilings section, which measures the matmul rate)
        floor = vit_flops(cfg.vision, grid[1] * grid[2], images) / ctx["matmul_rate"] * 1e3 \
            if cfg.vision.window_size == 0 and "matmul_rate" in ctx else None
        row = {"shape": f"{images} x {label}", "patches": patches.shape[0], "covered": covered, "eager_ms": eager_ms,
               "graphs_ms": graphs_ms, "graphs_busy_ms": graphs_busy_ms, "layout_ms": layout_ms,
               "layout_busy_ms": layout_busy_ms, "layout_captured": _layout_captured(tower, grids),
               "layout_max_abs_diff": float((whole - pieced).abs().max()),
               "compute_floor_ms": floor, "max_abs_diff": float((pieced - eager).abs().max()),
               "scale": float(eager.abs().max()), "eager_kernel_us": eager_us, "graphs_kernel_us": graph_us,
               "eager_kernels": eager_kernels, "graphs_kernels": graph_kernels}
        rows.append(row)
        log(f"vit graphs {row['shape']} ({row['patches']} patches{'' if covered else ', above the limit: eager'}): "
            f"eager {eager_ms:.2f} ms ({eager_us / 1e3:.2f} ms of kernels), graphs {graphs_ms:.2f} ms "
            f"({graph_us / 1e3:.2f}), busy interpreter {graphs_busy_ms:.2f}; layout graph {layout_ms:.2f} ms, "
            f"busy {layout_busy_ms:.2f} (captured: {row['layout_captured']}, diff {row['layout_max_abs_diff']:.3g}); "
            f"compute floor {floor and round(floor, 2)} ms; "
            f"max diff {row['max_abs_diff']:.3g} of {row['scale']:.3g}")
        for name, table in (("eager", eager_kernels), ("graphs", graph_kernels)):
            for k in table[:8]:
                log(f"    {name:<6} {k['name']:<60} {k['launches']:>5} {k['us']:>10.1f} us")
    RESULTS["vit_graphs"] = {"max_patches": limit, "capture_s": round(capture_s, 1), "shapes": rows}


def preprocess(ctx):
    import numpy as np

    from tools.bench.dataset import make_image
    from shared.model.presets import materialize_preset
    from shared.model.processor import ImagePreprocessor, TorchImagePreprocessor

    dev = ctx["device"]
    path = materialize_preset(ctx["preset"]) if ctx["big"] else ctx["tiny_path"]
    height, width = (1080, 1920) if ctx["big"] else (224, 224)
    pixels = np.asarray(make_image(0, width, height))
    pil, on_device = ImagePreprocessor(path), TorchImagePreprocessor(path, ctx["dtype"])
    source = torch.from_numpy(pixels.copy())
    cpu_timer = Timer(torch.device("cpu"))
    pil_ms = cpu_timer.ms(lambda: pil(pixels), repeat=5, warmup=1)
    # wall clock around copy + kernels, as the encoder's vision thread pays it
    torch_ms = cpu_timer.ms(lambda: (on_device(source.to(dev)), torch.cuda.synchronize() if dev.type == "cuda"
                                     else None), repeat=20, warmup=3)
    expected, _ = pil(pixels)
    got = TorchImagePreprocessor(path)(source.to(dev)).cpu()
    difference = (got - torch.from_numpy(expected)).abs()
    step = 1 / 255 / min(pil._processor.image_std)
    RESULTS["preprocess"] = {"image": f"{width}x{height}", "pil_cpu_ms": pil_ms, "torch_device_ms": torch_ms,
                             "speedup": pil_ms / torch_ms, "max_diff_8bit_steps": difference.max().item() / step,
                             "share_differing": (difference > step / 2).float().mean().item()}
    log(f"preprocess {width}x{height}: PIL (1 CPU thread) {pil_ms:.1f} ms, torch on {dev.type} {torch_ms:.2f} ms "
        f"({pil_ms / torch_ms:.0f}x); patches differ by <= {difference.max().item() / step:.2f} 8-bit steps")


def encode_path(ctx):
    """Where an encode's time goes for small images (Dynamo's 10 × 448²): the device preprocessing of
    one image, the tower's forward over 1 and over 10 images, and the batcher (an encoder's vision
    thread) fed ten images one at a time, as ten per-image jobs arrive — its wall time per image against
    the forward's. The stacks report ~35-60 ms of forward per 448² image against ~3 ms in a batch of
    ten: this tells whether the tower's per-call cost or the path around it is to blame."""
    import asyncio

    import numpy as np

    from services.encoder.batcher import VisionBatcher
    from shared.model.processor import TorchImagePreprocessor
    from tools.bench.dataset import make_image

    dev, cfg, timer = ctx["device"], ctx["config"], ctx["timer"]
    path = materialize_preset(ctx["preset"]) if ctx["big"] else ctx["tiny_path"]
    side = 448 if ctx["big"] else 112
    tower = load_vision_tower(None, cfg, dev, ctx["dtype"], load_format="dummy")
    prepare = TorchImagePreprocessor(path, ctx["dtype"])
    source = torch.from_numpy(np.asarray(make_image(0, side, side)).copy())
    patches, grid = prepare(source.to(dev)), ImageGeometry.from_checkpoint(path).grid(side, side)
    cpu = Timer(torch.device("cpu"))  # wall clock: what the vision thread waits, syncs included
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    out = {"image": f"{side}x{side}", "grid": list(grid)}
    out["preprocess_ms"] = cpu.ms(lambda: (prepare(source.to(dev)), sync()), repeat=20, warmup=3)
    with torch.inference_mode():
        for images in (1, 10):
            batch = patches.repeat(images, 1)
            out[f"forward_{images}_ms"] = cpu.ms(lambda: (tower(batch, [grid] * images), sync()), repeat=10, warmup=2)
            out[f"forward_{images}_device_ms"] = timer.ms(lambda: tower(batch, [grid] * images), repeat=10, warmup=2)

    def rounds(mode: str, spacing_s: float, sibling_wait_s: float = 0.0) -> list[dict]:
        """Ten images one at a time, three rounds on one batcher (the first warms it up): ``thread``, an
        encoder's vision thread; ``step``, the aggregated path (``step`` in the caller's thread). With
        ``sibling_wait_s`` the batcher knows the request's images still to come, as an encoder does."""
        async def run() -> list[dict]:
            left = [0]  # the round's images not fed yet
            batcher = VisionBatcher(tower, asyncio.get_running_loop(), max_images=16, max_patches=65536,
                                    prepare=prepare, sibling_wait_s=sibling_wait_s, pending=lambda group: left[0])
            if mode == "thread":
                batcher.start()
            results = []
            for _ in range(3):
                before, batches, started = batcher.times.stats(), batcher.batches, time.perf_counter()
                jobs, left[0] = [], 10
                for _ in range(10):
                    jobs.append(batcher.encode(source, grid, group="request"))
                    left[0] -= 1
                    await asyncio.sleep(spacing_s)
                if mode == "step":
                    batcher.step()
                await asyncio.gather(*jobs)
                after = batcher.times.stats()
                results.append({"wall_ms": round((time.perf_counter() - started) * 1e3, 2),
                                "batches": batcher.batches - batches,
                                **{f"{stage}_ms_per_image": round(
                                    (after[f"{stage}_seconds_total"] - before[f"{stage}_seconds_total"])
                                    / max(1, after[f"{stage}_count"] - before[f"{stage}_count"]) * 1e3, 2)
                                   for stage in ("queue", "forward")}})
            batcher.stop()
            return results
        return asyncio.run(run())

    out["batcher_thread_together"] = rounds("thread", 0.0)
    out["batcher_thread_2ms_apart"] = rounds("thread", 0.002)
    out["batcher_thread_together_sibling_wait"] = rounds("thread", 0.0, 0.005)  # the encoder's default wait
    out["batcher_thread_2ms_apart_sibling_wait"] = rounds("thread", 0.002, 0.005)
    out["batcher_step_together"] = rounds("step", 0.0)
    out["tower_10_in_threads"] = _forward_in_threads(lambda: (tower(patches.repeat(10, 1), [grid] * 10), sync()), cpu)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.0002)
    out["batcher_thread_together_0.2ms_switch"] = rounds("thread", 0.0)
    out["batcher_thread_2ms_apart_0.2ms_switch"] = rounds("thread", 0.002)
    sys.setswitchinterval(interval)
    with torch.inference_mode():  # the batcher's forward, piece by piece, in this thread
        sources = [source] * 10
        made = lambda: torch.cat([prepare(x.to(dev)).to(ctx["dtype"]) for x in sources])  # noqa: E731
        out["prepare_10_ms"] = cpu.ms(lambda: (made(), sync()), repeat=10, warmup=2)
        batch = made()
        out["tower_10_prepared_ms"] = cpu.ms(lambda: (tower(batch, [grid] * 10), sync()), repeat=10, warmup=2)
    RESULTS["encode_path"] = out
    log(f"encode path {side}x{side}: preprocess {out['preprocess_ms']:.2f} ms, forward 1 image "
        f"{out['forward_1_ms']:.1f} ms wall / {out['forward_1_device_ms']:.1f} device, 10 images "
        f"{out['forward_10_ms']:.1f} / {out['forward_10_device_ms']:.1f}; prepare 10 {out['prepare_10_ms']:.1f}, "
        f"tower over them {out['tower_10_prepared_ms']:.1f}; batcher: "
        f"{ {k: v for k, v in out.items() if k.startswith('batcher')} }")


def _forward_in_threads(fn, cpu: Timer) -> dict:
    """``fn``'s wall time in this thread, in a thread of its own (main thread joining), and from
    ``asyncio.to_thread`` (the main thread in the event loop's poll), 5 rounds each after a warm-up."""
    import asyncio
    import threading

    def in_thread() -> float:
        times: list[float] = []

        def body():
            with torch.inference_mode():
                fn()
                for _ in range(5):
                    t = time.perf_counter()
                    fn()
                    times.append((time.perf_counter() - t) * 1e3)
        worker = threading.Thread(target=body)
        worker.start()
        worker.join()
        return statistics.median(times)

    async def from_loop() -> float:
        return await asyncio.to_thread(in_thread_body)

    def in_thread_body() -> float:
        with torch.inference_mode():
            return cpu.ms(fn, repeat=5, warmup=1)

    with torch.inference_mode():
        here = cpu.ms(fn, repeat=5, warmup=1)
    return {"this_thread_ms": here, "own_thread_ms": in_thread(), "to_thread_ms": asyncio.run(from_loop())}


def video(ctx):
    """The ViT over video clips (720p at 2 sampled frames a second, the processor's budget): frames →
    patches on the device, one clip's forward and four clips batched (patches and frames per second,
    against the compute floor for full-attention towers), HF's tower on the short clip; and the
    frontend's cost: PyAV decoding of the clip (30 fps source) against the frames it decodes."""
    from shared.model.video_processor import VideoPreprocessor

    dev, cfg, timer = ctx["device"], ctx["config"], ctx["timer"]
    path = materialize_preset(ctx["preset"]) if ctx["big"] else ctx["tiny_path"]
    processor = VideoPreprocessor.from_checkpoint(path, ctx["dtype"])
    g = processor.geometry
    tower = load_vision_tower(None, cfg, dev, ctx["dtype"], load_format="dummy")
    hf_visual = _hf_vision(ctx)
    height, width = (720, 1280) if ctx["big"] else (120, 160)
    out = {"resolution": f"{width}x{height}", "budget": {"cap_pixels_per_frame": g.cap_pixels_per_frame,
                                                          "max_video_tokens": g.max_video_tokens}}
    RESULTS["video"] = out  # rows land as they are measured: a fault later keeps the earlier ones
    for seconds in ((10, 30) if ctx["big"] else (2, 4)):
        frames = g.sampled_count(seconds * 30, 30.0)
        grid = g.grid(frames, height, width)
        pixels = torch.randint(0, 256, (frames, height, width, 3), dtype=torch.uint8)
        repeat = 5 if ctx["big"] else 2
        prep_ms = timer.ms(lambda: processor(pixels.to(dev)), repeat=repeat, warmup=1)
        patches, _ = processor(pixels.to(dev))
        row = {"frames": frames, "grid": grid, "patches": patches.shape[0],
               "tokens": patches.shape[0] // cfg.vision.merge_size ** 2, "preprocess_ms": prep_ms}
        out[f"{seconds}s"] = row
        row["decode"] = _decode_cost(seconds, width, height, g)  # the CPU's part first: a GPU fault keeps it
        with torch.inference_mode():
            for clips in (1, 4):
                log(f"video {seconds}s: ViT over {clips} clip(s), grid {grid}")
                batch = patches.repeat(clips, 1)
                ms = timer.ms(lambda: tower(batch, [grid] * clips), repeat=repeat, warmup=1)
                floor = vit_flops(cfg.vision, grid[1] * grid[2], grid[0] * clips) / ctx.get("matmul_rate", math.inf) \
                    * 1e3 if cfg.vision.window_size == 0 else None
                row[f"vit_{clips}"] = {"ms": ms, "patches_per_s": batch.shape[0] / ms * 1e3,
                                       "sampled_frames_per_s": frames * clips / ms * 1e3, "compute_floor_ms": floor}
            if seconds == (10 if ctx["big"] else 2):
                log(f"video {seconds}s: HF's tower")
                thw = torch.tensor([grid], device=dev)
                row["hf_vit_ms"] = timer.ms(lambda: hf_visual(patches, grid_thw=thw), repeat=2, warmup=1)
        log(f"video {seconds}s {width}x{height}: {frames} frames → grid {grid} ({row['tokens']} tokens); "
            f"preprocess {prep_ms:.1f} ms, ViT {row['vit_1']['ms']:.1f} ms ({row['vit_1']['patches_per_s']:.3g} "
            f"patches/s), 4 clips {row['vit_4']['ms']:.1f} ms, HF {row.get('hf_vit_ms')}; decode {row['decode']}")


def _decode_cost(seconds: int, width: int, height: int, geometry) -> dict:
    """The frontend's decode of one synthetic H.264 clip at 30 fps (CPU, frame threads), per frame decoded."""
    try:
        from services.frontend.video import VideoLimits, decode_video
        from tools.bench.video import make_clip
    except ImportError as err:  # PyAV missing on this machine
        return {"skipped": f"{err}"}
    data = make_clip(0, seconds, 30, width, height)
    limits = VideoLimits(max_seconds=600, max_fps=240, max_frames=768, max_frame_pixels=1 << 30, decode_timeout=600)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        decoded = decode_video(data, geometry, limits)
        times.append((time.perf_counter() - start) * 1e3)
    ms = statistics.median(times)
    decoded_frames = decoded.sampling.frame_indices[-1] + 1  # decoding stops after the last sampled frame
    return {"bytes": len(data), "ms": ms, "frames_decoded": decoded_frames, "frames_sampled": decoded.num_frames,
            "ms_per_decoded_frame": ms / decoded_frames}


def _copy_vision_weights(hf_visual, tower):
    from shared.model.loader import load_into

    load_into(tower, iter(hf_visual.state_dict().items()))  # the checkpoint loading path, fusing included


# ------------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench-results")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--preset", default="qwen2.5-vl-7b", choices=sorted(PRESETS))
    parser.add_argument("--tiny", action="store_true", help="smoke-test on a tiny model")
    parser.add_argument("--tiny-family", default="qwen2_5_vl", choices=["qwen2_5_vl", "qwen2_vl", *QWEN3_FAMILIES],
                        help="with --tiny: the tiny model's family")
    parser.add_argument("--kv-gb", type=float, default=24.0)
    parser.add_argument("--decode1-contexts", default="128",
                        help="decode1: context lengths, comma-separated; the first is measured in full, the others "
                             "as the graph replay alone")
    parser.add_argument("--prefill-graph-tokens", type=int, default=4096,
                        help="capture prefill steps of up to this many tokens piece by piece (0: eager), as "
                             "EPD_PREFILL_GRAPH_TOKENS does in a worker")
    parser.add_argument("--vit-graph-patches", type=int, default=16384,
                        help="vit_graphs: the largest forward (patches) captured")
    parser.add_argument("--min-blocks", default="",
                        help="decode1: at each of --decode1-contexts but the first, also the replay with the decode "
                             "attention's MIN_BLOCKS set to each of these (comma-separated)")
    parser.add_argument("--prefill-lengths", default="152,512,2132,8192",
                        help="prefill_sizes: prompt lengths in tokens, comma-separated")
    parser.add_argument("--no-decode1-parts", dest="decode1_parts", action="store_false",
                        help="decode1: skip the replays without each part and the MoE / projection paths")
    parser.add_argument("--trigger-first", action="store_true",
                        help="every section with shared.kernels.launch.TRIGGER_FIRST on (check: its accuracy)")
    parser.add_argument("--gemv-preload-bytes", type=int, default=None,
                        help="every section with shared.kernels.gemv.PRELOAD_BYTES set to this")
    args = parser.parse_args()
    if args.trigger_first or args.gemv_preload_bytes is not None:
        from shared.kernels import gemv, launch

        launch.TRIGGER_FIRST = args.trigger_first or launch.TRIGGER_FIRST
        gemv.PRELOAD_BYTES = gemv.PRELOAD_BYTES if args.gemv_preload_bytes is None else args.gemv_preload_bytes
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ctx = {"device": dev, "timer": Timer(dev), "big": not args.tiny, "preset": args.preset,
           "dtype": torch.bfloat16 if dev.type == "cuda" else torch.float32,
           "decode1_contexts": [int(c) for c in args.decode1_contexts.split(",")], "decode1_parts": args.decode1_parts,
           "prefill_lengths": [int(n) for n in args.prefill_lengths.split(",")],
           "min_blocks_ab": [int(n) for n in args.min_blocks.split(",") if n],
           "prefill_graph_tokens": args.prefill_graph_tokens, "vit_graph_patches": args.vit_graph_patches,
           "out": Path(args.out)}
    if args.tiny:
        from shared.model.tiny import write_tiny_checkpoint
        import tempfile

        ctx["tiny_path"] = write_tiny_checkpoint(tempfile.mkdtemp(), family=args.tiny_family)
        ctx["config"] = ModelConfig.from_checkpoint(ctx["tiny_path"])
    else:
        ctx["config"] = preset_config(args.preset)
    geometry = ImageGeometry.from_checkpoint(ctx["tiny_path"] if args.tiny else materialize_preset(args.preset))
    ctx["geometry"] = geometry
    ctx["grid_1080p"] = geometry.grid(1080, 1920)  # (1, 78, 138) for Qwen2.5-VL, (1, 68, 120) for Qwen3-VL
    ctx["vocab"] = min(1000, ctx["config"].text.vocab_size)
    per_block = KVCache.bytes_per_block(ctx["config"].text, 16, ctx["dtype"])
    ctx["kv_blocks"] = int(args.kv_gb * 1e9 // per_block) if not args.tiny else 2048
    ctx["max_len"] = 16384 if not args.tiny else 2048
    ctx["max_batch"] = 64 if not args.tiny else 8
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}
    try:
        import transformers
        import triton

        env.update(transformers=transformers.__version__, triton=triton.__version__)
    except ImportError:
        pass
    RESULTS["env"] = env
    log(f"env: {env}")
    for name in args.sections.split(","):
        try:
            globals()[name](ctx)
        except Exception as err:  # keep measuring the other sections
            RESULTS[name] = {"error": f"{type(err).__name__}: {err}"}
            log(f"{name} FAILED: {err}")
            traceback.print_exc()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_engine.json").write_text(json.dumps(RESULTS, indent=2, default=str))
    log(json.dumps(RESULTS, default=str))


if __name__ == "__main__":
    main()
