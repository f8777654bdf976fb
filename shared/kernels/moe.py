"""Mixture-of-experts MLP on the GPU: two grouped GEMMs over tokens sorted by expert, or two GEMVs for
a few tokens.

A layer's ``T`` tokens each pick ``top_k`` experts: ``A = T · top_k`` assignments. Two paths, picked
from ``A`` alone (``expert_path``), so from the shapes and never from the routing:

- ``"small"`` (``A <= moe_small.MAX_ASSIGNMENTS``, decode at small batches): routing alone, one
  program per token (``moe_routing.route``), then each assignment reads its expert's weights directly
  (``shared.kernels.moe_small``): four kernels a layer (router GEMM, routing, gate|up, down with the
  weighted sum), nothing sorted or padded;
- ``"sorted"``: the assignments sorted by expert with each expert's run padded to a multiple of
  ``BLOCK_M`` (``shared.kernels.moe_routing``), so every row block of the sorted list belongs to one
  expert. Then one launch computes SiLU(x·Wg)·(x·Wu) for every assignment (``gate_up``: both halves of
  the expert's fused weight in one program, the activation applied before anything is stored) and one
  launch the down projection times the routing weight (``down``); the ``top_k`` rows of a token are
  summed at the end: five kernels (seven for larger batches) whatever the number of experts.

Nothing loops over experts in Python and nothing waits for the host: shapes depend only on ``T`` (the
padded list has room for the worst case, blocks past the real end exit at once), so a decode step
with this layer can be captured in a CUDA graph.

Block sizes of the sorted path (``kernel_config``), chosen for H200 (132 SMs, ~4.8 TB/s HBM, bf16
tensor cores; the small path's are in ``shared.kernels.moe_small``):

- few assignments per expert (decode, small batches): the layer is bound by reading the touched
  experts' weights once. ``BLOCK_M = 16`` (the smallest ``tl.dot`` tile, so little of the tile is
  padding) and narrow ``BLOCK_N`` (32) spread one expert's weight over many programs: at batch 1 of
  Qwen3-VL-30B-A3B, 8 experts × 768/32 = 192 programs for gate|up, 8 × 2048/32 = 512 for down, more
  than the SMs, each streaming a contiguous 32-row slab of K with ``BLOCK_K = 128`` and 4 stages in
  flight;
- many per expert (prefill, large batches): bound by tensor-core throughput. From 128 assignments an
  expert on average, 128 × 128 tiles with ``BLOCK_K = 64``, 8 warps (gate|up holds two fp32
  accumulators) and 3 stages; between 16 and 128, 64 × 64 tiles, 4 warps, 4 stages (less of each
  expert's last tile is padding). Measured on an H200 with Qwen3-VL-30B-A3B's experts (µs a layer,
  ``bench/gpu_engine.py --sections prefill_sizes``, eight tile shapes): 152 tokens 326 (the small tiles;
  every shape within 20 %), 512 tokens 366 (64 × 64; 408 with the 64 × 128 tiles used before), 2,132
  tokens 669 (128 × 128; 729), 4,096 tokens 1,061 (1,170), 8,192 tokens 1,843 (2,118: 44 % of the bf16
  peak).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from shared.kernels import moe_small
from shared.kernels.moe_routing import ExpertLayout, align, route, route_and_align


@dataclass(frozen=True)
class KernelConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


SMALL = KernelConfig(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=4)
MIDDLE = KernelConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=4)
LARGE = KernelConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
LARGE_FROM = 128  # assignments an expert on average from which the 128-row tiles win


PATHS = ("small", "sorted")


def expert_path(num_assignments: int, forced: str | None = None) -> str:
    """``"small"`` (per-assignment GEMVs, no sorting) for a few assignments, else ``"sorted"``; ``forced``
    (tests, benchmarks) wins."""
    if forced is None:
        return "small" if num_assignments <= moe_small.MAX_ASSIGNMENTS else "sorted"
    if forced not in PATHS:
        raise ValueError(f"unknown MoE path {forced!r}: use one of {PATHS}")
    return forced


SHARED_MEMORY = 232_448  # bytes of shared memory one program may use on H100/H200 (sm_90)


def kernel_config(num_assignments: int, num_experts: int, itemsize: int = 2) -> KernelConfig:
    """Tiles for a launch: small while an expert's rows would mostly be padding in a 64-row tile; with
    fewer pipeline stages where wider elements (float32 weights) would not fit the shared memory (each
    stage holds a BLOCK_M x BLOCK_K tile of A and the gate and up BLOCK_N x BLOCK_K tiles of B)."""
    config = SMALL if num_assignments <= 16 * num_experts else \
        MIDDLE if num_assignments < LARGE_FROM * num_experts else LARGE
    per_stage = (config.block_m + 2 * config.block_n) * config.block_k * itemsize
    stages = max(1, min(config.num_stages, SHARED_MEMORY // per_stage))
    return config if stages == config.num_stages else replace(config, num_stages=stages)


@triton.jit(do_not_specialize=["num_assignments"])  # varies every step: one compile, not one per residue
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
        acc = tl.dot(a, b, acc, input_precision="ieee")  # float32 weights (checks): not TF32
        if GATED:
            up = tl.load(b_ptrs + N * stride_bn, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc_up = tl.dot(a, up, acc_up, input_precision="ieee")
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    out_type = c_ptr.dtype.element_ty
    if GATED:
        # rounded where the reference rounds: gate and up in the model's dtype, SiLU in float32
        gate = acc.to(out_type).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(out_type).to(tl.float32)
        acc = act * acc_up.to(out_type).to(tl.float32)
    if WEIGHTED:
        weight = tl.load(weights_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc.to(out_type).to(tl.float32) * weight[:, None]
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


def grouped_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                    layout: ExpertLayout, config: KernelConfig) -> torch.Tensor:
    """``x`` ``[T, H]``; ``gate_up`` ``[E, 2I, H]`` (gate rows first); ``down`` ``[E, H, I]``; routing
    ``weights`` ``[T, top_k]`` → ``Σ_k w_k · expert_k(x)`` ``[T, H]``."""
    tokens, hidden = x.shape
    top_k = weights.shape[1]
    x = x.contiguous()
    act = torch.empty(tokens * top_k, gate_up.shape[1] // 2, dtype=x.dtype, device=x.device)
    _launch(x, gate_up, act, None, layout, act.shape[1], top_k, True, config)
    out = torch.empty(tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    _launch(act, down, out, weights.reshape(-1).contiguous(), layout, hidden, 1, False, config)
    return out.view(tokens, top_k, hidden).sum(1)


def moe(x: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
        renormalize: bool, path: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole MoE MLP from the router's logits: (output ``[T, H]``, expert ids ``[T, top_k]``).
    ``path``: ``"small"`` or ``"sorted"`` to force one (tests, benchmarks); by default ``expert_path``."""
    a = x.shape[0] * top_k
    if expert_path(a, path) == "small":
        weights, ids = route(logits, top_k, renormalize)
        return moe_small.gemv_experts(x, gate_up, down, ids, weights), ids
    config = kernel_config(a, gate_up.shape[0], gate_up.element_size())
    weights, ids, layout = route_and_align(logits, top_k, renormalize, config.block_m)
    return grouped_experts(x, gate_up, down, weights, layout, config), ids


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
                  weights: torch.Tensor, config: KernelConfig | None = None, path: str | None = None) -> torch.Tensor:
    """The experts for a routing decided elsewhere (``ids``/``weights`` ``[T, top_k]``). ``path`` as for
    ``moe``; ``config``: the sorted path's tiles (tests)."""
    if expert_path(ids.numel(), path) == "small":
        return moe_small.gemv_experts(x, gate_up, down, ids, weights)
    num_experts = gate_up.shape[0]
    config = config or kernel_config(ids.numel(), num_experts, gate_up.element_size())
    layout = align(ids, num_experts, config.block_m)
    return grouped_experts(x, gate_up, down, weights, layout, config)
