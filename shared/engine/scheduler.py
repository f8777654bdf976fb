"""Continuous batching: which tokens of which sequences the next step computes, and who waits when
blocks run out.

A step computes at most ``max_batched_tokens`` tokens. With chunked prefill (the default) every
running sequence past its prompt gets its one decode token first — generation never stalls behind a
long prompt — and the rest of the budget goes to prompt chunks: a prompt longer than what is left is
split, and continues in the next steps. While sequences decode, a step is also given a time,
``target_s`` (less what other work of the engine thread took since the last step: the aggregated
worker's ViT): their next token waits for the whole step, so its prompt chunks are cut to what the
step-time model (``shared.engine.step_time``) predicts fits — a token count would bound a step's
time only for one mix of chunks, prefixes and decode rows. A step still takes a block's worth of prompt
tokens, so prompts always advance; a step without decode rows uses the whole token budget. The budget
costs prompt throughput — every step pays its decode rows and its own launch, and a budgeted step takes
fewer prompt tokens — so it yields to the queue: steps are sized by tokens again while holding it would
give the last prompt this worker holds its first token more than one target step later, or while a prompt
has waited longer than ``BACKLOG_S`` (``Scheduler.yields``). On one H100 at ~90 % of the 7B's saturation
(image-heavy, mixed) that keeps mean TTFT at 0.96–1.08× the budget-off stack's, where the 2 s bound alone
cost 1.56–1.67×; a chat app's short prompts at 12 req/s keep the budget, ITL p99 54–59 against 80–102 ms
(``docs/benchmarks.md``). Without chunking, prompts are prefilled whole in steps of their own
(prefill before decode; the first prompt of a step may exceed the budget).

Prompts are served shortest remaining first — a text prompt does not wait behind a prompt of eight
images — except that one waiting longer than the priority window goes first, oldest first, so no prompt
waits for ever. A prompt gets blocks for all its tokens when admitted, sharing the blocks of its longest
cached prefix (those tokens are never computed), and only if a block per running sequence remains, so
admitting it never forces a preemption. When the pool cannot hold the next token of every decoding
sequence, the most recently admitted sequence is preempted: its KV is parked in host memory (swapped
out) and copied back when blocks free up, so it resumes exactly where it stopped — no recompute, which
matters here because a disaggregated decode worker never holds the image embeddings.

A prompt whose images came without embeddings (the frontend was told their KV is in this worker's
prefix cache) cannot wait in the queue: nothing would keep that prefix from eviction meanwhile, and
its images' tokens could not be computed. It is admitted when it comes — if the prefix still covers
those images and it has a seat and room beyond what every queued prompt needs (so it takes nothing
they wait for) — or refused at once (``PrefixUnavailable``), and its sender sends the embeddings.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from shared.engine.block_manager import BlockManager, blocks_for
from shared.engine.sequence import Sequence, Status
from shared.engine.step_time import StepShape, StepTimes

PRIORITY_WINDOW_S = 2.0  # a prompt passed over this long goes first (the priority window)
BACKLOG_S = PRIORITY_WINDOW_S  # a prompt waiting this long: steps are sized by tokens, not time, until none is


class PrefixUnavailable(Exception):
    """A prompt's images came without embeddings and it cannot start now: their KV is not cached here
    (evicted since the frontend looked, or never), or there is no seat or room for it at once."""


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
    shape: StepShape = StepShape()  # what the step computes, as the step-time model sees it
    paced: bool = False  # the time budget cut its prompt chunks

    @property
    def seqs(self) -> list[Sequence]:
        return [chunk.seq for chunk in self.chunks]


class _Budget:
    """What a step's prompt chunks may still take: tokens, and while sequences decode, ``seconds`` by the
    step-time model; a block's worth of tokens (``floor``) whatever the model says."""

    def __init__(self, tokens: int, shape: StepShape, times: StepTimes | None = None, seconds: float = 0.0,
                 floor: int = 0):
        self.tokens, self.shape, self.times, self.seconds, self.floor = tokens, shape, times, seconds, floor
        self.paced = False  # the time cut a chunk

    def fit(self, start: int, remaining: int) -> int:
        """Tokens of a chunk after ``start`` computed ones, ``remaining`` left in its prompt."""
        take = min(remaining, self.tokens)
        if self.times is not None:
            fits = self.times.chunk_tokens(self.shape, start, take, self.seconds)
            self.paced = self.paced or fits < take
            take = max(fits, min(take, self.floor))
        return take

    def spend(self, start: int, tokens: int) -> None:
        self.tokens -= tokens
        self.floor -= tokens
        self.shape = self.shape.with_chunk(start, tokens)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_batched_tokens: int, swapper,
                 priority_window: float = PRIORITY_WINDOW_S, chunked: bool = True,
                 step_times: StepTimes | None = None, target_s: float = 0.0):
        self.blocks = blocks
        self.priority_window = priority_window  # seconds; 0: first come, first served
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.step_times = step_times
        self.target_s = target_s  # a step that carries decode rows: seconds; 0: tokens only
        self.chunked = chunked
        self.swapper = swapper  # has swap_out(seq) and swap_in(seq)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.swapped: deque[Sequence] = deque()
        # prompt tokens this worker holds that are not queued here yet: the aggregated worker's images
        # waiting for its ViT (``EngineLoop.attach``); the budget yields to them too
        self.upstream: Callable[[], int] = lambda: 0

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def add_waiting(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        seq.arrival = time.monotonic()
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        seq.status = Status.RUNNING
        self.running.append(seq)

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached prefix ``seq`` starts from, which must cover every image of it without embeddings."""
        hits = self.blocks.cached_prefix(seq)
        end = max((image.offset + image.num_tokens for image in seq.images if image.embeds is None), default=0)
        if len(hits) * self.blocks.block_size < end:
            raise PrefixUnavailable(f"the KV of an image of {seq.request_id} that came without embeddings is "
                                    "not cached here")
        return hits

    def admit_now(self, seq: Sequence) -> None:
        """Admit a prompt whose images came without embeddings as it comes, or refuse it."""
        hits = self.cached_prefix(seq)
        queued = sum(blocks_for(len(s), self.blocks.block_size) for s in self.waiting)  # theirs to wait for
        if (self.swapped or len(self.running) + len(self.waiting) >= self.max_num_seqs
                or not self.blocks.can_allocate_prompt(seq, hits, len(self.running) + 1 + queued)):
            raise PrefixUnavailable(f"no seat or room to start {seq.request_id} at once")
        self.add_waiting(seq)
        self._admit(seq, hits)

    def remove(self, seq: Sequence) -> None:
        for queue in (self.waiting, self.running, self.swapped):
            if seq in queue:
                queue.remove(seq)
        if seq.block_table:
            self.blocks.deallocate(seq)
        seq.swapped_kv = None

    @property
    def pacing(self) -> bool:
        return self.target_s > 0 and self.step_times is not None

    def schedule(self, spent_s: float = 0.0) -> Plan:
        """The next step; ``spent_s``: seconds the engine thread spent on other work since the last step
        (the decode rows' next token has waited that long already)."""
        self._swap_in_what_fits()
        if not self.chunked:
            budget = _Budget(self.max_batched_tokens, StepShape())
            prompts = self._prompt_chunks(budget)
            if prompts:
                return Plan("prefill", prompts, budget.shape)
        rows = self._decode_rows()
        decode = [Chunk(seq, len(seq) - 1, len(seq)) for seq in rows]
        shape = StepShape.of_decode([len(seq) for seq in rows])
        if not self.chunked:
            return Plan("decode", decode, shape) if decode else Plan("idle", [])
        budget = self._prompt_budget(shape, spent_s)
        prompts = self._prompt_chunks(budget)
        if prompts:
            return Plan("prefill", decode + prompts, budget.shape, budget.paced)
        return Plan("decode", decode, shape) if decode else Plan("idle", [])

    def gap_budget_s(self) -> float | None:
        """Seconds other work of the engine thread (the aggregated worker's ViT) may take before the next
        step and the decoding sequences' next token still come within the target: the target less the
        predicted step of their rows alone. None: no sequence is decoding, or no time budget, or it yields."""
        contexts = [len(seq) for seq in self.running if seq.decoding]
        if not contexts or not self.pacing or self.yields():
            return None
        return max(0.0, self.target_s - self.step_times.predict(StepShape.of_decode(contexts)))

    def yields(self) -> bool:
        """The time budget gives way to the prompts this worker holds (partly prefilled, waiting, and the
        aggregated worker's images still in its ViT queue, ``upstream``): budgeted steps would give the last
        of them its first token later than steps sized by tokens, by more than one target step, or one has
        waited longer than ``BACKLOG_S`` already (``waiting`` is in arrival order: its first is the
        oldest). Every step pays the decode rows' part (their rows, the step's launch and weight reads),
        and a budgeted step takes fewer prompt tokens, so draining ``Q`` tokens pays that part
        ``Q/budgeted − Q/full`` times more."""
        prompts = [s for s in self.running if not s.decoding]
        late = time.monotonic() - BACKLOG_S
        if self.waiting and self.waiting[0].arrival < late or any(s.arrival < late for s in prompts):
            return True
        prompts += self.waiting
        queued = sum(s.num_uncomputed for s in prompts) + self.upstream()
        if not queued:
            return False
        rows = StepShape.of_decode([len(seq) for seq in self.running if seq.decoding])
        floor = self.blocks.block_size
        full = max(self.max_batched_tokens - rows.decode_rows, floor)
        start = prompts[0].num_computed if prompts else 0
        budgeted = max(self.step_times.chunk_tokens(rows, start, full, self.target_s), floor)
        return self.step_times.predict(rows) * queued * (1 / budgeted - 1 / full) > self.target_s

    def _prompt_budget(self, decode: StepShape, spent_s: float) -> _Budget:
        # a block's worth at least, so prompts advance even when decode rows fill the budget
        floor = self.blocks.block_size
        tokens = max(self.max_batched_tokens - decode.decode_rows, floor)
        if not decode.decode_rows or not self.pacing or self.yields():
            return _Budget(tokens, decode)
        return _Budget(tokens, decode, self.step_times, self.target_s - spent_s, floor)

    def _swap_in_what_fits(self) -> None:
        while self.swapped and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            if not self.blocks.can_allocate(len(seq)):  # its prompt, or its context and next token
                break
            self.swapped.popleft()
            self.swapper.swap_in(seq)
            self.running.append(seq)

    def _prompt_chunks(self, budget: _Budget) -> list[Chunk]:
        """Chunks of prompts, in prefill order, within ``budget``; admits waiting prompts."""
        chunks: list[Chunk] = []
        admitting = not self.swapped  # preempted work resumes before new prompts start
        for seq in self._prefill_order():
            if budget.tokens <= 0:
                break
            hits: list[int] = []
            if seq.status is Status.WAITING:
                if not admitting:
                    continue
                hits = self.blocks.cached_prefix(seq)
            start = max(seq.num_computed, len(hits) * self.blocks.block_size)
            remaining = len(seq) - start
            if not self.chunked and chunks and remaining > budget.tokens:
                break  # whole prompts only: this one waits for a step of its own
            take = budget.fit(start, remaining) if self.chunked else remaining
            if take <= 0:
                break  # the step's time is spent
            if seq.status is Status.WAITING and not self._admit(seq, hits):
                admitting = False  # later prompts would jump the queue for blocks this one waits for
                continue
            chunks.append(Chunk(seq, start, start + take))
            budget.spend(start, take)
            if take < remaining:
                break  # the budget ran out within this prompt
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
