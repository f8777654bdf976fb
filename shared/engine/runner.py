"""Runs the language model for a scheduled batch: prepares packed inputs, runs forward, samples."""

from __future__ import annotations

import itertools

import torch

from shared.engine.attention import ForwardBatch, make_backend
from shared.engine.inputs import DecodeInputs, table_width
from shared.engine.kv_cache import KVCache
from shared.engine.sampling import Sampler
from shared.engine.scheduler import Chunk
from shared.engine.sequence import Sequence
from shared.model import deepstack
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

    # -- prefill: prompt chunks, decode rows riding along ----------------------------------------------
    def prepare_prefill(self, chunks: list[Chunk]) -> tuple[torch.Tensor, torch.Tensor, ForwardBatch,
                                                            deepstack.Deepstack | None]:
        """Packed input embeddings ``[T, hidden]``, positions ``[3, T]``, the batch layout of ``chunks``, and
        the deepstack levels of the image rows they cover (Qwen3-VL; None for other models)."""
        ids, positions, slots, cu = [], [], [], [0]
        for chunk in chunks:
            seq = chunk.seq
            ids.extend(seq.token_ids[chunk.start:chunk.end])
            positions.append(self._positions(seq, chunk.start, chunk.end))
            slots.extend(self.cache.slots(seq.block_table, chunk.start, chunk.end))
            cu.append(cu[-1] + chunk.num_tokens)
        embeds = self.model.embed(torch.tensor(ids, device=self.device))
        rows, levels = [], []  # Qwen3-VL: image rows carry deepstack levels after the input embedding
        for row, image in image_rows(chunks, cu):
            main, extra = deepstack.split_rows(image.to(self.device, self.dtype), embeds.shape[1])
            embeds[row:row + main.shape[0]] = main
            rows.append(torch.arange(row, row + main.shape[0], device=self.device))
            levels.append(extra)
        batch = self._prefill_batch(chunks, cu, torch.tensor(slots, dtype=torch.int32, device=self.device))
        return embeds, torch.cat(positions, dim=1).to(self.device), batch, deepstack.collect(rows, levels)

    def _positions(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        if start >= seq.prompt_len:  # generated tokens are text: one position on every axis
            return (torch.arange(start, end) + seq.rope_delta).expand(3, -1)
        if seq.positions is None:  # the whole prompt's, once: later chunks slice them
            images = [(i.offset, i.grid, i.time_interval) for i in seq.images]
            seq.positions, seq.rope_delta = mrope_positions(seq.prompt_len, images, self.merge_size)
        return seq.positions[:, start:end]

    def _prefill_batch(self, chunks: list[Chunk], cu: list[int], slots: torch.Tensor) -> ForwardBatch:
        prefix = [chunk.start for chunk in chunks]
        num_decode = sum(1 for _ in itertools.takewhile(lambda c: c.seq.decoding, chunks))
        batch = ForwardBatch(is_prefill=True, slot_mapping=slots, cu_seqlens=cu, prefix_lens=prefix,
                             num_decode=num_decode)
        if any(prefix):  # some chunk attends over KV already in the cache: the kernels read it via the tables
            batch.tables = [chunk.seq.block_table for chunk in chunks]
            width = max(len(table) for table in batch.tables)
            padded = [table + [0] * (width - len(table)) for table in batch.tables]
            batch.block_tables = torch.tensor(padded, dtype=torch.int32, device=self.device)
            batch.context_lens = torch.tensor([chunk.end for chunk in chunks], dtype=torch.int32, device=self.device)
            batch.cu_seqlens_q = torch.tensor(cu, dtype=torch.int32, device=self.device)
            batch.max_query_len = max(chunk.num_tokens for chunk in chunks[num_decode:]) if num_decode < len(chunks) else 0
            batch.num_splits = self._splits(num_decode) if num_decode else 1
        return batch

    @torch.inference_mode()
    def prefill(self, chunks: list[Chunk], on_layer_done=None) -> list[int | None]:
        """Run a step of chunks; a sampled token for each chunk that completes its sequence, else None.
        ``on_layer_done(layer)`` is called after each layer's KV is in the cache."""
        embeds, positions, batch, levels = self.prepare_prefill(chunks)
        batch.on_layer_done = on_layer_done
        extra = {} if levels is None else {"deepstack": levels}
        hidden = self.model(embeds, positions, batch, self.backend, **extra)
        complete = [i for i, chunk in enumerate(chunks) if chunk.end == len(chunk.seq)]
        tokens: list[int | None] = [None] * len(chunks)
        if complete:
            last = torch.tensor([batch.cu_seqlens[i + 1] - 1 for i in complete], device=self.device)
            seqs = [chunks[i].seq for i in complete]
            sampled = self.sampler.sample(self.model.logits(hidden[last]), seqs)
            for i, token in zip(complete, sampled):
                tokens[i] = token
        return tokens

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
        return self.sampler.sample(logits, seqs)

    def _splits(self, batch: int) -> int:
        """KV splits for ``batch`` decode rows: those of the graph bucket the count falls in. The count is
        a compile-time constant of the decode kernels, so the rows riding along a prompt chunk (any
        number) must not bring a new one — each was a Triton compile mid-serving, 1-11 per loaded point."""
        if self.device.type != "cuda":
            return 1
        from shared.engine.graphs import BUCKETS
        from shared.kernels.decode_attention import default_splits

        if self.graphs is not None and (bucket := self.graphs.bucket(batch)) is not None:
            return self.graphs.splits[bucket]  # compiled when the graphs were captured
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        snapped = next((b for b in BUCKETS if b >= batch), BUCKETS[-1])
        return default_splits(snapped, self.model.config.num_kv_heads, sms)


def image_rows(chunks: list[Chunk], cu: list[int]) -> list[tuple[int, torch.Tensor]]:
    """The image embedding rows the chunks cover: (first row in the packed batch, the rows of that image
    for the chunk with all their columns). A chunk that splits an image takes the rows it covers."""
    pieces = []
    for chunk, base in zip(chunks, cu):
        for image in chunk.seq.images:
            first, last = max(chunk.start, image.offset), min(chunk.end, image.offset + image.num_tokens)
            if first < last:
                pieces.append((base + first - chunk.start, image.embeds[first - image.offset:last - image.offset]))
    return pieces
