"""Attention over the paged KV cache, and the batch layout it reads.

``TorchAttention`` is the reference path (any device, exact in fp32): it writes the new K/V into their
slots and runs ``scaled_dot_product_attention`` per sequence. Faster paths implement the same
``forward(layer, q, k, v, batch)`` contract.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from shared.engine.kv_cache import KVCache


@dataclass
class ForwardBatch:
    """The layout of one forward pass over packed tokens."""

    is_prefill: bool
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    cu_seqlens: list[int] = field(default_factory=list)  # prefill: sequence bounds in the packed tokens
    context_lens: list[int] = field(default_factory=list)  # decode: tokens each row attends over (incl. new)
    block_tables: list[list[int]] = field(default_factory=list)  # decode: each row's blocks
    on_layer_done: object = None  # optional callable(layer) after a layer's KV is written


class TorchAttention:
    def __init__(self, cache: KVCache):
        self.cache = cache

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        k_cache, v_cache = self.cache.layer(layer)
        k_cache.index_copy_(0, batch.slot_mapping, k)
        v_cache.index_copy_(0, batch.slot_mapping, v)
        out = self._prefill(q, k, v, batch) if batch.is_prefill else self._decode(q, k_cache, v_cache, batch)
        if batch.on_layer_done is not None:
            batch.on_layer_done(layer)
        return out

    @staticmethod
    def _prefill(q, k, v, batch: ForwardBatch) -> torch.Tensor:
        out = torch.empty_like(q)
        for start, end in zip(batch.cu_seqlens[:-1], batch.cu_seqlens[1:]):
            s = slice(start, end)
            out[s] = F.scaled_dot_product_attention(
                q[s].transpose(0, 1), k[s].transpose(0, 1), v[s].transpose(0, 1), is_causal=True, enable_gqa=True
            ).transpose(0, 1)
        return out

    def _decode(self, q, k_cache, v_cache, batch: ForwardBatch) -> torch.Tensor:
        out = torch.empty_like(q)
        bs = self.cache.block_size
        for i, (ctx, table) in enumerate(zip(batch.context_lens, batch.block_tables)):
            blocks = torch.tensor(table[: (ctx + bs - 1) // bs], device=q.device)
            slots = (blocks[:, None] * bs + torch.arange(bs, device=q.device)).flatten()[:ctx]
            keys, values = k_cache[slots].transpose(0, 1), v_cache[slots].transpose(0, 1)
            out[i] = F.scaled_dot_product_attention(q[i, :, None], keys, values, enable_gqa=True)[:, 0]
        return out
