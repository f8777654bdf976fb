"""How long an engine step takes, from what it computes: a linear model the engine measures on its own
device at start and corrects after every step it can time — what the scheduler sizes a step by when
sequences are decoding (``Scheduler``: a step that carries decode rows delays each of their next tokens
by its whole length, so it is given a time, not a token count).

The model: t = θ · x over a step's features (``StepShape.features``), each a cost the step pays:
- 1: launching the step and reading the weights once (a step of a few tokens is bound by the weights);
- tokens, prompt tokens and decode rows alike: the matmuls of every row (a decode row riding along is
  one more row of the same matmuls);
- prompt attention pairs: a chunk of n tokens after p computed ones attends over n·p + n(n+1)/2 query-key
  pairs (quadratic: a long chunk costs more per token);
- decode context: the tokens the decode rows attend over (their KV read from the pool).
Features are scaled to O(1) on an H200 step so the fit stays well conditioned; times are in ms inside.
A cost is never negative: the fit is constrained to θ ≥ 0 (``shared.fit.nonnegative_solve``), which also keeps
every prediction increasing in every feature (the budget's closed form relies on it).

The fit: least squares with forgetting, updated after every step (``shared.fit``): older steps weigh
``FORGETTING`` less per step, so the model follows what a step costs now (another process on the GPU,
a hotter clock) and is right where the load puts the steps.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from shared.fit import FORGETTING, RecursiveFit

if TYPE_CHECKING:
    from shared.engine.scheduler import Plan

SCALES = (1.0, 1e3, 1e6, 1e5)  # features per unit: step, tokens, attention pairs, decode context tokens
NAMES = ("ms_per_step", "ms_per_1k_tokens", "ms_per_1m_attention_pairs", "ms_per_100k_decode_context")


@dataclass(frozen=True)
class StepShape:
    """What a step computes, as its cost model sees it."""

    prompt_tokens: int = 0
    attention_pairs: int = 0  # query-key pairs of the prompt chunks' attention
    decode_rows: int = 0
    decode_context: int = 0  # tokens the decode rows attend over, summed

    @staticmethod
    def of_decode(contexts: list[int]) -> "StepShape":
        return StepShape(decode_rows=len(contexts), decode_context=sum(contexts))

    def with_chunk(self, start: int, tokens: int) -> "StepShape":
        """Plus a prompt chunk of ``tokens`` after ``start`` computed ones."""
        pairs = tokens * start + tokens * (tokens + 1) // 2
        return replace(self, prompt_tokens=self.prompt_tokens + tokens,
                       attention_pairs=self.attention_pairs + pairs)

    def features(self) -> np.ndarray:
        raw = (1, self.prompt_tokens + self.decode_rows, self.attention_pairs, self.decode_context)
        return np.array(raw, dtype=np.float64) / SCALES


class StepTimes:
    """An engine's step-time model, and how far its predictions were from the steps it sized."""

    def __init__(self, forgetting: float = FORGETTING):
        self.fit = RecursiveFit(len(SCALES), forgetting)
        self.calibrated = False
        self.observed = 0
        self.error_total = 0.0  # Σ |predicted − observed| / observed over the steps that carried decode rows
        self.error_count = 0
        self.paced = 0  # steps whose prompt chunks the time budget cut
        self._idle = True  # the device had nothing queued when the last step ended

    def predict(self, shape: StepShape) -> float:
        """Seconds."""
        return self.fit.predict(shape.features()) / 1e3

    def chunk_tokens(self, shape: StepShape, start: int, remaining: int, seconds: float) -> int:
        """The most tokens (≤ ``remaining``) of a chunk after ``start`` computed ones that a step of
        ``shape`` so far may add and still be predicted within ``seconds``."""
        room = seconds * 1e3 - self.fit.predict(shape.features())
        if room <= 0:
            return 0
        theta = self.fit.theta
        # predicted(n) − predicted(0) = a·n² + b·n (ms)
        a = theta[2] / SCALES[2] / 2
        b = theta[1] / SCALES[1] + theta[2] / SCALES[2] * (start + 0.5)
        if a > 0:
            n = (-b + np.sqrt(b * b + 4 * a * room)) / (2 * a)
        else:
            n = room / b if b > 0 else remaining
        return int(min(remaining, max(0.0, np.floor(n))))

    def calibrate(self, samples: list[tuple[StepShape, float]]) -> None:
        """Start from ``samples`` (shape, seconds) alone, weighed alike: the start-up's timed steps."""
        timed = [(shape.features(), seconds * 1e3) for shape, seconds in samples]
        self.fit = RecursiveFit.calibrated(len(SCALES), timed, self.fit.forgetting)
        self.calibrated = bool(samples)

    def step_ended(self, plan: "Plan", seconds: float, sampled: bool) -> None:
        """An engine step took ``seconds`` on the host. That is its time on the device only if the
        device was idle when it began and the step waited for it at its end (it sampled a token: a
        step of prompt chunks that completes none queues its kernels and returns); other steps are not
        learnt from. Decode-only steps (graph replays, no prompt to size) are not either."""
        clean = self._idle and sampled
        self._idle = sampled or plan.kind == "decode"
        self.paced += plan.paced
        if clean and plan.kind == "prefill":
            self.observe(plan.shape, seconds)

    def observe(self, shape: StepShape, seconds: float) -> None:
        """A step timed while serving: its prediction's error is counted (steps with decode rows, the
        ones the budget sizes), then the fit corrected."""
        x = shape.features()
        if shape.decode_rows and seconds > 0:
            self.error_total += abs(self.fit.predict(x) - seconds * 1e3) / (seconds * 1e3)
            self.error_count += 1
        self.fit.update(x, seconds * 1e3)
        self.observed += 1

    def coefficients(self) -> dict[str, float]:
        """θ in readable units, for the log."""
        return {name: round(float(value), 4) for name, value in zip(NAMES, self.fit.theta)}

    def stats(self) -> dict[str, float]:
        return {"step_time_error_total": round(self.error_total, 6), "step_time_error_count": self.error_count,
                "steps_timed": self.observed, "steps_paced": self.paced}
