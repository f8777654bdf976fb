"""CUDA graphs for the decode step: one captured forward per batch-size bucket.

A decode step is ~10 small kernels per layer; launched one by one the CPU cannot keep a fast GPU
busy. Captured once per bucket (1, 2, 4, 8, … up to the largest batch), a step is one graph launch.
The graphs read their inputs from the runner's staging buffers (``DecodeInputs``), padded up to the
bucket with rows that read one token and write their KV into the scratch block.
"""

from __future__ import annotations

import torch

from shared.engine.attention import ForwardBatch
from shared.engine.inputs import DecodeInputs
from shared.kernels.decode_attention import default_splits
from shared.logging import get_logger
from shared.model.text import LanguageModel

log = get_logger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


class DecodeGraphs:
    def __init__(self, model: LanguageModel, backend, inputs: DecodeInputs):
        self.model = model
        self.backend = backend
        self.inputs = inputs
        limit = inputs.max_batch
        self.buckets = sorted({b for b in BUCKETS if b < limit} | {limit})
        sms = torch.cuda.get_device_properties(next(model.parameters()).device).multi_processor_count
        self.splits = {b: default_splits(b, model.config.num_kv_heads, sms) for b in self.buckets}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def _forward(self, rows: int) -> torch.Tensor:
        ids, positions, slots, lens, tables = self.inputs.views(rows)
        batch = ForwardBatch(is_prefill=False, slot_mapping=slots, context_lens=lens, block_tables=tables,
                             num_splits=self.splits[rows])
        return self.model.logits(self.model(self.model.embed(ids), positions.expand(3, -1), batch, self.backend))

    @torch.inference_mode()
    def capture(self) -> None:
        self.inputs.stage([], self.buckets[-1])  # every row a padding row while capturing
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

    def replay(self, bucket: int) -> torch.Tensor:
        """Run the captured step on the staged inputs; logits ``[bucket, vocab]`` (padding rows last)."""
        self.graphs[bucket].replay()
        return self.logits[bucket]
