"""Mixture-of-experts MLP as two grouped GEMMs over tokens sorted by expert (the GPU path).

A layer's ``T`` tokens each pick ``top_k`` experts: ``A = T · top_k`` assignments. ``route`` turns the
router's logits into the top-k (softmax, top-k, renormalization, counts per expert: one launch);
``align`` sorts the assignments by expert and pads each expert's run to a multiple of ``BLOCK_M``, so
every row block of the sorted list belongs to one expert (one launch). Then one launch computes SiLU(x·Wg)·(x·Wu) for
every assignment (``gate_up``: both halves of the expert's fused weight in one program, the
activation applied before anything is stored) and one launch the down projection times the routing
weight (``down``); the ``top_k`` rows of a token are summed at the end. A MoE layer is eight kernels
(router GEMM, two zero-fills, route, align, the two GEMMs, the sum) whatever the number of experts:
at decode every launch counts, so the routing is not a dozen small torch ops. Nothing loops over
experts in Python and nothing waits for the host: shapes depend only on ``T`` (the padded list has room for the
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


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, counts_ptr, num_tokens, stride_l,
                  NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                  RENORMALIZE: tl.constexpr, ROWS: tl.constexpr):
    """Softmax over the experts (float32), the top k (first index on ties), optionally renormalized;
    each expert's count of assignments added to ``counts``."""
    t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    t_ok = t < num_tokens
    e = tl.arange(0, E_PAD)
    e_ok = e < NUM_EXPERTS
    x = tl.load(logits_ptr + t[:, None].to(tl.int64) * stride_l + e[None, :], mask=t_ok[:, None] & e_ok[None, :],
                other=0.0).to(tl.float32)
    x = tl.where(e_ok[None, :], x, float("-inf"))
    p = tl.exp(x - tl.max(x, 1)[:, None])
    p = p / tl.sum(p, 1)[:, None]
    slot = tl.arange(0, K_PAD)
    weights = tl.zeros((ROWS, K_PAD), tl.float32)
    ids = tl.zeros((ROWS, K_PAD), tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(p, 1)
        pick = tl.min(tl.where(p == best[:, None], e[None, :], E_PAD), 1)
        weights = tl.where(slot[None, :] == k, best[:, None], weights)
        ids = tl.where(slot[None, :] == k, pick[:, None], ids)
        p = tl.where(e[None, :] == pick[:, None], -1.0, p)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 1)[:, None]
    out = t[:, None] * TOP_K + slot[None, :]
    ok = t_ok[:, None] & (slot[None, :] < TOP_K)
    tl.store(weights_ptr + out, weights.to(weights_ptr.dtype.element_ty), mask=ok)
    tl.store(ids_ptr + out, ids, mask=ok)
    tl.atomic_add(counts_ptr + ids, 1, mask=ok)


@triton.jit
def _align_kernel(ids_ptr, counts_ptr, cursor_ptr, sorted_ids_ptr, block_experts_ptr, num_padded_ptr,
                  num_assignments, capacity,
                  NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """Program ``p`` fills slots ``[p·CHUNK, (p+1)·CHUNK)`` of the padded list that are padding (and
    the expert of each block starting there), and places assignments ``[p·CHUNK, (p+1)·CHUNK)`` in
    their experts' runs: disjoint writes, so programs need no ordering. The order inside an expert's
    run follows the atomics and is arbitrary, which changes nothing: output rows are independent."""
    pid = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + e, mask=e < NUM_EXPERTS, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    total = tl.max(ends, 0)
    if pid == 0:
        tl.store(num_padded_ptr, total)
    s = pid * CHUNK + tl.arange(0, CHUNK)
    s_ok = s < capacity
    expert = tl.minimum(tl.sum((ends[None, :] <= s[:, None]).to(tl.int32), 1), NUM_EXPERTS - 1)
    tl.store(block_experts_ptr + s // BLOCK_M, expert, mask=s_ok & (s % BLOCK_M == 0))
    mine = e[None, :] == expert[:, None]
    used = tl.sum(tl.where(mine, starts[None, :] + counts[None, :], 0), 1)  # end of the expert's real rows
    tl.store(sorted_ids_ptr + s, num_assignments, mask=s_ok & ((s >= total) | (s >= used)))
    a = pid * CHUNK + tl.arange(0, CHUNK)
    a_ok = a < num_assignments
    routed = tl.load(ids_ptr + a, mask=a_ok, other=0)
    rank = tl.atomic_add(cursor_ptr + routed, 1, mask=a_ok)
    start = tl.sum(tl.where(e[None, :] == routed[:, None], starts[None, :], 0), 1)
    tl.store(sorted_ids_ptr + start + rank, a, mask=a_ok)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router logits ``[T, E]`` → routing weights (the logits' dtype) and expert ids ``[T, top_k]``, and
    the assignments per expert ``[E]`` int32 (what ``align`` needs)."""
    tokens, experts = logits.shape
    weights = torch.empty(tokens, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=logits.device)
    counts = torch.zeros(experts, dtype=torch.int32, device=logits.device)
    rows = 16
    _route_kernel[(triton.cdiv(tokens, rows),)](
        logits, weights, ids, counts, tokens, logits.stride(0), NUM_EXPERTS=experts,
        E_PAD=triton.next_power_of_2(experts), TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k),
        RENORMALIZE=renormalize, ROWS=rows)
    return weights, ids, counts


def align(ids: torch.Tensor, counts: torch.Tensor, num_experts: int, block_m: int) -> ExpertLayout:
    """Expert ids ``[T, top_k]`` and their counts → the padded, expert-sorted layout. Device-side only:
    no host sync, shapes depend on ``T`` alone (graph capturable)."""
    a = ids.numel()
    device = ids.device
    # worst case: every non-empty expert wastes block_m - 1 rows
    capacity = triton.cdiv(a + min(num_experts, a) * (block_m - 1), block_m) * block_m
    sorted_ids = torch.empty(capacity, dtype=torch.int32, device=device)
    block_experts = torch.empty(capacity // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    cursor = torch.zeros(num_experts, dtype=torch.int32, device=device)
    chunk = 64
    _align_kernel[(triton.cdiv(capacity, chunk),)](
        ids.reshape(-1), counts, cursor, sorted_ids, block_experts, num_padded, a, capacity,
        NUM_EXPERTS=num_experts, E_PAD=triton.next_power_of_2(num_experts), BLOCK_M=block_m, CHUNK=chunk)
    return ExpertLayout(sorted_ids, block_experts, num_padded, a, block_m)


def count(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert ``[E]`` int32 for ids routed elsewhere (``route`` counts as it routes)."""
    flat = ids.reshape(-1).long()
    return torch.zeros(num_experts, dtype=torch.int32, device=ids.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))


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
        renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole MoE MLP from the router's logits: (output ``[T, H]``, expert ids ``[T, top_k]``)."""
    num_experts = gate_up.shape[0]
    config = kernel_config(x.shape[0] * top_k, num_experts)
    weights, ids, counts = route(logits, top_k, renormalize)
    layout = align(ids, counts, num_experts, config.block_m)
    return grouped_experts(x, gate_up, down, weights, layout, config), ids


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
                  weights: torch.Tensor, config: KernelConfig | None = None) -> torch.Tensor:
    """The experts for a routing decided elsewhere (``ids``/``weights`` ``[T, top_k]``)."""
    num_experts = gate_up.shape[0]
    config = config or kernel_config(ids.numel(), num_experts)
    layout = align(ids, count(ids, num_experts), num_experts, config.block_m)
    return grouped_experts(x, gate_up, down, weights, layout, config)
