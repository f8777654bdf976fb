"""Mixture-of-experts MLP as two grouped GEMMs over tokens sorted by expert (the GPU path).

A layer's ``T`` tokens each pick ``top_k`` experts: ``A = T · top_k`` assignments. ``align_by_expert``
sorts the assignments by expert and pads each expert's run to a multiple of ``BLOCK_M``, so every
row block of the sorted list belongs to one expert. Then one launch computes SiLU(x·Wg)·(x·Wu) for
every assignment (``gate_up``: both halves of the expert's fused weight in one program, the
activation applied before anything is stored) and one launch the down projection times the routing
weight (``down``); the ``top_k`` rows of a token are summed at the end. Nothing loops over experts in
Python and nothing waits for the host: shapes depend only on ``T`` (the padded list has room for the
worst case, blocks past the real end exit at once), so a decode step with this layer can be captured
in a CUDA graph.

Block sizes (``kernel_config``), chosen for H200 (132 SMs, ~4.8 TB/s HBM, bf16 tensor cores):

- few assignments per expert (decode, small batches): the layer is bound by reading the touched
  experts' weights once. ``BLOCK_M = 16`` (the smallest ``tl.dot`` tile, so little of the tile is
  padding) and narrow ``BLOCK_N`` (32) spread one expert's weight over many programs: at batch 1 of
  Qwen3-VL-30B-A3B, 8 experts × 768/32 = 192 programs for gate|up, 8 × 2048/32 = 512 for down, more
  than the SMs, each streaming a contiguous 32-row slab of K with ``BLOCK_K = 128`` and 4 stages in
  flight;
- many per expert (prefill, large batches): bound by tensor-core throughput. 64 × 128 tiles with
  ``BLOCK_K = 64``, 8 warps (gate|up holds two fp32 accumulators) and 3 stages, the shape Triton's
  bf16 GEMMs reach most of the H100/H200 peak with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class KernelConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


SMALL = KernelConfig(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=4)
LARGE = KernelConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)


def kernel_config(num_assignments: int, num_experts: int) -> KernelConfig:
    """Tiles for a launch: small while an expert's rows would mostly be padding in a 64-row tile."""
    return SMALL if num_assignments <= 16 * num_experts else LARGE


@dataclass
class ExpertLayout:
    """Assignments sorted by expert, each expert's run padded to whole row blocks."""

    sorted_ids: torch.Tensor  # [capacity] int32: assignment index (token · top_k + slot); padding = A
    block_experts: torch.Tensor  # [capacity / block_m] int32: the expert of each row block
    num_padded: torch.Tensor  # [1] int32: rows in use (a multiple of block_m)
    num_assignments: int
    block_m: int


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertLayout:
    """``topk_ids`` ``[T, top_k]`` → the layout; device-side only (no host sync: graph capturable)."""
    flat = topk_ids.reshape(-1).long()
    a = flat.numel()
    device = flat.device
    # worst case: every non-empty expert wastes block_m - 1 rows
    capacity = triton.cdiv(a + min(num_experts, a) * (block_m - 1), block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.sort(flat, stable=True).indices  # assignments grouped by expert, token order within
    experts = flat[order]
    rank = torch.arange(a, device=device) - (counts.cumsum(0) - counts)[experts]
    sorted_ids = torch.full((capacity,), a, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, (ends - padded)[experts] + rank, order.to(torch.int32))
    block_starts = torch.arange(0, capacity, block_m, device=device)
    block_experts = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return ExpertLayout(sorted_ids, block_experts.to(torch.int32), ends[-1:].to(torch.int32), a, block_m)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids, block_experts, num_padded,
    N, K, num_assignments,
    stride_am, stride_be, stride_bn, stride_cm,
    A_ROWS_PER_TOKEN: tl.constexpr, GATED: tl.constexpr, WEIGHTED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """C[row] = A[row // A_ROWS_PER_TOKEN] · B[expert]ᵀ for the rows of one expert's block.

    GATED: B holds [gate; up] (2N rows) and C = SiLU(A·Gᵀ) · (A·Uᵀ), N wide. WEIGHTED: C is scaled by
    the row's routing weight. A and C rows are contiguous in K / N."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded):
        return
    expert = tl.load(block_experts + pid_m).to(tl.int64)
    rows = tl.load(sorted_ids + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < num_assignments
    a_rows = (rows // A_ROWS_PER_TOKEN).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + ks[None, :]
    b_ptrs = b_ptr + expert * stride_be + cols[None, :].to(tl.int64) * stride_bn + ks[:, None]  # [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # unused (and compiled out) unless GATED
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        if GATED:
            up = tl.load(b_ptrs + N * stride_bn, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc_up = tl.dot(a, up, acc_up)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    out_type = c_ptr.dtype.element_ty
    if GATED:
        # rounded where the reference rounds: gate and up in the model's dtype, SiLU in float32
        gate = acc.to(out_type).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(out_type).to(tl.float32)
        acc = act * acc_up.to(out_type).to(tl.float32)
    if WEIGHTED:
        acc = acc.to(out_type).to(tl.float32) * tl.load(weights_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(out_type), mask=row_ok[:, None] & col_ok[None, :])


def _launch(a, b, out, weights, layout: ExpertLayout, n: int, rows_per_token: int, gated: bool,
            config: KernelConfig) -> None:
    grid = (layout.sorted_ids.numel() // layout.block_m, triton.cdiv(n, config.block_n))
    _grouped_gemm_kernel[grid](
        a, b, out, weights if weights is not None else out, layout.sorted_ids, layout.block_experts,
        layout.num_padded, n, a.shape[1], layout.num_assignments,
        a.stride(0), b.stride(0), b.stride(1), out.stride(0),
        A_ROWS_PER_TOKEN=rows_per_token, GATED=gated, WEIGHTED=weights is not None,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, config: KernelConfig | None = None) -> torch.Tensor:
    """``x`` ``[T, H]``; ``gate_up`` ``[E, 2I, H]`` (gate rows first); ``down`` ``[E, H, I]``;
    ``topk_ids``/``topk_weights`` ``[T, top_k]`` → ``Σ_k w_k · expert_k(x)`` ``[T, H]``."""
    tokens, hidden = x.shape
    num_experts, two_i, _ = gate_up.shape
    top_k = topk_ids.shape[1]
    config = config or kernel_config(tokens * top_k, num_experts)
    layout = align_by_expert(topk_ids, num_experts, config.block_m)
    x = x.contiguous()
    act = torch.empty(tokens * top_k, two_i // 2, dtype=x.dtype, device=x.device)
    _launch(x, gate_up, act, None, layout, two_i // 2, top_k, True, config)
    out = torch.empty(tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    _launch(act, down, out, topk_weights.reshape(-1).contiguous(), layout, hidden, 1, False, config)
    return out.view(tokens, top_k, hidden).sum(1)
