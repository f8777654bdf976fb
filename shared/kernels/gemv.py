"""Projections for a few rows (decode at small batches), with the RMSNorm before them fused in.

At batch 1 a decoder layer's projections are matrix-vector products bound by reading the weights, and
the norms between them are launches of their own: residual add + RMSNorm, then cuBLAS's GEMV. Here one
kernel does both: every program computes the norm statistic of the rows it needs (x + residual: a few
KB, read from L2 by each program) and streams its block of weight rows against the normalized rows.
One program also writes the new residual and, where the next kernel needs it (the MoE experts read
the normalized rows), the normalized rows themselves; they go to new tensors, never in place: the
other programs are still reading the old residual.

The kernels launch with programmatic dependent launch where the device has it
(``shared.kernels.launch``): each program loads its first block of weights before it waits for the
previous kernel, so the weight stream starts while that kernel finishes.

Numerics are those of ``fused.add_rms_norm`` followed by a matrix product: the sum rounded to the
model's dtype (the residual stream's), the normalized row rounded, times the norm's weight rounded;
products summed in float32, the output rounded once (plus the bias, rounded, where there is one).
Only the order of the float32 additions differs from cuBLAS's.

Tiles: a program computes ``BLOCK_N`` outputs for every row, streaming ``BLOCK_K`` of the reduction a
step in 16-byte vectors along the contiguous K, with the next step's weights loaded before the
current step's products are summed (bytes in flight while it computes). ``BLOCK_N`` is chosen so there
are at least two programs per SM on an H200 (q|k|v of Qwen3-VL-30B-A3B: 5,120 outputs / 16 = 320
programs; o: 2,048 / 8 = 256), and the ``[rows, BLOCK_N, BLOCK_K]`` products stay at 32 float32 values
a thread.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.kernels import launch

MAX_ROWS = 4  # rows up to which these kernels replace norm + cuBLAS (decode graphs of 1, 2 and 4 rows)
NUM_WARPS = 8
PROGRAMS = 256  # about two per SM of an H200 (132)


def tiles(n: int, rows: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) for ``n`` outputs of ``rows`` rows."""
    block_n = 16
    while block_n > 4 and triton.cdiv(n, block_n) < PROGRAMS:
        block_n //= 2
    rows_pad = triton.next_power_of_2(rows)
    block_k = max(64, 32 * 32 * NUM_WARPS // (rows_pad * block_n))  # 32 products a thread
    return block_n, min(block_k, 1024)


@triton.jit(do_not_specialize=["rows"])
def _gemv_kernel(x_ptr, res_ptr, norm_ptr, w_ptr, bias_ptr, out_ptr, res_out_ptr, h_out_ptr,
                 rows, N, K, eps, stride_x, stride_r, stride_w, stride_o,
                 NORM: tl.constexpr, RESIDUAL: tl.constexpr, KEEP: tl.constexpr, HAS_BIAS: tl.constexpr,
                 ROWS_PAD: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PDL: tl.constexpr):
    """out[r, cols] = h[r] · W[cols]ᵀ (+ bias): h = x, or with NORM the RMSNorm of x (+ res with RESIDUAL).
    Program 0 writes x + res to res_out (RESIDUAL) and h to h_out (KEEP). Rows are contiguous in K; the
    res_out and h_out rows have x's stride."""
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_w + ks[None, :]
    w = tl.load(w_ptrs, mask=col_ok[:, None] & (ks < K)[None, :], other=0.0)  # weights: no kernel writes them
    launch.wait_for_inputs(PDL)

    r = tl.arange(0, ROWS_PAD)
    r_ok = r < rows
    dtype = x_ptr.dtype.element_ty
    rstd = tl.zeros((ROWS_PAD,), tl.float32)
    if NORM:  # the rows' statistics (and program 0's writes) over the whole width first
        kk = tl.arange(0, K_PAD)
        whole = r_ok[:, None] & (kk < K)[None, :]
        xs = tl.load(x_ptr + r[:, None] * stride_x + kk[None, :], mask=whole, other=0.0)
        if RESIDUAL:  # the residual stream is kept in the model's dtype
            xs = (xs.to(tl.float32) + tl.load(res_ptr + r[:, None] * stride_r + kk[None, :], mask=whole,
                                              other=0.0).to(tl.float32)).to(dtype)
        xf = xs.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, 1) / K + eps)
        if pid == 0:
            if RESIDUAL:
                tl.store(res_out_ptr + r[:, None] * stride_x + kk[None, :], xs, mask=whole)
            if KEEP:
                weight = tl.load(norm_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
                normed = (xf * rstd[:, None]).to(dtype).to(tl.float32)
                tl.store(h_out_ptr + r[:, None] * stride_x + kk[None, :], (weight[None, :] * normed).to(dtype),
                         mask=whole)

    acc = tl.zeros((ROWS_PAD, BLOCK_N), tl.float32)
    x_ptrs = x_ptr + r[:, None] * stride_x + ks[None, :]
    res_ptrs = res_ptr + r[:, None] * stride_r + ks[None, :]
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks < K - k0
        x_ok = r_ok[:, None] & k_ok[None, :]
        h = tl.load(x_ptrs, mask=x_ok, other=0.0)
        if NORM:
            if RESIDUAL:
                h = (h.to(tl.float32) + tl.load(res_ptrs, mask=x_ok, other=0.0).to(tl.float32)).to(dtype)
            weight = tl.load(norm_ptr + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
            h = (weight[None, :] * (h.to(tl.float32) * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype)
        w_next = tl.load(w_ptrs + BLOCK_K, mask=col_ok[:, None] & (ks < K - k0 - BLOCK_K)[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32)[None, :, :] * h.to(tl.float32)[:, None, :], 2)
        w = w_next
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        res_ptrs += BLOCK_K
    out_type = out_ptr.dtype.element_ty
    if HAS_BIAS:  # as F.linear rounds: the product, then the sum with the bias
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc = acc.to(out_type).to(tl.float32) + bias[None, :]
    tl.store(out_ptr + r[:, None] * stride_o + cols[None, :], acc.to(out_type), mask=r_ok[:, None] & col_ok[None, :])


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
            norm: torch.Tensor | None, eps: float, keep: bool, block: tuple[int, int] | None):
    rows, k = x.shape
    n = weight.shape[0]
    assert rows <= MAX_ROWS and weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else None
    h_out = torch.empty_like(x) if keep else None
    if block is None:  # in the interpreter each program costs ~20 ms whatever its size: few, wide ones
        block = (min(triton.next_power_of_2(n), 256), 64) if launch.interpreted() else tiles(n, rows)
    block_n, block_k = block
    pdl = launch.pdl(x)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, residual if residual is not None else x, norm if norm is not None else weight, weight,
        bias if bias is not None else weight, out, res_out if res_out is not None else out,
        h_out if h_out is not None else out, rows, n, k, eps, x.stride(0),
        residual.stride(0) if residual is not None else 0, weight.stride(0), out.stride(0),
        NORM=norm is not None, RESIDUAL=residual is not None, KEEP=keep, HAS_BIAS=bias is not None,
        ROWS_PAD=triton.next_power_of_2(rows), K_PAD=triton.next_power_of_2(k), BLOCK_N=block_n, BLOCK_K=block_k,
        PDL=pdl, num_warps=NUM_WARPS, **launch.options(pdl))
    return out, res_out, h_out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           block: tuple[int, int] | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` ``[rows <= MAX_ROWS, K]``; ``block``: (BLOCK_N, BLOCK_K)
    instead of ``tiles``' (tests)."""
    return _launch(x, weight, bias, None, None, 0.0, False, block)[0]


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm: torch.Tensor, eps: float,
                weight: torch.Tensor, bias: torch.Tensor | None = None, keep: bool = False,
                block: tuple[int, int] | None = None):
    """``F.linear(rms_norm(x + residual), weight, bias)`` → (that, the new residual ``x + residual`` — ``x``
    itself when ``residual`` is None —, the normalized rows if ``keep`` else None)."""
    out, res_out, h_out = _launch(x, weight, bias, residual, norm, eps, keep, block)
    return out, (res_out if residual is not None else x), h_out
