"""Attention over the paged KV cache, and the batch layout it reads.

A backend takes one layer's q, k, v (before rotary), applies the model's QK-norm where it has one
(Qwen3), rotary, writes k and v into their cache slots and attends. ``TorchAttention`` is the
reference path (any device, exact in fp32): it runs
``scaled_dot_product_attention`` per sequence. ``TritonAttention`` is the GPU path: decode rows (a
decode step's, or those riding along prompt chunks) in one kernel that normalizes, rotates, writes
their KV and attends over the paged pool (``shared.kernels.decode_attention``); prompt chunks through
the fused rotary+cache-write kernel, then:

- a chunk that starts its prompt: cuDNN's fused attention at a bucketed length (``shared.kernels.sdpa``:
  all its KV is in hand, and a padded causal call is exact), so a new prompt length plans nothing;
- a chunk after a cached or computed prefix (``prefix_chunks``): ``"split"`` attends in two fused
  kernels and merges them by their log-sum-exps — the chunk's queries over the prefix's keys
  (gathered from the pool; no mask: the flash kernel, at any length) and over the chunk's own keys
  (causal: the bucketed cuDNN call) — or ``"paged"``, one Triton kernel reading the prefix through
  the block table (133–224 TFLOP/s on an H200, well under the fused kernels' rate on a whole prompt:
  most of the 14 % that chunking cost at the 8,192-token budget). ``"split"`` is used where the flash
  kernel runs and agrees with the reference on this device (``sdpa.usable``), in steps whose longest
  such chunk has at least ``split_min_tokens``; else ``"paged"``.

A decode-only step syncs nothing with the host, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from shared.kernels import TRITON, attention as paged, decode_attention, fused, sdpa
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
    prefix_slots: dict = field(default_factory=dict)  # chunk → its prefix's cache slots (device), built once a step


class TorchAttention:
    def __init__(self, cache: KVCache):
        self.cache = cache

    def forward(self, layer: int, q, k, v, cos, sin, batch: ForwardBatch, qk_norm=None) -> torch.Tensor:
        if qk_norm is not None:
            q, k = qk_norm[0](q), qk_norm[1](k)
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
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, heads, tokens, dim]
    if prefix == 0:
        return sdpa.causal(qs, ks, vs)[0].transpose(0, 1)
    group = q.shape[1] // k.shape[1]
    ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
    rows = torch.arange(q.shape[0], device=q.device)[:, None] + prefix
    mask = torch.arange(k.shape[0], device=q.device)[None, :] <= rows
    return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)[0].transpose(0, 1)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int],
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention within each packed sequence (no cached prefix); ``q`` ``[T, H, D]``, ``k,v`` ``[T, KVH, D]``."""
    out = torch.empty_like(q) if out is None else out
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        out[start:end] = causal_attention(q[start:end], k[start:end], v[start:end])
    return out


def split_chunk_attention(q, k_prefix, v_prefix, k_new, v_new) -> torch.Tensor:
    """``causal_attention(q, prefix ++ new, prefix_len)`` as two fused calls: the chunk's queries
    ``[n, H, D]`` over the prefix's keys ``[P, KVH, D]`` (all visible: no mask) and over its own ``[n, KVH, D]``
    (causal), merged by the log-sum-exps: ``out = o_new + (o_prefix − o_new) · σ(lse_prefix − lse_new)``."""
    qs = q.transpose(0, 1).unsqueeze(0)
    o_prefix, lse_prefix = sdpa.flash(qs, *(x.transpose(0, 1).unsqueeze(0) for x in (k_prefix, v_prefix)),
                                      causal=False, with_lse=True)
    o_new, lse_new = sdpa.causal(qs, *(x.transpose(0, 1).unsqueeze(0) for x in (k_new, v_new)), with_lse=True)
    share = torch.sigmoid(lse_prefix - lse_new).unsqueeze(-1)  # the prefix's part of each row's softmax mass
    out = torch.lerp(o_new.float(), o_prefix.float(), share)
    return out[0].transpose(0, 1).to(q.dtype)


class TritonAttention:
    # shorter chunks: the paged kernel (H200: 0.34 against 0.53 ms for 512 after 8,192; 0.56 / 0.72 for 2,048
    # after 2,048; the split wins from 2,048 after 8,192 on: 1.28 / 1.42 ms, and 2,711 after 8,192: 1.49 / 2.15)
    SPLIT_MIN_TOKENS = 2048

    def __init__(self, cache: KVCache, scale: float, sdpa_for_fresh_chunks: bool = True,
                 prefix_chunks: str = "split"):
        self.cache = cache
        self.scale = scale
        self.sdpa_for_fresh_chunks = sdpa_for_fresh_chunks  # False: the paged kernel does every chunk
        self.prefix_chunks = prefix_chunks  # "split" | "paged" (module docstring)
        self.split_min_tokens = self.SPLIT_MIN_TOKENS
        self.split_chunks = 0  # chunks attended the split way

    def forward(self, layer: int, q, k, v, cos, sin, batch: ForwardBatch, qk_norm=None) -> torch.Tensor:
        norms = qk_norm and (qk_norm[0].weight, qk_norm[1].weight, qk_norm[0].eps)
        k_blocks, v_blocks = self.cache.data[layer]
        rows = batch.num_decode if batch.is_prefill else q.shape[0]  # decode rows come first
        out = torch.empty_like(q)
        if rows:
            decode_attention.decode_attention(q[:rows], k[:rows], v[:rows], cos[:rows], sin[:rows],
                                              batch.slot_mapping[:rows], k_blocks, v_blocks, batch.block_tables[:rows],
                                              batch.context_lens[:rows], self.scale, batch.num_splits, norms,
                                              out=out[:rows])
        if batch.is_prefill:
            k_cache, v_cache = self.cache.layer(layer)
            fused.rope_store(q[rows:], k[rows:], v[rows:], cos[rows:], sin[rows:], k_cache, v_cache,
                             batch.slot_mapping[rows:], norms)
            self._prefill(q, k, v, k_blocks, v_blocks, batch, out)
        if batch.on_layer_done is not None:
            batch.on_layer_done(layer)
        return out

    def _prefill(self, q, k, v, k_blocks, v_blocks, batch: ForwardBatch, out: torch.Tensor) -> None:
        """Prompt chunks' attention into ``out`` (their rows after the decode rows'), q and k rotated."""
        if batch.block_tables is None:  # every chunk starts its prompt (and no decode row rides along)
            prefill_attention(q, k, v, batch.cu_seqlens, out)
            return
        rows, cu = batch.num_decode, batch.cu_seqlens
        chunks = range(rows, len(cu) - 1)
        after_prefix = [i for i in chunks if batch.prefix_lens[i]]
        split = bool(after_prefix) and self._splits(max(cu[i + 1] - cu[i] for i in after_prefix), q)
        if not split and (after_prefix or not self.sdpa_for_fresh_chunks):  # it skips what SDPA does
            paged.paged_prefill_attention(q, k_blocks, v_blocks, batch.block_tables, batch.cu_seqlens_q,
                                          batch.context_lens, self.scale, batch.max_query_len, first_chunk=rows,
                                          skip_fresh=self.sdpa_for_fresh_chunks, out=out)
        k_pool, v_pool = (x.flatten(0, 1) for x in (k_blocks, v_blocks))
        for i in chunks:
            s = slice(cu[i], cu[i + 1])
            if split and batch.prefix_lens[i]:
                slots = self._prefix_slots(batch, i)
                out[s] = split_chunk_attention(q[s], k_pool[slots], v_pool[slots], k[s], v[s])
                self.split_chunks += 1
            elif batch.prefix_lens[i] == 0 and self.sdpa_for_fresh_chunks:
                out[s] = causal_attention(q[s], k[s], v[s])

    def _splits(self, longest: int, q: torch.Tensor) -> bool:
        """Whether this step's chunks after a prefix go the split way (all of them: the paged kernel's
        launch covers every chunk, so the two ways do not mix in one step)."""
        if self.prefix_chunks != "split" or not self.sdpa_for_fresh_chunks or longest < self.split_min_tokens:
            return False
        return not q.is_cuda or sdpa.usable("flash", q.device, q.dtype, q.shape[1], self.cache.data.shape[-2],
                                            q.shape[2])

    def warm(self, heads: int, up_to: int) -> int:
        """Plan the fresh chunks' attention at every length up to ``up_to`` tokens, in the calling thread
        (the engine's: the plans are per thread), and compile the paged prefill kernel; returns how many
        plans."""
        kv_heads, dim = self.cache.data.shape[-2:]
        if self.cache.data.is_cuda and self.cache.num_blocks >= 2:
            k_blocks, v_blocks = self.cache.data[0]
            paged.warm_prefill(k_blocks, v_blocks, heads, self.sdpa_for_fresh_chunks)
        return sdpa.warm(self.cache.data.device, self.cache.data.dtype, heads, kv_heads, dim, up_to)

    def _prefix_slots(self, batch: ForwardBatch, i: int) -> torch.Tensor:
        """Chunk ``i``'s prefix's slots in the pool, from its block table on the device (once a step)."""
        if i not in batch.prefix_slots:
            bs, prefix = self.cache.block_size, batch.prefix_lens[i]
            blocks = batch.block_tables[i, : (prefix + bs - 1) // bs].long()
            batch.prefix_slots[i] = (blocks[:, None] * bs + torch.arange(bs, device=blocks.device)).flatten()[:prefix]
        return batch.prefix_slots[i]


def make_backend(cache: KVCache, head_dim: int):
    """The fastest backend this device supports."""
    if cache.data.is_cuda and TRITON:
        return TritonAttention(cache, head_dim ** -0.5)
    return TorchAttention(cache)
