"""Attention kernels over the paged KV pool for prompt chunks, and the ViT's windows. (Decode rows have a
kernel of their own: ``shared.kernels.decode_attention``.)

Paged prefill (varlen, causal, after a prefix): one program per (chunk, KV head, tile of the chunk's
queries); the tile's queries of the whole query group form one matrix, and the keys — the prefix's and
the chunk's own, already written to the pool — stream through the block table up to the tile's last
position, with an online softmax. Chunk ``i`` holds packed queries ``cu_seqlens_q[i] …
cu_seqlens_q[i+1]``, the last of its ``context_lens[i]`` tokens, so query ``t`` sits at position
``context_lens[i] - len + t`` and sees keys up to it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
    # "ieee": float32 operands (the float32 dtype, which parity runs use) multiply in float32, not in TF32 (Triton's
    # default for them, ~1e-3 relative: enough to flip a near-tie against HF); 16-bit operands ignore it
    scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    scores = tl.where(rows[None, :], scores, float("-inf"))
    p = tl.exp(scores - tl.max(scores, 1)[:, None])
    p = p / tl.sum(p, 1)[:, None]
    out = tl.dot(p.to(v.dtype), v, input_precision="ieee")
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


# the decode rows before it and the tables' width: a new value must not recompile
@triton.jit(do_not_specialize=["first_chunk", "stride_bt"])
def _prefill_kernel(q_ptr, k_cache, v_cache, out_ptr, block_tables, cu_seqlens_q, context_lens, scale,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_bt,
                    first_chunk, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    SKIP_FRESH: tl.constexpr):
    chunk = tl.program_id(0) + first_chunk
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q + chunk)
    q_len = tl.load(cu_seqlens_q + chunk + 1) - q_start
    ctx = tl.load(context_lens + chunk)
    prefix = ctx - q_len

    # rows: BLOCK_M query tokens x GROUP_PAD heads of this KV head's group
    r = tl.arange(0, BLOCK_M * GROUP_PAD)
    token = tile * BLOCK_M + r // GROUP_PAD
    g = r % GROUP_PAD
    row_ok = (token < q_len) & (g < GROUP)
    d = tl.arange(0, HEAD_DIM)
    head = kv_head * GROUP + g
    q = tl.load(q_ptr + (q_start + token)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    position = prefix + token

    # keys up to the tile's last query; none for a tile past the chunk or a chunk SDPA does instead
    end = tl.minimum(ctx, prefix + (tile + 1) * BLOCK_M)
    active = tile * BLOCK_M < q_len
    if SKIP_FRESH:
        active = active & (prefix > 0)
    end = tl.where(active, end, 0)

    m = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, HEAD_DIM], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for key_start in range(0, end, BLOCK_N):
        key = key_start + n
        key_ok = key < end
        block = tl.load(block_tables + chunk * stride_bt + key // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        offsets = block[:, None] * stride_kb + (key % BLOCK_SIZE)[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
        k = tl.load(k_cache + offsets, mask=key_ok[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # float32: not TF32 (see above)
        visible = key_ok[None, :] & (key[None, :] <= position[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        # key 0 is visible to every row, so each row's maximum is finite from the first tile on
        m_new = tl.maximum(m, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_cache + offsets, mask=key_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new

    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + (q_start + token)[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(row_ok & active)[:, None])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                            scale: float, max_query_len: int, first_chunk: int = 0, skip_fresh: bool = False,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of packed chunks over their whole context in the paged pool (new tokens' KV
    already written). ``q`` ``[T, heads, D]``; caches ``[blocks, block_size, kv_heads, D]``;
    ``block_tables`` ``[chunks, width]``, ``cu_seqlens_q`` ``[chunks + 1]``, ``context_lens`` ``[chunks]``,
    int32. Chunks before ``first_chunk`` are left alone (decode rows, done by the decode kernel), and so
    are chunks with no prefix when ``skip_fresh``. ``max_query_len``: the longest chunk computed here."""
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    # 128 query rows (tokens x heads of a group) per program: each key tile loaded serves them all
    block_m = max(1, 128 // group_pad)
    out = torch.empty_like(q) if out is None else out
    chunks = cu_seqlens_q.numel() - 1 - first_chunk
    if chunks <= 0 or max_query_len <= 0:
        return out
    grid = (chunks, num_kv_heads, triton.cdiv(max_query_len, block_m))
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, cu_seqlens_q, context_lens, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), block_tables.stride(0), first_chunk,
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1], BLOCK_M=block_m,
        BLOCK_N=64, SKIP_FRESH=skip_fresh, num_warps=8,
    )
    return out


def warm_prefill(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, skip_fresh: bool) -> None:
    """Compile ``paged_prefill_attention``'s variant for this pool now: one 16-token chunk after a block of
    prefix (the pool's first two blocks, read only; the output is dropped). Serving reaches it only at the
    first short chunk after a prefix, mid-load: one H200 run compiled it there (559 ms) with a dozen decode
    rows waiting."""
    device = k_cache.device
    block_size = k_cache.shape[1]
    q = torch.zeros(16, num_heads, k_cache.shape[-1], device=device, dtype=k_cache.dtype)
    tables = torch.tensor([[0, 1]], dtype=torch.int32, device=device)
    cu = torch.tensor([0, 16], dtype=torch.int32, device=device)
    lens = torch.tensor([block_size + 16], dtype=torch.int32, device=device)
    paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, 1.0, 16, skip_fresh=skip_fresh)
