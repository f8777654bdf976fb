#!/usr/bin/env python3
"""The decode attention kernel (``shared.kernels.decode_attention``) on the GPU: right, repeatable, and
how long one launch takes.

For each (batch, context) with Qwen3-VL-30B-A3B's attention (32 query heads, 4 KV heads, head_dim 128,
QK-norm; Qwen2.5-VL-7B's with ``--heads 28``), bf16, 16-token blocks scattered over the pool:

- right: fresh random inputs each trial against a float32 reference (QK-norm, rotary, the new key and
  value written to its slot, SDPA over the whole context), ‖out − ref‖ / ‖ref‖, the output poisoned
  with NaN before each launch; the new key and value in their slots;
- repeatable: the same inputs launched many times give bit-identical outputs (a missing wait or a
  stale read would show as a moving result);
- time: one launch per layer of a 48-layer chain in one CUDA graph (every layer its own pool, so the
  KV is not in L2 from the layer before), µs a launch, against the KV bytes it reads over the copy
  bandwidth measured here.

    python3 bench/decode_attention.py --out $OUT/decode_attention.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gemv_tiles import replay_us  # noqa: E402
from shared.kernels.decode_attention import NUM_WARPS, decode_attention, default_splits  # noqa: E402
from shared.model.rope import apply_rotary  # noqa: E402

BLOCK = 16


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x = x.float()
    return weight.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class Case:
    """One batch's inputs: raw q/k/v, rotary tables, a pool with the contexts' earlier tokens, tables."""

    def __init__(self, batch: int, context: int, heads: int, kv_heads: int, dim: int, gen: torch.Generator,
                 dev: torch.device, dtype: torch.dtype):
        blocks_each = math.ceil(context / BLOCK)
        self.pool_blocks = batch * blocks_each + 1
        self.k_cache = torch.randn(self.pool_blocks, BLOCK, kv_heads, dim, generator=gen, device=dev, dtype=dtype)
        self.v_cache = torch.randn_like(self.k_cache)
        order = torch.randperm(self.pool_blocks - 1, generator=gen, device=dev).int() + 1
        self.tables = order.view(batch, blocks_each)
        self.lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
        last = context - 1
        self.slots = (self.tables[:, last // BLOCK].long() * BLOCK + last % BLOCK)
        qkv = torch.randn(batch, (heads + 2 * kv_heads) * dim, generator=gen, device=dev, dtype=dtype)
        q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        self.q, self.k, self.v = q.view(batch, heads, dim), k.view(batch, kv_heads, dim), v.view(batch, kv_heads, dim)
        angles = torch.rand(batch, dim // 2, generator=gen, device=dev) * 100
        self.cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
        self.sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
        self.q_norm = (1 + 0.1 * torch.randn(dim, generator=gen, device=dev)).to(dtype)
        self.k_norm = (1 + 0.1 * torch.randn(dim, generator=gen, device=dev)).to(dtype)

    def launch(self, splits: int, out: torch.Tensor | None = None, num_warps: int = NUM_WARPS) -> torch.Tensor:
        return decode_attention(self.q, self.k, self.v, self.cos, self.sin, self.slots, self.k_cache, self.v_cache,
                                self.tables, self.lens, self.q.shape[-1] ** -0.5, splits,
                                (self.q_norm, self.k_norm, 1e-6), out=out, num_warps=num_warps)

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float32: the output, and the new keys as they should be in the pool."""
        q = apply_rotary(rms(self.q, self.q_norm), self.cos.float(), self.sin.float())
        k_new = apply_rotary(rms(self.k, self.k_norm), self.cos.float(), self.sin.float())
        outs = []
        for b in range(q.shape[0]):
            context = int(self.lens[b])
            slots = (self.tables[b].long()[:, None] * BLOCK + torch.arange(BLOCK, device=q.device)).flatten()[:context]
            keys = self.k_cache.flatten(0, 1)[slots].float()
            values = self.v_cache.flatten(0, 1)[slots].float()
            keys[-1], values[-1] = k_new[b], self.v[b].float()
            outs.append(F.scaled_dot_product_attention(q[b][:, None], keys.transpose(0, 1), values.transpose(0, 1),
                                                       enable_gqa=True)[:, 0])
        return torch.stack(outs), k_new


def check(case_args, dev, dtype, trials: int, repeats: int) -> dict:
    worst, ragged = 0.0, 0
    gen = torch.Generator(dev).manual_seed(0)
    for trial in range(trials):
        case = Case(*case_args, gen, dev, dtype)
        splits = default_splits(case.q.shape[0], case.k.shape[1])
        ref, k_new = case.reference()
        out = torch.full_like(case.q, float("nan"))
        case.launch(splits, out)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        err = (torch.linalg.norm((out.float() - ref).flatten()) / torch.linalg.norm(ref.flatten())).item()
        worst = max(worst, err if not math.isnan(err) else float("inf"))
        stored = case.k_cache.flatten(0, 1)[case.slots].float()
        assert torch.allclose(stored, k_new, rtol=2e-2, atol=2e-2), "new keys not in their slots"
        assert torch.equal(case.v_cache.flatten(0, 1)[case.slots], case.v), "new values not in their slots"
        if trial == 0:  # the same inputs again and again: any difference is a race
            for _ in range(repeats):
                again = case.launch(splits)
                ragged += not torch.equal(again, out)
    return {"rel_error_max": worst, "repeats": repeats, "repeats_differing": ragged}


def time_chain(case_args, dev, dtype, layers: int, bandwidth: float, num_warps: int) -> dict:
    gen = torch.Generator(dev).manual_seed(1)
    cases = [Case(*case_args, gen, dev, dtype) for _ in range(layers)]
    splits = default_splits(cases[0].q.shape[0], cases[0].k.shape[1])
    outs = [torch.empty_like(c.q) for c in cases]

    def chain():
        for case, out in zip(cases, outs):
            case.launch(splits, out, num_warps)

    us = replay_us(chain, layers)
    c = cases[0]
    kv_bytes = 2 * int(c.lens.sum()) * c.k.shape[1] * c.k.shape[2] * c.k.element_size()
    return {"us_per_launch": us, "splits": splits, "kv_floor_us": kv_bytes / bandwidth * 1e6}  # both kernels


def copy_bandwidth(dev) -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return 2 * a.numel() / (statistics.median(times) / 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="decode_attention.json")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--shapes", default="1x128,1x2048,1x16384,8x2048,64x2048", help="BATCHxCONTEXT, comma-separated")
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--num-warps", default=str(NUM_WARPS), help="the decode kernel's, comma-separated: timed each")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()  # on CPU (TRITON_INTERPRET=1, small --shapes): the checks alone, a smoke test
    dev, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    bandwidth = copy_bandwidth(dev) if cuda else math.nan
    results = {"device": torch.cuda.get_device_name(dev) if cuda else "cpu", "torch": torch.__version__,
               "copy_bandwidth_TBps": bandwidth / 1e12, "heads": args.heads, "kv_heads": args.kv_heads, "shapes": {}}
    for shape in args.shapes.split(","):
        batch, context = (int(x) for x in shape.split("x"))
        case_args = (batch, context, args.heads, args.kv_heads, 128)
        row = check(case_args, dev, dtype, args.trials, args.repeats)
        timed = []
        for warps in (int(w) for w in args.num_warps.split(",")) if cuda else ():
            row[f"warps_{warps}"] = time_chain(case_args, dev, dtype, args.layers, bandwidth, warps)
            timed.append(f"{warps} warps {row[f'warps_{warps}']['us_per_launch']:.2f} µs")
        results["shapes"][shape] = row
        floor = f" (KV floor {row[f'warps_{warps}']['kv_floor_us']:.2f} µs)" if timed else ""
        print(f"{shape:>9}: rel error {row['rel_error_max']:.2e}, {row['repeats_differing']}/{row['repeats']} repeats "
              f"differ; a launch: {', '.join(timed)}{floor}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
