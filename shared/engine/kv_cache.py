"""The paged KV pool: one tensor ``[layers, 2 (k|v), blocks, block_size, kv_heads, head_dim]``.

A token's KV lives at a *slot*: ``block * block_size + offset``. Moving a request's KV between workers
is a gather of its slots into a contiguous ``[layers, 2, tokens, kv_heads, head_dim]`` tensor on one
side and a scatter into freshly reserved slots on the other.
"""

from __future__ import annotations

import torch

from shared.model.config import TextConfig


class KVCache:
    def __init__(self, config: TextConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.data = torch.zeros(config.num_layers, 2, num_blocks, block_size, config.num_kv_heads,
                                config.head_dim, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_block(config: TextConfig, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim * itemsize

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K and V as ``[blocks * block_size, kv_heads, head_dim]`` views."""
        k, v = self.data[layer]
        return k.flatten(0, 1), v.flatten(0, 1)

    def slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[i // bs] * bs + i % bs for i in range(start, end)]

    def gather(self, slots: torch.Tensor, layers: slice = slice(None)) -> torch.Tensor:
        """KV of ``slots`` as ``[layers, 2, len(slots), kv_heads, head_dim]`` (a copy)."""
        flat = self.data[layers].flatten(2, 3)
        return flat.index_select(2, slots.to(self.data.device))

    def scatter(self, slots: torch.Tensor, kv: torch.Tensor, layers: slice = slice(None)) -> None:
        flat = self.data[layers].flatten(2, 3)
        flat.index_copy_(2, slots.to(self.data.device), kv.to(self.data.device, self.data.dtype))
