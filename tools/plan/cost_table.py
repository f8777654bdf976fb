"""The costs ``epd plan`` and the benchmarks reason with, as data: what ``tools.plan.costs`` measured (no
torch here: the planner, the benchmark scripts and their reports read costs without loading a model).

A decode step is fitted as step_ms = a + b·x(B) + c·B·context over the three measured steps (batch 1 and
B over a short context, B over a long one). x(B) is what the weights a step reads grow with: for a dense
model the batch itself (x = B: per-row work; its weights are read once whatever the batch), for a
mixture of experts the experts B tokens touch in a layer, E·(1 − (1 − k/E)^B) with E experts, k per
token, routed independently (Qwen3-VL-30B-A3B: 8 at B = 1, 51.6 at 8, 111.8 at 32, 128 at most). A MoE
step at these batches is bandwidth-bound: it reads the shared weights (a), the touched experts' weights
(b an expert) and the rows' KV (c a token), which is ``bench/engine/roofline.py``'s bytes floor of a step; a fit
linear in B would draw a straight line under that concave curve between the measured batches.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field

import numpy as np

TEMPLATE_TOKENS = 24  # the chat template around one user turn (system prompt, role markers)
PER_IMAGE_TOKENS = 2  # <|vision_start|> and <|vision_end|> around each image's placeholders


def _width(batch: float, experts: int, top_k: int) -> float:
    if not (experts > 0 and top_k > 0):
        return batch
    if math.isinf(batch):
        return float(experts)
    return experts * (1 - (1 - top_k / experts) ** batch)


@functools.lru_cache(maxsize=64)
def _decode_fit(steps: tuple, experts: int, top_k: int) -> tuple[float, float, float]:
    rows = np.array([[1.0, _width(b, experts, top_k), b * ctx] for b, ctx, _ in steps])
    ms = np.array([m for _, _, m in steps])
    coef, *_ = np.linalg.lstsq(rows, ms, rcond=None)
    return tuple(max(0.0, float(c)) for c in coef)


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
    # mixture of experts: experts in a MoE layer and experts a token runs (0: dense). Cost files written
    # before these were recorded take them from the model preset their ``model`` names (``from_json``).
    moe_experts: int = 0
    moe_top_k: int = 0

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

    @property
    def moe(self) -> bool:
        return self.moe_experts > 0 and self.moe_top_k > 0

    def decode_width(self, batch: float) -> float:
        """x(B) of the module docstring: the batch (dense), or the experts ``batch`` tokens touch in a MoE
        layer, each token's k drawn independently and uniformly (what random routing gives; the floor's
        dummy weights route so)."""
        return _width(batch, self.moe_experts, self.moe_top_k)

    def decode_fit(self) -> tuple[float, float, float]:
        """(a, b, c) of step_ms = a + b·x(batch) + c·batch·context, fitted to the measured steps (once per
        set of steps: the simulation asks for it at every step)."""
        return _decode_fit(tuple(map(tuple, self.decode_ms)), self.moe_experts, self.moe_top_k)

    def decode_step(self, batch: float, context: float) -> float:
        a, b, c = self.decode_fit()
        return a + b * self.decode_width(batch) + c * batch * context

    def decode_per_token(self, batch: float, context: float) -> float:
        """ms a step of ``batch`` rows costs per row (the step shared out; ``batch`` may be inf)."""
        a, b, c = self.decode_fit()
        shared = (a + b * self.decode_width(batch)) / batch if self.moe else a / batch + b
        return shared + c * context

    def decode_rows(self, batch: float, context: float) -> float:
        """ms ``batch`` decode rows add to a step that also computes a prompt chunk (the step's fixed part
        is the chunk's). A MoE chunk of more than a few dozen tokens already touches every expert, so the
        rows add only their KV; a dense model's rows add their per-row work too."""
        _, b, c = self.decode_fit()
        return (0.0 if self.moe else b * batch) + c * batch * context

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
        if "moe_experts" not in data:
            data["moe_experts"], data["moe_top_k"] = preset_moe(data["model"])
        return cls(**data)


def preset_moe(model: str) -> tuple[int, int]:
    """(experts, top k) of the model preset ``model`` names (the checkpoint directory: ``preset-<name>-v3``
    for a materialized preset, or a published checkpoint's name), (0, 0) for a dense model or a name no
    preset matches. The longest matching preset name wins (qwen3-vl-2b is not qwen3-vl-235b-a22b)."""
    from shared.model.presets import PRESETS

    name = model.lower()
    matches = [p for p in PRESETS if p in name]
    if not matches:
        return 0, 0
    text = PRESETS[max(matches, key=len)].get("text_config", {})
    return text.get("num_experts", 0), text.get("num_experts_per_tok", 0)
