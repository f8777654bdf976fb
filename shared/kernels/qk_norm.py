"""QK-norm (Qwen3): RMSNorm over each head of q and of k, in place, one launch for both.

q and k are strided views into the fused q|k|v projection's output, so the eager path's two norms
each paid a copy of their input as well; here one program per token normalizes all of its heads where
they lie. Rounding follows the reference: float32 inside, the model's dtype where it rounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_heads(base, stride_h, w_ptr, eps, HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                DIM_PAD: tl.constexpr):
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, DIM_PAD)
    mask = (h < HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    ptrs = base + h[:, None] * stride_h + d[None, :]
    x = tl.load(ptrs, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    normed = (xf * tl.rsqrt(tl.sum(xf * xf, 1) / HEAD_DIM + eps)[:, None]).to(x.dtype)
    w = tl.load(w_ptr + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
    tl.store(ptrs, (w[None, :] * normed.to(tl.float32)).to(x.dtype), mask=mask)


@triton.jit
def _qk_norm_kernel(q_ptr, k_ptr, q_weight, k_weight, stride_qt, stride_qh, stride_kt, stride_kh, eps,
                    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
                    KV_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    _norm_heads(q_ptr + t * stride_qt, stride_qh, q_weight, eps, NUM_HEADS, HEADS_PAD, HEAD_DIM, DIM_PAD)
    _norm_heads(k_ptr + t * stride_kt, stride_kh, k_weight, eps, NUM_KV_HEADS, KV_PAD, HEAD_DIM, DIM_PAD)


def qk_norm_(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float) -> None:
    """``q`` ``[T, H, D]`` and ``k`` ``[T, KVH, D]`` (any token and head strides, D contiguous)."""
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    _qk_norm_kernel[(tokens,)](
        q, k, q_weight, k_weight, q.stride(0), q.stride(1), k.stride(0), k.stride(1), eps,
        NUM_HEADS=heads, NUM_KV_HEADS=kv_heads, HEADS_PAD=triton.next_power_of_2(heads),
        KV_PAD=triton.next_power_of_2(kv_heads), HEAD_DIM=dim, DIM_PAD=triton.next_power_of_2(dim),
    )
