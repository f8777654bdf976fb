"""Fused elementwise kernels for the GPU path: one pass over memory where eager torch makes several.

- ``add_rms_norm``: residual add + RMSNorm (the residual stream is updated in place);
- ``rms_norm``: RMSNorm alone (first layer, ViT blocks);
- ``silu_mul``: SiLU(gate) × up from the fused gate|up projection;
- ``rope_store``: rotary embedding of q and k in place (after Qwen3's QK-norm, where asked), and k, v
  written into their KV-cache slots.

Each follows the reference's rounding points (float32 inside, the model's dtype where the reference
rounds), so results match the torch path to bf16 precision.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.kernels import launch


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, n, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # row · stride passes 2^31 in a ViT batch of long clips
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        summed = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32))
        x = summed.to(x_ptr.dtype.element_ty)  # the residual stream is kept in the model's dtype
        tl.store(res_ptr + row * stride_r + cols, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, 0) / n
    normed = (xf * tl.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty_like(rows)
    _rms_norm_kernel[(rows.shape[0],)](rows, rows, weight, out, rows.stride(0), rows.stride(0), out.stride(0),
                                      rows.shape[1], eps, HAS_RESIDUAL=False,
                                      BLOCK=triton.next_power_of_2(rows.shape[1]), num_warps=8)
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += x`` (in place) and return ``rms_norm(residual)``."""
    out = torch.empty_like(x)
    _rms_norm_kernel[(x.shape[0],)](x, residual, weight, out, x.stride(0), residual.stride(0), out.stride(0),
                                   x.shape[1], eps, HAS_RESIDUAL=True, BLOCK=triton.next_power_of_2(x.shape[1]),
                                   num_warps=8)
    return out


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # four 30 s 720p clips: 574k rows × 6,840
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=mask, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, (act.to(tl.float32) * up.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows, width = gate_up.shape
    n = width // 2
    out = torch.empty(rows, n, device=gate_up.device, dtype=gate_up.dtype)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, n, gate_up.stride(0), out.stride(0), BLOCK=block)
    return out


@triton.jit
def _norm_halves(lo, hi, x_ptr, w_ptr, d, dm, eps, HALF: tl.constexpr):
    """RMSNorm over each row of a head's two halves (QK-norm), rounded as ``RMSNorm`` rounds."""
    rstd = tl.rsqrt((tl.sum(lo * lo, 1) + tl.sum(hi * hi, 1)) / (2 * HALF) + eps)[:, None]
    w_lo = tl.load(w_ptr + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    w_hi = tl.load(w_ptr + HALF + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    dtype = x_ptr.dtype.element_ty
    lo = (w_lo * (lo * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    hi = (w_hi * (hi * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    return lo, hi


# a mixed step's chunks start after its decode rows: their slots are a view at any int32 offset, and a
# specialization on its alignment was one compile per residue of the row count mid-serving (one scalar
# is loaded per program: alignment buys nothing)
@triton.jit(do_not_specialize_on_alignment=["slots"])
def _rope_store_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, k_cache, v_cache, slots, q_norm, k_norm, eps,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct,
                       stride_cs, stride_ch,
                       NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                       HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr, KV_PAD: tl.constexpr, STORE: tl.constexpr,
                       QK_NORM: tl.constexpr, PDL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)  # the ViT's fused qkv: 574k tokens × 3,840 passes 2^31
    d = tl.arange(0, HALF_PAD)
    dm = d < HALF
    launch.wait_for_inputs(PDL)
    cos_lo = tl.load(cos_ptr + t * stride_ct + d, mask=dm, other=0.0).to(tl.float32)
    cos_hi = tl.load(cos_ptr + t * stride_ct + HALF + d, mask=dm, other=0.0).to(tl.float32)
    sin_lo = tl.load(sin_ptr + t * stride_ct + d, mask=dm, other=0.0).to(tl.float32)
    sin_hi = tl.load(sin_ptr + t * stride_ct + HALF + d, mask=dm, other=0.0).to(tl.float32)

    h = tl.arange(0, HEADS_PAD)
    hm = (h < NUM_HEADS)[:, None] & dm[None, :]
    q_lo_ptr = q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :]
    q_lo = tl.load(q_lo_ptr, mask=hm, other=0.0).to(tl.float32)
    q_hi = tl.load(q_lo_ptr + HALF, mask=hm, other=0.0).to(tl.float32)
    if QK_NORM:
        q_lo, q_hi = _norm_halves(q_lo, q_hi, q_ptr, q_norm, d, dm, eps, HALF)
    tl.store(q_lo_ptr, (q_lo * cos_lo[None, :] - q_hi * sin_lo[None, :]).to(q_ptr.dtype.element_ty), mask=hm)
    tl.store(q_lo_ptr + HALF, (q_hi * cos_hi[None, :] + q_lo * sin_hi[None, :]).to(q_ptr.dtype.element_ty), mask=hm)

    kh = tl.arange(0, KV_PAD)
    km = (kh < NUM_KV_HEADS)[:, None] & dm[None, :]
    k_lo_ptr = k_ptr + t * stride_kt + kh[:, None] * stride_kh + d[None, :]
    k_lo = tl.load(k_lo_ptr, mask=km, other=0.0).to(tl.float32)
    k_hi = tl.load(k_lo_ptr + HALF, mask=km, other=0.0).to(tl.float32)
    if QK_NORM:
        k_lo, k_hi = _norm_halves(k_lo, k_hi, k_ptr, k_norm, d, dm, eps, HALF)
    new_lo = (k_lo * cos_lo[None, :] - k_hi * sin_lo[None, :]).to(k_ptr.dtype.element_ty)
    new_hi = (k_hi * cos_hi[None, :] + k_lo * sin_hi[None, :]).to(k_ptr.dtype.element_ty)
    tl.store(k_lo_ptr, new_lo, mask=km)
    tl.store(k_lo_ptr + HALF, new_hi, mask=km)
    if STORE:
        slot = tl.load(slots + t).to(tl.int64)
        cache = slot * stride_cs + kh[:, None] * stride_ch + d[None, :]
        tl.store(k_cache + cache, new_lo, mask=km)
        tl.store(k_cache + cache + HALF, new_hi, mask=km)
        v_row = v_ptr + t * stride_vt + kh[:, None] * stride_vh + d[None, :]
        tl.store(v_cache + cache, tl.load(v_row, mask=km, other=0.0), mask=km)
        tl.store(v_cache + cache + HALF, tl.load(v_row + HALF, mask=km, other=0.0), mask=km)


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_cache: torch.Tensor | None, v_cache: torch.Tensor | None, slots: torch.Tensor | None,
               qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> None:
    """Rotate ``q`` ``[T, H, D]`` and ``k`` ``[T, KVH, D]`` in place; write k, v to cache ``slots`` if given.

    Caches are ``[slots, kv_heads, D]`` views of one layer's pool. ``cos``/``sin`` ``[T, D]`` may be
    float32 (the ViT's rotary) or the model's dtype. ``qk_norm``: (q's weight, k's weight, eps) of an
    RMSNorm over each head of q and of k before the rotary (Qwen3's QK-norm), done in the same pass."""
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    store = k_cache is not None
    q_norm, k_norm, eps = qk_norm if qk_norm is not None else (cos, cos, 0.0)
    pdl = launch.pdl(q)
    _rope_store_kernel[(tokens,)](
        q, k, v, cos, sin, k_cache if store else k, v_cache if store else v, slots if store else cos,
        q_norm, k_norm, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        k_cache.stride(0) if store else 0, k_cache.stride(1) if store else 0,
        NUM_HEADS=heads, NUM_KV_HEADS=kv_heads, HALF=dim // 2, HALF_PAD=triton.next_power_of_2(dim // 2),
        HEADS_PAD=triton.next_power_of_2(heads),
        KV_PAD=triton.next_power_of_2(kv_heads), STORE=store, QK_NORM=qk_norm is not None, PDL=pdl,
        **launch.options(pdl),
    )
