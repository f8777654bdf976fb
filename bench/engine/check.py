"""Accuracy on the GPU: our path (CUDA graphs, and eager) and the plain torch path in bf16, each against an
fp32 reference of the same weights, teacher-forced so every path sees the same tokens. Fails when our path
is less accurate than bf16 itself allows."""

from __future__ import annotations

import torch

from bench.engine.common import Bench, build_lm, forced_logits, lm_bytes, log
from shared.engine.engine import Engine
from shared.engine.kv_cache import KVCache
from shared.engine.runner import ModelRunner
from shared.model.loader import load_language_model


def run(bench: Bench, out: dict) -> None:
    from shared.engine.attention import TorchAttention
    from shared.kernels import ENABLED

    engine = build_lm(bench)
    lm, cfg, dev = bench.lm, bench.config, bench.device
    if dev.type != "cuda":
        out["skipped"] = "no GPU: the torch path is the only path"
        return
    if 2 * lm_bytes(lm) > torch.cuda.mem_get_info(dev)[0]:  # its fp32 copy would not fit: check 4 layers
        engine, lm, cfg = shallow_engine(bench, layers=4)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, bench.vocab, (300,), generator=gen).tolist()
    forced = torch.randint(10, bench.vocab, (6,), generator=gen).tolist()

    def torch_engine(model, dtype):
        cache = KVCache(cfg.text, 64, 16, dtype, dev)
        return Engine(ModelRunner(model, cache, 2, backend=TorchAttention(cache)), (2,), 1000)

    runner = engine.runner
    results = {"graphs": forced_logits(engine, prompt, forced)}
    graphs, runner.graphs = runner.graphs, None
    results["eager"] = forced_logits(engine, prompt, forced)
    runner.graphs = graphs
    switches = ("fused", "moe", "gemv")
    for path in switches:  # the pure torch path
        ENABLED[path] = False
    try:
        results["torch_bf16"] = forced_logits(torch_engine(lm, bench.dtype), prompt, forced)
        lm32 = load_language_model(None, cfg, dev, torch.float32, load_format="dummy")
        lm32.load_state_dict({k: v.float() for k, v in lm.state_dict().items()})
        results["fp32"] = forced_logits(torch_engine(lm32, torch.float32), prompt, forced)
        del lm32
    finally:
        for path in switches:
            ENABLED[path] = True
    torch.cuda.empty_cache()
    report = {}
    for name in ("graphs", "eager", "torch_bf16"):
        errors = [(torch.linalg.norm(a - b) / torch.linalg.norm(b)).item() for a, b in zip(results[name], results["fp32"])]
        report[name] = errors
        log(f"check {name} vs fp32: rel. error per step {['%.1e' % e for e in errors]}")
    out["rel_error_vs_fp32"] = report
    worst_torch = max(report["torch_bf16"])
    if max(max(report["graphs"]), max(report["eager"])) > max(2 * worst_torch, 1e-2):
        raise AssertionError("GPU path is less accurate than the bf16 torch path")


def shallow_engine(bench: Bench, layers: int):
    """The preset's architecture cut to its first ``layers`` decoder layers, with its own engine and graphs."""
    from dataclasses import replace

    cfg, dev = bench.config, bench.device
    moe = cfg.text.moe and replace(cfg.text.moe, layers=tuple(i for i in cfg.text.moe.layers if i < layers))
    cfg = replace(cfg, text=replace(cfg.text, num_layers=layers, moe=moe))
    lm = load_language_model(None, cfg, dev, bench.dtype, load_format="dummy")
    cache = KVCache(cfg.text, 256, 16, bench.dtype, dev)
    engine = Engine(ModelRunner(lm, cache, cfg.vision.merge_size), (2,), 1024, "both", max_num_seqs=8)
    engine.runner.capture_graphs(8, 1024)
    return engine, lm, cfg
