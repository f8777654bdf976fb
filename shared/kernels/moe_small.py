"""Mixture-of-experts MLP for a few assignments (decode at small batches): two GEMVs, no sorting.

With ``A = T · top_k`` small, sorting the assignments by expert costs more than it saves: at batch 1
of Qwen3-VL-30B-A3B the one-program routing and alignment alone took 22 µs a layer, the 16-row tiles
of the grouped GEMMs were 15/16 padding, and the ``top_k`` rows were summed by a separate launch.
Here every assignment reads its own expert's weights directly (``ids`` say which):

1. ``_gate_up_kernel``, grid (assignment, block of the intermediate width): the token's row of ``x``
   against the expert's gate and up rows (``gate_up`` ``[E, 2I, H]``, gate rows first), products and
   sums in float32 (elementwise and ``tl.sum``: no ``tl.dot``, so no 16-row tile of which 15 rows are
   padding), then SiLU(gate) · up into ``act`` ``[A, I]``;
2. ``_down_kernel``, grid (token, block of H): the token's ``top_k`` rows of ``act`` against their
   experts' ``down`` rows (``[E, H, I]``), all slots in one ``[top_k, BLOCK_N, BLOCK_K]`` tile, the
   routing-weighted sum taken in registers and the ``[T, H]`` output written once: no ``[A, H]``
   intermediate and no separate sum. Launched with PDL, it reads the expert ids and loads its first
   weights before it waits for gate|up (the ids come from the kernel before that one).

Numerics are the grouped GEMMs' (``shared.kernels.moe``): gate and up rounded to the model's dtype,
SiLU in float32 and rounded, their product rounded; each expert's output rounded, times its routing
weight and rounded again, the ``top_k`` terms summed in float32 and rounded once (as torch's ``sum``
over the grouped GEMMs' rows does). Only the order of the float32 additions inside a dot product
differs (a tree sum of each step's products here, ``tl.dot``'s order there).

Up to ``MAX_ASSIGNMENTS = 64`` (8 tokens at top-8). Each assignment reads its expert on its own, so
an expert that several of the batch's tokens chose is read once per token. At batch 8 of 128 experts
the 64 assignments touch ~52 distinct experts: ~12 experts (9.4 MB each for Qwen3-VL-30B-A3B, ~24 µs
a layer at 4.8 TB/s) more than the sorted path reads, at worst, about what the sorted path's routing
and separate sum cost (22 + 4.7 µs a layer, measured at batch 1). Usually less: assignments are the
fastest grid axis, so programs reading the same expert's rows run side by side and the second read
is likely an L2 hit. Past that, sharing grows with the batch and the sorted path reads less.

Tiles (``GATE_UP``, ``DOWN``), chosen for H200 (132 SMs, ~4.8 TB/s): the work is reading the weights
once, so what counts is covering the SMs at batch 1 with enough bytes in flight (4.8 TB/s × ~1 µs of
latency: ~5 MB). Triton pipelines through shared memory only loads that feed ``tl.dot`` (the sm_90
build of these kernels has no async copies whatever ``num_stages`` says), so each loop loads the next
step's weights before it adds the current step's products: those loads are in flight while it
computes. The float32 products accumulate elementwise (32 or 64 values a thread) and
are reduced across threads once, after the last step: reducing every step (last session's kernels)
cost shuffles and a barrier per step, and the batch-1 decode step 3.14–3.16 against 3.08–3.11 ms
(docs/architecture.md, "Decode at batch 1"). The tiles come from a sweep at batch 1 (on one H200,
one layer's two GEMVs, 8 layers of experts of their own in one graph): gate|up 8 columns ×
256-wide steps, 4 warps (8 assignments × 768/8 = 768 programs, 8 steps over H = 2048), down 8 experts × 8
columns × 256-wide steps, 8 warps (256 programs, 3 steps over I = 768). The layer's GEMVs took 30.6 µs with
the first tiles of this scheme (8 warps, gate|up 16 × 256), 25.1 with gate|up 8 × 512 and down 8 × 128
(4 warps); the decode step 2.77 against 3.08–3.11 ms. With down's early loads (2. above) two more sweeps
and the step at each candidate, alternating processes, chose today's tiles: the step 2.476–2.481 ms
against 2.517–2.529 with gate|up 8 × 512 and down 8 × 256 at 4 warps, and 2.552–2.559 with down 8 × 128
(docs/benchmarks.md). Batches of 2–8 tokens run the same tiles, not swept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shared.kernels import launch

MAX_ASSIGNMENTS = 64  # tokens · top_k up to which the GEMVs beat sorting by expert (see above)
# down loads its ids and first weights before its wait: batch-1 step of Qwen3-VL-30B-A3B on an H200 2.58-2.59
# against 2.63-2.65 ms (docs/benchmarks.md); the benchmarks switch it off to measure that
EARLY_DOWN = True


@dataclass(frozen=True)
class GemvTiles:
    block_n: int  # output columns a program computes
    block_k: int  # reduction width streamed a step
    num_warps: int


GATE_UP = GemvTiles(block_n=8, block_k=256, num_warps=4)
DOWN = GemvTiles(block_n=8, block_k=256, num_warps=8)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, act_ptr, ids_ptr, N, K, stride_x, stride_we, stride_wn, stride_act,
                    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """act[a, cols] = SiLU(x[a // TOP_K] · G[e]ᵀ) · (x[a // TOP_K] · U[e]ᵀ), e = ids[a], for one block of
    the N = I columns; G and U are the first and last N rows of w[e]. x and w rows are contiguous in K."""
    launch.wait_for_inputs(PDL)
    a = tl.program_id(0)
    expert = tl.load(ids_ptr + a).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (a // TOP_K).to(tl.int64) * stride_x + ks
    w_ptrs = w_ptr + expert * stride_we + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]  # [BN, BK]
    gates = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    ups = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    w_ok = col_ok[:, None] & (ks < K)[None, :]
    g_w = tl.load(w_ptrs, mask=w_ok, other=0.0)
    u_w = tl.load(w_ptrs + N * stride_wn, mask=w_ok, other=0.0)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs, mask=ks < K - k0, other=0.0).to(tl.float32)[None, :]
        w_ok = col_ok[:, None] & (ks < K - k0 - BLOCK_K)[None, :]
        g_next = tl.load(w_ptrs + BLOCK_K, mask=w_ok, other=0.0)
        u_next = tl.load(w_ptrs + N * stride_wn + BLOCK_K, mask=w_ok, other=0.0)
        gates += g_w.to(tl.float32) * x
        ups += u_w.to(tl.float32) * x
        g_w, u_w = g_next, u_next
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    gate = tl.sum(gates, 1)
    up = tl.sum(ups, 1)
    out_type = act_ptr.dtype.element_ty
    # rounded where the reference rounds: gate and up in the model's dtype, SiLU in float32
    g = gate.to(out_type).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(out_type).to(tl.float32)
    act = silu * up.to(out_type).to(tl.float32)
    tl.store(act_ptr + a.to(tl.int64) * stride_act + cols, act.to(out_type), mask=col_ok)


@triton.jit
def _down_kernel(act_ptr, w_ptr, out_ptr, weights_ptr, ids_ptr, N, K, stride_act, stride_we, stride_wn, stride_out,
                 TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PDL: tl.constexpr, EARLY: tl.constexpr):
    """out[t, cols] = Σ_k weights[t, k] · (act[t·TOP_K + k] · D[ids[t, k]]ᵀ) for one block of the N = H
    columns, every slot k in one tile (slots past TOP_K masked). act and D rows are contiguous in K.
    EARLY: the ids and the first weights are loaded before the wait for the previous kernel (gate|up). The
    ids are written before gate|up, which waits for its own previous kernel before this one may launch:
    so they are complete and visible when this kernel starts."""
    if not EARLY:
        launch.wait_for_inputs(PDL)
    t = tl.program_id(0)
    slot = tl.arange(0, K_PAD)
    slot_ok = slot < TOP_K
    a = t * TOP_K + slot  # the token's assignments
    experts = tl.load(ids_ptr + a, mask=slot_ok, other=0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    act_ptrs = act_ptr + a[:, None].to(tl.int64) * stride_act + ks[None, :]  # [K_PAD, BK]
    w_ptrs = (w_ptr + experts[:, None, None] * stride_we + cols[None, :, None].to(tl.int64) * stride_wn
              + ks[None, None, :])  # [K_PAD, BN, BK]
    w_rows_ok = slot_ok[:, None, None] & col_ok[None, :, None]
    products = tl.zeros((K_PAD, BLOCK_N, BLOCK_K), dtype=tl.float32)
    w = tl.load(w_ptrs, mask=w_rows_ok & (ks < K)[None, None, :], other=0.0)
    if EARLY:
        launch.wait_for_inputs(PDL)
    for k0 in range(0, K, BLOCK_K):
        act = tl.load(act_ptrs, mask=slot_ok[:, None] & (ks < K - k0)[None, :], other=0.0).to(tl.float32)
        w_next = tl.load(w_ptrs + BLOCK_K, mask=w_rows_ok & (ks < K - k0 - BLOCK_K)[None, None, :], other=0.0)
        products += w.to(tl.float32) * act[:, None, :]
        w = w_next
        act_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc = tl.sum(products, 2)
    out_type = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + a, mask=slot_ok, other=0.0).to(tl.float32)
    # rounded as the grouped GEMMs' rows are before torch sums them: the expert's output, then the weighted term
    terms = (acc.to(out_type).to(tl.float32) * weight[:, None]).to(out_type).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_out + cols, tl.sum(terms, 0).to(out_type), mask=col_ok)


def gemv_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
                 weights: torch.Tensor, gate_up_tiles: GemvTiles | None = None,
                 down_tiles: GemvTiles | None = None) -> torch.Tensor:
    """``x`` ``[T, H]``; ``gate_up`` ``[E, 2I, H]`` (gate rows first); ``down`` ``[E, H, I]``; expert
    ``ids`` and routing ``weights`` ``[T, top_k]`` → ``Σ_k w_k · expert_k(x)`` ``[T, H]``. Two launches,
    shapes from ``T`` alone; tiles ``GATE_UP`` and ``DOWN`` (read at each call) unless given."""
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    inter = gate_up.shape[1] // 2
    gate_up_tiles, down_tiles = gate_up_tiles or GATE_UP, down_tiles or DOWN
    x, ids, weights = x.contiguous(), ids.contiguous().view(-1), weights.contiguous().view(-1)
    act = torch.empty(tokens * top_k, inter, dtype=x.dtype, device=x.device)
    pdl = launch.pdl(x)
    _gate_up_kernel[(tokens * top_k, triton.cdiv(inter, gate_up_tiles.block_n))](
        x, gate_up, act, ids, inter, hidden, x.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0),
        TOP_K=top_k, BLOCK_N=gate_up_tiles.block_n, BLOCK_K=gate_up_tiles.block_k,
        PDL=pdl, num_warps=gate_up_tiles.num_warps, **launch.options(pdl))
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    _down_kernel[(tokens, triton.cdiv(hidden, down_tiles.block_n))](
        act, down, out, weights, ids, hidden, inter, act.stride(0), down.stride(0), down.stride(1), out.stride(0),
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), BLOCK_N=down_tiles.block_n, BLOCK_K=down_tiles.block_k,
        PDL=pdl, EARLY=EARLY_DOWN, num_warps=down_tiles.num_warps, **launch.options(pdl))
    return out
