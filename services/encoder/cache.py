"""This encoder's embedding cache: least recently used first out, bounded in bytes.

Keys come from ``shared.embedding_index.embedding_key`` (the image's content hash and this encoder's
fingerprint), so the same key means the same embeddings on every encoder of a stack.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from shared.model.geometry import Grid


@dataclass
class Embedding:
    """One image's ViT output and the patch grid prefill needs with it."""

    tensor: torch.Tensor  # [tokens, hidden], on the device that produced it
    grid: Grid
    owned: bool = True  # encoded here, so the index may name this encoder; False: borrowed from a peer
    announced_at: float = 0.0  # when the index last named this encoder for it (monotonic seconds)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


class EmbeddingCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, Embedding] = OrderedDict()
        self.bytes_held = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> Embedding | None:
        """A job's lookup: counted as a hit or a miss, and a hit becomes the most recently used."""
        found = self.peek(key)
        if found is None:
            self.misses += 1
        else:
            self.hits += 1
        return found

    def peek(self, key: str) -> Embedding | None:
        """A lookup on a peer's behalf: refreshes recency, counts neither hit nor miss."""
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
        return found

    def put(self, key: str, embedding: Embedding) -> list[tuple[str, Embedding]]:
        """Keep ``embedding``; returns the entries evicted to make room (oldest first)."""
        if embedding.nbytes > self.max_bytes:
            return []
        # The ViT returns views into one batch tensor: a cached view would keep the whole batch alive
        # while being counted as its own size. Own storage keeps the byte bound honest.
        if embedding.tensor.untyped_storage().nbytes() != embedding.nbytes:
            embedding.tensor = embedding.tensor.clone()
        self._drop(key)
        evicted = []
        while self.bytes_held + embedding.nbytes > self.max_bytes:
            old_key, old = self._entries.popitem(last=False)
            self.bytes_held -= old.nbytes
            self.evictions += 1
            evicted.append((old_key, old))
        self._entries[key] = embedding
        self.bytes_held += embedding.nbytes
        return evicted

    def _drop(self, key: str) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes_held -= old.nbytes
