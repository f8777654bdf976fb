"""``epd plan``: measure this model's costs here, then predict each layout's latency for a workload.

The costs are measured in-process (``costs.py``), the latency model is ``model.py`` (its docstring has
the formulas), the layouts are ``layouts.py``. The recommendation is the stable layout with the lowest
predicted mean TTFT (near ties, within 5 %, go to the layout with fewer processes).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

from pydantic import Field

from services.encoder.settings import Preprocessing
from tools.plan.cost_table import Costs
from tools.plan.layouts import Layout, layouts
from tools.plan.model import DATA_PLANE_GBS, Planner, Prediction, Traffic, traffic  # noqa: F401 - the planner's public names
from tools.bench.settings import Workload
from shared.engine.settings import EngineSettings


class PlanSettings(Preprocessing, Workload, EngineSettings):
    """Measures the model's ViT, prefill and decode costs (and the frontend's image decoding, and how much
    a ViT forward and the language model slow each other side by side) on this machine, then predicts
    mean TTFT and TPOT of each layout for the workload: ViT v(n) per forward, prefill P by prompt tokens,
    decode step t(B) = a + b·B + c·B·ctx with the batch B = rate·output_len·TPOT (Little); per-request
    queues M/G/1. Aggregated: the ViT, prefill and decode one after another in one engine thread.
    E/PD: an encoder beside a language worker that prefills and decodes; E/P/D: an encoder, a prefill
    and a decode worker. Processes sharing a GPU slow each other by the measured co-run factors under
    MPS, or time-slice it without. Disaggregated: encoders on GPUs of their own. The recommendation is
    the stable layout with the lowest predicted mean TTFT."""

    request_rate: list[float] = Field([1.0], description="request rates (req/s) to predict for, e.g. 1,2,4")
    gpus: int = Field(0, ge=0, description="GPUs to lay the services out on; 0: every visible GPU (1 on CPU)")
    max_num_seqs: int = Field(64, ge=1, description="the measuring engine's batch limit (graph capture is "
                                                    "per batch size: fewer is quicker)")
    corun_seconds: float = Field(1.0, ge=0, description="seconds each co-run measurement (ViT beside decode, "
                                                        "ViT beside prefill) runs; 0: skip, assume a factor")
    out: str = Field("", description="write costs, predictions and the recommendation to this JSON file")


DECODE_BATCH = 16  # the larger batch decode steps are timed at (the smaller: 1)


def recommend(predictions: list[Prediction], layouts_by_name: dict[str, Layout]) -> Prediction | None:
    stable = [p for p in predictions if p.stable]
    if not stable:
        return None
    best = min(p.ttft_ms for p in stable)
    near = [p for p in stable if p.ttft_ms <= best * 1.05]
    return min(near, key=lambda p: (layouts_by_name[p.layout].processes, p.ttft_ms))


def embedding_bytes(settings) -> int:
    from shared.model.config import ModelConfig

    config = ModelConfig.from_checkpoint(settings.model_path())
    return config.embedding_width * settings.torch_dtype().itemsize  # one image token, deepstack included


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def main(settings: PlanSettings) -> int:
    gpus = settings.gpus or visible_gpus()
    from tools.plan.costs import measure_costs  # torch, the model: only to measure

    costs = measure_costs(settings, DECODE_BATCH)
    bandwidth = DATA_PLANE_GBS.get(settings.transport, DATA_PLANE_GBS["zmq"])  # --transport: the stack's
    planner = Planner(costs, bandwidth, embedding_bytes(settings))
    candidates = layouts(gpus)
    by_name = {layout.label(): layout for layout in candidates}
    print(describe_costs(costs))
    results = []
    for rate in settings.request_rate:
        t = traffic(settings, rate)
        predictions = [planner.predict(layout, t) for layout in candidates]
        best = recommend(predictions, by_name)
        print(format_predictions(rate, predictions, best))
        results.append({"rate": rate, "predictions": [asdict(p) for p in predictions],
                        "recommended": asdict(best) if best else None})
    if settings.out:
        Path(settings.out).write_text(json.dumps(
            {"costs": costs.to_json(), "gpus": gpus, "workload": Workload.model_validate(
                settings, from_attributes=True).model_dump(), "data_plane_gbs": bandwidth,
             "embedding_bytes": planner.hidden_bytes, "rates": results}, indent=1, default=json_default))
    return 0


def json_default(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    raise TypeError(type(value).__name__)


def describe_costs(c: Costs) -> str:
    vit = ", ".join(f"{c.vit_ms[b] / b:.1f} ms/image at batch {b}" for b in sorted(c.vit_ms))
    prefill = ", ".join(f"{tokens} tokens {ms:.1f} ms" for tokens, ms in sorted(c.prefill_ms.items()))
    decode = ", ".join(f"batch {b} @ {ctx} ctx {ms:.2f} ms" for b, ctx, ms in c.decode_ms)
    if c.moe:
        decode += f" (mixture of experts: {c.moe_top_k} of {c.moe_experts} a token)"
    corun = ", ".join(f"{pair} ×{k:.2f}" for pair, k in c.corun.items()) or "not measured"
    return (f"epd plan: {c.model} on {c.device} ({c.dtype}); {c.resolution} image = {c.image_tokens} tokens\n"
            f"  frontend: {c.media_ms:.1f} ms to decode one image, {c.media_threads} at a time\n"
            f"  ViT: {vit}; {_preprocessing(c)}\n"
            f"  prefill: {prefill}\n  decode step: {decode}\n"
            f"  side by side on two streams (time beside / alone): {corun}")


def _preprocessing(c: Costs) -> str:
    if c.preprocess == "torch":
        return "preprocessing on the device (inside the ViT times)"
    return f"preprocessing {c.preprocess_ms:.1f} ms/image (CPU, {c.preprocess_threads} threads)"


def format_predictions(rate: float, predictions: list[Prediction], best: Prediction | None) -> str:
    lines = [f"\nrate {rate:g} req/s", f"  {'layout':64}{'TTFT ms':>10}{'TPOT ms':>10}"]
    for p in predictions:
        figures = f"{p.ttft_ms:10.1f}{p.tpot_ms:10.2f}" if p.stable else f"{'unstable':>20}"
        lines.append(f"  {p.layout:64}{figures}")
    if best is None:
        lines.append("  recommendation: none of these layouts keeps up with this rate; add GPUs or lower the rate")
    else:
        encoders = f", {best.encoders} encoder(s)" if best.encoders else ""
        lines.append(f"  recommended: {best.topology}{encoders} ({best.layout}) — predicted mean TTFT "
                     f"{best.ttft_ms:.1f} ms")
    return "\n".join(lines)
