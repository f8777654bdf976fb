"""Per-request sampling: greedy, temperature, top-k, top-p, seeded.

A seeded request draws the noise for its ``i``-th output token from a generator seeded with
``(seed, i)``, so its output does not depend on which worker samples which token, nor on what else is in
the batch: prefill samples token 0, decode the rest, and a request resumed elsewhere continues the same.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import msgspec
import torch

_MIX = 0x9E3779B97F4A7C15  # splitmix64 constant: spreads (seed, index) over the generator's seed space


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How a request picks its tokens; travels inside prefill and decode jobs as it is."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError("temperature must be within [0, 100]")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be within (0, 1]")
        if self.top_k < 0 or self.max_tokens < 1 or len(self.stop_token_ids) > 1024:
            raise ValueError("top_k must be >= 0, max_tokens >= 1, at most 1024 stop token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def _noise_seed(seed: int, index: int) -> int:
    return ((seed * _MIX) ^ (index + 1) * 0xBF58476D1CE4E5B9) & 0x7FFF_FFFF_FFFF_FFFF


class Sampler:
    def __init__(self, device: torch.device | str = "cpu", seed: int | None = None):
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def sample(self, logits: torch.Tensor, params: Seq[SamplingParams], output_index: Seq[int]) -> list[int]:
        """``logits`` ``[B, vocab]`` float32 → one token per row. ``output_index[i]``: which output token row i is."""
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            probs = self._probabilities(logits[rows], [params[i] for i in random_rows])
            noise = torch.stack([self._noise(probs.shape[1], params[i], output_index[i]) for i in random_rows])
            # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, in one vectorized pass.
            tokens[rows] = (probs / noise).argmax(dim=-1)
        return tokens.tolist()

    def _noise(self, vocab: int, params: SamplingParams, index: int) -> torch.Tensor:
        gen = self.generator
        if params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(_noise_seed(params.seed, index))
        return torch.empty(vocab, device=self.device).exponential_(generator=gen).clamp_min_(1e-10)

    @staticmethod
    def _probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        temps = torch.tensor([p.temperature for p in params], device=logits.device).unsqueeze(1)
        logits = logits / temps
        for i, p in enumerate(params):
            if 0 < p.top_k < logits.shape[1]:
                kth = logits[i].topk(p.top_k).values[-1]
                logits[i] = logits[i].masked_fill(logits[i] < kth, float("-inf"))
        probs = logits.softmax(dim=-1)
        for i, p in enumerate(params):
            if p.top_p < 1.0:
                sorted_p, order = probs[i].sort(descending=True)
                # keep the smallest prefix whose mass reaches top_p (the first token always stays)
                drop = sorted_p.cumsum(0) - sorted_p >= p.top_p
                probs[i, order[drop]] = 0.0
        return probs
