#!/usr/bin/env python3
"""Engine and vision-tower benchmark on the GPU machine, side by side with HF transformers in one run.

Measures, for Qwen2.5-VL-7B shapes with random bf16 weights (timing does not depend on weight values):
  ceilings    device copy bandwidth and bf16 matmul rate (this run's own roofline)
  check       our GPU path (Triton kernels) against the torch reference path, same inputs
  decode1     decode step at batch 1 (128-token context): CUDA-graph replay and a whole engine step
  decode64    decode step at batch 64 with 2,048-token contexts, against weights + KV bytes / bandwidth
  prefill     prefill of the four-1080p-image prompt (10,903 tokens), against FLOPs / matmul rate
  memory      1,000 requests through the engine: KV pool and allocator do not grow
  hf          HF generate() decode step (t(65 tokens) - t(1 token)) / 64, 128-token prompt
  vit         vision tower, 1 and 4 x 1080p (and 8), ours against HF's
  sampling    decode step at batch 64 (2,048-token contexts): every row greedy, then one row with every sampling
              option (penalties, bias, top-k/p, min-p, seed, logprobs), one row under a JSON-schema grammar, every
              row with every option: what one request's options cost the others' steps
  preprocess  one 1080p image to patches: HF's PIL processor on one CPU thread against the torch path on
              the GPU (pixels copied over included), and how far apart their patches are

    python bench/gpu_engine.py --out results/ [--sections decode1,hf] [--tiny]

``--tiny`` runs every section on the built-in tiny model (CPU works) as a smoke test of this script.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.engine.engine import Engine  # noqa: E402
from shared.engine.kv_cache import KVCache  # noqa: E402
from shared.engine.runner import ModelRunner  # noqa: E402
from shared.engine.sampling import SamplingParams  # noqa: E402
from shared.engine.sequence import ImageInput, Sequence  # noqa: E402
from shared.model.config import ModelConfig  # noqa: E402
from shared.model.loader import load_language_model, load_vision_tower  # noqa: E402
from shared.model.presets import PRESETS  # noqa: E402

SECTIONS = ["ceilings", "check", "decode1", "decode64", "sampling", "prefill", "memory", "hf", "vit", "preprocess",
            "profile"]
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
                           max_batched_tokens=16384)
    if dev.type == "cuda":
        runner.capture_graphs(ctx["max_batch"], ctx["max_len"])
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
    from shared.engine import kernels
    from shared.engine.attention import TorchAttention

    build_lm(ctx)
    engine, lm, cfg, dev = ctx["engine"], ctx["lm"], ctx["config"], ctx["device"]
    if dev.type != "cuda":
        RESULTS["check"] = {"skipped": "no GPU: the torch path is the only path"}
        return
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
    kernels.fused.available = False  # the pure torch path: no fused kernels either
    try:
        results["torch_bf16"] = _forced_logits(torch_engine(lm, ctx["dtype"]), prompt, forced)
        lm32 = load_language_model(None, cfg, dev, torch.float32, load_format="dummy")
        lm32.load_state_dict({k: v.float() for k, v in lm.state_dict().items()})
        results["fp32"] = _forced_logits(torch_engine(lm32, torch.float32), prompt, forced)
        del lm32
    finally:
        kernels.fused.available = True
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
    patches = torch.randn(78 * 138, cfg.vision.patch_dim, dtype=ctx["dtype"], device=ctx["device"])
    with torch.inference_mode():
        table("vit_1080p", lambda: tower(patches, [(1, 78, 138)]))
    RESULTS["profile"] = tables


def decode1(ctx):
    build_lm(ctx)
    engine, timer = ctx["engine"], ctx["timer"]
    runner = engine.runner
    prompt = 128 if ctx["big"] else 32
    seq = new_seq("b1", list(range(100, 100 + prompt)), 10_000)
    engine.add_prompt(seq)
    engine.step()  # prefill
    for _ in range(3):
        engine.step()
    engine.blocks.may_append(seq)  # room for the token a replay computes
    rows = runner.stage_decode([seq])
    replay = None
    if runner.graphs is not None:
        replay = timer.ms(lambda: runner.graphs.replay(rows), repeat=200, warmup=10)
    walls = []
    for _ in range(100):
        t = time.perf_counter()
        engine.step()
        walls.append((time.perf_counter() - t) * 1e3)
    engine.abort("b1")
    step = statistics.median(walls)
    floor = ctx["weights_bytes"] / ctx.get("bandwidth", math.inf) * 1e3
    RESULTS["decode1"] = {"graph_replay_ms": replay, "engine_step_ms": step, "bandwidth_floor_ms": floor,
                          "weights_GB": ctx["weights_bytes"] / 1e9}
    log(f"decode b1: graph replay {replay and round(replay, 3)} ms, engine step {step:.3f} ms, floor {floor:.2f} ms")


def _decode_batch(ctx, name: str) -> list[Sequence]:
    """A running batch of sequences whose 2,047-token KV was written straight into the pool (random values)."""
    engine, cfg = ctx["engine"], ctx["config"]
    runner = engine.runner
    batch, context = (64, 2048) if ctx["big"] else (8, 64)
    seqs = []
    for i in range(batch):
        seq = Sequence(f"{name}-{i}", [7] * context, context - 1, SamplingParams(temperature=0, max_tokens=10_000,
                                                                                 ignore_eos=True),
                       num_computed=context - 1)
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
    moved = ctx["weights_bytes"] + kv_bytes
    floor = moved / ctx.get("bandwidth", math.inf) * 1e3
    for seq in seqs:
        engine.abort(seq.request_id)
    RESULTS["decode64"] = {"batch": batch, "context": context, "graph_replay_ms": replay,
                           "engine_step_ms": statistics.median(walls), "bytes_GB": moved / 1e9,
                           "bandwidth_floor_ms": floor, "share_of_bandwidth_limit": floor / replay,
                           "tokens_per_s": batch / (statistics.median(walls) / 1e3)}
    log(f"decode b{batch}@{context}: replay {replay:.2f} ms (floor {floor:.2f} ms, {floor / replay:.0%} of limit), "
        f"engine step {statistics.median(walls):.2f} ms")


def _prefill_prompt(ctx):
    cfg = ctx["config"]
    grid, images = ((1, 78, 138), 4) if ctx["big"] else ((1, 8, 8), 2)
    per_image = grid[1] * grid[2] // 4
    text = 10_903 - images * per_image if ctx["big"] else 40
    tokens = [11] * (text // 2)
    slots = []
    for _ in range(images):
        slots.append(ImageInput(len(tokens), grid, torch.randn(per_image, cfg.text.hidden_size, dtype=ctx["dtype"],
                                                               device=ctx["device"])))
        tokens += [6] * per_image
    tokens += [12] * (text - text // 2)
    return tokens, slots


def _run_prefill(engine: Engine, tokens, images) -> None:
    seq = new_seq("prefill", list(tokens), 1, images=images)
    engine.add_prompt(seq)
    engine.step()


def prefill(ctx):
    build_lm(ctx)
    engine, cfg, timer = ctx["engine"], ctx["config"], ctx["timer"]
    tokens, images = _prefill_prompt(ctx)
    ms = timer.ms(lambda: _run_prefill(engine, tokens, images), repeat=3, warmup=1)
    t, h, layers = len(tokens), cfg.text.hidden_size, cfg.text.num_layers
    linear = 2 * t * (ctx["weights_bytes"] / 2 - cfg.text.vocab_size * h)  # bf16: params = bytes / 2
    attention = 2 * t * t * h * layers  # causal: half of 4·T²·hidden per layer
    flops = linear + attention + 2 * h * cfg.text.vocab_size
    floor = flops / ctx.get("matmul_rate", math.inf) * 1e3
    RESULTS["prefill"] = {"tokens": t, "ms": ms, "TFLOP": flops / 1e12, "compute_floor_ms": floor,
                          "ratio_to_floor": ms / floor if floor else None}
    log(f"prefill {t} tokens: {ms:.1f} ms, {flops / 1e12:.0f} TFLOP, floor {floor:.1f} ms ({ms / max(floor, 1e-9):.2f}x)")


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


def vit(ctx):
    from transformers import AutoConfig, AutoModelForImageTextToText

    dev, cfg, timer = ctx["device"], ctx["config"], ctx["timer"]
    tower = load_vision_tower(None, cfg, dev, ctx["dtype"], load_format="dummy")
    grid = (1, 78, 138) if ctx["big"] else (1, 8, 12)
    n = grid[1] * grid[2]
    if ctx["big"]:
        config = AutoConfig.for_model(**{k: v for k, v in PRESETS[ctx["preset"]].items()})
    else:
        config = AutoConfig.from_pretrained(ctx["tiny_path"])
    with torch.device(dev):
        hf_visual = AutoModelForImageTextToText.from_config(config, dtype=ctx["dtype"]).model.visual.eval()
    out = {}
    for images in (1, 4, 8):
        patches = torch.randn(images * n, cfg.vision.patch_dim, dtype=ctx["dtype"], device=dev)
        grids = [grid] * images
        with torch.inference_mode():
            ours = timer.ms(lambda: tower(patches, grids), repeat=5 if ctx["big"] else 2, warmup=2)
            theirs = None
            if images <= 4:
                thw = torch.tensor(grids, device=dev)
                theirs = timer.ms(lambda: hf_visual(patches, grid_thw=thw), repeat=3 if ctx["big"] else 1, warmup=1)
        out[images] = {"ours_ms": ours, "ours_ms_per_image": ours / images, "hf_ms": theirs}
        log(f"vit {images} image(s): ours {ours:.1f} ms ({ours / images:.1f}/image), hf {theirs and round(theirs, 1)} ms")
    with torch.inference_mode():  # agreement with HF on one image (same weights copied over)
        patches = torch.randn(n, cfg.vision.patch_dim, dtype=ctx["dtype"], device=dev)
        _copy_vision_weights(hf_visual, tower)
        a = tower(patches, [grid]).float()
        b = hf_visual(patches, grid_thw=torch.tensor([grid], device=dev)).pooler_output.float()
        out["rel_error_vs_hf"] = (torch.linalg.norm(a - b) / torch.linalg.norm(b)).item()
    log(f"vit rel. error vs HF: {out['rel_error_vs_hf']:.1e}")
    RESULTS["vit"] = out


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


def _copy_vision_weights(hf_visual, tower):
    from shared.model.loader import load_into

    load_into(tower, iter(hf_visual.state_dict().items()))  # the checkpoint loading path, fusing included


# ------------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench-results")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--preset", default="qwen2.5-vl-7b", choices=sorted(PRESETS))
    parser.add_argument("--tiny", action="store_true", help="smoke-test on the tiny model")
    parser.add_argument("--kv-gb", type=float, default=24.0)
    args = parser.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ctx = {"device": dev, "timer": Timer(dev), "big": not args.tiny, "preset": args.preset,
           "dtype": torch.bfloat16 if dev.type == "cuda" else torch.float32}
    if args.tiny:
        from shared.model.tiny import write_tiny_checkpoint
        import tempfile

        ctx["tiny_path"] = write_tiny_checkpoint(tempfile.mkdtemp())
        ctx["config"] = ModelConfig.from_checkpoint(ctx["tiny_path"])
    else:
        ctx["config"] = preset_config(args.preset)
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
