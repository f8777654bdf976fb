"""Qwen3-VL's kernels (GPU path): MoE routing, sorting and grouped GEMMs against a plain loop over
experts, QK-norm against the norms. On CPU they run in Triton's interpreter, so this checks the
kernel source the GPU compiles. Kept tiny: the interpreter is slow."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from shared.kernels.moe import KernelConfig, fused_experts, kernel_config, moe  # noqa: E402
from shared.kernels.moe_routing import align, route_and_align  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TINY = KernelConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=1)


def plain_loop(x, gate_up, down, ids, weights):
    """Token by token, expert by expert: the definition."""
    out = torch.zeros_like(x)
    inter = gate_up.shape[1] // 2
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = gate_up[e] @ x[t]
            out[t] += weights[t, k] * (down[e] @ (F.silu(h[:inter]) * h[inter:]))
    return out


def routing(tokens, experts, top_k, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    return ids.to(DEVICE), (weights / weights.sum(1, keepdim=True)).to(DEVICE)


@pytest.mark.parametrize("tokens,experts,routed,top_k,hidden,inter", [
    (1, 4, 4, 2, 32, 16),  # decode at batch 1: every block mostly padding
    (40, 6, 3, 2, 40, 24),  # ragged: widths not multiples of the tiles, experts over two blocks, some unused
    (5, 3, 3, 3, 16, 48),  # every expert of every token
])
def test_grouped_gemm_equals_plain_loop(tokens, experts, routed, top_k, hidden, inter):
    torch.manual_seed(tokens)
    x = torch.randn(tokens, hidden, device=DEVICE)
    gate_up = torch.randn(experts, 2 * inter, hidden, device=DEVICE) / hidden ** 0.5
    down = torch.randn(experts, hidden, inter, device=DEVICE) / inter ** 0.5
    ids, weights = routing(tokens, routed, top_k, seed=tokens)
    got = fused_experts(x, gate_up, down, ids, weights, TINY)
    torch.testing.assert_close(got, plain_loop(x, gate_up, down, ids, weights), rtol=1e-4, atol=1e-4)


def check_layout(layout, ids, block_m):
    """Every assignment once, one expert per block (none empty), padding everywhere else."""
    flat = ids.reshape(-1).cpu()
    sorted_ids = layout.sorted_ids.cpu()
    used = int(layout.num_padded)
    assert used % block_m == 0 and used <= sorted_ids.numel()
    assert sorted(sorted_ids[sorted_ids < flat.numel()].tolist()) == list(range(flat.numel()))
    for block, expert in enumerate(layout.block_experts.cpu()[:used // block_m].tolist()):
        rows = sorted_ids[block * block_m:(block + 1) * block_m]
        real = rows[rows < flat.numel()]
        assert real.numel() > 0 and (flat[real] == expert).all()
    assert (sorted_ids[used:] == flat.numel()).all()


def test_alignment_groups_assignments_by_expert_in_whole_blocks():
    ids, _ = routing(tokens=9, experts=5, top_k=2, seed=3)
    check_layout(align(ids, num_experts=5, block_m=4), ids, 4)


@pytest.mark.parametrize("one_program", [True, False], ids=["one-program", "route-then-align"])
def test_routing_equals_torch_and_aligns(one_program):
    """Softmax, top-k and renormalization as the reference computes them, on both paths."""
    torch.manual_seed(2)
    logits = torch.randn(11, 6, device=DEVICE)
    weights, ids, layout = route_and_align(logits, 3, renormalize=True, block_m=4, one_program=one_program)
    top, expected_ids = torch.softmax(logits, -1).topk(3, dim=-1)
    assert torch.equal(ids.long(), expected_ids)
    torch.testing.assert_close(weights, top / top.sum(-1, keepdim=True))
    check_layout(layout, ids, 4)


def test_tile_choice_follows_rows_per_expert():
    assert kernel_config(8, 128).block_m == 16  # decode, batch 1, Qwen3-VL-30B-A3B
    assert kernel_config(64 * 8, 128).block_m == 16  # decode, batch 64
    assert kernel_config(10_000 * 8, 128).block_m == 64  # a 10k-token prefill


def test_the_moe_block_reference_path_agrees_with_the_kernel():
    """The model's two paths on one routing: the fp32 torch reference (CPU) and the kernel (GPU)."""
    from shared.model.config import MoEConfig
    from shared.model.moe import SparseMoeBlock

    torch.manual_seed(0)
    block = SparseMoeBlock(MoEConfig(num_experts=6, top_k=2, intermediate_size=24, norm_topk_prob=True,
                                     layers=(0,)), hidden=32).to(DEVICE)
    for p in block.parameters():
        p.data.normal_(0, 0.2)
    x = torch.randn(7, 32, device=DEVICE)
    logits = block.gate(x)
    weights, ids = block.route(logits)
    torch.testing.assert_close(weights.sum(1), torch.ones(7, device=DEVICE))
    got, _ = moe(x, logits, block.experts.gate_up_proj, block.experts.down_proj, 2, renormalize=True)
    torch.testing.assert_close(got, block.experts.reference(x, weights, ids), rtol=1e-4, atol=1e-4)


def test_qk_norm_in_place_equals_the_norms():
    """Qwen3's QK-norm kernel, on q and k as the strided views of the fused projection they are."""
    from shared.kernels.qk_norm import qk_norm_
    from shared.model.text import RMSNorm

    torch.manual_seed(1)
    heads, kv_heads, dim = 4, 2, 32
    qkv = torch.randn(5, (heads + 2 * kv_heads) * dim, device=DEVICE)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(-1, heads, dim), k.view(-1, kv_heads, dim)
    q_norm, k_norm = RMSNorm(dim, 1e-6).to(DEVICE), RMSNorm(dim, 1e-6).to(DEVICE)
    q_norm.weight.data.normal_()
    k_norm.weight.data.normal_()
    expected_q, expected_k = q_norm(q.clone()), k_norm(k.clone())
    qk_norm_(q, k, q_norm.weight, k_norm.weight, 1e-6)
    torch.testing.assert_close(q, expected_q)
    torch.testing.assert_close(k, expected_k)


def test_kernels_compile_for_hopper():
    """The same kernels through Triton's real compiler for sm_90 (no GPU needed), in a process of its own
    (this one runs Triton in interpreter mode)."""
    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-m", "tests.hopper_compile"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count(" ok") == 8
