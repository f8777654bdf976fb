"""Projections for one row (decode at batch 1), with the RMSNorm before them fused in.

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
current step's products are added (bytes in flight while it computes); the products accumulate
elementwise (32 float32 values a thread) and are reduced across threads once, after the last step.
Chosen by a sweep on one H200 (every layer's weight in turn in one CUDA graph, PDL on;
docs/architecture.md): 4 warps; 4 outputs x 1,024 a step for weights up to 64 MB, which
beat cuBLAS on Qwen3-VL-30B-A3B's q|k|v (7.5 against 7.9 µs), o (5.9 / 8.8) and router (1.6 / 4.8)
and the 7B's q|k|v and o; 8 x 512 for larger ones (the 7B's gate|up and down: 70.5 / 69.4 and
36.4 / 36.7 µs, even with cuBLAS). With the norm fused in, every program first reads the whole row for
its statistic: there 256-wide steps win where the outputs are many (Qwen3-VL-30B-A3B's q|k|v 8.8 against
9.6 µs, the 7B's 13.5 against 14.6; the step 2.448-2.449 against 2.473-2.474 ms and 4.27 against 4.30 ms),
not for the router's 128 outputs (3.4 against 2.2 µs). At 4 rows every tiling took about twice cuBLAS's
time (the accumulator grows with the rows, so the steps shrink), so the layers use these kernels for one
row only (``MAX_ROWS``); they compute up to ``ROWS_LIMIT``.

At one row a program whose weights take at most ``PRELOAD_BYTES`` (16 KB: Qwen3-VL-30B-A3B's q|k|v and
router programs, 4 outputs × 2,048) loads all of them before its wait, not only the first step, and
takes the products in one step after it: the batch-1 step 2.446 → 2.395 ms (one H200, same process and
inputs). At 32 KB o's programs do so too and the step took 2.471 ms: their 168 registers a thread leave
room for three programs an SM, so fewer of them load before the wait (docs/architecture.md, "Decode
at batch 1").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.kernels import launch

MAX_ROWS = 1  # rows the decoder layers use these kernels for (measured: see above)
ROWS_LIMIT = 4  # rows the kernels compute
SMALL_WEIGHT = 64 << 20  # bytes up to which the narrower, longer tiles win
NORM_BLOCK_K = 256  # their step where the norm is fused in and the outputs are many (measured: see above)
NORM_MIN_OUTPUTS = 1024  # (the router's 128 outputs, 32 programs, need the longer steps)
PRELOAD_BYTES = 16 << 10  # one row: a program whose weights fit loads all of them before its wait (see above)


def suits(weight: torch.Tensor) -> bool:
    """Whether a decoder layer computes its product with ``weight`` here (and fuses the norm before it in):
    weights up to ``SMALL_WEIGHT``. Above, cuBLAS streams as fast (``tiles``), and every program's
    norm statistic — the whole row of x + residual read from L2 by each of thousands of programs — made
    the 7B's decode step 0.1 ms slower with its gate|up here (4.51 against 4.41 ms)."""
    return weight.numel() * weight.element_size() <= SMALL_WEIGHT


def tiles(n: int, k: int, rows: int = 1, norm: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for ``n`` outputs over ``k`` inputs of ``rows`` rows (bf16 weights);
    ``norm``: with the RMSNorm fused in (its statistic over the whole row first, in every program)."""
    if n * k * 2 > SMALL_WEIGHT:
        block_n, block_k = 8, 512
    else:  # shorter steps where every program first reads the whole row for the norm, if there are many
        block_n, block_k = 4, (NORM_BLOCK_K if norm and n >= NORM_MIN_OUTPUTS else 1024)
    return block_n, max(64, block_k // triton.next_power_of_2(rows)), 4  # 32 accumulator values a thread


@triton.jit(do_not_specialize=["rows"])
def _gemv_kernel(x_ptr, res_ptr, norm_ptr, w_ptr, bias_ptr, out_ptr, res_out_ptr, h_out_ptr,
                 rows, N, K, eps, stride_x, stride_r, stride_w, stride_o,
                 NORM: tl.constexpr, RESIDUAL: tl.constexpr, KEEP: tl.constexpr, HAS_BIAS: tl.constexpr,
                 ROWS_PAD: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PDL: tl.constexpr, WHOLE: tl.constexpr = False):
    """out[r, cols] = h[r] · W[cols]ᵀ (+ bias): h = x, or with NORM the RMSNorm of x (+ res with RESIDUAL).
    Program 0 writes x + res to res_out (RESIDUAL) and h to h_out (KEEP). Rows are contiguous in K; the
    res_out and h_out rows have x's stride. WHOLE: the program's weights ``[BLOCK_N, K_PAD]`` are all
    loaded before the wait, and the products taken in one step after it."""
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if WHOLE:
        ks = tl.arange(0, K_PAD)
    else:
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

    x_ptrs = x_ptr + r[:, None] * stride_x + ks[None, :]
    res_ptrs = res_ptr + r[:, None] * stride_r + ks[None, :]
    if WHOLE:  # the whole row against the weights already loaded
        h = _rows(x_ptrs, res_ptrs, norm_ptr, rstd, ks, r_ok[:, None] & (ks < K)[None, :], ks < K, NORM, RESIDUAL)
        acc = tl.sum(w.to(tl.float32)[None, :, :] * h.to(tl.float32)[:, None, :], 2)
    else:
        # products summed elementwise in registers, reduced across the threads along K once at the end (a
        # reduction every step costs shuffles and a barrier per step: 1.5x cuBLAS's time on the 7B's gate|up)
        acc = tl.zeros((ROWS_PAD, BLOCK_N, BLOCK_K), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = ks < K - k0
            h = _rows(x_ptrs, res_ptrs, norm_ptr + k0, rstd, ks, r_ok[:, None] & k_ok[None, :], k_ok, NORM, RESIDUAL)
            w_next = tl.load(w_ptrs + BLOCK_K, mask=col_ok[:, None] & (ks < K - k0 - BLOCK_K)[None, :], other=0.0)
            acc += w.to(tl.float32)[None, :, :] * h.to(tl.float32)[:, None, :]
            w = w_next
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            res_ptrs += BLOCK_K
        acc = tl.sum(acc, 2)
    out_type = out_ptr.dtype.element_ty
    if HAS_BIAS:  # as F.linear rounds: the product, then the sum with the bias
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc = acc.to(out_type).to(tl.float32) + bias[None, :]
    tl.store(out_ptr + r[:, None] * stride_o + cols[None, :], acc.to(out_type), mask=r_ok[:, None] & col_ok[None, :])


@triton.jit
def _rows(x_ptrs, res_ptrs, norm_ptr, rstd, ks, x_ok, k_ok, NORM: tl.constexpr, RESIDUAL: tl.constexpr):
    """The rows' inputs at ``ks``: x, or with NORM the RMSNorm (statistic ``rstd``) of x (+ res), rounded
    where ``fused.add_rms_norm`` rounds."""
    h = tl.load(x_ptrs, mask=x_ok, other=0.0)
    if NORM:
        dtype = h.dtype
        if RESIDUAL:
            h = (h.to(tl.float32) + tl.load(res_ptrs, mask=x_ok, other=0.0).to(tl.float32)).to(dtype)
        weight = tl.load(norm_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
        h = (weight[None, :] * (h.to(tl.float32) * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype)
    return h


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
            norm: torch.Tensor | None, eps: float, keep: bool, block: tuple[int, int, int] | None):
    rows, k = x.shape
    n = weight.shape[0]
    assert rows <= ROWS_LIMIT and weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else None
    h_out = torch.empty_like(x) if keep else None
    if block is None:  # in the interpreter each program costs ~20 ms whatever its size: few, wide ones
        block = (min(triton.next_power_of_2(n), 256), 64, 4) if launch.interpreted() else \
            tiles(n, k, rows, norm is not None)
    block_n, block_k, num_warps = block
    k_pad = triton.next_power_of_2(k)
    whole = rows == 1 and block_n * k_pad * weight.element_size() <= PRELOAD_BYTES
    pdl = launch.pdl(x)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, residual if residual is not None else x, norm if norm is not None else weight, weight,
        bias if bias is not None else weight, out, res_out if res_out is not None else out,
        h_out if h_out is not None else out, rows, n, k, eps, x.stride(0),
        residual.stride(0) if residual is not None else 0, weight.stride(0), out.stride(0),
        NORM=norm is not None, RESIDUAL=residual is not None, KEEP=keep, HAS_BIAS=bias is not None,
        ROWS_PAD=triton.next_power_of_2(rows), K_PAD=k_pad, BLOCK_N=block_n, BLOCK_K=block_k,
        PDL=pdl, WHOLE=whole, num_warps=num_warps, **launch.options(pdl))
    return out, res_out, h_out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           block: tuple[int, int, int] | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` ``[rows <= ROWS_LIMIT, K]``; ``block``: (BLOCK_N, BLOCK_K,
    num_warps) instead of ``tiles``' (tests, tile sweeps)."""
    return _launch(x, weight, bias, None, None, 0.0, False, block)[0]


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm: torch.Tensor, eps: float,
                weight: torch.Tensor, bias: torch.Tensor | None = None, keep: bool = False,
                block: tuple[int, int, int] | None = None):
    """``F.linear(rms_norm(x + residual), weight, bias)`` → (that, the new residual ``x + residual`` — ``x``
    itself when ``residual`` is None —, the normalized rows if ``keep`` else None)."""
    out, res_out, h_out = _launch(x, weight, bias, residual, norm, eps, keep, block)
    return out, (res_out if residual is not None else x), h_out
