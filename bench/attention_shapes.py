#!/usr/bin/env python3
"""What a new attention shape costs: each SDPA backend's first call at a shape it has not seen, against
its steady time at that shape, for the shapes serving produces (every prompt its own length, every ViT
batch its own mix of image sizes), and what that first call costs in a thread that has not seen it.

cuDNN's fused attention (SDPA's first choice on sm90 with recent cuDNN) builds an execution plan per
exact shape — sizes and strides, batch included — and keeps it in a *thread-local* cache; the flash
kernel plans nothing. This measures both, and cuDNN with ``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1``
(PyTorch's opt-in ragged path: sequence lengths rounded to powers of two in the plan's key), which is
read once per process, so each setting runs in a child process of its own.

    python bench/attention_shapes.py --out results/          # on the GPU machine
    python bench/attention_shapes.py --out /tmp/smoke --tiny # CPU: the script's own smoke test

Cases (bf16 on the GPU):
  lm_causal   a fresh prompt's causal attention, Qwen2.5-VL-7B's heads (28 query, 4 KV, 128 dims), KV
              heads expanded as the engine expands them, at 10 lengths between 700 and 12,000
  lm_prefix   a chunk's queries over a prefix's keys, no mask (the split path's first half), 6 pairs
  vit         bidirectional attention over images of one size in one call ([images, 16 heads, length,
              80 dims], Qwen2.5-VL's tower), 8 (images, length) pairs from 448² to 1080p
  thread      a shape already planned in the main thread, called first in a new thread
  lm_causal/bucketed  what the engine runs for a fresh chunk: cuDNN at the chunk's bucketed length
              (``shared.kernels.sdpa``), after planning every bucket
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def synced_ms(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def first_and_steady(fn, device, repeat: int = 5) -> dict:
    first = synced_ms(fn, device)
    steady = statistics.median(synced_ms(fn, device) for _ in range(repeat))
    return {"first_ms": round(first, 3), "steady_ms": round(steady, 3), "excess_ms": round(first - steady, 3)}


def bshd(seqs: int, length: int, heads: int, dim: int, device, dtype) -> torch.Tensor:
    """``[seqs, heads, length, dim]`` laid out as [seqs, length, heads, dim], as the engine's and the
    tower's projections leave them."""
    return torch.randn(seqs, length, heads, dim, device=device, dtype=dtype).transpose(1, 2)


def measure(backend: str, shapes: list[dict], device, dtype) -> list[dict]:
    rows = []
    for shape in shapes:
        q = bshd(shape["b"], shape["q"], shape["heads"], shape["dim"], device, dtype)
        k = bshd(shape["b"], shape["kv"], shape["heads"], shape["dim"], device, dtype)
        v = bshd(shape["b"], shape["kv"], shape["heads"], shape["dim"], device, dtype)

        def call(q=q, k=k, v=v, causal=shape["causal"]):
            with sdpa_kernel([BACKENDS[backend]]):
                F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        try:
            row = first_and_steady(call, device)
        except RuntimeError as err:
            row = {"error": str(err).splitlines()[0][:160]}
        rows.append({**shape, **row})
    return rows


def bucketed(shapes: list[dict], device, dtype) -> tuple[list[dict], dict]:
    """What the engine runs for a fresh chunk (``shared.kernels.sdpa.causal``: cuDNN at the chunk's
    bucket), after planning every bucket up to the longest case as a worker's engine thread does."""
    from shared.kernels import sdpa

    first = shapes[0]
    started = time.perf_counter()
    plans = sdpa.warm(device, dtype, first["heads"], first["heads"], first["dim"], max(s["q"] for s in shapes))
    warm = {"plans": plans, "ms": round((time.perf_counter() - started) * 1e3, 1)}
    rows = []
    for shape in shapes:
        q, k, v = (bshd(1, shape["q"], shape["heads"], shape["dim"], device, dtype) for _ in range(3))
        rows.append({**shape, "bucket": sdpa.bucket(shape["q"]),
                     **first_and_steady(lambda: sdpa.causal(q, k, v), device)})
    return rows, warm


def thread_case(backend: str, shape: dict, device, dtype) -> dict:
    """The shape planned here first, then its first call in a new thread."""
    q = bshd(shape["b"], shape["q"], shape["heads"], shape["dim"], device, dtype)

    def call():
        with sdpa_kernel([BACKENDS[backend]]):
            F.scaled_dot_product_attention(q, q, q, is_causal=shape["causal"])
    here = first_and_steady(call, device)
    result = {}
    worker = threading.Thread(target=lambda: result.update(first_and_steady(call, device)))
    worker.start()
    worker.join()
    return {**shape, "main_thread": here, "new_thread": result}


def shapes_for(tiny: bool) -> dict[str, list[dict]]:
    rng = random.Random(0)
    if tiny:
        lm = [dict(b=1, q=n, kv=n, heads=4, dim=16, causal=True) for n in (17, 33, 50)]
        return {"lm_causal": lm, "lm_prefix": [dict(b=1, q=20, kv=40, heads=4, dim=16, causal=False)],
                "vit": [dict(b=b, q=n, kv=n, heads=4, dim=16, causal=False) for b, n in ((1, 64), (3, 64))]}
    lengths = sorted(rng.sample(range(700, 12000), 10))
    prefix_pairs = [(2048, 2048), (2711, 8192), (2048, 6144), (512, 8192), (1500, 3000), (8192, 4096)]
    vit_pairs = [(10, 1024), (9, 1024), (1, 1024), (3, 1024), (1, 8160), (4, 8160), (2, 4096), (5, 2304)]
    return {
        "lm_causal": [dict(b=1, q=n, kv=n, heads=28, dim=128, causal=True) for n in lengths],
        "lm_prefix": [dict(b=1, q=n, kv=p, heads=28, dim=128, causal=False) for n, p in prefix_pairs],
        "vit": [dict(b=b, q=n, kv=n, heads=16, dim=80, causal=False) for b, n in vit_pairs],
    }


def child(args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backends = ["cudnn", "flash"] if device.type == "cuda" else ["math"]
    if os.environ.get("TORCH_CUDNN_SDPA_AVOID_RECOMPILE") == "1":
        backends = ["cudnn"]
    # warm the library up (handles, the first kernel load) on a shape no case uses
    warm = bshd(1, 96, 4, 64, device, dtype)
    for backend in backends:
        with sdpa_kernel([BACKENDS[backend]]):
            F.scaled_dot_product_attention(warm, warm, warm, is_causal=True)
    out: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 "torch": torch.__version__,
                 "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
                 "avoid_recompile": os.environ.get("TORCH_CUDNN_SDPA_AVOID_RECOMPILE") == "1", "cases": {}}
    for case, shapes in shapes_for(args.tiny).items():
        for backend in backends:
            out["cases"][f"{case}/{backend}"] = measure(backend, shapes, device, dtype)
    if not out["avoid_recompile"]:
        out["cases"]["lm_causal/bucketed"], out["warm"] = bucketed(shapes_for(args.tiny)["lm_causal"], device, dtype)
    shape = shapes_for(args.tiny)["vit"][0]
    out["cases"]["thread"] = {b: thread_case(b, shape, device, dtype) for b in backends}
    return out


def summary(runs: dict) -> list[str]:
    lines = ["| setting | case | shapes | first call: excess over steady, mean (max) ms | steady ms, mean |",
             "|---|---|---|---|---|"]
    for name, run in runs.items():
        for case, rows in run["cases"].items():
            if case == "thread":
                for backend, row in rows.items():
                    lines.append(f"| {name} | thread/{backend} | 1 | main {row['main_thread']['excess_ms']}, "
                                 f"new thread {row['new_thread']['excess_ms']} | {row['new_thread']['steady_ms']} |")
                continue
            good = [r for r in rows if "error" not in r]
            if not good:
                lines.append(f"| {name} | {case} | 0 | {rows[0]['error']} | |")
                continue
            excess = [r["excess_ms"] for r in good]
            lines.append(f"| {name} | {case} | {len(good)} | {statistics.mean(excess):.1f} ({max(excess):.1f}) | "
                         f"{statistics.mean(r['steady_ms'] for r in good):.3f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true", help="CPU-sized shapes: a smoke test of this script")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    runs = {}
    settings = {"default": {}}
    if torch.cuda.is_available() and not args.tiny:
        settings["avoid_recompile"] = {"TORCH_CUDNN_SDPA_AVOID_RECOMPILE": "1"}
    for name, env in settings.items():
        cmd = [sys.executable, __file__, "--child", "--out", str(args.out)] + (["--tiny"] if args.tiny else [])
        done = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, check=False)
        if done.returncode:
            print(done.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"{name}: the child failed ({done.returncode})")
        runs[name] = json.loads(done.stdout.strip().splitlines()[-1])
    (args.out / "attention_shapes.json").write_text(json.dumps(runs, indent=1))
    text = "\n".join(summary(runs))
    (args.out / "attention_shapes.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
