"""Attention over the paged KV cache, and the batch layout it reads.

A backend takes one layer's q, k, v (before rotary), applies rotary, writes k and v into their cache
slots and attends. ``TorchAttention`` is the reference path (any device, exact in fp32): it runs
``scaled_dot_product_attention`` per sequence. ``TritonAttention`` is the GPU path: one fused
rotary+cache-write kernel, the paged flash-decoding kernel for decode rows, and for prompt chunks the
paged prefill kernel (chunks after a cached or computed prefix) or SDPA (chunks that start a prompt:
all their KV is in hand, and cuDNN's flash kernel is the fastest there is). A decode-only step syncs
nothing with the host, so it can be captured in a CUDA graph.
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
    """The layout of one forward pass over packed tokens.

    A prefill step packs chunks ``[start, end)`` of sequences, its decode rows (one token each) first.
    ``context_lens``, ``block_tables`` and ``cu_seqlens_q`` are set there only when some chunk has a
    prefix (``start > 0``) to read from the cache.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor  # [T] int32/int64: where each new token's K/V is written
    cu_seqlens: list[int] = field(default_factory=list)  # prefill: chunk bounds in the packed tokens
    prefix_lens: list[int] = field(default_factory=list)  # prefill: tokens of each sequence before its chunk
    num_decode: int = 0  # prefill: leading chunks that are decode rows
    max_query_len: int = 0  # prefill: longest chunk after the decode rows
    tables: list[list[int]] = field(default_factory=list)  # prefill: each chunk's block table (host)
    cu_seqlens_q: torch.Tensor | None = None  # prefill: [chunks + 1] int32, cu_seqlens on the device
    context_lens: torch.Tensor | None = None  # [rows] int32, tokens each row / chunk attends over (incl. new)
    block_tables: torch.Tensor | None = None  # [rows, width] int32, each row's / chunk's blocks (padded)
    num_splits: int = 1  # decode rows on GPU: context splits per (row, KV head)
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
        out = self._prefill(q, k, v, k_cache, v_cache, batch) if batch.is_prefill else \
            self._decode(q, k_cache, v_cache, batch)
        if batch.on_layer_done is not None:
            batch.on_layer_done(layer)
        return out

    def _prefill(self, q, k, v, k_cache, v_cache, batch: ForwardBatch) -> torch.Tensor:
        out = torch.empty_like(q)
        bounds = zip(batch.cu_seqlens[:-1], batch.cu_seqlens[1:], batch.prefix_lens)
        for i, (start, end, prefix) in enumerate(bounds):
            s = slice(start, end)
            if prefix == 0:
                out[s] = causal_attention(q[s], k[s], v[s])
                continue
            slots = torch.tensor(self.cache.slots(batch.tables[i], 0, prefix + end - start), device=q.device)
            out[s] = causal_attention(q[s], k_cache[slots], v_cache[slots], prefix)
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


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int = 0) -> torch.Tensor:
    """One chunk's causal attention: ``q`` ``[n, H, D]`` for the tokens after ``prefix``; ``k,v``
    ``[prefix + n, KVH, D]``, the prefix's KV first. Query ``i`` sees keys ``0 … prefix + i``."""
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, heads, tokens, dim]: 4-D for the flash kernels
    group = q.shape[1] // k.shape[1]
    if q.is_cuda and group > 1:
        # expanded heads keep the flash kernel eligible (its GQA support varies across torch builds)
        ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
        group = 1
    if prefix == 0:
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=group > 1)
    else:
        rows = torch.arange(q.shape[0], device=q.device)[:, None] + prefix
        mask = torch.arange(k.shape[0], device=q.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=group > 1)
    return out[0].transpose(0, 1)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
    """Causal attention within each packed sequence (no cached prefix); ``q`` ``[T, H, D]``, ``k,v`` ``[T, KVH, D]``."""
    out = torch.empty_like(q)
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        out[start:end] = causal_attention(q[start:end], k[start:end], v[start:end])
    return out


class TritonAttention:
    def __init__(self, cache: KVCache, scale: float, sdpa_for_fresh_chunks: bool = True):
        self.cache = cache
        self.scale = scale
        self.sdpa_for_fresh_chunks = sdpa_for_fresh_chunks  # False: the paged kernel does every chunk

    def forward(self, layer: int, q, k, v, cos, sin, batch: ForwardBatch) -> torch.Tensor:
        k_cache, v_cache = self.cache.layer(layer)
        fused.rope_store(q, k, v, cos, sin, k_cache, v_cache, batch.slot_mapping)
        k_blocks, v_blocks = self.cache.data[layer]
        if batch.is_prefill:
            out = self._prefill(q, k, v, k_blocks, v_blocks, batch)
        else:
            out = paged.paged_decode_attention(q, k_blocks, v_blocks, batch.block_tables, batch.context_lens,
                                               self.scale, batch.num_splits)
        if batch.on_layer_done is not None:
            batch.on_layer_done(layer)
        return out

    def _prefill(self, q, k, v, k_blocks, v_blocks, batch: ForwardBatch) -> torch.Tensor:
        if batch.block_tables is None:  # every chunk starts its prompt
            return prefill_attention(q, k, v, batch.cu_seqlens)
        out = torch.empty_like(q)
        rows = batch.num_decode
        if rows:
            paged.paged_decode_attention(q[:rows], k_blocks, v_blocks, batch.block_tables[:rows],
                                         batch.context_lens[:rows], self.scale, batch.num_splits, out=out[:rows])
        if batch.max_query_len:
            paged.paged_prefill_attention(q, k_blocks, v_blocks, batch.block_tables, batch.cu_seqlens_q,
                                          batch.context_lens, self.scale, batch.max_query_len, first_chunk=rows,
                                          skip_fresh=self.sdpa_for_fresh_chunks, out=out)
        if self.sdpa_for_fresh_chunks:
            cu = batch.cu_seqlens
            for i in range(rows, len(cu) - 1):
                if batch.prefix_lens[i] == 0:
                    s = slice(cu[i], cu[i + 1])
                    out[s] = causal_attention(q[s], k[s], v[s])
        return out


def make_backend(cache: KVCache, head_dim: int):
    """The fastest backend this device supports."""
    if cache.data.is_cuda and TRITON:
        return TritonAttention(cache, head_dim ** -0.5)
    return TorchAttention(cache)
