"""Decode attention: QK-norm, rotary, the new token's KV write and flash-decoding over the paged pool in
one kernel, and the merge of the context's splits in a second.

A decode row attends over its whole context with one query token. Before, a batch-1 decode step paid
three latency-bound kernels a layer for it — rotary and cache write, a split kernel over the context, a
merge of the splits — each waiting for the one before, and the split kernel started its own chain of
loads (context length → block table → keys) only after that wait. Here one program per (row, KV head,
split of the context):

0. before it waits for the previous kernel (programmatic dependent launch), loads what no kernel still
   running can write: the row's context length, its first walk's block table entries, keys and values
   (``WALK_TOKENS``, written by earlier steps) and the rotary tables (made at the step's start, kernels
   before the previous one: each kernel passes its own wait before the next may start);
1. normalizes (Qwen3's QK-norm) and rotates its query group's rows and the row's new key in registers,
   rounded to the model's dtype where ``fused.rope_store`` rounds them;
2. split 0 writes the new key and value to the row's cache slot. No program of the launch reads that
   slot: the new token's score and value come from registers, in the program whose split holds the
   last position, after its walks over the cached positions;
3. walks its split's blocks through the block table with an online softmax, as flash-decoding does;
4. writes the output itself when its row uses one split (a split takes at least one walk: contexts up
   to ``WALK_TOKENS``), else its partial result (running max, sum and weighted values), which
   ``_merge_kernel`` (one program per row and query head) combines by their maxima.

A first version merged in the same kernel (the last split to finish, found through an atomic counter):
on an H200 the merge of a program reading every split's partials alone made the batch-1 step slower
than the three kernels it replaced (docs/benchmarks.md).

Shapes depend on the batch alone (the split count is a compile-time constant, the context lengths
are read on the device), so the step stays capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.kernels import launch

WALK_TOKENS = 64  # keys a program loads and scores at once
MIN_BLOCKS = 4  # KV blocks of 16 a split takes at least: one walk; shorter contexts use fewer splits
NUM_WARPS = 8  # the first walk's keys and values stay in registers across the wait: at 4 warps they spilled


def default_splits(batch: int, num_kv_heads: int, multiprocessors: int = 132) -> int:
    """Enough programs to keep every multiprocessor streaming KV on long contexts, at most 32 splits."""
    return max(1, min(32, triton.cdiv(4 * multiprocessors, batch * num_kv_heads)))


@triton.jit
def _split_layout(context_lens, b, NUM_SPLITS: tl.constexpr, MIN_BLOCKS: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Row ``b``'s context length, its blocks, blocks a split and splits in use (both kernels agree)."""
    ctx = tl.load(context_lens + b)  # the new token included: it sits at position ctx - 1
    n_blocks = tl.cdiv(ctx, BLOCK_SIZE)
    per_split = tl.maximum(tl.cdiv(n_blocks, NUM_SPLITS), MIN_BLOCKS)
    return ctx, n_blocks, per_split, tl.cdiv(n_blocks, per_split)


@triton.jit
def _normed_rotated(x_ptr, offsets, d, partner, cos, sin_signed, norm_ptr, eps, mask,
                    QK_NORM: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Rows ``x[offsets]`` (``[rows, HEAD_DIM]``) after the optional RMSNorm over each row and the rotary
    (``x·cos + rotate_half(x)·sin``, the partner element read as a second load), in x's dtype."""
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(x_ptr + offsets - d[None, :] + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:  # rounded as ``RMSNorm`` rounds: the normalized row, then times the weight
        rstd = tl.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)[:, None]
        w = tl.load(norm_ptr + d).to(tl.float32)[None, :]
        wp = tl.load(norm_ptr + partner).to(tl.float32)[None, :]
        x = (w * (x * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        xp = (wp * (xp * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    return (x * cos[None, :] + xp * sin_signed[None, :]).to(dtype)


@triton.jit
def _load_walk(k_cache, v_cache, block_tables, b, kv_head, start, last, ctx, d, stride_cb, stride_cs, stride_ch,
               stride_bt, BLOCK_SIZE: tl.constexpr, TOKENS: tl.constexpr):
    """The keys and values of one walk (``TOKENS`` positions from block ``start``, before block ``last``),
    and which positions count: those before the new token's (``ctx - 1``), whose slot is not read."""
    t = tl.arange(0, TOKENS)
    block_index = start + t // BLOCK_SIZE
    in_range = block_index < last
    block = tl.load(block_tables + b * stride_bt + block_index, mask=in_range, other=0).to(tl.int64)
    valid = in_range & (block_index * BLOCK_SIZE + t % BLOCK_SIZE < ctx - 1)
    offsets = block[:, None] * stride_cb + (t % BLOCK_SIZE)[:, None] * stride_cs + kv_head * stride_ch + d[None, :]
    k = tl.load(k_cache + offsets, mask=valid[:, None], other=0.0)
    v = tl.load(v_cache + offsets, mask=valid[:, None], other=0.0)
    return k, v, valid


@triton.jit
def _attend(q, k, v, valid, m, l, acc, scale):
    """One walk into the online softmax (running max ``m``, sum ``l``, weighted values ``acc``)."""
    scores = tl.where(valid[None, :], tl.dot(q, tl.trans(k), input_precision="ieee") * scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    base = tl.where(m_new == float("-inf"), 0.0, m_new)  # a walk that met only the new token's position
    p = tl.exp(scores - base[:, None])
    alpha = tl.exp(m - base)
    return m_new, l * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")


# a mixed step's block tables are as wide as its longest table: their row stride changes from step to step
# (one compile per new specialization of it, 0.4-0.6 s each on the H200), graph replays keep theirs; the
# rows' slots and lengths are read a scalar a program, from graph inputs packed in one buffer or from a
# step's own tensors: their alignment is not specialized on either
@triton.jit(do_not_specialize=["stride_bt"], do_not_specialize_on_alignment=["slots", "context_lens"])
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_norm, k_norm, eps, slots,
    k_cache, v_cache, block_tables, context_lens, out_ptr, acc_ptr, m_ptr, l_ptr, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct,
    stride_cb, stride_cs, stride_ch, stride_bt, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, MIN_BLOCKS: tl.constexpr, GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCKS_PER_ITER: tl.constexpr,
    QK_NORM: tl.constexpr, PDL: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx, n_blocks, per_split, splits = _split_layout(context_lens, b, NUM_SPLITS, MIN_BLOCKS, BLOCK_SIZE)
    if split >= splits:  # the row's other programs wait, so the launch still ends after the previous kernel
        return
    first = split * per_split
    last = tl.minimum(first + per_split, n_blocks)

    # 0. before the wait: the first walk and the rotary tables
    TOKENS: tl.constexpr = BLOCK_SIZE * BLOCKS_PER_ITER
    d = tl.arange(0, HEAD_DIM)
    k, v, valid = _load_walk(k_cache, v_cache, block_tables, b, kv_head, first, last, ctx, d, stride_cb, stride_cs,
                             stride_ch, stride_bt, BLOCK_SIZE, TOKENS)
    cos = tl.load(cos_ptr + b * stride_ct + d).to(tl.float32)
    sin = tl.load(sin_ptr + b * stride_ct + d).to(tl.float32)
    launch.wait_for_inputs(PDL)

    # 1. the query group and the new key (the previous kernel's output), normalized and rotated
    partner = (d + HEAD_DIM // 2) % HEAD_DIM
    sin_signed = tl.where(d < HEAD_DIM // 2, -sin, sin)
    g = tl.arange(0, GROUP_PAD)
    g_ok = g < GROUP
    heads = kv_head * GROUP + g
    q = _normed_rotated(q_ptr, b * stride_qt + heads[:, None] * stride_qh + d[None, :], d, partner, cos, sin_signed,
                        q_norm, eps, g_ok[:, None], QK_NORM, HEAD_DIM)
    k_new = _normed_rotated(k_ptr, b * stride_kt + kv_head * stride_kh + d[None, :], d, partner, cos, sin_signed,
                            k_norm, eps, d[None, :] < HEAD_DIM, QK_NORM, HEAD_DIM)  # [1, HEAD_DIM]
    v_new = tl.load(v_ptr + b * stride_vt + kv_head * stride_vh + d[None, :])

    # 2. the new token's KV into its slot
    if split == 0:
        slot = tl.load(slots + b).to(tl.int64)
        cache = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + kv_head * stride_ch + d[None, :]
        tl.store(k_cache + cache, k_new)
        tl.store(v_cache + cache, v_new)

    # 3. the split's walks, then (last split) the new token
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    m, l, acc = _attend(q, k, v, valid, m, l, acc, scale)
    for start in range(first + BLOCKS_PER_ITER, last, BLOCKS_PER_ITER):
        k, v, valid = _load_walk(k_cache, v_cache, block_tables, b, kv_head, start, last, ctx, d, stride_cb,
                                 stride_cs, stride_ch, stride_bt, BLOCK_SIZE, TOKENS)
        m, l, acc = _attend(q, k, v, valid, m, l, acc, scale)
    if last == n_blocks:
        score = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), 1) * scale
        m_new = tl.maximum(m, score)
        p = tl.exp(score - m_new)
        alpha = tl.exp(m - m_new)
        l = l * alpha + p
        acc = acc * alpha[:, None] + p.to(v_new.dtype).to(tl.float32)[:, None] * v_new.to(tl.float32)
        m = m_new

    # 4. the output, or this split's partials for the merge
    if splits == 1:
        tl.store(out_ptr + b * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
    else:
        row = (b * NUM_HEADS + heads) * NUM_SPLITS + split
        tl.store(m_ptr + row, m, mask=g_ok)
        tl.store(l_ptr + row, l, mask=g_ok)
        tl.store(acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=g_ok[:, None])


@triton.jit(do_not_specialize_on_alignment=["context_lens"])
def _merge_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, context_lens, stride_ob, stride_oh,
                  NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
                  MIN_BLOCKS: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, PDL: tl.constexpr):
    """One row's query head: ``Σ_s acc_s · e^(m_s − M) / Σ_s l_s · e^(m_s − M)`` over its splits in use; a
    row of one split has its output already."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    _, _, _, splits = _split_layout(context_lens, b, NUM_SPLITS, MIN_BLOCKS, BLOCK_SIZE)
    launch.wait_for_inputs(PDL)  # also where there is nothing to merge: this launch must end after the last
    if splits == 1:
        return
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM)
    ok = s < splits
    row = (b * NUM_HEADS + h) * NUM_SPLITS + s
    m = tl.load(m_ptr + row, mask=ok, other=float("-inf"))
    l = tl.load(l_ptr + row, mask=ok, other=0.0)
    weight = tl.where(ok, tl.exp(m - tl.max(m, 0)), 0.0)
    acc = tl.load(acc_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=ok[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(l * weight, 0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, num_splits: int,
                     qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                     out: torch.Tensor | None = None, min_blocks: int | None = None,
                     num_warps: int = NUM_WARPS) -> torch.Tensor:
    """Decode rows' attention. ``q`` ``[B, heads, D]``, ``k``, ``v`` ``[B, kv_heads, D]`` before rotary (left
    unchanged); ``cos``/``sin`` ``[B, D]``; ``slots`` ``[B]``: each row's new token's cache slot; caches
    ``[blocks, block_size, kv_heads, D]``; ``block_tables`` ``[B, width]`` int32; ``context_lens`` ``[B]``
    int32, the new token included; ``qk_norm``: (q's weight, k's weight, eps); ``min_blocks``: blocks a
    split takes at least (tests: 1, for many splits on short contexts; by default ``MIN_BLOCKS``, read at
    each call so that a benchmark can set it); ``num_warps``: the first kernel's (benchmarks). Returns
    ``[B, heads, D]``."""
    min_blocks = MIN_BLOCKS if min_blocks is None else min_blocks
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q) if out is None else out
    partials = batch * num_heads * num_splits
    acc = torch.empty(partials, head_dim, device=q.device, dtype=torch.float32)
    m = torch.empty(partials, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    q_norm, k_norm, eps = qk_norm if qk_norm is not None else (cos, cos, 0.0)
    layout = dict(NUM_HEADS=num_heads, NUM_SPLITS=num_splits, MIN_BLOCKS=min_blocks, BLOCK_SIZE=block_size)
    pdl = launch.pdl(q)
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k, v, cos, sin, q_norm, k_norm, eps, slots, k_cache, v_cache, block_tables, context_lens, out,
        acc, m, l, scale, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCKS_PER_ITER=max(1, WALK_TOKENS // block_size), QK_NORM=qk_norm is not None, PDL=pdl,
        num_warps=num_warps, **layout, **launch.options(pdl),
    )
    _merge_kernel[(batch, num_heads)](
        acc, m, l, out, context_lens, out.stride(0), out.stride(1),
        SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)), HEAD_DIM=head_dim, PDL=pdl,
        **layout, **launch.options(pdl),
    )
    return out
