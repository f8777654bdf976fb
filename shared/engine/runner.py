"""Runs the language model for a scheduled batch: prepares packed inputs, runs forward, samples."""

from __future__ import annotations

import torch

from shared.engine.attention import ForwardBatch, make_backend
from shared.engine.inputs import DecodeInputs, table_width
from shared.engine.kv_cache import KVCache
from shared.engine.sampling import Sampler
from shared.engine.sequence import Sequence
from shared.model.rope import mrope_positions
from shared.model.text import LanguageModel


class ModelRunner:
    def __init__(self, model: LanguageModel, cache: KVCache, merge_size: int, backend=None,
                 sampler: Sampler | None = None):
        self.model = model
        self.cache = cache
        self.merge_size = merge_size
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.backend = backend or make_backend(cache, model.config.head_dim)
        self.sampler = sampler or Sampler(self.device)
        self.graphs = None  # DecodeGraphs, once captured
        self.inputs: DecodeInputs | None = None  # decode staging buffers, grown on demand

    def capture_graphs(self, max_batch: int, max_model_len: int) -> None:
        """Capture the decode step for every batch bucket (CUDA only)."""
        from shared.engine.graphs import DecodeGraphs

        self.inputs = DecodeInputs(max_batch, table_width(max_model_len, self.cache.block_size),
                                   self.cache.block_size, self.device)
        self.graphs = DecodeGraphs(self.model, self.backend, self.inputs)
        self.graphs.capture()

    # -- prefill -------------------------------------------------------------------------------------
    def prepare_prefill(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, ForwardBatch]:
        ids, positions, slots, cu = [], [], [], [0]
        for seq in seqs:
            ids.extend(seq.token_ids)
            pos, seq.rope_delta = mrope_positions(len(seq), [(i.offset, i.grid) for i in seq.images],
                                                  self.merge_size)
            positions.append(pos)
            slots.extend(self.cache.slots(seq.block_table, 0, len(seq)))
            cu.append(cu[-1] + len(seq))
        embeds = self.model.embed(torch.tensor(ids, device=self.device))
        for seq, start in zip(seqs, cu):
            for image in seq.images:
                row = start + image.offset
                embeds[row:row + image.embeds.shape[0]] = image.embeds.to(self.device, self.dtype)
        batch = ForwardBatch(is_prefill=True, slot_mapping=torch.tensor(slots, device=self.device), cu_seqlens=cu)
        return embeds, torch.cat(positions, dim=1).to(self.device), batch

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence], on_layer_done=None) -> list[int]:
        embeds, positions, batch = self.prepare_prefill(seqs)
        if on_layer_done is not None:
            batch.on_layer_done = lambda layer: on_layer_done(layer, seqs)
        hidden = self.model(embeds, positions, batch, self.backend)
        last = torch.tensor(batch.cu_seqlens[1:], device=self.device) - 1
        logits = self.model.logits(hidden[last])
        for seq in seqs:
            seq.num_computed = len(seq)
        return self.sampler.sample(logits, seqs)

    # -- decode --------------------------------------------------------------------------------------
    def stage_decode(self, seqs: list[Sequence]) -> int:
        """Stage the step's inputs on the device; returns the rows staged (the graph bucket, or len(seqs))."""
        rows = len(seqs)
        bucket = self.graphs.bucket(rows) if self.graphs is not None else None
        width = max(len(s.block_table) for s in seqs)
        if self.inputs is None or self.inputs.max_batch < rows or self.inputs.width < width:
            self.inputs = DecodeInputs(max(rows, 8), max(width, 64), self.cache.block_size, self.device)
        self.inputs.stage(seqs, bucket or rows)
        return bucket or rows

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> list[int]:
        rows = self.stage_decode(seqs)
        if self.graphs is not None and rows in self.graphs.graphs:
            logits = self.graphs.replay(rows)[:len(seqs)]
        else:
            ids, positions, slots, lens, tables = self.inputs.views(rows)
            batch = ForwardBatch(is_prefill=False, slot_mapping=slots, context_lens=lens, block_tables=tables,
                                 num_splits=self._splits(rows))
            logits = self.model.logits(self.model(self.model.embed(ids), positions.expand(3, -1), batch, self.backend))
        for seq in seqs:
            seq.num_computed = len(seq)
        return self.sampler.sample(logits, seqs)

    def _splits(self, batch: int) -> int:
        if self.device.type != "cuda":
            return 1
        from shared.kernels.attention import default_splits

        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        return default_splits(batch, self.model.config.num_kv_heads, sms)
