"""Fixed-size KV blocks: who holds which, whether a request fits before it is admitted, and the prefix
cache (full blocks kept, under their chain hash, after their sequences end).

A block is held by every sequence whose table names it (a reference count). Once a sequence has
computed a full block whose chain hash it knows, the block is *indexed*: a later prompt with the same
hash shares it instead of computing it again. When its last holder lets go, an indexed block is not
freed but parked, least recently released first out: it still serves hits until a request needs room
and evicts it. Free and parked blocks both count as free. A sequence releases its blocks last to first,
so a conversation's tail is evicted before the prefix every turn shares.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from shared.engine.prefix import cacheable_blocks
from shared.engine.sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


SCRATCH_BLOCK = 0  # never handed out: padded rows of a captured decode step write their KV here


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, caching: bool = False):
        if num_blocks <= 1 or block_size <= 0:
            raise ValueError("the KV pool needs at least two blocks of at least one token")
        self.num_blocks = num_blocks - 1  # usable blocks
        self.block_size = block_size
        self.caching = caching
        self._free: deque[int] = deque(range(1, num_blocks))
        self._refs = [0] * num_blocks
        self._parked: OrderedDict[int, None] = OrderedDict()  # indexed blocks nobody holds, oldest first
        self._block_of: dict[str, int] = {}  # chain hash → the block holding that KV
        self._hash_of: dict[int, str] = {}
        self.num_evicted = 0  # cached blocks reused for other KV since start

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._parked)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_parked(self) -> int:
        """Blocks nobody holds that still serve prefix hits (counted as free)."""
        return len(self._parked)

    def can_allocate(self, num_tokens: int) -> bool:
        return blocks_for(num_tokens, self.block_size) <= self.num_free

    # -- prefix cache ----------------------------------------------------------------------------------
    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks holding the longest cached prefix of ``seq``'s prompt. At least one prompt token is
        left out, so the prefill that follows has a last token to compute logits from."""
        hits: list[int] = []
        if self.caching:
            for block_hash in seq.block_hashes[:cacheable_blocks(seq.prompt_len, self.block_size)]:
                block = self._block_of.get(block_hash)
                if block is None:
                    break
                hits.append(block)
        return hits

    def count_cached(self, block_hashes: list[str]) -> int:
        """How many leading ``block_hashes`` the cache holds. Safe from another thread (dictionary reads):
        a worker answers the frontend's lookups without its engine thread. A hint: a prompt relying on it
        is checked again when it is queued."""
        found = 0
        if self.caching:
            for block_hash in block_hashes:
                if block_hash not in self._block_of:
                    break
                found += 1
        return found

    def can_allocate_prompt(self, seq: Sequence, hits: list[int], headroom: int) -> bool:
        """Room for ``seq``'s prompt sharing ``hits``, with ``headroom`` blocks to spare. Parked hits
        count against the room: sharing them takes them out of the free pool."""
        fresh = blocks_for(len(seq), self.block_size) - len(hits)
        parked = sum(1 for block in hits if self._refs[block] == 0)
        return fresh + parked + headroom <= self.num_free

    def index(self, seq: Sequence) -> None:
        """Offer ``seq``'s full, computed blocks to the cache under their hashes. A hash already held by
        another block keeps that block (two prompts computed side by side)."""
        if not self.caching:
            return
        full = min(seq.num_computed // self.block_size, len(seq.block_hashes), len(seq.block_table))
        for i in range(seq.num_indexed, full):
            block, block_hash = seq.block_table[i], seq.block_hashes[i]
            if block_hash not in self._block_of and block not in self._hash_of:
                self._block_of[block_hash] = block
                self._hash_of[block] = block_hash
        seq.num_indexed = max(seq.num_indexed, full)

    # -- holding and releasing -------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_tokens: int, shared: list[int] = ()) -> None:
        """Give ``seq`` blocks for its first ``num_tokens`` tokens: ``shared`` (cached prefix blocks),
        then fresh ones."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.request_id} already holds blocks")
        fresh = blocks_for(num_tokens, self.block_size) - len(shared)
        if fresh + sum(1 for b in shared if self._refs[b] == 0) > self.num_free:
            raise MemoryError(f"KV pool exhausted: {fresh} fresh blocks asked, {self.num_free} free")
        for block in shared:
            self._hold(block)
        seq.block_table = list(shared) + self.take(fresh)
        seq.num_indexed = len(shared)

    def take(self, count: int) -> list[int]:
        """``count`` blocks nobody holds: free ones first, then the longest-parked cached ones."""
        if count > self.num_free:
            raise MemoryError(f"KV pool exhausted: {count} blocks asked, {self.num_free} free")
        taken = []
        for _ in range(count):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._parked.popitem(last=False)
                del self._block_of[self._hash_of.pop(block)]  # evicted: its KV is about to be overwritten
                self.num_evicted += 1
            self._refs[block] = 1
            taken.append(block)
        return taken

    def _hold(self, block: int) -> None:
        if self._refs[block] == 0:
            del self._parked[block]
        self._refs[block] += 1

    def deallocate(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._parked[block] = None
                else:
                    self._free.append(block)
        seq.block_table = []
        seq.num_indexed = 0

    def can_append(self, seq: Sequence) -> bool:
        """Room for the KV of the token ``seq`` computes next."""
        return self._needs_block(seq) <= self.num_free

    def may_append(self, seq: Sequence) -> None:
        if self._needs_block(seq):
            seq.block_table.extend(self.take(1))

    def _needs_block(self, seq: Sequence) -> int:
        return 1 if seq.num_computed + 1 > len(seq.block_table) * self.block_size else 0
