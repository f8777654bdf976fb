"""Qwen3-VL's kernels (GPU path): MoE routing, sorting and grouped GEMMs, and the small path's GEMVs,
against a plain loop over experts, QK-norm against the norms. On CPU they run in Triton's interpreter,
so this checks the kernel source the GPU compiles. Kept tiny: the interpreter is slow."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from shared.kernels.moe import KernelConfig, expert_path, fused_experts, kernel_config, moe  # noqa: E402
from shared.kernels.moe_routing import align, route, route_and_align  # noqa: E402
from shared.kernels.moe_small import MAX_ASSIGNMENTS, GemvTiles, gemv_experts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TINY = KernelConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=1)
TINY_GEMV = GemvTiles(block_n=16, block_k=16, num_warps=4)


def plain_loop(x, gate_up, down, ids, weights, rounded=lambda t: t):
    """Token by token, expert by expert: the definition; ``rounded`` is applied where the kernels round
    to the model's dtype (gate, up, SiLU, their product, each expert's output, each weighted term, the sum)."""
    out = torch.zeros_like(x)
    inter = gate_up.shape[1] // 2
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = gate_up[e] @ x[t]
            gate = rounded(h[:inter])
            act = rounded(rounded(F.silu(gate)) * rounded(h[inter:]))
            out[t] += rounded(rounded(down[e] @ act) * weights[t, k])
    return rounded(out)


def routing(tokens, experts, top_k, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    return ids.to(DEVICE), (weights / weights.sum(1, keepdim=True)).to(DEVICE)


def experts_case(tokens, experts, routed, top_k, hidden, inter):
    """Random inputs and expert weights, and a routing of each token to ``top_k`` of the first ``routed``."""
    torch.manual_seed(tokens)
    x = torch.randn(tokens, hidden, device=DEVICE)
    gate_up = torch.randn(experts, 2 * inter, hidden, device=DEVICE) / hidden ** 0.5
    down = torch.randn(experts, hidden, inter, device=DEVICE) / inter ** 0.5
    return (x, gate_up, down, *routing(tokens, routed, top_k, seed=tokens))


@pytest.mark.parametrize("tokens,experts,routed,top_k,hidden,inter", [
    (1, 4, 4, 2, 32, 16),  # decode at batch 1: every block mostly padding
    (40, 6, 3, 2, 40, 24),  # ragged: widths not multiples of the tiles, experts over two blocks, some unused
    (5, 3, 3, 3, 16, 48),  # every expert of every token
])
def test_grouped_gemm_equals_plain_loop(tokens, experts, routed, top_k, hidden, inter):
    x, gate_up, down, ids, weights = experts_case(tokens, experts, routed, top_k, hidden, inter)
    got = fused_experts(x, gate_up, down, ids, weights, TINY, path="sorted")
    torch.testing.assert_close(got, plain_loop(x, gate_up, down, ids, weights), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tokens,experts,routed,top_k,hidden,inter", [
    (1, 4, 4, 2, 32, 16),  # decode at batch 1
    (5, 6, 3, 3, 40, 24),  # tokens sharing experts; widths not multiples of the tiles; top_k not a power of 2
])
def test_small_path_experts_equal_plain_loop(tokens, experts, routed, top_k, hidden, inter):
    """The GEMVs with tiles smaller than the widths (partial blocks on every axis), and with the model's
    tiles through ``fused_experts`` (tiles wider than the widths)."""
    x, gate_up, down, ids, weights = experts_case(tokens, experts, routed, top_k, hidden, inter)
    expected = plain_loop(x, gate_up, down, ids, weights)
    torch.testing.assert_close(gemv_experts(x, gate_up, down, ids, weights, TINY_GEMV, TINY_GEMV), expected,
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fused_experts(x, gate_up, down, ids, weights), expected, rtol=1e-4, atol=1e-4)


def to_bf16(t):
    """float32 → bf16 → float32 as the kernels convert: to nearest on the GPU; Triton's interpreter
    truncates (3.6 does), so on CPU the reference truncates too."""
    if t.is_cuda:
        return t.to(torch.bfloat16).float()
    return (t.float().contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32)


def rounded_loop(x, gate_up, down, ids, weights):
    """``plain_loop`` in float32, rounded to bf16 where the kernels round."""
    x, gate_up, down, weights = (t.float() for t in (x, gate_up, down, weights))
    return plain_loop(x, gate_up, down, ids, weights, rounded=to_bf16)


def test_small_path_rounds_where_the_sorted_path_rounds_in_bf16():
    """In the model's dtype: the same roundings as the grouped GEMMs, so only the order of float32
    additions inside a dot product can move a result (by one bf16 step, rarely)."""
    x, gate_up, down, ids, weights = (t.to(torch.bfloat16) if t.is_floating_point() else t
                                      for t in experts_case(3, 6, 6, 2, 32, 16))
    got = fused_experts(x, gate_up, down, ids, weights, path="small")
    assert got.dtype == torch.bfloat16
    expected = rounded_loop(x, gate_up, down, ids, weights)
    assert (got.float() == expected).float().mean() > 0.95
    torch.testing.assert_close(got.float(), expected, rtol=2 ** -7, atol=2 ** -12)


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


@pytest.mark.parametrize("renormalize", [True, False])
def test_small_path_routing_equals_the_model_block(renormalize):
    """One program per token: the weights and ids ``SparseMoeBlock.route`` gives."""
    from shared.model.config import MoEConfig
    from shared.model.moe import SparseMoeBlock

    block = SparseMoeBlock(MoEConfig(num_experts=6, top_k=3, intermediate_size=8, norm_topk_prob=renormalize,
                                     layers=(0,)), hidden=8)
    torch.manual_seed(4)
    logits = torch.randn(5, 6, device=DEVICE)
    weights, ids = route(logits, 3, renormalize)
    expected_weights, expected_ids = block.route(logits)
    assert torch.equal(ids.long(), expected_ids)
    torch.testing.assert_close(weights, expected_weights)


def test_small_path_routing_takes_the_first_expert_on_ties():
    """Tied probabilities go to the lowest expert index, as in the sorted path's routing (torch's topk on
    CPU picks other tied indices: only the weights can be compared with it)."""
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0, 2.0, 0.0], [1.0, 2.0, -3.0, 1.0, 0.0, 1.0]], device=DEVICE)
    weights, ids = route(logits, 2, renormalize=False)
    assert ids.tolist() == [[1, 2], [1, 0]]
    assert torch.equal(route_and_align(logits, 2, False, block_m=4)[1], ids)
    torch.testing.assert_close(weights, torch.softmax(logits, -1).topk(2, dim=-1).values)


def test_few_assignments_take_the_small_path_and_more_the_sorted_one():
    """The path follows ``A = T · top_k`` alone, and ``moe`` without a path gives exactly the result of
    the path ``expert_path`` names."""
    assert expert_path(8) == expert_path(MAX_ASSIGNMENTS) == "small"  # decode at batch 1 / 8 of Qwen3-VL-30B-A3B
    assert expert_path(MAX_ASSIGNMENTS + 1) == "sorted"
    assert expert_path(8, "sorted") == "sorted"
    with pytest.raises(ValueError, match="unknown MoE path"):
        expert_path(8, "fast")
    torch.manual_seed(3)
    gate_up, down = torch.randn(4, 16, 8, device=DEVICE), torch.randn(4, 8, 8, device=DEVICE)
    for tokens in (1, MAX_ASSIGNMENTS // 2 + 1):  # 2 and MAX_ASSIGNMENTS + 2 assignments at top-2
        x, logits = torch.randn(tokens, 8, device=DEVICE), torch.randn(tokens, 4, device=DEVICE)
        chosen = expert_path(tokens * 2)
        assert chosen == ("small" if tokens == 1 else "sorted")
        assert torch.equal(moe(x, logits, gate_up, down, 2, True)[0], moe(x, logits, gate_up, down, 2, True, chosen)[0])


def test_tile_choice_follows_rows_per_expert():
    assert kernel_config(8, 128).block_m == 16  # decode, batch 1, Qwen3-VL-30B-A3B
    assert kernel_config(64 * 8, 128).block_m == 16  # decode, batch 64
    assert kernel_config(512 * 8, 128).block_m == 64  # a 512-token prefill: 32 rows an expert
    assert kernel_config(10_000 * 8, 128).block_m == 128  # a 10k-token prefill
    # float32 weights (the GPU check's reference copy): fewer stages, within the H200's shared memory
    wide = kernel_config(10_000 * 8, 128, itemsize=4)
    assert wide.block_m == 128 and wide.num_stages < kernel_config(10_000 * 8, 128).num_stages


@pytest.mark.parametrize("path", ["small", "sorted"])
def test_the_moe_block_reference_path_agrees_with_the_kernel(path):
    """The model's two paths on one routing: the fp32 torch reference (CPU) and the kernel (GPU), logits
    in, output out, on either kernel path."""
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
    got, got_ids = moe(x, logits, block.experts.gate_up_proj, block.experts.down_proj, 2, renormalize=True,
                       path=path)
    assert torch.equal(got_ids.long(), ids)
    torch.testing.assert_close(got, block.experts.reference(x, weights, ids), rtol=1e-4, atol=1e-4)
    one, _ = moe(x[:1], logits[:1], block.experts.gate_up_proj, block.experts.down_proj, 2, True, path)  # batch 1
    torch.testing.assert_close(one, got[:1], rtol=1e-4, atol=1e-4)


def test_rotary_kernel_applies_qk_norm_first():
    """Qwen3's QK-norm inside the rotary + cache-write kernel, on q and k as the strided views of the fused
    projection they are: the same as the two norms, then rotary."""
    from shared.kernels.fused import rope_store
    from shared.model.rope import apply_rotary
    from shared.model.text import RMSNorm

    torch.manual_seed(1)
    tokens, heads, kv_heads, dim = 5, 4, 2, 32
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device=DEVICE)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.view(-1, heads, dim), k.view(-1, kv_heads, dim), v.view(-1, kv_heads, dim)
    q_norm, k_norm = RMSNorm(dim, 1e-6).to(DEVICE), RMSNorm(dim, 1e-6).to(DEVICE)
    q_norm.weight.data.normal_()
    k_norm.weight.data.normal_()
    angles = torch.randn(tokens, dim // 2, device=DEVICE)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    expected_q, expected_k = apply_rotary(q_norm(q.clone()), cos, sin), apply_rotary(k_norm(k.clone()), cos, sin)
    k_cache, v_cache = torch.zeros(8, kv_heads, dim, device=DEVICE), torch.zeros(8, kv_heads, dim, device=DEVICE)
    slots = torch.tensor([6, 0, 3, 7, 1], device=DEVICE)
    rope_store(q, k, v, cos, sin, k_cache, v_cache, slots, (q_norm.weight, k_norm.weight, 1e-6))
    torch.testing.assert_close(q, expected_q)
    torch.testing.assert_close(k, expected_k)
    torch.testing.assert_close(k_cache[slots], expected_k)
    torch.testing.assert_close(v_cache[slots], v)


def test_kernels_compile_for_hopper():
    """The same kernels through Triton's real compiler for sm_90 (no GPU needed), in a process of its own
    (this one runs Triton in interpreter mode), each within the H200's shared memory (the grouped GEMMs
    with float32 weights too: at three stages their 64 x 128 tiles needed 245,760 bytes and failed to
    launch on the H200)."""
    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-m", "tests.hopper_compile"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    # 12 grouped GEMMs, 17 others (the decode attention pair twice, the three GEMVs stepped and whole)
    assert done.stdout.count(" ok") == 29
