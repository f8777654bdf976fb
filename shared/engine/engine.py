"""The engine: scheduler + model runner + KV pool, stepped by one thread.

Roles share the code: ``prefill`` computes prompts and hands each sequence out after its first token
(its KV leaves layer group by layer group through the ``on_layer_done`` hook, while the prompt is still
being computed); ``decode`` takes sequences whose KV arrives from elsewhere and generates; ``both`` does
the whole life of a request (the aggregated topology).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.engine import choices
from shared.engine.block_manager import BlockManager, blocks_for
from shared.engine.runner import ModelRunner
from shared.engine.sampling import TokenLogprobs
from shared.engine.scheduler import Scheduler
from shared.engine.sequence import Sequence, Status

ROLES = ("prefill", "decode", "both")


@dataclass
class StepOutput:
    """One new token of one sequence. Read ``index``, not ``seq``'s live state: by the time another
    thread looks, the engine may have stepped again."""

    seq: Sequence
    token: int
    index: int  # position of ``token`` among the sequence's output tokens
    finish_reason: str | None  # None: more tokens follow (or, for role prefill, the sequence is handed off)
    logprobs: TokenLogprobs | None = None  # when the request asked for them

    @property
    def request_id(self) -> str:
        return choices.request_of(self.seq.request_id)


class Engine:
    def __init__(self, runner: ModelRunner, eos_token_ids: tuple[int, ...], max_model_len: int, role: str = "both",
                 max_num_seqs: int = 256, max_batched_tokens: int = 8192, priority_window: float = 2.0):
        if role not in ROLES:
            raise ValueError(f"engine role must be one of {ROLES}")
        cache = runner.cache
        self.blocks = BlockManager(cache.num_blocks, cache.block_size)
        if blocks_for(max_model_len, cache.block_size) > self.blocks.num_blocks:
            raise ValueError(f"the KV pool ({self.blocks.num_blocks} blocks of {cache.block_size}) cannot hold one "
                             f"sequence of max_model_len={max_model_len} tokens; give it more memory")
        self.runner = runner
        self.role = role
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max(max_batched_tokens, max_model_len), self,
                                   priority_window)
        self.reserved: dict[str, Sequence] = {}
        self._by_id: dict[str, Sequence] = {}

    # -- admission -----------------------------------------------------------------------------------
    def add_prompt(self, seq: Sequence) -> None:
        """Queue a prompt for prefill (roles prefill and both)."""
        if len(seq) >= self.max_model_len:
            raise ValueError(f"prompt of {len(seq)} tokens does not fit max_model_len={self.max_model_len}")
        self._by_id[seq.request_id] = seq
        self.scheduler.add_waiting(seq)

    def can_reserve(self, num_tokens: int) -> bool:
        running = len(self.scheduler.running) + len(self.reserved)
        return (running < self.scheduler.max_num_seqs and
                self.blocks.can_allocate(num_tokens + (running + 1) * self.blocks.block_size))

    def reserve(self, seq: Sequence) -> None:
        """Hold blocks for a sequence whose KV (``seq.num_computed`` tokens) arrives from elsewhere."""
        self.blocks.allocate(seq, seq.num_computed)
        self.reserved[seq.request_id] = seq
        self._by_id[seq.request_id] = seq

    def write_kv(self, request_id: str, kv: torch.Tensor, layers: slice = slice(None)) -> None:
        """Land transferred KV (``[layers, 2, num_computed, kv_heads, head_dim]``) in a reservation."""
        seq = self.reserved[request_id]
        self.runner.cache.scatter(self._slots(seq), kv, layers)

    def read_kv(self, seq: Sequence, layers: slice = slice(None)) -> torch.Tensor:
        """A copy of ``seq``'s computed KV for ``layers`` (what prefill streams out)."""
        return self.runner.cache.gather(self._slots(seq), layers)

    def _slots(self, seq: Sequence) -> torch.Tensor:
        return torch.tensor(self.runner.cache.slots(seq.block_table, 0, seq.num_computed or len(seq)))

    def activate(self, request_id: str) -> bool:
        """The reserved sequence's KV is complete: it joins the running batch at the next step, and its
        request's other choices are forked from it. False: its first token already ended it (it only
        seeded the other choices, and is released)."""
        seq = self.reserved.pop(request_id)
        self.scheduler.add_running(seq)
        if not choices.should_fork(seq):
            return True
        self._add_choices(seq)
        if self._stop_reason(seq, seq.last_token) is None:
            return True
        self._release(seq)
        return False

    def _add_choices(self, parent: Sequence) -> None:
        for child in choices.fork(self, parent):
            self._by_id[child.request_id] = child
            if child.status is Status.WAITING:
                self.scheduler.add_waiting(child)
            else:
                self.scheduler.swapped.append(child)

    def abort(self, request_id: str) -> Sequence | None:
        """Drop the request (every choice of it); its first sequence found, or None."""
        found = None
        for seq_id in choices.family(request_id):
            seq = self._by_id.pop(seq_id, None)
            if seq is None:
                continue
            self.reserved.pop(seq_id, None)
            self.scheduler.remove(seq)
            seq.status = Status.FINISHED
            seq.finish_reason = seq.finish_reason or "abort"
            found = found or seq
        return found

    # -- stepping ------------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return len(self.scheduler) > 0

    def block_stats(self) -> dict[str, int]:
        """The KV pool's figures, as services report them in their NATS stats."""
        return {"kv_blocks_free": self.blocks.num_free, "kv_blocks_used": self.blocks.num_used,
                "kv_blocks_total": self.blocks.num_blocks}

    def request_ids(self) -> list[str]:
        return list(dict.fromkeys(choices.request_of(seq_id) for seq_id in self._by_id))

    @property
    def num_active(self) -> int:
        return len(self.scheduler) + len(self.reserved)

    def step(self, on_layer_done=None) -> list[StepOutput]:
        """One prefill or decode step. ``on_layer_done(layer, seqs)`` is called during a prefill after
        each layer's KV is in the cache (role prefill streams it out from there)."""
        plan = self.scheduler.schedule()
        if plan.kind == "idle":
            return []
        if plan.kind == "prefill":
            tokens = self.runner.prefill(plan.seqs, on_layer_done)
        else:
            tokens = self.runner.decode(plan.seqs)
        return [self._advance(seq, token, plan.kind) for seq, token in zip(plan.seqs, tokens)]

    def _advance(self, seq: Sequence, token: int, kind: str) -> StepOutput:
        seq.token_ids.append(token)
        logprobs = self.runner.sampler.take_logprobs(seq)
        if self.role == "both" and choices.should_fork(seq):
            self._add_choices(seq)  # before a finish releases the prompt's blocks
        reason = self._stop_reason(seq, token)
        if reason is not None:
            seq.finish_reason = reason
        if reason is not None or (kind == "prefill" and self.role == "prefill"):
            self._release(seq)  # finished, or handed off: its KV already left through the layer hook
        return StepOutput(seq, token, seq.output_offset + seq.num_output - 1, reason, logprobs)

    def _release(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        self._by_id.pop(seq.request_id, None)
        seq.status = Status.FINISHED

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.sampling
        stoppable = seq.num_output > params.min_tokens  # min_tokens masks these; this holds if all else was masked
        if stoppable and ((token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids):
            return "stop"
        if seq.num_output >= params.max_tokens or len(seq) >= self.max_model_len:
            return "length"
        return None

    # -- preemption (called by the scheduler) --------------------------------------------------------
    def swap_out(self, seq: Sequence) -> None:
        seq.swapped_kv = self.read_kv(seq).to("cpu")
        self.blocks.deallocate(seq)
        seq.status = Status.SWAPPED

    def swap_in(self, seq: Sequence) -> None:
        self.blocks.allocate(seq, seq.num_computed)
        self.runner.cache.scatter(self._slots(seq), seq.swapped_kv)
        seq.swapped_kv = None
        seq.status = Status.RUNNING
