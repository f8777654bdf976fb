"""Compiles Qwen3-VL's Triton kernels for Hopper (sm_90) without a GPU, with the tile shapes the model
uses: type and shape errors the interpreter lets through fail here. Run as a script (Triton must not
be in interpreter mode): ``python -m tests.hopper_compile``; prints one line per kernel."""

from __future__ import annotations

import inspect
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from shared.kernels import attention, decode_attention, fused, gemv, moe, moe_routing, moe_small  # noqa: E402


def compile_for_hopper(kernel, pointers: dict[str, str], constants: dict, **options) -> None:
    """Scalars not named in ``pointers`` are int32 (``eps``: float32)."""
    names = inspect.signature(kernel.fn).parameters
    signature = {n: "constexpr" if n in constants else pointers.get(n, "fp32" if n == "eps" else "i32") for n in names}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                              target=GPUTarget("cuda", 90, 32), options=options)
    shared = compiled.metadata.shared
    if shared > moe.SHARED_MEMORY:  # the launch would fail with OutOfResources on the GPU
        raise SystemExit(f"{kernel.fn.__name__} {constants}: {shared} bytes of shared memory, over {moe.SHARED_MEMORY}")
    print(kernel.fn.__name__, constants, f"ok ({shared} bytes shared)")


def main() -> int:
    bf16, i32 = "*bf16", "*i32"
    gemm = dict(a_ptr=bf16, b_ptr=bf16, c_ptr=bf16, weights_ptr=bf16, sorted_ids=i32, block_experts=i32,
                num_padded=i32)
    f32 = {name: "*fp32" if kind == bf16 else kind for name, kind in gemm.items()}  # float32 weights (checks)
    for pointers, tiles in ((gemm, moe.SMALL), (gemm, moe.MIDDLE), (gemm, moe.LARGE),
                            (f32, moe.kernel_config(8, 128, 4)), (f32, moe.kernel_config(512 * 8, 128, 4)),
                            (f32, moe.kernel_config(10_000 * 8, 128, 4))):
        for gated in (True, False):
            compile_for_hopper(moe._grouped_gemm_kernel, pointers, dict(
                A_ROWS_PER_TOKEN=8 if gated else 1, GATED=gated, WEIGHTED=not gated, BLOCK_M=tiles.block_m,
                BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k), num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    routing = dict(NUM_EXPERTS=128, E_PAD=128, TOP_K=8, K_PAD=8, RENORMALIZE=True)
    compile_for_hopper(moe_routing._route_align_kernel, dict(
        logits_ptr=bf16, weights_ptr=bf16, ids_ptr=i32, sorted_ids_ptr=i32, block_experts_ptr=i32,
        num_padded_ptr=i32), dict(routing, ROWS=16, BLOCK_M=16, BLOCKS_PAD=128), num_warps=8)
    route = dict(logits_ptr=bf16, weights_ptr=bf16, ids_ptr=i32, counts_ptr=i32)
    compile_for_hopper(moe_routing._route_kernel, route, dict(routing, ROWS=16, COUNT=True))
    compile_for_hopper(moe_routing._route_kernel, route, dict(routing, ROWS=1, COUNT=False, PDL=True), num_warps=1,
                       launch_pdl=True)
    for kernel, pointers, tiles, constants in (
            (moe_small._gate_up_kernel, dict(x_ptr=bf16, w_ptr=bf16, act_ptr=bf16, ids_ptr=i32), moe_small.GATE_UP,
             dict(TOP_K=8)),
            (moe_small._down_kernel, dict(act_ptr=bf16, w_ptr=bf16, out_ptr=bf16, weights_ptr=bf16, ids_ptr=i32),
             moe_small.DOWN, dict(TOP_K=8, K_PAD=8, EARLY=True))):
        compile_for_hopper(kernel, pointers, dict(constants, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, PDL=True),
                           num_warps=tiles.num_warps, launch_pdl=True)
    compile_for_hopper(moe_routing._align_kernel, dict(
        ids_ptr=i32, counts_ptr=i32, cursor_ptr=i32, sorted_ids_ptr=i32, block_experts_ptr=i32, num_padded_ptr=i32),
        dict(NUM_EXPERTS=128, E_PAD=128, BLOCK_M=64, CHUNK=64))
    # the decode step's chain at batch 1 of Qwen3-VL-30B-A3B, launched with PDL
    gemv_pointers = dict(x_ptr=bf16, res_ptr=bf16, norm_ptr=bf16, w_ptr=bf16, bias_ptr=bf16, out_ptr=bf16,
                         res_out_ptr=bf16, h_out_ptr=bf16)
    for n, k, norm, keep in ((5120, 2048, True, False), (2048, 4096, False, False), (128, 2048, True, True)):
        block_n, block_k, warps = gemv.tiles(n, k, norm=norm)
        for whole in (False, True):  # and all weights before the wait
            compile_for_hopper(gemv._gemv_kernel, gemv_pointers, dict(
                NORM=norm, RESIDUAL=norm, KEEP=keep, HAS_BIAS=False, ROWS_PAD=1, K_PAD=k, BLOCK_N=block_n,
                BLOCK_K=block_k, PDL=1, WHOLE=whole), num_warps=warps, launch_pdl=True)
    compile_for_hopper(fused._rope_store_kernel, dict(
        q_ptr=bf16, k_ptr=bf16, v_ptr=bf16, cos_ptr=bf16, sin_ptr=bf16, k_cache=bf16, v_cache=bf16, slots="*i64",
        q_norm=bf16, k_norm=bf16), dict(NUM_HEADS=32, NUM_KV_HEADS=4, HALF=64, HALF_PAD=64, HEADS_PAD=32, KV_PAD=4,
                                        STORE=True, QK_NORM=True, PDL=True), launch_pdl=True)
    decode = dict(q_ptr=bf16, k_ptr=bf16, v_ptr=bf16, cos_ptr=bf16, sin_ptr=bf16, q_norm=bf16, k_norm=bf16,
                  slots="*i64", k_cache=bf16, v_cache=bf16, block_tables=i32, context_lens=i32, out_ptr=bf16,
                  acc_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32")
    layout = dict(NUM_SPLITS=32, MIN_BLOCKS=decode_attention.MIN_BLOCKS, BLOCK_SIZE=16, HEAD_DIM=128, PDL=True)
    for heads, group, qk_norm in ((32, 8, True), (28, 7, False)):  # Qwen3-VL-30B-A3B, Qwen2.5-VL-7B
        compile_for_hopper(decode_attention._decode_kernel, decode, dict(
            layout, NUM_HEADS=heads, GROUP=group, GROUP_PAD=16, BLOCKS_PER_ITER=decode_attention.WALK_TOKENS // 16,
            QK_NORM=qk_norm), num_warps=decode_attention.NUM_WARPS, launch_pdl=True)
        compile_for_hopper(decode_attention._merge_kernel, dict(
            acc_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32", out_ptr=bf16, context_lens=i32),
            dict(layout, NUM_HEADS=heads, SPLITS_PAD=32), launch_pdl=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
