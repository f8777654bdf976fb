"""How a request picks its tokens: the sampling parameters that travel inside prefill and decode jobs
(``shared.engine.sampling`` applies them). Plain structs with their limits: no engine behind them.
"""

from __future__ import annotations

from typing import Literal

import msgspec

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300
MAX_CHOICES = 16


class Constraint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Structured output: what every sampled token must keep valid (``shared.engine.grammar``).
    ``kind``: json (``spec`` a JSON schema, or empty for any JSON object), regex, choice (``spec`` a
    JSON list of strings), lark (a grammar in llguidance's Lark dialect); ``spec`` is the source text."""

    kind: Literal["json", "regex", "choice", "lark"]
    spec: str = ""

    def __post_init__(self) -> None:
        if len(self.spec) > 1 << 20:
            raise ValueError("a structured-output spec may be at most 1 MiB")


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How a request picks its tokens; travels inside prefill and decode jobs as it is. Penalties follow
    OpenAI (presence, frequency: over output tokens) and HF/vLLM (repetition: prompt and output)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    min_p: float = 0.0  # drop tokens below min_p x the most likely one's probability
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: none
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    max_tokens: int = 16
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many more tokens are out (like max_tokens)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None  # None: no logprobs; k: the sampled token's and the k most likely
    n: int = 1  # choices: the prompt is computed once and the sequence forked
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError("temperature must be within [0, 100]")
        if not 0.0 < self.top_p <= 1.0 or not 0.0 <= self.min_p <= 1.0:
            raise ValueError("top_p must be within (0, 1], min_p within [0, 1]")
        if self.top_k < 0 or self.max_tokens < 1 or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError("top_k must be >= 0, max_tokens >= 1, min_tokens within [0, max_tokens]")
        if not (-2.0 <= self.presence_penalty <= 2.0 and -2.0 <= self.frequency_penalty <= 2.0
                and 0.0 < self.repetition_penalty <= 10.0):
            raise ValueError("presence/frequency penalties must be within [-2, 2], repetition within (0, 10]")
        if len(self.stop_token_ids) > 1024 or len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most 1024 stop token ids and {MAX_LOGIT_BIAS} logit biases")
        if any(not -100.0 <= bias <= 100.0 for _, bias in self.logit_bias):
            raise ValueError("logit biases must be within [-100, 100]")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be within [0, {MAX_TOP_LOGPROBS}]")
        if not 1 <= self.n <= MAX_CHOICES:
            raise ValueError(f"n must be within [1, {MAX_CHOICES}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
