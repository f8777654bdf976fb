"""1,000 requests (16-200-token prompts, 8 tokens out) through one engine: neither the allocator nor the KV
pool grows."""

from __future__ import annotations

import time

import torch

from bench.engine.common import Bench, build_lm, log, new_seq


def run(bench: Bench, out: dict) -> None:
    engine, dev = build_lm(bench), bench.device
    n = 1000 if bench.big else 100
    gen = torch.Generator().manual_seed(1)

    def wave(start: int, count: int):
        for i in range(start, start + count):
            length = int(torch.randint(16, 200, (1,), generator=gen))
            engine.add_prompt(new_seq(f"m{i}", torch.randint(10, bench.vocab, (length,), generator=gen).tolist(), 8))
        while engine.has_work():
            engine.step()

    cuda = dev.type == "cuda"
    wave(0, 100)  # warm the allocator
    if cuda:
        import gc

        gc.collect()  # earlier sections' leftovers must not count as "before"
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(dev) if cuda else 0
    peak_before = torch.cuda.max_memory_reserved(dev) if cuda else 0
    t = time.perf_counter()
    for start in range(0, n, 200):
        wave(start + 100, min(200, n - start))
    elapsed = time.perf_counter() - t
    after = torch.cuda.memory_allocated(dev) if cuda else 0
    out.update(requests=n, allocated_before_MB=before / 2**20, allocated_after_MB=after / 2**20,
               reserved_peak_before_MB=peak_before / 2**20,
               reserved_peak_after_MB=(torch.cuda.max_memory_reserved(dev) if cuda else 0) / 2**20,
               kv_blocks_free_after=engine.blocks.num_free, kv_blocks_total=engine.blocks.num_blocks, seconds=elapsed)
    log(f"memory: {n} requests in {elapsed:.1f}s, allocated {before / 2**20:.0f} -> {after / 2**20:.0f} MB, "
        f"blocks free {engine.blocks.num_free}/{engine.blocks.num_blocks}")
