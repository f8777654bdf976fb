"""Per-request sampling, batched: greedy, temperature, top-k, top-p, min-p, seeded; logprobs.

A seeded request draws the noise for its ``i``-th output token from a generator seeded with
``(seed, i)``, so its output does not depend on which worker samples which token, nor on what else is in
the batch: prefill samples token 0, decode the rest, and a request resumed elsewhere continues the same.

A step samples every row at once: the requests' logits adjustments (``shared.engine.logits``) touch only
the rows that ask for them, truncation (top-k, top-p, min-p) sorts only the rows that truncate, and the
draw is one vectorized pass. A row that asks for nothing costs what greedy costs.

Logprobs are the log-softmax of the *processed* logits: after penalties, bias, ``min_tokens`` and the
grammar mask, before temperature and truncation (what HF ``generate`` reports as scores under greedy).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shared.engine.grammar import Grammars
from shared.engine.logits import LogitsProcessors
from shared.messages.sampling import SamplingParams

if TYPE_CHECKING:
    from shared.engine.sequence import Sequence

_MIX = 0x9E3779B97F4A7C15  # splitmix64 constant: spreads (seed, index) over the generator's seed space
MAX_COMPACT_TOP_K = 1024  # a top-k up to this draws among its k candidates (topk, not a sort of the vocabulary)


def choice_seed(seed: int | None, choice: int) -> int | None:
    """The seed of choice ``choice`` of a request seeded with ``seed`` (choice 0 keeps it)."""
    if seed is None or choice == 0:
        return seed
    return _noise_seed(seed, -1 - choice)


def _noise_seed(seed: int, index: int) -> int:
    return ((seed * _MIX) ^ (index + 1) * 0xBF58476D1CE4E5B9) & 0x7FFF_FFFF_FFFF_FFFF


LOWEST_LOGPROB = -9999.0  # what a logprob is reported as at least (vLLM's floor)


@dataclass
class TokenLogprobs:
    """The sampled token's logprob and the ``len(top_ids)`` most likely tokens' (most likely first)."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


class Sampler:
    def __init__(self, device: torch.device | str = "cpu", seed: int | None = None, eos_token_ids: Seq[int] = (),
                 grammars: Callable[[], Grammars] | None = None):
        """``eos_token_ids``: masked while a request is under ``min_tokens``; ``grammars``: builds the
        structured-output compiler on first use (it needs the checkpoint's tokenizer)."""
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        self.processors = LogitsProcessors(self.device, eos_token_ids, grammars)
        self._logprobs: dict[int, TokenLogprobs] = {}  # id(seq) -> the last step's, until taken

    def sample(self, logits: torch.Tensor, seqs: Seq["Sequence"]) -> list[int]:
        """``logits`` ``[B, vocab]`` float32 (adjusted in place) → one token per row of ``seqs``."""
        params = [s.sampling for s in seqs]
        self.processors.apply(logits, seqs)
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        # rows with a small top-k draw among their candidates only (a partial sort, noise for k tokens);
        # the others over the whole vocabulary
        few = [i for i in random_rows if 1 < params[i].top_k <= MAX_COMPACT_TOP_K]
        many = [i for i in random_rows if not 1 < params[i].top_k <= MAX_COMPACT_TOP_K]
        for group, compact in ((few, True), (many, False)):
            if not group:
                continue
            rows = torch.tensor(group, device=logits.device)
            chosen = [params[i] for i in group]
            probs, ids = _candidates(logits[rows], chosen) if compact else (_probabilities(logits[rows], chosen), None)
            noise = self._noise(probs.shape, chosen, [seqs[i].output_offset + seqs[i].num_output for i in group])
            # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, in one vectorized pass.
            picked = (probs / noise).argmax(dim=-1)
            tokens[rows] = picked if ids is None else ids.gather(1, picked.unsqueeze(1)).squeeze(1)
        self._record_logprobs(logits, seqs, params, tokens)
        out = tokens.tolist()
        self.processors.accept(seqs, out)
        return out

    def take_logprobs(self, seq: "Sequence") -> TokenLogprobs | None:
        """The logprobs of ``seq``'s last sampled token, if it asked for them (once)."""
        return self._logprobs.pop(id(seq), None) if self._logprobs else None

    def _record_logprobs(self, logits: torch.Tensor, seqs, params, tokens: torch.Tensor) -> None:
        self._logprobs.clear()
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not wanted:
            return
        rows = torch.tensor(wanted, device=logits.device)
        # as vLLM reports them: at least LOWEST_LOGPROB, never -inf or NaN (JSON has neither; a masked token
        # is -inf, and a repetition penalty near 0 divides a logit into +inf, its row into NaN)
        logprobs = logits[rows].log_softmax(dim=-1).nan_to_num(LOWEST_LOGPROB).clamp_min(LOWEST_LOGPROB)
        chosen = logprobs.gather(1, tokens[rows].unsqueeze(1)).squeeze(1).tolist()
        k = max(params[i].logprobs for i in wanted)
        top = logprobs.topk(k, dim=-1) if k else None
        top_values = top.values.tolist() if top is not None else [[] for _ in wanted]
        top_ids = top.indices.tolist() if top is not None else [[] for _ in wanted]
        for n, i in enumerate(wanted):
            k_i = params[i].logprobs
            self._logprobs[id(seqs[i])] = TokenLogprobs(chosen[n], top_ids[n][:k_i], top_values[n][:k_i])

    def _noise(self, shape, params: list[SamplingParams], indices: list[int]) -> torch.Tensor:
        """Exp(1) noise ``[rows, vocab]``: seeded rows from their own (seed, index) generator, the
        others in one draw from the sampler's."""
        noise = torch.empty(shape, device=self.device)
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), shape[1], device=self.device).exponential_(
                generator=self.generator)
        for i, p in enumerate(params):
            if p.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(_noise_seed(p.seed, indices[i]))
                noise[i] = torch.empty(shape[1], device=self.device).exponential_(generator=gen)
        return noise.clamp_min_(1e-10)


def _scaled(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    return logits / torch.tensor([p.temperature for p in params], device=logits.device).unsqueeze(1)


def _candidates(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with a top-k of at most ``MAX_COMPACT_TOP_K``: (probabilities ``[rows, k]``, their token ids),
    top-p and min-p applied within the k — a partial sort instead of sorting the vocabulary."""
    ordered, ids = _scaled(logits, params).topk(max(p.top_k for p in params), dim=-1)
    return _cut_sorted(ordered, params).softmax(dim=-1), ids


def _probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Over the whole vocabulary: sorted only for the rows with a top-p (or a large top-k)."""
    logits = _scaled(logits, params)
    sorting = [i for i, p in enumerate(params) if p.top_p < 1.0 or p.top_k > 1]
    if sorting:
        rows = torch.tensor(sorting, device=logits.device)
        logits[rows] = _truncate(logits[rows], [params[i] for i in sorting])
    probs = logits.softmax(dim=-1)
    min_p = torch.tensor([p.min_p for p in params], device=logits.device).unsqueeze(1)
    # min-p compares with the most likely token: renormalizing scales both sides alike (so do the others')
    return probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)


def _truncate(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Top-k, then top-p over what is left, then min-p (HF's order), over all rows in one sort."""
    ordered, order = logits.sort(dim=-1, descending=True)
    return torch.empty_like(logits).scatter_(1, order, _cut_sorted(ordered, params))


def _cut_sorted(ordered: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Logits sorted most likely first, with what top-k, top-p and min-p drop set to -inf."""
    width, device = ordered.shape[1], ordered.device
    top_k = torch.tensor([p.top_k if 0 < p.top_k < width else width for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    drop = torch.arange(width, device=device).unsqueeze(0) >= top_k.unsqueeze(1)
    probs = ordered.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # keep the smallest prefix whose mass reaches top_p (the first token always stays)
    drop |= probs.cumsum(dim=-1) - probs >= top_p.unsqueeze(1)
    # min-p compares with the most likely token: renormalizing scales both sides alike
    drop |= probs < (min_p * probs[:, 0]).unsqueeze(1)
    return ordered.masked_fill(drop, float("-inf"))
