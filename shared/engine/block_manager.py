"""Fixed-size KV blocks: who holds which, and whether a request fits before it is admitted."""

from __future__ import annotations

from collections import deque

from shared.engine.sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


SCRATCH_BLOCK = 0  # never handed out: padded rows of a captured decode step write their KV here


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 1 or block_size <= 0:
            raise ValueError("the KV pool needs at least two blocks of at least one token")
        self.num_blocks = num_blocks - 1  # usable blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, num_tokens: int) -> bool:
        return blocks_for(num_tokens, self.block_size) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Give ``seq`` blocks for its first ``num_tokens`` tokens."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.request_id} already holds blocks")
        seq.block_table = self.take(blocks_for(num_tokens, self.block_size))

    def take(self, count: int) -> list[int]:
        if count > len(self._free):
            raise MemoryError(f"KV pool exhausted: {count} blocks asked, {len(self._free)} free")
        return [self._free.popleft() for _ in range(count)]

    def release(self, blocks: list[int]) -> None:
        self._free.extend(blocks)

    def deallocate(self, seq: Sequence) -> None:
        self.release(seq.block_table)
        seq.block_table = []

    def can_append(self, seq: Sequence) -> bool:
        """Room for the KV of the token ``seq`` computes next."""
        return self._needs_block(seq) <= len(self._free)

    def may_append(self, seq: Sequence) -> None:
        if self._needs_block(seq):
            seq.block_table.extend(self.take(1))

    def _needs_block(self, seq: Sequence) -> int:
        return 1 if seq.num_computed + 1 > len(seq.block_table) * self.block_size else 0
