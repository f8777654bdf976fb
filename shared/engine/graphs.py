"""CUDA graphs for the decode step: one captured forward per batch-size bucket.

A decode step is ~10 small kernels per layer; launched one by one the CPU cannot keep a fast GPU
busy. Captured once per bucket (1, 2, 4, 8, … up to the largest batch), a step is one graph launch.
Inputs live in static buffers; a batch is padded up to its bucket with rows that read one token and
write their KV into the scratch block, which the block manager never hands out.
"""

from __future__ import annotations

import torch

from shared.engine.attention import ForwardBatch
from shared.engine.block_manager import SCRATCH_BLOCK
from shared.engine.kernels.attention import default_splits
from shared.logging import get_logger
from shared.model.text import LanguageModel

log = get_logger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


class DecodeGraphs:
    def __init__(self, model: LanguageModel, backend, max_batch: int, max_blocks_per_seq: int):
        self.model = model
        self.backend = backend
        device = next(model.parameters()).device
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        self.buckets = sorted(set(self.buckets))
        n = self.buckets[-1]
        self.ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), SCRATCH_BLOCK * backend.cache.block_size, dtype=torch.long, device=device)
        self.tables = torch.full((n, max_blocks_per_seq), SCRATCH_BLOCK, dtype=torch.int32, device=device)
        self.lens = torch.ones(n, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.splits = {b: default_splits(b, model.config.num_kv_heads, sms) for b in self.buckets}

    def _forward(self, b: int) -> torch.Tensor:
        batch = ForwardBatch(is_prefill=False, slot_mapping=self.slots[:b], context_lens=self.lens[:b],
                             block_tables=self.tables[:b], num_splits=self.splits[b])
        hidden = self.model(self.model.embed(self.ids[:b]), self.positions[:b].expand(3, -1), batch, self.backend)
        return self.model.logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in reversed(self.buckets):  # largest first: smaller graphs reuse its memory
                self._forward(b)  # warm-up: compiles kernels, settles the allocator
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.logits[b] = self._forward(b)
                pool = graph.pool()
                self.graphs[b] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        log.info("decode_graphs.captured", buckets=self.buckets)

    def bucket(self, batch: int) -> int | None:
        return next((b for b in self.buckets if b >= batch), None)

    def run(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
            lens: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, vocab]`` for a batch of ``B`` ≤ the largest bucket (inputs on the device)."""
        batch, width = tables.shape
        b = self.bucket(batch)
        self.ids[:batch].copy_(ids, non_blocking=True)
        self.positions[:batch].copy_(positions, non_blocking=True)
        self.slots[:batch].copy_(slots, non_blocking=True)
        self.tables[:batch, :width].copy_(tables, non_blocking=True)
        self.lens[:batch].copy_(lens, non_blocking=True)
        if b > batch:  # padding rows: one token, the scratch block
            self.slots[batch:b].fill_(SCRATCH_BLOCK * self.backend.cache.block_size)
            self.lens[batch:b].fill_(1)
            self.tables[batch:b, 0].fill_(SCRATCH_BLOCK)
        self.graphs[b].replay()
        return self.logits[b][:batch]
