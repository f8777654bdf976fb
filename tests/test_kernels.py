"""The GPU path's Triton kernels against the torch reference path (on CPU they run in Triton's
interpreter, so this checks the same kernel source the GPU compiles)."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from shared.kernels.attention import paged_prefill_attention  # noqa: E402
from shared.kernels.fused import add_rms_norm, rms_norm, rope_store, silu_mul  # noqa: E402
from shared.kernels.gemv import linear, norm_linear, tiles  # noqa: E402
from shared.model.rope import apply_rotary  # noqa: E402
from shared.model.text import RMSNorm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def close(a, b, tol=1e-4):
    assert torch.linalg.norm((a - b).float()) / torch.linalg.norm(b.float()) < tol


@pytest.mark.parametrize("heads,kv_heads,splits,min_blocks,qk_norm", [
    (4, 2, 1, 8, False), (8, 2, 3, 1, True), (4, 4, 2, 1, False), (8, 2, 4, 2, True)])
def test_decode_attention_rotates_writes_the_new_kv_and_attends_over_the_pool(heads, kv_heads, splits, min_blocks,
                                                                              qk_norm):
    """The decode kernels against the unfused reference: (QK-norm,) rotary of q and the new k, the new KV
    written to its slot, and attention over the whole context — one split, or several merged (``min_blocks``
    1: a split per block)."""
    from shared.kernels.decode_attention import decode_attention

    torch.manual_seed(heads * 10 + splits)
    dim, block_size, blocks = 16, 16, 40
    lens = [1, 17, 70, 33, 16]  # tokens attended, the new one included (1: a graph's padding row)
    k_cache = torch.randn(blocks, block_size, kv_heads, dim, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(blocks).tolist()
    tables, cursor = [], 0
    for n in lens:
        need = math.ceil(n / block_size)
        tables.append(perm[cursor:cursor + need] + [0] * (8 - need))
        cursor += need
    slots = torch.tensor([tables[i][(n - 1) // block_size] * block_size + (n - 1) % block_size
                          for i, n in enumerate(lens)], device=DEVICE)
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * dim, device=DEVICE)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)  # strided, as the model's
    q, k, v = q.view(-1, heads, dim), k.view(-1, kv_heads, dim), v.view(-1, kv_heads, dim)
    angles = torch.randn(len(lens), dim // 2, device=DEVICE)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    norms, q_ref, k_ref = None, q, k
    if qk_norm:
        q_norm, k_norm = RMSNorm(dim, 1e-6).to(DEVICE), RMSNorm(dim, 1e-6).to(DEVICE)
        q_norm.weight.data.normal_()
        k_norm.weight.data.normal_()
        norms, q_ref, k_ref = (q_norm.weight, k_norm.weight, 1e-6), q_norm(q), k_norm(k)
    q_ref, k_ref = apply_rotary(q_ref, cos, sin), apply_rotary(k_ref, cos, sin)
    before = q.clone(), k.clone()
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    tables_t = torch.tensor(tables, dtype=torch.int32, device=DEVICE)
    out = decode_attention(q, k, v, cos, sin, slots, k_cache, v_cache, tables_t, lens_t, dim ** -0.5, splits, norms,
                           min_blocks=min_blocks)
    close(k_cache.flatten(0, 1)[slots], k_ref)
    close(v_cache.flatten(0, 1)[slots], v)
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])  # the inputs are left as they were
    for i, n in enumerate(lens):
        context = torch.cat([torch.arange(block_size) + b * block_size for b in tables[i]])[:n].to(DEVICE)
        keys = k_cache.flatten(0, 1)[context].transpose(0, 1)
        values = v_cache.flatten(0, 1)[context].transpose(0, 1)
        ref = F.scaled_dot_product_attention(q_ref[i, :, None], keys, values, enable_gqa=True)[:, 0]
        close(out[i], ref)


@pytest.mark.parametrize("skip_fresh", [False, True])
def test_the_prefill_kernel_warms_up_on_the_pool_without_writing_it(skip_fresh):
    """The engine compiles the paged prefill kernel at start-up (``warm_prefill``): a launch on the
    pool's own tensors that reads two blocks and leaves the pool as it was."""
    from shared.kernels.attention import warm_prefill

    k_cache = torch.randn(4, 16, 2, 16, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    before = k_cache.clone(), v_cache.clone()
    warm_prefill(k_cache, v_cache, num_heads=4, skip_fresh=skip_fresh)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


@pytest.mark.parametrize("heads,kv_heads,skip_fresh", [(4, 2, False), (8, 2, True), (4, 4, False), (12, 4, False)])
def test_paged_prefill_attention_matches_causal_sdpa_over_the_prefix(heads, kv_heads, skip_fresh):
    """Chunks of packed queries after prefixes of every kind (none, inside a block, many blocks, a
    decode-like single token), KV read through scattered block tables; chunks before ``first_chunk``
    and, with ``skip_fresh``, chunks with no prefix are left untouched. Group 3 pads to 4 rows."""
    from shared.engine.attention import causal_attention

    torch.manual_seed(heads + kv_heads)
    dim, block_size, blocks = 16, 16, 64
    chunks = [(9, 1), (0, 1), (5, 3), (0, 37), (40, 70), (17, 1), (32, 16)]  # (prefix, new tokens)
    k_cache = torch.randn(blocks, block_size, kv_heads, dim, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    perm = (torch.randperm(blocks - 1) + 1).tolist()
    tables, cursor = [], 0
    for prefix, n in chunks:
        need = math.ceil((prefix + n) / block_size)
        tables.append(perm[cursor:cursor + need])
        cursor += need
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE)
    cu = [0]
    for _, n in chunks:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], heads, dim, device=DEVICE)
    untouched = torch.full_like(q, 7.0)
    out = paged_prefill_attention(q, k_cache, v_cache, block_tables, torch.tensor(cu, dtype=torch.int32, device=DEVICE),
                                  torch.tensor([p + n for p, n in chunks], dtype=torch.int32, device=DEVICE),
                                  dim ** -0.5, max(n for _, n in chunks[1:]), first_chunk=1, skip_fresh=skip_fresh,
                                  out=untouched.clone())
    for i, (prefix, n) in enumerate(chunks):
        rows = slice(cu[i], cu[i + 1])
        if i == 0 or (skip_fresh and prefix == 0):
            assert torch.equal(out[rows], untouched[rows]), i
            continue
        slots = torch.tensor([tables[i][j // block_size] * block_size + j % block_size for j in range(prefix + n)],
                             device=DEVICE)
        ref = causal_attention(q[rows], k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots], prefix)
        close(out[rows], ref)


def test_norms_and_activation():
    torch.manual_seed(0)
    x, res = torch.randn(5, 96, device=DEVICE), torch.randn(5, 96, device=DEVICE)
    norm = RMSNorm(96, 1e-6).to(DEVICE)
    norm.weight.data.normal_()
    close(rms_norm(x, norm.weight, 1e-6), norm(x))
    residual = res.clone()
    close(add_rms_norm(x, residual, norm.weight, 1e-6), norm(x + res))
    close(residual, x + res)
    gate_up = torch.randn(3, 2 * 40, device=DEVICE)
    close(silu_mul(gate_up), F.silu(gate_up[:, :40]) * gate_up[:, 40:])


@pytest.mark.parametrize("rows,with_residual,bias", [(1, True, False), (3, True, True), (2, False, True)])
def test_norm_linear_equals_the_norm_then_the_projection(rows, with_residual, bias):
    """Widths that are not multiples of the tiles (and a K that is not a power of two), several K steps;
    the new residual and the normalized rows come back as the unfused path computes them."""
    torch.manual_seed(rows)
    hidden, outputs = 40, 37
    x, res = torch.randn(rows, hidden, device=DEVICE), torch.randn(rows, hidden, device=DEVICE)
    norm = RMSNorm(hidden, 1e-6).to(DEVICE)
    norm.weight.data.normal_()
    proj = torch.nn.Linear(hidden, outputs, bias=bias).to(DEVICE)
    summed = x + res if with_residual else x
    for block in ((8, 16, 4), None):  # several programs and K steps; the model's tiles
        out, residual, normed = norm_linear(x, res if with_residual else None, norm.weight, 1e-6, proj.weight,
                                            proj.bias, keep=True, block=block)
        close(residual, summed)
        close(normed, norm(summed))
        close(out, proj(norm(summed)))
    close(linear(x, proj.weight, proj.bias, block=(8, 16, 4)), proj(x))
    assert norm_linear(x, None, norm.weight, 1e-6, proj.weight)[1] is x


def test_norm_linear_rounds_where_the_unfused_path_rounds_in_bf16():
    torch.manual_seed(0)
    hidden = 64
    x, res = (torch.randn(2, hidden, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
    weight = torch.randn(hidden, dtype=torch.bfloat16, device=DEVICE)
    proj = (torch.randn(24, hidden, device=DEVICE) / hidden ** 0.5).to(torch.bfloat16)
    residual = res.clone()
    normed = add_rms_norm(x, residual, weight, 1e-6)  # the unfused kernel: the reference
    out, new_residual, kept = norm_linear(x, res, weight, 1e-6, proj, keep=True, block=(8, 32, 4))
    assert torch.equal(new_residual, residual) and torch.equal(kept, normed)
    expected = (normed.float() @ proj.float().T).to(torch.bfloat16)  # float32 sums, rounded once
    assert (out.float() - expected.float()).abs().max() <= 2 ** -7 * expected.float().abs().max()


@pytest.mark.parametrize("with_norm,bias", [(True, False), (False, True)])
def test_gemv_whole_row_preload_equals_the_stepped_products(monkeypatch, with_norm, bias):
    """``PRELOAD_BYTES``: one row's program loads all its weights before its wait and takes the products in
    one step; the same outputs (float32 sums in another order), residual and normalized row."""
    from shared.kernels import gemv

    torch.manual_seed(7)
    hidden, outputs = 40, 37  # K not a power of two: the padded tail is masked
    x, res = torch.randn(1, hidden, device=DEVICE), torch.randn(1, hidden, device=DEVICE)
    norm = RMSNorm(hidden, 1e-6).to(DEVICE)
    norm.weight.data.normal_()
    proj = torch.nn.Linear(hidden, outputs, bias=bias).to(DEVICE)
    run = (lambda: norm_linear(x, res, norm.weight, 1e-6, proj.weight, proj.bias, keep=True, block=(8, 16, 4))) \
        if with_norm else (lambda: (linear(x, proj.weight, proj.bias, block=(8, 16, 4)), None, None))
    monkeypatch.setattr(gemv, "PRELOAD_BYTES", 0)
    stepped = run()
    monkeypatch.setattr(gemv, "PRELOAD_BYTES", 1 << 20)
    whole = run()
    close(whole[0], stepped[0], 1e-6)
    close(whole[0], proj(norm(x + res)) if with_norm else proj(x))
    if with_norm:
        assert torch.equal(whole[1], stepped[1]) and torch.equal(whole[2], stepped[2])


def test_gemv_tiles_follow_the_weights_size():
    """The measured choice: Qwen3-VL-30B-A3B's q|k|v (21 MB) narrow and long; the 7B's gate|up (272 MB)
    wider and shorter; more rows, shorter steps."""
    assert tiles(5120, 2048) == (4, 1024, 4) and tiles(37888, 3584) == (8, 512, 4)
    assert tiles(5120, 2048, rows=4) == (4, 256, 4)
    # with the norm fused in: shorter steps for q|k|v's 5,120 outputs, not for a 128-expert router's
    assert tiles(5120, 2048, norm=True) == (4, 256, 4) and tiles(128, 2048, norm=True) == (4, 1024, 4)


@pytest.mark.parametrize("dim", [16, 20])  # 20: a half width that is not a power of two (the ViT's 80)
def test_rope_store_rotates_and_writes_the_cache(dim):
    torch.manual_seed(1)
    tokens, heads, kv_heads = 6, 4, 2
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device=DEVICE)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)
    angles = torch.randn(tokens, dim // 2, device=DEVICE)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    ref_q, ref_k, ref_v = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v.clone()
    k_cache = torch.zeros(32, kv_heads, dim, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([3, 9, 0, 31, 7, 12], device=DEVICE)
    rope_store(q, k, v, cos, sin, k_cache, v_cache, slots)
    close(q, ref_q)
    close(k, ref_k)
    close(k_cache[slots], ref_k)
    close(v_cache[slots], ref_v)


def force_few_rows(monkeypatch) -> list[int]:
    """Decode steps of up to ``gemv.ROWS_LIMIT`` rows through the few-rows layer on this CPU as well (the
    kernels in the interpreter): on its own it is taken on GPU only, for ``MAX_ROWS``. Returns the row
    counts it took."""
    from shared.kernels import gemv
    from shared.model import text  # Qwen3's layers inherit its forward

    taken: list[int] = []

    def few_rows(x):
        if x.shape[0] > gemv.ROWS_LIMIT:
            return False
        taken.append(x.shape[0])
        return True

    monkeypatch.setattr(text, "few_rows", few_rows)
    return taken


@pytest.mark.parametrize("few_rows", ["off", "all", "mixed"])
def test_triton_backend_generates_hf_tokens(tiny_model, reference, few_rows, monkeypatch):
    """The GPU attention path (fused rotary + cache write, paged flash-decoding) inside the real engine,
    and with ``few_rows`` the decode steps through the GEMVs with their fused norms as well: every
    projection ("all"), or all but gate|up, the one weight over a lowered ``SMALL_WEIGHT`` ("mixed")."""
    gemv = importlib.import_module("shared.kernels.gemv")  # the module (``shared.kernels.gemv`` may be its handle)
    from shared.engine.attention import TritonAttention
    from shared.engine.engine import Engine
    from shared.engine.kv_cache import KVCache
    from shared.engine.runner import ModelRunner
    from shared.messages.sampling import SamplingParams
    from shared.engine.sequence import ImageInput, Sequence
    from shared.model.config import ModelConfig
    from shared.model.loader import load_language_model, load_vision_tower
    from tests.support import make_image

    taken = force_few_rows(monkeypatch) if few_rows != "off" else []
    suited: list[bool] = []
    if few_rows == "mixed":  # the tiny model's fp32 weights: q|k|v 32 KB, o 16, gate|up 64, down 32
        monkeypatch.setattr(gemv, "SMALL_WEIGHT", 40_000)
        suits = gemv.suits
        monkeypatch.setattr(gemv, "suits", lambda weight: suited.append(suits(weight)) or suited[-1])
    config = ModelConfig.from_checkpoint(tiny_model)
    lm, tower = load_language_model(tiny_model, config), load_vision_tower(tiny_model, config)
    cache = KVCache(config.text, 64, 16, torch.float32, "cpu")
    engine = Engine(ModelRunner(lm, cache, 2, backend=TritonAttention(cache, config.text.head_dim ** -0.5)),
                    config.eos_token_ids, max_model_len=1000)
    cases = [("What colour is the square?", [make_image(2, 60, 200), make_image(3, 90, 90)]), ("Hello there", [])]
    seqs, expected = [], []
    for i, (text, images) in enumerate(cases):
        expected.append(reference.generate(text, images, 12))
        inputs = reference.inputs(text, images)
        ids = inputs["input_ids"][0].tolist()
        slots = []
        if images:
            grids = [tuple(int(x) for x in g) for g in inputs["image_grid_thw"]]
            embeds = tower(inputs["pixel_values"], grids).split([t * h * w // 4 for t, h, w in grids])
            starts = [j for j, t in enumerate(ids) if t == config.image_token_id and ids[j - 1] != t]
            slots = [ImageInput(o, g, e) for o, g, e in zip(starts, grids, embeds)]
        seqs.append(Sequence(f"r{i}", ids, len(ids), SamplingParams(temperature=0, max_tokens=12), images=slots))
        engine.add_prompt(seqs[-1])
    while engine.has_work():
        engine.step()
    assert [s.output_ids for s in seqs] == expected
    assert few_rows == "off" or 2 in taken  # both sequences decoded together
    assert few_rows != "mixed" or (True in suited and False in suited)


def test_segment_attention_matches_per_segment_sdpa():
    from shared.kernels.attention import segment_attention

    torch.manual_seed(3)
    cu = [0, 64, 100, 164, 180, 181]
    qkv = torch.randn(cu[-1], 3, 2, 20, device=DEVICE)  # head dim 20: padded inside the kernel
    q, k, v = qkv.unbind(1)
    out = segment_attention(q, k, v, torch.tensor(cu, dtype=torch.int32, device=DEVICE), 64)
    for start, end in zip(cu[:-1], cu[1:]):
        s = slice(start, end)
        ref = F.scaled_dot_product_attention(q[s].transpose(0, 1), k[s].transpose(0, 1), v[s].transpose(0, 1))
        close(out[s], ref.transpose(0, 1))


def test_each_triton_compile_is_logged_with_its_time():
    """``log_compiles`` hooks Triton's compile callbacks with the keywords Triton 3.6 passes them
    (``JITFunction._call_hook``): a compile mid-serving shows up as a ``kernel.compiled`` line."""
    pytest.importorskip("triton")
    from triton import knobs
    from triton.runtime.jit import JitFunctionInfo

    from shared import kernels
    from shared.kernels import attention

    lines = []

    class Log:
        def info(self, event, **fields):
            lines.append((event, fields))

    saved = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    try:
        kernels.log_compiles(Log())
        hook_args = dict(key=("k", 1), repr="_prefill_kernel[num_warps=8](q_ptr: *bf16)", compile={},
                         is_manual_warmup=False, already_compiled=False,
                         fn=JitFunctionInfo(attention, "_prefill_kernel", attention._prefill_kernel))
        assert not knobs.runtime.jit_cache_hook(**hook_args)  # falsy: Triton goes on and compiles
        knobs.runtime.jit_post_compile_hook(**hook_args)
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = saved
    assert lines[0][0] == "kernel.compiled" and lines[0][1]["kernel"] == "_prefill_kernel"
    assert lines[0][1]["ms"] >= 0 and "q_ptr" in lines[0][1]["specialization"]


def test_mixed_steps_launch_the_kernels_the_decode_graphs_compiled(tiny_model, monkeypatch):
    """Triton compiles a kernel anew for every new specialization of its arguments: pointer dtypes, 16-byte
    alignment, integers equal to 1 or divisible by 16. The decode graphs compile theirs at start-up; a
    mixed step's decode rows and the chunks after them must launch those same variants, whatever the
    number of decode rows, or each new one is a compile mid-serving (on the H200 1.1 s for the decode
    kernel, with the stack's requests waiting). Every launch's specialization is taken as Triton's own
    binder for sm_90 computes it (the CPU's allocator aligns like the GPU's), over decode steps of 1-4
    rows, a prompt alone, and mixed steps of 1-3 decode rows with a chunk."""
    pytest.importorskip("triton.backends.nvidia")
    from collections import defaultdict

    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    from shared.engine.attention import TritonAttention
    from shared.engine.engine import Engine
    from shared.engine.kv_cache import KVCache
    from shared.engine.runner import ModelRunner
    from shared.messages.sampling import SamplingParams
    from shared.engine.sequence import Sequence
    from shared.kernels import decode_attention as decode_module, fused
    from shared.model.config import ModelConfig
    from shared.model.loader import load_language_model

    hopper = CUDABackend(GPUTarget("cuda", 90, 32))
    variants: dict[str, set[str]] = defaultdict(set)
    for module, name in ((decode_module, "_decode_kernel"), (decode_module, "_merge_kernel"),
                         (fused, "_rope_store_kernel")):
        kernel = getattr(module, name)
        jit = JITFunction(kernel.fn, **kernel.kwargs)
        bind = create_function_from_signature(jit.signature, jit.params, hopper)

        def recorded(*args, grid, warmup, _run=kernel.run, _bind=bind, _name=name, **kwargs):
            _, specialization, options = _bind(*args, **kwargs)
            variants[_name].add(repr((specialization, options)))
            return _run(*args, grid=grid, warmup=warmup, **kwargs)

        monkeypatch.setattr(kernel, "run", recorded)
    config = ModelConfig.from_checkpoint(tiny_model)
    cache = KVCache(config.text, 64, 16, torch.float32, "cpu")
    engine = Engine(ModelRunner(load_language_model(tiny_model, config), cache, 2,
                                backend=TritonAttention(cache, config.text.head_dim ** -0.5)),
                    config.eos_token_ids, max_model_len=1000)
    ids = torch.randint(10, config.text.vocab_size - 10, (60,), generator=torch.Generator().manual_seed(0)).tolist()
    for i in range(4):  # each prompt joins the decode rows of those before it: mixed steps of 1, 2, 3 rows
        prompt = ids[i:20 + 7 * i]
        engine.add_prompt(Sequence(f"r{i}", prompt, len(prompt), SamplingParams(temperature=0, max_tokens=4,
                                                                                 ignore_eos=True)))
        engine.step()
        engine.step()
    while engine.has_work():
        engine.step()
    assert {name: len(v) for name, v in variants.items()} == {"_decode_kernel": 1, "_merge_kernel": 1,
                                                              "_rope_store_kernel": 1}


def test_the_encoders_warm_up_reaches_every_segment_tile_and_the_eager_forward(tiny_model):
    """An encoder forwards ``warm_grids`` before it registers: images short enough for the one-tile segment
    kernel at each of its tile lengths (16-128 patches, one Triton variant each), and one past the pieces'
    graphs (the eager forward, whose first norm has no residual), within the batch limit; the tiny tower
    runs them all (through its real layout and forward)."""
    from services.encoder.vision import warm_grids, warm_up
    from shared.model.config import ModelConfig
    from shared.model.loader import load_vision_tower
    from shared.model.vision_attention import SegmentAttention

    def patches(batches):
        return [sum(t * h * w for t, h, w in grids) for grids in batches]

    sizes = patches(warm_grids(2, 8192, 16384))
    tiles = {max(16, triton.next_power_of_2(n)) for n in sizes if n <= SegmentAttention.SHORT}
    assert tiles == {16, 32, 64, 128} and max(sizes) > 8192 and all(n <= 16384 for n in sizes)
    assert max(patches(warm_grids(2, 8192, 8192))) <= 8192  # past the graphs only within the batch limit
    config = ModelConfig.from_checkpoint(tiny_model)
    tower = load_vision_tower(tiny_model, config)
    assert warm_up(tower, 512, 4096) == len(warm_grids(config.vision.merge_size, 512, 4096)) == 6
