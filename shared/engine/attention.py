"""Attention over the paged KV cache, and the batch layout it reads.

A backend takes one layer's q, k, v (before rotary), applies rotary, writes k and v into their cache
slots and attends. ``TorchAttention`` is the reference path (any device, exact in fp32): it runs
``scaled_dot_product_attention`` per sequence. ``TritonAttention`` is the GPU path: one fused
rotary+cache-write kernel, the paged flash-decoding kernel for decode rows, and for prompt chunks:

- a chunk that starts its prompt: SDPA (all its KV is in hand; cuDNN's flash kernel is the fastest
  there is);
- a chunk after a cached or computed prefix (``prefix_chunks``): ``"split"`` attends in two fused
  kernels and merges them by their log-sum-exps — the chunk's queries over the prefix's keys
  (gathered from the pool; no mask, so cuDNN's kernel applies although the lengths differ) and over
  the chunk's own keys (causal, square) — or ``"paged"``, one Triton kernel reading the prefix through
  the block table (133–224 TFLOP/s on an H200, well under cuDNN's rate on a whole prompt: most of
  the 14 % that chunking cost at the 8,192-token budget). ``"split"`` is used where ``LseKernel.find`` found a
  fused kernel that returns log-sum-exps and agrees with the reference on this device, in steps whose
  longest such chunk has at least ``split_min_tokens``; else ``"paged"``.

A decode-only step syncs nothing with the host, so it can be captured in a CUDA graph.
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
    prefix_slots: dict = field(default_factory=dict)  # chunk → its prefix's cache slots (device), built once a step


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


class LseKernel:
    """A fused attention kernel that also returns each query's log-sum-exp (``torch.ops.aten``'s own
    entry points, which SDPA dispatches to; the public call does not return it): ``q`` ``[1, H, n, D]``,
    ``k, v`` ``[1, KVH, m, D]`` → (out ``[1, H, n, D]``, lse ``[1, H, n]`` float32)."""

    def __init__(self, name: str, expand: bool):
        self.name = name  # "cudnn" | "flash" | "cpu"
        self.expand = expand  # repeat KV heads to the query's (a kernel without grouped-query support)

    def __call__(self, q, k, v, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if self.expand and k.shape[1] != q.shape[1]:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        ops = torch.ops.aten
        if self.name == "cudnn":
            out, lse = ops._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False)[:2]
        elif self.name == "flash":
            out, lse = ops._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False)[:2]
        else:
            out, lse = ops._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)[:2]
        lse = lse.squeeze(-1) if lse.dim() == 4 else lse  # cuDNN's is [B, H, n, 1]
        return out, lse[..., : q.shape[2]].float()

    _found: dict = {}

    @classmethod
    def find(cls, device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, dim: int) -> "LseKernel | None":
        """The first kernel, fastest first, that runs here and agrees with SDPA's reference on a probe
        (these entry points are private: a torch build may lack one or lay its outputs out otherwise)."""
        key = (str(device), dtype, heads, kv_heads, dim)
        if key not in cls._found:
            names = ["cudnn", "flash"] if device.type == "cuda" else ["cpu"]
            cls._found[key] = next((k for k in (cls(n, e) for n in names for e in (False, True))
                                    if k._agrees(device, dtype, heads, kv_heads, dim)), None)
        return cls._found[key]

    def _agrees(self, device, dtype, heads, kv_heads, dim) -> bool:
        gen = torch.Generator(device="cpu").manual_seed(0)
        prefix, n = 200, 72
        q = torch.randn(n, heads, dim, generator=gen).to(device, dtype)
        k = torch.randn(prefix + n, kv_heads, dim, generator=gen).to(device, dtype)
        v = torch.randn(prefix + n, kv_heads, dim, generator=gen).to(device, dtype)
        try:
            got = split_chunk_attention(q, k[:prefix], v[:prefix], k[prefix:], v[prefix:], self)
        except RuntimeError:  # not in this build, or not for these shapes
            return False
        want = causal_attention(q.float(), k.float(), v.float(), prefix)
        return bool(torch.allclose(got.float(), want, atol=2e-2 if dtype != torch.float32 else 1e-4, rtol=0))


def split_chunk_attention(q, k_prefix, v_prefix, k_new, v_new, kernel: LseKernel) -> torch.Tensor:
    """``causal_attention(q, prefix ++ new, prefix_len)`` as two fused calls: the chunk's queries
    ``[n, H, D]`` over the prefix's keys ``[P, KVH, D]`` (all visible: no mask) and over its own ``[n, KVH, D]``
    (causal), merged by the log-sum-exps: ``out = o_new + (o_prefix − o_new) · σ(lse_prefix − lse_new)``."""
    qs = q.transpose(0, 1).unsqueeze(0)
    o_prefix, lse_prefix = kernel(qs, *(x.transpose(0, 1).unsqueeze(0) for x in (k_prefix, v_prefix)), causal=False)
    o_new, lse_new = kernel(qs, *(x.transpose(0, 1).unsqueeze(0) for x in (k_new, v_new)), causal=True)
    share = torch.sigmoid(lse_prefix - lse_new).unsqueeze(-1)  # the prefix's part of each row's softmax mass
    out = torch.lerp(o_new.float(), o_prefix.float(), share)
    return out[0].transpose(0, 1).to(q.dtype)


class TritonAttention:
    SPLIT_MIN_TOKENS = 256  # shorter chunks: the paged kernel (two launches, a gather and a merge cost more)

    def __init__(self, cache: KVCache, scale: float, sdpa_for_fresh_chunks: bool = True,
                 prefix_chunks: str = "split"):
        self.cache = cache
        self.scale = scale
        self.sdpa_for_fresh_chunks = sdpa_for_fresh_chunks  # False: the paged kernel does every chunk
        self.prefix_chunks = prefix_chunks  # "split" | "paged" (module docstring)
        self.split_min_tokens = self.SPLIT_MIN_TOKENS
        self._lse: LseKernel | None | bool = False  # found on first use (the pool's device and dtype)

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
        rows, cu = batch.num_decode, batch.cu_seqlens
        if rows:
            paged.paged_decode_attention(q[:rows], k_blocks, v_blocks, batch.block_tables[:rows],
                                         batch.context_lens[:rows], self.scale, batch.num_splits, out=out[:rows])
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
                out[s] = split_chunk_attention(q[s], k_pool[slots], v_pool[slots], k[s], v[s], self._lse)
            elif batch.prefix_lens[i] == 0 and self.sdpa_for_fresh_chunks:
                out[s] = causal_attention(q[s], k[s], v[s])
        return out

    def _splits(self, longest: int, q: torch.Tensor) -> bool:
        """Whether this step's chunks after a prefix go the split way (all of them: the paged kernel's
        launch covers every chunk, so the two ways do not mix in one step)."""
        if self.prefix_chunks != "split" or not self.sdpa_for_fresh_chunks or longest < self.split_min_tokens:
            return False
        if self._lse is False:
            self._lse = LseKernel.find(q.device, q.dtype, q.shape[1], self.cache.data.shape[-2], q.shape[2])
        return self._lse is not None

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
