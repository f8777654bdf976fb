"""MoE routing on the GPU: router logits → top-k experts per token → assignments sorted by expert.

``route_and_align`` gives the routing weights and ids ``[T, top_k]`` and the ``ExpertLayout`` the
grouped GEMMs (``shared.kernels.moe``) read: the ``A = T · top_k`` assignments grouped by expert, each
expert's run padded to whole blocks of ``block_m`` rows. Every step runs on the device with shapes
that depend on ``T`` alone, so a decode step stays capturable in a CUDA graph.

Two paths, by size. Up to ``SMALL_ASSIGNMENTS`` (decode at small batches, where each launch costs
as much as the work) one program does it all: softmax, top-k, renormalization, the counts, the prefix
sums, the block experts, the padding and every assignment's row. Beyond, three launches: a zero-fill,
``_route_kernel`` over token blocks (counting through atomics) and ``_align_kernel`` over slot blocks.
The order inside one expert's run is whatever the atomics give, which changes nothing: output rows
are computed independently of each other.

``route`` is the routing alone, for the experts that need no layout (``shared.kernels.moe_small``, a
few tokens at decode): ``_route_kernel`` with one program (one warp) per token and no counting, so at
batch 1 it is one short program instead of the ~50 dependent reductions of the one-program alignment.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shared.kernels import launch

SMALL_ASSIGNMENTS = 128  # one program routes and aligns up to this many (16 tokens at top-8)


@dataclass
class ExpertLayout:
    """Assignments sorted by expert, each expert's run padded to whole row blocks."""

    sorted_ids: torch.Tensor  # [capacity] int32: assignment index (token · top_k + slot); padding = A
    block_experts: torch.Tensor  # [capacity / block_m] int32: the expert of each row block
    num_padded: torch.Tensor  # [1] int32: rows in use (a multiple of block_m)
    num_assignments: int
    block_m: int


def capacity(num_assignments: int, num_experts: int, block_m: int) -> int:
    """Rows of the padded list in the worst case: every non-empty expert wastes ``block_m - 1``."""
    return triton.cdiv(num_assignments + min(num_experts, num_assignments) * (block_m - 1), block_m) * block_m


@triton.jit
def _top_k(logits_ptr, t, t_ok, stride_l, NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr, TOP_K: tl.constexpr,
           K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr):
    """Softmax over the experts (float32), the top k (first index on ties), optionally renormalized:
    weights ``[rows, K_PAD]`` float32 and ids ``[rows, K_PAD]`` int32 (columns past TOP_K are 0)."""
    e = tl.arange(0, E_PAD)
    e_ok = e < NUM_EXPERTS
    x = tl.load(logits_ptr + t[:, None].to(tl.int64) * stride_l + e[None, :], mask=t_ok[:, None] & e_ok[None, :],
                other=0.0).to(tl.float32)
    x = tl.where(e_ok[None, :], x, float("-inf"))
    p = tl.exp(x - tl.max(x, 1)[:, None])
    p = p / tl.sum(p, 1)[:, None]
    slot = tl.arange(0, K_PAD)
    weights = tl.zeros((t.shape[0], K_PAD), tl.float32)
    ids = tl.zeros((t.shape[0], K_PAD), tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(p, 1)
        pick = tl.min(tl.where(p == best[:, None], e[None, :], E_PAD), 1)
        weights = tl.where(slot[None, :] == k, best[:, None], weights)
        ids = tl.where(slot[None, :] == k, pick[:, None], ids)
        p = tl.where(e[None, :] == pick[:, None], -1.0, p)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 1)[:, None]
    return weights, ids


@triton.jit
def _store_routing(weights_ptr, ids_ptr, weights, ids, t, t_ok, TOP_K: tl.constexpr, K_PAD: tl.constexpr):
    slot = tl.arange(0, K_PAD)
    out = t[:, None] * TOP_K + slot[None, :]
    ok = t_ok[:, None] & (slot[None, :] < TOP_K)
    tl.store(weights_ptr + out, weights.to(weights_ptr.dtype.element_ty), mask=ok)
    tl.store(ids_ptr + out, ids, mask=ok)
    return ok


@triton.jit
def _expert_runs(counts, BLOCK_M: tl.constexpr):
    """Each expert's run in the padded list: (starts, ends), and the rows in use."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    return ends - padded, ends, tl.max(ends, 0)


@triton.jit
def _pick(table, e, index):
    """``table[index]`` for a vector of indices, ``table`` ``[E_PAD]`` held in registers."""
    return tl.sum(tl.where(e[None, :] == index[:, None], table[None, :], 0), 1)


@triton.jit
def _mark_blocks(sorted_ids_ptr, block_experts_ptr, s, s_ok, counts, starts, ends, total, num_assignments,
                 NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """For slots ``s`` of the padded list: the expert of each block starting there, and the padding."""
    e = tl.arange(0, E_PAD)
    expert = tl.minimum(tl.sum((ends[None, :] <= s[:, None]).to(tl.int32), 1), NUM_EXPERTS - 1)
    tl.store(block_experts_ptr + s // BLOCK_M, expert, mask=s_ok & (s % BLOCK_M == 0))
    used = _pick(starts + counts, e, expert)  # end of the expert's real rows
    tl.store(sorted_ids_ptr + s, num_assignments, mask=s_ok & ((s >= total) | (s >= used)))


@triton.jit
def _mark_all_blocks(sorted_ids_ptr, block_experts_ptr, num_blocks, counts, starts, ends, total, num_assignments,
                     NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCKS_PAD: tl.constexpr):
    """``_mark_blocks`` for the whole list at once, block by block (a ``[blocks, experts]`` table, not
    ``[slots, experts]``)."""
    e = tl.arange(0, E_PAD)
    b = tl.arange(0, BLOCKS_PAD)
    b_ok = b < num_blocks
    expert = tl.minimum(tl.sum((ends[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), 1), NUM_EXPERTS - 1)
    tl.store(block_experts_ptr + b, expert, mask=b_ok)
    used = _pick(starts + counts, e, expert)
    s = (b * BLOCK_M)[:, None] + tl.arange(0, BLOCK_M)[None, :]
    tl.store(sorted_ids_ptr + s, num_assignments, mask=b_ok[:, None] & ((s >= total) | (s >= used[:, None])))


@triton.jit(do_not_specialize=["num_tokens", "capacity"])
def _route_align_kernel(logits_ptr, weights_ptr, ids_ptr, sorted_ids_ptr, block_experts_ptr, num_padded_ptr,
                        num_tokens, stride_l, capacity,
                        NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                        RENORMALIZE: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCKS_PAD: tl.constexpr):
    """Everything in one program (few tokens): ranks within an expert follow (slot, token) order."""
    t = tl.arange(0, ROWS)
    t_ok = t < num_tokens
    e = tl.arange(0, E_PAD)
    slot = tl.arange(0, K_PAD)
    weights, ids = _top_k(logits_ptr, t, t_ok, stride_l, NUM_EXPERTS, E_PAD, TOP_K, K_PAD, RENORMALIZE)
    _store_routing(weights_ptr, ids_ptr, weights, ids, t, t_ok, TOP_K, K_PAD)
    counts = tl.zeros((E_PAD,), tl.int32)
    ranks = tl.zeros((ROWS, K_PAD), tl.int32)
    for k in tl.static_range(TOP_K):
        pick = tl.sum(tl.where(slot[None, :] == k, ids, 0), 1)
        hit = ((e[None, :] == pick[:, None]) & t_ok[:, None]).to(tl.int32)
        earlier = tl.cumsum(hit, 0) - hit + counts[None, :]  # same-expert assignments placed before
        ranks = tl.where(slot[None, :] == k, tl.sum(hit * earlier, 1)[:, None], ranks)
        counts += tl.sum(hit, 0)
    starts, ends, total = _expert_runs(counts, BLOCK_M)
    tl.store(num_padded_ptr, total)
    _mark_all_blocks(sorted_ids_ptr, block_experts_ptr, capacity // BLOCK_M, counts, starts, ends, total,
                     num_tokens * TOP_K, NUM_EXPERTS, E_PAD, BLOCK_M, BLOCKS_PAD)
    for k in tl.static_range(TOP_K):
        pick = tl.sum(tl.where(slot[None, :] == k, ids, 0), 1)
        row = _pick(starts, e, pick) + tl.sum(tl.where(slot[None, :] == k, ranks, 0), 1)
        tl.store(sorted_ids_ptr + row, t * TOP_K + k, mask=t_ok)


@triton.jit(do_not_specialize=["num_tokens"])
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, counts_ptr, num_tokens, stride_l,
                  NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                  RENORMALIZE: tl.constexpr, ROWS: tl.constexpr, COUNT: tl.constexpr, PDL: tl.constexpr = False):
    """Routing of ``ROWS`` tokens; COUNT: also add each assignment to its expert's count."""
    launch.wait_for_inputs(PDL)
    t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    t_ok = t < num_tokens
    weights, ids = _top_k(logits_ptr, t, t_ok, stride_l, NUM_EXPERTS, E_PAD, TOP_K, K_PAD, RENORMALIZE)
    ok = _store_routing(weights_ptr, ids_ptr, weights, ids, t, t_ok, TOP_K, K_PAD)
    if COUNT:
        tl.atomic_add(counts_ptr + ids, 1, mask=ok)


@triton.jit(do_not_specialize=["num_assignments", "capacity"])
def _align_kernel(ids_ptr, counts_ptr, cursor_ptr, sorted_ids_ptr, block_experts_ptr, num_padded_ptr,
                  num_assignments, capacity,
                  NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """Program ``p`` marks slots ``[p·CHUNK, (p+1)·CHUNK)`` of the padded list and places assignments
    ``[p·CHUNK, (p+1)·CHUNK)`` in their experts' runs: disjoint writes, no ordering between programs."""
    pid = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + e, mask=e < NUM_EXPERTS, other=0)
    starts, ends, total = _expert_runs(counts, BLOCK_M)
    if pid == 0:
        tl.store(num_padded_ptr, total)
    s = pid * CHUNK + tl.arange(0, CHUNK)
    _mark_blocks(sorted_ids_ptr, block_experts_ptr, s, s < capacity, counts, starts, ends, total, num_assignments,
                 NUM_EXPERTS, E_PAD, BLOCK_M)
    a = pid * CHUNK + tl.arange(0, CHUNK)
    a_ok = a < num_assignments
    routed = tl.load(ids_ptr + a, mask=a_ok, other=0)
    rank = tl.atomic_add(cursor_ptr + routed, 1, mask=a_ok)
    tl.store(sorted_ids_ptr + _pick(starts, e, routed) + rank, a, mask=a_ok)


def _layout_buffers(a: int, num_experts: int, block_m: int, device) -> ExpertLayout:
    rows = capacity(a, num_experts, block_m)
    return ExpertLayout(torch.empty(rows, dtype=torch.int32, device=device),
                        torch.empty(rows // block_m, dtype=torch.int32, device=device),
                        torch.empty(1, dtype=torch.int32, device=device), a, block_m)


def _routing_buffers(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = logits.shape[0]
    return (torch.empty(tokens, top_k, dtype=logits.dtype, device=logits.device),
            torch.empty(tokens, top_k, dtype=torch.int32, device=logits.device))


def _routing_constants(experts: int, top_k: int, renormalize: bool) -> dict:
    # at least 2 slot columns: padding slots are masked out
    return dict(E_PAD=triton.next_power_of_2(experts), TOP_K=top_k, K_PAD=max(2, triton.next_power_of_2(top_k)),
                NUM_EXPERTS=experts, RENORMALIZE=renormalize)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits ``[T, E]`` → routing weights (the logits' dtype) and expert ids ``[T, top_k]`` int32,
    one program per token, no layout: what ``SparseMoeBlock.route`` gives (float32 softmax, top-k with
    the first index on ties, optional renormalization)."""
    tokens, experts = logits.shape
    weights, ids = _routing_buffers(logits, top_k)
    pdl = launch.pdl(logits)
    # one warp: a [1, E] row is 4 values a lane at 128 experts, every reduction a few shuffles
    _route_kernel[(tokens,)](logits, weights, ids, ids, tokens, logits.stride(0), ROWS=1, COUNT=False, PDL=pdl,
                             num_warps=1, **_routing_constants(experts, top_k, renormalize), **launch.options(pdl))
    return weights, ids


def route_and_align(logits: torch.Tensor, top_k: int, renormalize: bool, block_m: int,
                    one_program: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, ExpertLayout]:
    """Router logits ``[T, E]`` → routing weights (the logits' dtype), expert ids ``[T, top_k]`` int32,
    and the layout. ``one_program``: force a path (tests); by default by size."""
    tokens, experts = logits.shape
    a = tokens * top_k
    weights, ids = _routing_buffers(logits, top_k)
    layout = _layout_buffers(a, experts, block_m, logits.device)
    routing = _routing_constants(experts, top_k, renormalize)
    if one_program if one_program is not None else a <= SMALL_ASSIGNMENTS:
        _route_align_kernel[(1,)](
            logits, weights, ids, layout.sorted_ids, layout.block_experts, layout.num_padded, tokens,
            logits.stride(0), layout.sorted_ids.numel(), ROWS=max(16, triton.next_power_of_2(tokens)),  # rows masked
            BLOCK_M=block_m, BLOCKS_PAD=triton.next_power_of_2(layout.block_experts.numel()), num_warps=8, **routing)
        return weights, ids, layout
    counts = torch.zeros(2, experts, dtype=torch.int32, device=logits.device)  # counts, then cursors
    rows = 16
    _route_kernel[(triton.cdiv(tokens, rows),)](logits, weights, ids, counts[0], tokens, logits.stride(0), ROWS=rows,
                                                COUNT=True, **routing)
    _align(ids, counts[0], counts[1], layout, experts)
    return weights, ids, layout


def _align(ids: torch.Tensor, counts: torch.Tensor, cursor: torch.Tensor, layout: ExpertLayout, experts: int) -> None:
    chunk = 64
    _align_kernel[(triton.cdiv(layout.sorted_ids.numel(), chunk),)](
        ids.reshape(-1), counts, cursor, layout.sorted_ids, layout.block_experts, layout.num_padded,
        layout.num_assignments, layout.sorted_ids.numel(), NUM_EXPERTS=experts,
        E_PAD=triton.next_power_of_2(experts), BLOCK_M=layout.block_m, CHUNK=chunk)


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertLayout:
    """The layout for a routing decided elsewhere (expert ids ``[T, top_k]``)."""
    flat = ids.reshape(-1).long()
    counts = torch.zeros(2, num_experts, dtype=torch.int32, device=ids.device)
    counts[0].scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    layout = _layout_buffers(flat.numel(), num_experts, block_m, ids.device)
    _align(ids.to(torch.int32), counts[0], counts[1], layout, num_experts)
    return layout
