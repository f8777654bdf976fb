"""Continuous batching: which sequences run in the next step, and who waits when blocks run out.

Each step is either a prefill of waiting prompts (up to a token budget) or one decode step for every
running sequence. Waiting prompts start shortest first — a text prompt does not wait behind a prompt of
eight images — except that one passed over for longer than the priority window goes first, oldest
first, so no prompt waits for ever. Sequences join and leave between steps. When the pool cannot hold the next token of
every running sequence, the most recently admitted one is preempted: its KV is parked in host memory
(swapped out) and copied back when blocks free up, so it resumes exactly where it stopped — no
recompute, which matters here because a disaggregated decode worker never holds the image embeddings.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from shared.engine.block_manager import BlockManager
from shared.engine.sequence import Sequence, Status


@dataclass
class Plan:
    kind: str  # "prefill" | "decode" | "idle"
    seqs: list[Sequence]


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_batched_tokens: int, swapper,
                 priority_window: float = 2.0):
        self.blocks = blocks
        self.priority_window = priority_window  # seconds; 0: first come, first served
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
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
        self._swap_in_what_fits()
        prefill = self._take_prefill()
        if prefill:
            return Plan("prefill", prefill)
        if self.running:
            self._make_room_for_decode()
            return Plan("decode", list(self.running))
        return Plan("idle", [])

    def _swap_in_what_fits(self) -> None:
        while self.swapped and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            if not self.blocks.can_allocate(seq.num_computed + 1):
                break
            self.swapped.popleft()
            self.swapper.swap_in(seq)
            self.running.append(seq)

    def _take_prefill(self) -> list[Sequence]:
        if self.swapped:
            return []  # preempted work resumes before new prompts start
        batch, tokens = [], 0
        for seq in self._prefill_order():
            if len(self.running) >= self.max_num_seqs:
                break
            if batch and tokens + len(seq) > self.max_batched_tokens:
                break
            # leave one block per running sequence so admitting a prompt does not force a preemption
            if not self.blocks.can_allocate(len(seq) + (len(self.running) + 1) * self.blocks.block_size):
                break
            self.waiting.remove(seq)
            self.blocks.allocate(seq, len(seq))
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.append(seq)
            tokens += len(seq)
        return batch

    def _prefill_order(self) -> list[Sequence]:
        """Prompts passed over for longer than the window (oldest first), then the rest shortest first."""
        if self.priority_window <= 0 or len(self.waiting) < 2:
            return list(self.waiting)
        now = time.monotonic()
        overdue = [s for s in self.waiting if now - s.arrival > self.priority_window]
        fresh = [s for s in self.waiting if now - s.arrival <= self.priority_window]
        return overdue + sorted(fresh, key=len)  # stable: equal lengths keep their order

    def _make_room_for_decode(self) -> None:
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:
                continue  # preempted while making room for an earlier sequence
            while not self.blocks.can_append(seq):
                victim = self.running[-1]
                self.running.pop()
                self.swapper.swap_out(victim)
                self.swapped.appendleft(victim)
                if victim is seq:
                    break
            else:
                self.blocks.may_append(seq)
