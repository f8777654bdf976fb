"""Runs the language model for a scheduled batch: prepares packed inputs, runs forward, samples."""

from __future__ import annotations

import torch

from shared.engine.attention import ForwardBatch, TorchAttention
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
        self.backend = backend or TorchAttention(cache)
        self.sampler = sampler or Sampler(self.device)

    # -- prefill -------------------------------------------------------------------------------------
    def prepare_prefill(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, ForwardBatch]:
        embeds, positions, slots, cu = [], [], [], [0]
        for seq in seqs:
            ids = torch.tensor(seq.token_ids, device=self.device)
            emb = self.model.embed(ids)
            for image in seq.images:
                n = image.embeds.shape[0]
                emb[image.offset:image.offset + n] = image.embeds.to(self.device, self.dtype)
            pos, seq.rope_delta = mrope_positions(len(seq), [(i.offset, i.grid) for i in seq.images],
                                                  self.merge_size)
            embeds.append(emb)
            positions.append(pos)
            slots.extend(self.cache.slots(seq.block_table, 0, len(seq)))
            cu.append(cu[-1] + len(seq))
        batch = ForwardBatch(is_prefill=True, slot_mapping=torch.tensor(slots, device=self.device), cu_seqlens=cu)
        return torch.cat(embeds), torch.cat(positions, dim=1).to(self.device), batch

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence], on_layer_done=None) -> list[int]:
        embeds, positions, batch = self.prepare_prefill(seqs)
        batch.on_layer_done = on_layer_done
        hidden = self.model(embeds, positions, batch, self.backend)
        last = torch.tensor(batch.cu_seqlens[1:], device=self.device) - 1
        logits = self.model.logits(hidden[last])
        for seq in seqs:
            seq.num_computed = len(seq)
        return self.sampler.sample(logits, [s.sampling for s in seqs], [s.num_output for s in seqs])

    # -- decode --------------------------------------------------------------------------------------
    def prepare_decode(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, ForwardBatch]:
        ids = torch.tensor([s.last_token for s in seqs], device=self.device)
        pos = torch.tensor([len(s) - 1 + s.rope_delta for s in seqs], device=self.device)
        slots = [self.cache.slots(s.block_table, len(s) - 1, len(s))[0] for s in seqs]
        batch = ForwardBatch(
            is_prefill=False,
            slot_mapping=torch.tensor(slots, device=self.device),
            context_lens=[len(s) for s in seqs],
            block_tables=[s.block_table for s in seqs],
        )
        return self.model.embed(ids), pos.expand(3, -1), batch

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> list[int]:
        embeds, positions, batch = self.prepare_decode(seqs)
        logits = self.model.logits(self.model(embeds, positions, batch, self.backend))
        for seq in seqs:
            seq.num_computed = len(seq)
        return self.sampler.sample(logits, [s.sampling for s in seqs], [s.num_output for s in seqs])
