"""The costs ``epd plan`` and the benchmarks reason with, as data: what ``tools.plan.costs`` measured (no
torch here: the planner, the benchmark scripts and their reports read costs without loading a model)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

TEMPLATE_TOKENS = 24  # the chat template around one user turn (system prompt, role markers)
PER_IMAGE_TOKENS = 2  # <|vision_start|> and <|vision_end|> around each image's placeholders


@dataclass
class Costs:
    model: str
    device: str
    dtype: str
    resolution: str
    image_tokens: int  # language-model tokens per image at this resolution
    preprocess_ms: float  # CPU, one image (0 with preprocess "torch": inside vit_ms)
    preprocess_threads: int
    vit_ms: dict[int, float]  # images in one forward → ms for the forward
    prefill_ms: dict[int, float]  # prompt tokens → ms
    decode_ms: list[tuple[int, int, float]]  # (batch, context tokens, ms per step)
    preprocess: str = "pil"  # where the encoders preprocess: pil (CPU threads) or torch (the ViT's device)
    media_ms: float = 0.0  # the frontend decoding one image (plans written before it was measured: 0)
    media_threads: int = 4
    corun: dict[str, float] = field(default_factory=dict)  # "x|y": x's time beside y / alone (vit, prefill, decode)
    media_batch_ms: dict[int, float] = field(default_factory=dict)  # images → ms to decode them all (measured)

    def vit_per_image(self, batch: float) -> float:
        """ms per image when ``batch`` images share a forward (interpolated between measured batches)."""
        sizes = sorted(self.vit_ms)
        return float(np.interp(batch, sizes, [self.vit_ms[b] / b for b in sizes]))

    def prefill(self, tokens: float) -> float:
        """ms for a prompt of ``tokens`` (linear between measured lengths, extended by the last slope)."""
        sizes = sorted(self.prefill_ms)
        times = [self.prefill_ms[t] for t in sizes]
        if len(sizes) > 1 and tokens > sizes[-1]:
            slope = (times[-1] - times[-2]) / (sizes[-1] - sizes[-2])
            return times[-1] + slope * (tokens - sizes[-1])
        return float(np.interp(tokens, sizes, times))

    def decode_fit(self) -> tuple[float, float, float]:
        """(a, b, c) of step_ms = a + b·batch + c·batch·context, fitted to the measured steps."""
        rows = np.array([[1.0, b, b * ctx] for b, ctx, _ in self.decode_ms])
        ms = np.array([m for _, _, m in self.decode_ms])
        coef, *_ = np.linalg.lstsq(rows, ms, rcond=None)
        return tuple(max(0.0, float(c)) for c in coef)

    def decode_step(self, batch: float, context: float) -> float:
        a, b, c = self.decode_fit()
        return a + b * batch + c * batch * context

    def prompt_tokens(self, input_len: int, images: int) -> int:
        return input_len + TEMPLATE_TOKENS + images * (self.image_tokens + PER_IMAGE_TOKENS)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Costs":
        data = dict(data)
        data["vit_ms"] = {int(k): v for k, v in data["vit_ms"].items()}
        data["prefill_ms"] = {int(k): v for k, v in data["prefill_ms"].items()}
        data["decode_ms"] = [tuple(row) for row in data["decode_ms"]]
        data["media_batch_ms"] = {int(k): v for k, v in data.get("media_batch_ms", {}).items()}
        return cls(**data)
