"""The engine: scheduler + model runner + KV pool, stepped by one thread.

Roles share the code: ``prefill`` computes prompts and hands each sequence out after its first token
(its KV leaves layer group by layer group through the ``on_layer_done`` hook, chunk by chunk, while the
prompt is still being computed); ``decode`` takes sequences whose KV arrives from elsewhere and
generates; ``both`` does the whole life of a request (the aggregated topology).

Prefix caching (roles prefill and both): each prompt's full blocks get chain hashes
(``shared.engine.prefix``, the function the frontend routes with); a prompt starts after the longest
prefix whose blocks are still in the pool, and every block a sequence computes in full is kept for the
prompts that follow until the pool needs the room. An image may come without embeddings when its KV is
in that prefix: such a prompt starts at once or is refused (``Scheduler.admit_now``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shared.engine import choices
from shared.engine.block_manager import BlockManager, blocks_for
from shared.engine.prefix import block_hashes
from shared.engine.runner import ModelRunner
from shared.engine.sampling import TokenLogprobs
from shared.engine.scheduler import PRIORITY_WINDOW_S, Chunk, Scheduler
from shared.engine.sequence import Sequence, Status
from shared.engine.step_time import StepTimes

ROLES = ("prefill", "decode", "both")


@dataclass
class StepOutput:
    """One new token of one sequence. Read ``index``, not ``seq``'s live state: by the time another
    thread looks, the engine may have stepped again."""

    seq: Sequence
    token: int
    index: int  # position of ``token`` among the sequence's output tokens
    finish_reason: str | None  # None: more tokens follow (or, for role prefill, the sequence is handed off)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (usage.prompt_tokens_details)
    logprobs: TokenLogprobs | None = None  # when the request asked for them

    @property
    def request_id(self) -> str:
        return choices.request_of(self.seq.request_id)


@dataclass
class KVSpan:
    """Prompt tokens ``[start, end)`` of ``seq`` whose KV a layer holds now and no earlier call named:
    what role prefill streams out. A sequence's first span starts at 0, its cached prefix included."""

    seq: Sequence
    start: int
    end: int


LayerHook = Callable[[int, list[KVSpan]], None]  # (layer, spans), in the engine thread, after each layer


class Engine:
    def __init__(self, runner: ModelRunner, eos_token_ids: tuple[int, ...], max_model_len: int, role: str = "both",
                 max_num_seqs: int = 256, max_batched_tokens: int = 8192, priority_window: float = PRIORITY_WINDOW_S,
                 chunked_prefill: bool = True, prefix_caching: bool = True, target_itl_s: float = 0.0):
        if role not in ROLES:
            raise ValueError(f"engine role must be one of {ROLES}")
        cache = runner.cache
        # a decode worker never looks a prompt up: its prompts' KV arrives whole from prefill
        self.blocks = BlockManager(cache.num_blocks, cache.block_size, caching=prefix_caching and role != "decode")
        if blocks_for(max_model_len, cache.block_size) > self.blocks.num_blocks:
            raise MemoryError(f"the KV pool ({self.blocks.num_blocks} blocks of {cache.block_size} tokens) cannot hold "
                              f"one sequence of max_model_len={max_model_len} tokens: raise --gpu-memory-utilization "
                              f"(or --kv-cache-mb), or lower --max-model-len")
        self.runner = runner
        self.role = role
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        # only a joined engine has steps that carry decode rows and prompt chunks together
        self.step_times = StepTimes() if target_itl_s > 0 and role == "both" else None
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max_batched_tokens, self, priority_window,
                                   chunked=chunked_prefill, step_times=self.step_times, target_s=target_itl_s)
        self.reserved: dict[str, Sequence] = {}
        self._by_id: dict[str, Sequence] = {}
        self.prompt_tokens = 0  # prompt tokens admitted, and how many of them the prefix cache served
        self.cached_prompt_tokens = 0
        # where a prompt's time in this engine goes, summed (seconds, prompts; a tuple, replaced whole, so a
        # reader in another thread sees a matching pair): queued → its first chunk's step begins
        # (prompt_wait), that step → its first token (prompt_prefill, every chunk's step included)
        self.prompt_times: dict[str, tuple[float, int]] = {"prompt_wait": (0.0, 0), "prompt_prefill": (0.0, 0)}

    # -- admission -----------------------------------------------------------------------------------
    def add_prompt(self, seq: Sequence) -> None:
        """Queue a prompt for prefill (roles prefill and both)."""
        if len(seq) >= self.max_model_len:
            raise ValueError(f"prompt of {len(seq)} tokens does not fit max_model_len={self.max_model_len}")
        if self.blocks.caching and not seq.block_hashes:  # the aggregated worker hashes a parked prompt first
            seq.block_hashes = block_hashes(seq.token_ids, [i.span for i in seq.images], self.blocks.block_size)
        if any(image.embeds is None for image in seq.images):
            self.scheduler.admit_now(seq)  # or PrefixUnavailable
        else:
            self.scheduler.add_waiting(seq)
        self._by_id[seq.request_id] = seq

    def can_reserve(self, num_tokens: int) -> bool:
        running = len(self.scheduler.running) + len(self.reserved)
        return (running < self.scheduler.max_num_seqs and
                self.blocks.can_allocate(num_tokens + (running + 1) * self.blocks.block_size))

    def reserve(self, seq: Sequence) -> None:
        """Hold blocks for a sequence whose KV (``seq.num_computed`` tokens) arrives from elsewhere."""
        self.blocks.allocate(seq, seq.num_computed)
        self.reserved[seq.request_id] = seq
        self._by_id[seq.request_id] = seq

    def write_kv(self, request_id: str, kv: torch.Tensor, layers: slice = slice(None), start: int = 0) -> None:
        """Land transferred KV ``[layers, 2, tokens, kv_heads, head_dim]`` of tokens ``[start, start +
        tokens)`` in a reservation (chunks of a prompt may arrive in any order)."""
        seq = self.reserved[request_id]
        end = start + kv.shape[2]
        if start < 0 or end > seq.num_computed:
            raise ValueError(f"KV of tokens {start}..{end} does not fit a reservation of {seq.num_computed}")
        self.runner.cache.scatter(self._slots(seq, start, end), kv, layers)

    def read_kv(self, seq: Sequence, layers: slice = slice(None), start: int = 0, end: int | None = None) -> torch.Tensor:
        """A copy of the KV of ``seq``'s tokens ``[start, end)`` (default: all computed) for ``layers``.
        In the layer hook, pass the span's bounds: the step's tokens do not count as computed yet."""
        return self.runner.cache.gather(self._slots(seq, start, seq.num_computed if end is None else end), layers)

    def _slots(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        return torch.tensor(self.runner.cache.slots(seq.block_table, start, end), dtype=torch.long)

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
        """The KV pool's figures, as services report them in their NATS stats. Free blocks include the
        cached ones nobody holds (``kv_blocks_cached``): they are evicted when room is needed."""
        return {"kv_blocks_free": self.blocks.num_free, "kv_blocks_used": self.blocks.num_used,
                "kv_blocks_total": self.blocks.num_blocks, "kv_blocks_cached": self.blocks.num_parked,
                "kv_blocks_evicted": self.blocks.num_evicted,
                "prompt_tokens": self.prompt_tokens, "cached_prompt_tokens": self.cached_prompt_tokens}

    def request_ids(self) -> list[str]:
        return list(dict.fromkeys(choices.request_of(seq_id) for seq_id in self._by_id))

    @property
    def num_active(self) -> int:
        return len(self.scheduler) + len(self.reserved)

    def step(self, on_layer_done: LayerHook | None = None, spent_s: float = 0.0) -> list[StepOutput]:
        """One step: prompt chunks (with decode rows riding along) or a decode step of every running
        sequence. During a step with prompt chunks, ``on_layer_done(layer, spans)`` is called after each
        layer's KV is in the cache (role prefill streams the spans out from there). ``spent_s``: seconds
        of other work the engine thread did since the last step (its decode rows waited for it)."""
        plan = self.scheduler.schedule(spent_s)
        if plan.kind == "idle":
            return []
        began = time.monotonic()
        if plan.kind == "decode":
            tokens = self.runner.decode(plan.seqs)
        else:
            for chunk in plan.chunks:
                if not chunk.seq.decoding and not chunk.seq.started:
                    chunk.seq.started = began
                    self._time("prompt_wait", began - chunk.seq.arrival)
            tokens = self.runner.prefill(plan.chunks, self._layer_hook(plan.chunks, on_layer_done))
        if self.step_times is not None:  # a sampled token waited for the device: the step's end is known
            self.step_times.step_ended(plan, time.monotonic() - began, any(t is not None for t in tokens))
        outputs = []
        for chunk, token in zip(plan.chunks, tokens):
            self._computed(chunk)
            if token is not None:
                if chunk.seq.num_output == 0 and chunk.seq.started:  # its prompt's first token
                    self._time("prompt_prefill", time.monotonic() - chunk.seq.started)
                outputs.append(self._advance(chunk.seq, token))
        return outputs

    def _time(self, stage: str, seconds: float) -> None:
        total, count = self.prompt_times[stage]
        self.prompt_times[stage] = (total + seconds, count + 1)

    def timing_stats(self) -> dict[str, float]:
        """``prompt_times`` as services report stages in their NATS stats."""
        out: dict[str, float] = {}
        for stage, (total, count) in list(self.prompt_times.items()):
            out[f"{stage}_seconds_total"], out[f"{stage}_count"] = round(total, 6), count
        return out

    @staticmethod
    def _layer_hook(chunks: list[Chunk], on_layer_done: LayerHook | None) -> Callable[[int], None] | None:
        """``on_layer_done`` bound to the step's prompt spans (decode rows' KV never leaves)."""
        if on_layer_done is None:
            return None
        spans = []
        for chunk in chunks:
            if not chunk.seq.decoding:
                first = chunk.start == chunk.seq.num_cached  # the cached prefix has not been named yet
                spans.append(KVSpan(chunk.seq, 0 if first else chunk.start, chunk.end))
        return lambda layer: on_layer_done(layer, spans)

    def _computed(self, chunk: Chunk) -> None:
        seq = chunk.seq
        if chunk.start == seq.num_cached and not seq.decoding:
            self.prompt_tokens += seq.prompt_len
            self.cached_prompt_tokens += seq.num_cached
        seq.num_computed = chunk.end
        if seq.decoding:
            seq.positions = None  # the prompt's positions are no longer needed
        if self.blocks.caching and chunk.start // self.blocks.block_size < chunk.end // self.blocks.block_size:
            self._extend_hashes(seq)  # only when the step filled a block
            self.blocks.index(seq)

    def _extend_hashes(self, seq: Sequence) -> None:
        """Hashes for blocks filled past the prompt's (generated tokens), so a follow-up turn hits them."""
        full = seq.num_computed // self.blocks.block_size
        if len(seq.block_hashes) < full:
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes += block_hashes(seq.token_ids[:full * self.blocks.block_size],
                                             [i.span for i in seq.images], self.blocks.block_size,
                                             start_block=len(seq.block_hashes), parent=parent)

    def _advance(self, seq: Sequence, token: int) -> StepOutput:
        seq.token_ids.append(token)
        logprobs = self.runner.sampler.take_logprobs(seq)
        if self.role == "both" and choices.should_fork(seq):
            self._add_choices(seq)  # before a finish releases the prompt's blocks
        reason = self._stop_reason(seq, token)
        if reason is not None:
            seq.finish_reason = reason
        if reason is not None or self.role == "prefill":
            self._release(seq)  # finished, or handed off: its KV already left through the layer hook
        return StepOutput(seq, token, seq.output_offset + seq.num_output - 1, reason, seq.num_cached, logprobs)

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
        self.blocks.allocate(seq, len(seq))  # a prompt's every token, or the context and the next token
        self.runner.cache.scatter(self._slots(seq, 0, seq.num_computed), seq.swapped_kv)
        seq.swapped_kv = None
        seq.status = Status.RUNNING
