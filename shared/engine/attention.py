"""Attention over the paged KV cache, and the batch layout it reads.

A backend takes one layer's q, k, v (before rotary), applies rotary, writes k and v into their cache
slots and attends. ``TorchAttention`` is the reference path (any device, exact in fp32): it runs
``scaled_dot_product_attention`` per sequence. ``TritonAttention`` is the GPU path: one fused
rotary+cache-write kernel, flash attention for prefill, and the paged flash-decoding kernel for decode,
with nothing that syncs with the host, so a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from shared.kernels import TRITON, attention as paged, fused
from shared.engine.kv_cache import KVCache
from shared.model.rope import apply_rotary


@dataclass
class ForwardBatch:
    """The layout of one forward pass over packed tokens."""

    is_prefill: bool
    slot_mapping: torch.Tensor  # [T] int32/int64: where each new token's K/V is written
    cu_seqlens: list[int] = field(default_factory=list)  # prefill: sequence bounds in the packed tokens
    context_lens: torch.Tensor | None = None  # decode: [B] int32, tokens each row attends over (incl. new)
    block_tables: torch.Tensor | None = None  # decode: [B, width] int32, each row's blocks (padded)
    num_splits: int = 1  # decode on GPU: context splits per (row, KV head)
    on_layer_done: object = None  # optional callable(layer) after a layer's KV is written


class TorchAttention:
    def __init__(self, cache: KVCache):
        self.cache = cache

    def forward(self, layer: int, q, k, v, cos, sin, batch: ForwardBatch) -> torch.Tensor:
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k_cache, v_cache = self.cache.layer(layer)
        slots = batch.slot_mapping.long()
        k_cache.index_copy_(0, slots, k)
        v_cache.index_copy_(0, slots, v)
        out = prefill_attention(q, k, v, batch.cu_seqlens) if batch.is_prefill else \
            self._decode(q, k_cache, v_cache, batch)
        if batch.on_layer_done is not None:
            batch.on_layer_done(layer)
        return out

    def _decode(self, q, k_cache, v_cache, batch: ForwardBatch) -> torch.Tensor:
        out = torch.empty_like(q)
        bs = self.cache.block_size
        for i, (ctx, table) in enumerate(zip(batch.context_lens.tolist(), batch.block_tables.tolist())):
            blocks = torch.tensor(table[: (ctx + bs - 1) // bs], device=q.device)
            slots = (blocks[:, None] * bs + torch.arange(bs, device=q.device)).flatten()[:ctx]
            keys, values = k_cache[slots].transpose(0, 1), v_cache[slots].transpose(0, 1)
            out[i] = F.scaled_dot_product_attention(q[i, :, None], keys, values, enable_gqa=True)[:, 0]
        return out


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
    """Causal attention within each packed sequence (no cached prefix); ``q`` ``[T, H, D]``, ``k,v`` ``[T, KVH, D]``."""
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        s = slice(start, end)
        # [1, heads, tokens, dim]: the fused (flash) kernels take 4-D inputs only
        qs, ks, vs = (x[s].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        if q.is_cuda and group > 1:
            # expanded heads keep the flash kernel eligible (its GQA support varies across torch builds)
            ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
            out[s] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)[0].transpose(0, 1)
        else:
            out[s] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
    return out


class TritonAttention:
    def __init__(self, cache: KVCache, scale: float):
        self.cache = cache
        self.scale = scale

    def forward(self, layer: int, q, k, v, cos, sin, batch: ForwardBatch) -> torch.Tensor:
        k_cache, v_cache = self.cache.layer(layer)
        fused.rope_store(q, k, v, cos, sin, k_cache, v_cache, batch.slot_mapping)
        if batch.is_prefill:
            out = prefill_attention(q, k, v, batch.cu_seqlens)
        else:
            k_blocks, v_blocks = self.cache.data[layer]
            out = paged.paged_decode_attention(q, k_blocks, v_blocks, batch.block_tables, batch.context_lens,
                                               self.scale, batch.num_splits)
        if batch.on_layer_done is not None:
            batch.on_layer_done(layer)
        return out


def make_backend(cache: KVCache, head_dim: int):
    """The fastest backend this device supports."""
    if cache.data.is_cuda and TRITON:
        return TritonAttention(cache, head_dim ** -0.5)
    return TorchAttention(cache)
