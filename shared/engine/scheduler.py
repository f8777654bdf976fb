"""Continuous batching: which tokens of which sequences the next step computes, and who waits when
blocks run out.

A step computes at most ``max_batched_tokens`` tokens. With chunked prefill (the default) every
running sequence past its prompt gets its one decode token first — generation never stalls behind a
long prompt — and the rest of the budget goes to prompt chunks: a prompt longer than what is left is
split, and continues in the next steps. While sequences decode, a step's budget is
``decode_step_tokens`` where set (smaller): their next token waits for one step, and a step's time
grows with its tokens. Without it, prompts are prefilled whole in steps of their own
(prefill before decode; the first prompt of a step may exceed the budget).

Prompts are served shortest remaining first — a text prompt does not wait behind a prompt of eight
images — except that one waiting longer than the priority window goes first, oldest first, so no prompt
waits for ever. A prompt gets blocks for all its tokens when admitted, sharing the blocks of its longest
cached prefix (those tokens are never computed), and only if a block per running sequence remains, so
admitting it never forces a preemption. When the pool cannot hold the next token of every decoding
sequence, the most recently admitted sequence is preempted: its KV is parked in host memory (swapped
out) and copied back when blocks free up, so it resumes exactly where it stopped — no recompute, which
matters here because a disaggregated decode worker never holds the image embeddings.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from shared.engine.block_manager import BlockManager
from shared.engine.sequence import Sequence, Status

PRIORITY_WINDOW_S = 2.0  # a prompt passed over this long goes first (the priority window)


@dataclass
class Chunk:
    """Tokens ``[start, end)`` of ``seq`` computed in one step (a decode row is one token)."""

    seq: Sequence
    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass
class Plan:
    kind: str  # "prefill": prompt chunks, decode rows first | "decode": decode rows only | "idle"
    chunks: list[Chunk]

    @property
    def seqs(self) -> list[Sequence]:
        return [chunk.seq for chunk in self.chunks]


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_batched_tokens: int, swapper,
                 priority_window: float = PRIORITY_WINDOW_S, chunked: bool = True, decode_step_tokens: int = 0):
        self.blocks = blocks
        self.priority_window = priority_window  # seconds; 0: first come, first served
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        # the budget of a step that carries decode rows
        self.decode_step_tokens = min(decode_step_tokens or max_batched_tokens, max_batched_tokens)
        self.chunked = chunked
        self.swapper = swapper  # has swap_out(seq) and swap_in(seq)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.swapped: deque[Sequence] = deque()

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def add_waiting(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        seq.arrival = time.monotonic()
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        seq.status = Status.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        for queue in (self.waiting, self.running, self.swapped):
            if seq in queue:
                queue.remove(seq)
        if seq.block_table:
            self.blocks.deallocate(seq)
        seq.swapped_kv = None

    def schedule(self) -> Plan:
        """The next step."""
        self._swap_in_what_fits()
        if not self.chunked:
            prompts = self._prompt_chunks(self.max_batched_tokens)
            if prompts:
                return Plan("prefill", prompts)
        decode = [Chunk(seq, len(seq) - 1, len(seq)) for seq in self._decode_rows()]
        prompts = self._prompt_chunks(self._prompt_budget(len(decode))) if self.chunked else []
        if prompts:
            return Plan("prefill", decode + prompts)
        return Plan("decode", decode) if decode else Plan("idle", [])

    def _prompt_budget(self, decode_rows: int) -> int:
        # a block's worth at least, so prompts advance even when decode rows fill the budget
        budget = self.decode_step_tokens if decode_rows else self.max_batched_tokens
        return max(budget - decode_rows, self.blocks.block_size)

    def _swap_in_what_fits(self) -> None:
        while self.swapped and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            if not self.blocks.can_allocate(len(seq)):  # its prompt, or its context and next token
                break
            self.swapped.popleft()
            self.swapper.swap_in(seq)
            self.running.append(seq)

    def _prompt_chunks(self, budget: int) -> list[Chunk]:
        """Chunks of prompts, in prefill order, within ``budget`` tokens; admits waiting prompts."""
        chunks: list[Chunk] = []
        admitting = not self.swapped  # preempted work resumes before new prompts start
        for seq in self._prefill_order():
            if budget <= 0:
                break
            hits: list[int] = []
            if seq.status is Status.WAITING:
                if not admitting:
                    continue
                hits = self.blocks.cached_prefix(seq)
            remaining = len(seq) - max(seq.num_computed, len(hits) * self.blocks.block_size)
            if not self.chunked and chunks and remaining > budget:
                break  # whole prompts only: this one waits for a step of its own
            if seq.status is Status.WAITING and not self._admit(seq, hits):
                admitting = False  # later prompts would jump the queue for blocks this one waits for
                continue
            take = min(remaining, budget) if self.chunked else remaining
            chunks.append(Chunk(seq, seq.num_computed, seq.num_computed + take))
            budget -= take
        return chunks

    def _admit(self, seq: Sequence, hits: list[int]) -> bool:
        """A seat and blocks for a waiting prompt, sharing the blocks of its cached prefix ``hits``."""
        if len(self.running) >= self.max_num_seqs:
            return False
        # leave one block per running sequence so admitting a prompt does not force a preemption
        if not self.blocks.can_allocate_prompt(seq, hits, len(self.running) + 1):
            return False
        self.waiting.remove(seq)
        self.blocks.allocate(seq, len(seq), hits)
        seq.num_computed = seq.num_cached = len(hits) * self.blocks.block_size
        seq.status = Status.RUNNING
        self.running.append(seq)
        return True

    def _prefill_order(self) -> list[Sequence]:
        """Prompts (partly prefilled, then waiting) waiting longer than the window, oldest first, then
        the rest by tokens left to compute, fewest first."""
        prompts = [s for s in self.running if not s.decoding] + list(self.waiting)
        if self.priority_window <= 0 or len(prompts) < 2:
            return prompts
        now = time.monotonic()
        overdue = sorted((s for s in prompts if now - s.arrival > self.priority_window), key=lambda s: s.arrival)
        fresh = [s for s in prompts if now - s.arrival <= self.priority_window]
        return overdue + sorted(fresh, key=lambda s: s.num_uncomputed)  # stable: ties keep their order

    def _decode_rows(self) -> list[Sequence]:
        """Running sequences past their prompt, each given a block for its next token; preempts the most
        recently admitted sequences while the pool cannot."""
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or not seq.decoding:
                continue  # preempted while making room for an earlier sequence, or still prefilling
            while not self.blocks.can_append(seq):
                victim = self.running.pop()
                self.swapper.swap_out(victim)
                self.swapped.appendleft(victim)
                if victim is seq:
                    break
            else:
                self.blocks.may_append(seq)
        return [seq for seq in self.running if seq.decoding]
