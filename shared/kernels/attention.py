"""Paged decode attention (flash-decoding over KV blocks), for grouped-query attention.

One program per (sequence, KV head, split of the context): it loads the query rows of the KV head's
query group once, walks its share of the sequence's blocks through the block table, and keeps an
online softmax; a second kernel merges the splits. KV is read straight from the paged pool (no
gather), each KV head's keys once for its whole query group. Shapes are fixed per launch, with the
split count a compile-time constant, so the step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _split_kernel(
    q_ptr, k_cache, v_cache, block_tables, context_lens, acc_ptr, m_ptr, l_ptr, scale,
    stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCKS_PER_ITER: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens + b)
    n_blocks = tl.cdiv(ctx, BLOCK_SIZE)
    per_split = tl.cdiv(n_blocks, NUM_SPLITS)
    first = split * per_split
    last = tl.minimum(first + per_split, n_blocks)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + g
    g_ok = g < GROUP
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=g_ok[:, None], other=0.0)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    TOKENS: tl.constexpr = BLOCK_SIZE * BLOCKS_PER_ITER
    t = tl.arange(0, TOKENS)
    for start in range(first, last, BLOCKS_PER_ITER):
        block_index = start + t // BLOCK_SIZE
        in_range = block_index < last
        block = tl.load(block_tables + b * stride_bt + block_index, mask=in_range, other=0).to(tl.int64)
        position = block_index * BLOCK_SIZE + t % BLOCK_SIZE
        valid = in_range & (position < ctx)
        offsets = block[:, None] * stride_kb + (t % BLOCK_SIZE)[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
        k = tl.load(k_cache + offsets, mask=valid[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k)) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_cache + offsets, mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new

    row = (b * NUM_HEADS + heads) * NUM_SPLITS + split
    tl.store(m_ptr + row, m, mask=g_ok)
    tl.store(l_ptr + row, l, mask=g_ok)
    tl.store(acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=g_ok[:, None])


@triton.jit
def _merge_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, stride_ob, stride_oh,
                  NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
                  HEAD_DIM: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM)
    ok = s < NUM_SPLITS
    row = (b * NUM_HEADS + h) * NUM_SPLITS + s
    m = tl.load(m_ptr + row, mask=ok, other=float("-inf"))
    l = tl.load(l_ptr + row, mask=ok, other=0.0)
    top = tl.max(m, 0)
    weight = tl.where(ok & (l > 0), tl.exp(m - top), 0.0)
    total = tl.sum(l * weight, 0)
    acc = tl.load(acc_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=ok[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / total
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def default_splits(batch: int, num_kv_heads: int, multiprocessors: int = 132) -> int:
    """Enough programs to keep every multiprocessor streaming KV, at most 32 splits."""
    return max(1, min(32, triton.cdiv(4 * multiprocessors, batch * num_kv_heads)))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           num_splits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``q`` ``[B, heads, D]``; caches ``[blocks, block_size, kv_heads, D]``; block_tables ``[B, max_blocks]``
    int32; context_lens ``[B]`` int32 (tokens each row attends over). Returns ``[B, heads, D]``."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    acc = torch.empty(batch * num_heads * num_splits, head_dim, device=q.device, dtype=torch.float32)
    m = torch.empty(batch * num_heads * num_splits, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    _split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, acc, m, l, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        NUM_HEADS=num_heads, NUM_SPLITS=num_splits, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCKS_PER_ITER=max(1, 64 // block_size),
    )
    out = torch.empty_like(q) if out is None else out
    _merge_kernel[(batch, num_heads)](
        acc, m, l, out, out.stride(0), out.stride(1), NUM_HEADS=num_heads, NUM_SPLITS=num_splits,
        SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)), HEAD_DIM=head_dim,
    )
    return out


@triton.jit
def _segment_kernel(q_ptr, k_ptr, v_ptr, out_ptr, cu_ptr, scale, stride_t, stride_h, stride_ot, stride_oh,
                    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, MAX_LEN: tl.constexpr):
    segment = tl.program_id(0)
    head = tl.program_id(1)
    start = tl.load(cu_ptr + segment).to(tl.int64)
    length = tl.load(cu_ptr + segment + 1).to(tl.int64) - start
    t = tl.arange(0, MAX_LEN)
    d = tl.arange(0, DIM_PAD)
    rows = t < length
    mask = rows[:, None] & (d < HEAD_DIM)[None, :]
    offsets = (start + t)[:, None] * stride_t + head * stride_h + d[None, :]
    q = tl.load(q_ptr + offsets, mask=mask, other=0.0)
    k = tl.load(k_ptr + offsets, mask=mask, other=0.0)
    v = tl.load(v_ptr + offsets, mask=mask, other=0.0)
    scores = tl.dot(q, tl.trans(k)) * scale
    scores = tl.where(rows[None, :], scores, float("-inf"))
    p = tl.exp(scores - tl.max(scores, 1)[:, None])
    p = p / tl.sum(p, 1)[:, None]
    out = tl.dot(p.to(v.dtype), v)
    tl.store(out_ptr + (start + t)[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                      max_len: int) -> torch.Tensor:
    """Bidirectional attention within short segments of packed tokens (the ViT's windows, ≤ 128 tokens):
    one program per (segment, head) holds its whole segment, reading q, k, v in place (any token and
    head strides shared by the three). ``cu_seqlens`` int32 on the device."""
    tokens, heads, dim = q.shape
    out = torch.empty(tokens, heads, dim, dtype=q.dtype, device=q.device)
    _segment_kernel[(cu_seqlens.numel() - 1, heads)](
        q, k, v, out, cu_seqlens, dim ** -0.5, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=dim, DIM_PAD=max(16, triton.next_power_of_2(dim)), MAX_LEN=max(16, triton.next_power_of_2(max_len)),
    )
    return out
