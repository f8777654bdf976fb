"""``epd plan``: measure this model's costs here, then predict each topology's latency for a workload.

The model (every time in seconds; λ requests/s; q the share of image requests, n their image count,
L the output length; each GPU layout gets λ/replicas):

- encode: per image, ViT time at the request's batch, v(n) = ViT(n)/n, plus preprocessing p (CPU,
  ``--preprocess-threads`` in parallel); an encoder serves images at λ_img = λ·q·E[n], one image every
  max(v, p/threads).
- prefill: s_P(n) = prefill(prompt tokens of n images); embeddings reach prefill over the data plane at
  ``--data-plane-gbs`` (disaggregated and colocated only).
- decode: a step costs t(B, ctx) = a + b·B + c·B·ctx (fitted); the running batch B follows from
  Little's law, B = λ·L·TPOT, solved with TPOT below.
- media: the frontend decodes a request's images m at a time (``--media-threads``), each taking the
  measured decode + hash time of one image of the workload's resolution; the same in every layout.
- waiting: Poisson arrivals. A request's prefill (or encode + prefill) varies with its image count, so
  its queue is M/G/1, W = λ·E[S²] / 2(1−ρ); images on e encoders are M/D/e, W = ½ · Erlang-C wait of
  M/M/e. A stage at or beyond saturation is reported unstable.

Layouts:
- aggregated (one process per GPU): encode and prefill share the GPU with decode, with priority over
  it (the engine schedules prefill first): E+P work w = q·n·v + s_P waits W = M/G/1(λ, w) plus half a
  decode step when decode is running (share of time 1 − e^−B: running sequences are Poisson, M/G/∞);
  decode gets the rest of the GPU, TPOT = t(B) / (1 − λw). TTFT = W + (1 − e^−B)·t(B)/2 + E[p + n·v + s_P].
- colocated (E, P, D processes on one GPU): the GPU is time-sliced between busy processes, so a stage
  runs slower by 1 + (share of time each other process is busy); decode is busy 1 − e^−B of the time.
  TTFT = encode (M/D/1 wait over images + own images, slowed) + M/G/1 wait of prefill + slowed s_P
  + transfer; TPOT = t(B)·(1 + ρ_E + ρ_P).
- disaggregated: e encoder GPUs (one encoder each, M/D/e over images; a request's images spread, so its
  own encode takes ⌈n/e⌉·v); LM GPUs either run prefill and decode side by side (time-sliced, as
  colocated) or p prefill GPUs (M/G/1 each at λ/p: NATS queue groups pick at random) and d decode GPUs
  (TPOT = t(B) at B = λ/d·L·TPOT).

The recommendation is the stable layout with the lowest predicted mean TTFT (near ties, within 5 %,
go to the layout with fewer processes).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field

from tools.plan.costs import Costs, measure_costs
from tools.plan.queueing import mdc_wait, mg1_wait
from tools.bench.settings import Workload
from shared.engine.settings import EngineSettings


class PlanSettings(EngineSettings, Workload):
    """Measures the model's ViT, prefill and decode costs (and the frontend's image decoding) on this
    machine, then predicts mean TTFT and TPOT of each layout for the workload: ViT v per image, prefill
    s_P by prompt tokens, decode step t(B) = a + b·B + c·B·ctx with the batch B = rate·output_len·TPOT
    (Little); per-request queues M/G/1 (service time varies with the image count), images over
    encoders M/D/e. Aggregated: encode + prefill wait as one queue ahead of decode (prefill first),
    TTFT = W + (1 − e^−B)·t(B)/2 + own work, TPOT = t(B)/(1 − ρ_E+P). Colocated: each process on a
    shared GPU slowed by 1 + the others' busy shares. Disaggregated: a request's images split over the
    encoders; prefill per GPU; decode alone. The recommendation is the stable layout with the lowest
    predicted mean TTFT."""

    request_rate: list[float] = Field([1.0], description="request rates (req/s) to predict for, e.g. 1,2,4")
    gpus: int = Field(0, ge=0, description="GPUs to lay the services out on; 0: every visible GPU (1 on CPU)")
    max_num_seqs: int = Field(64, ge=1, description="the measuring engine's batch limit (graph capture is "
                                                    "per batch size: fewer is quicker)")
    decode_batch: int = Field(16, ge=2, description="the larger batch decode steps are timed at")
    preprocess: Literal["auto", "pil", "torch"] = Field("auto", description="where encoders preprocess images "
                                                                          "(as `epd encoder --preprocess`)")
    preprocess_threads: int = Field(2, ge=1, description="image preprocessing threads per encoder (pil)")
    media_threads: int = Field(4, ge=1, description="the frontend's image-decoding threads (as `epd frontend`)")
    image_format: Literal["png", "jpeg"] = Field("jpeg", description="how clients send images (the frontend "
                                                                    "decodes them)")
    data_plane_gbs: float = Field(5.0, gt=0, description="assumed data-plane bandwidth between processes (GB/s)")
    out: str = Field("", description="write costs, predictions and the recommendation to this JSON file")


@dataclass(frozen=True)
class Layout:
    topology: str  # aggregated | colocated | disaggregated
    gpus: int
    encoder_gpus: int = 0  # disaggregated: GPUs holding one encoder each
    prefill_gpus: int = 0  # disaggregated: 0 with shared_lm
    decode_gpus: int = 0
    shared_lm: bool = False  # disaggregated: prefill and decode processes side by side on each LM GPU

    @property
    def encoders(self) -> int:
        return self.encoder_gpus if self.topology == "disaggregated" else (self.gpus if self.topology == "colocated"
                                                                             else 0)

    @property
    def processes(self) -> int:
        if self.topology == "aggregated":
            return self.gpus
        if self.topology == "colocated":
            return 3 * self.gpus
        lm = 2 * (self.gpus - self.encoder_gpus) if self.shared_lm else self.prefill_gpus + self.decode_gpus
        return self.encoder_gpus + lm

    def describe(self) -> str:
        if self.topology == "aggregated":
            return f"aggregated x{self.gpus}"
        if self.topology == "colocated":
            return f"colocated x{self.gpus} (E+P+D per GPU)"
        lm = (f"P+D on {self.gpus - self.encoder_gpus} GPU(s)" if self.shared_lm
              else f"P on {self.prefill_gpus}, D on {self.decode_gpus} GPU(s)")
        return f"disaggregated: {self.encoder_gpus} encoder GPU(s), {lm}"


@dataclass
class Prediction:
    layout: str
    topology: str
    encoders: int
    rate: float
    ttft_ms: float
    tpot_ms: float
    stable: bool


@dataclass
class Traffic:
    """The workload as the model sees it, at one rate."""

    rate: float
    image_share: float
    counts: list[int]  # image counts of image requests, equally likely
    input_len: int
    output_len: int

    @property
    def mean_images(self) -> float:
        return sum(self.counts) / len(self.counts) if self.counts else 0.0

    def classes(self) -> list[tuple[float, int]]:
        """(probability, images) of every request kind."""
        text = [(1 - self.image_share, 0)] if self.image_share < 1 else []
        return text + [(self.image_share / len(self.counts), n) for n in self.counts if self.image_share > 0]


def traffic(workload: Workload, rate: float) -> Traffic:
    counts = [n for n in workload.image_counts() if n > 0]
    share = 0.0 if not counts else 1 - workload.text_ratio
    return Traffic(rate, share, counts, workload.input_len, workload.output_len)


def _mean(traffic: Traffic, fn) -> float:
    return sum(p * fn(n) for p, n in traffic.classes())


def _decode_batch(rate: float, length: int, step, slowdown: float = 1.0) -> tuple[float, float]:
    """(B, TPOT s) with B = rate·L·TPOT and TPOT = step(B)·slowdown; (inf, inf) when decode cannot keep up."""
    batch = 0.0
    for _ in range(200):  # fixed point; step() is increasing and affine in B
        tpot = step(batch) * slowdown
        nxt = rate * length * tpot
        if nxt > 1e6:
            return math.inf, math.inf
        if abs(nxt - batch) < 1e-6:
            break
        batch = nxt
    tpot = step(batch) * slowdown
    return (batch, tpot) if rate * length * tpot <= batch * 1.01 + 1e-9 else (math.inf, math.inf)


def decode_busy(batch: float) -> float:
    """Share of time at least one sequence is decoding: running sequences are Poisson (M/G/∞) of mean B."""
    return 1 - math.exp(-batch)


class Planner:
    def __init__(self, costs: Costs, data_plane_gbs: float = 5.0, hidden_bytes: int = 0):
        self.costs = costs
        self.bandwidth = data_plane_gbs * 1e9
        self.hidden_bytes = hidden_bytes  # bytes of one token's embedding (for the E→P transfer)

    # -- per-request pieces (seconds) ----------------------------------------------------------------
    def vit(self, n: int) -> float:
        return n * self.costs.vit_per_image(n) / 1e3 if n else 0.0

    def preprocess(self, n: int, parallel: int = 1) -> float:
        rounds = math.ceil(n / parallel / self.costs.preprocess_threads) if n else 0
        return rounds * self.costs.preprocess_ms / 1e3

    def prefill(self, t: Traffic, n: int) -> float:
        return self.costs.prefill(self.costs.prompt_tokens(t.input_len, n)) / 1e3

    def media(self, n: int) -> float:
        """The frontend fetching and decoding a request's images (its pool decodes several at once)."""
        return math.ceil(n / self.costs.media_threads) * self.costs.media_ms / 1e3 if n else 0.0

    def transfer(self, n: int) -> float:
        return n * self.costs.image_tokens * self.hidden_bytes / self.bandwidth

    def step(self, t: Traffic):
        context = _mean(t, lambda n: self.costs.prompt_tokens(t.input_len, n)) + t.output_len / 2
        return lambda batch: self.costs.decode_step(batch, context) / 1e3

    # -- layouts -------------------------------------------------------------------------------------
    def predict(self, layout: Layout, t: Traffic) -> Prediction:
        ttft, tpot = {"aggregated": self._aggregated, "colocated": self._colocated,
                      "disaggregated": self._disaggregated}[layout.topology](layout, t)
        ttft += _mean(t, self.media)  # the same in every layout: before any encoder sees an image
        stable = math.isfinite(ttft) and math.isfinite(tpot)
        return Prediction(layout.describe(), layout.topology, layout.encoders, t.rate,
                          ttft * 1e3 if stable else math.inf, tpot * 1e3 if stable else math.inf, stable)

    def _aggregated(self, layout: Layout, t: Traffic) -> tuple[float, float]:
        rate = t.rate / layout.gpus
        work = _mean(t, lambda n: self.vit(n) + self.prefill(t, n))
        spread = _mean(t, lambda n: (self.vit(n) + self.prefill(t, n)) ** 2)
        if rate * work >= 1:
            return math.inf, math.inf
        step = self.step(t)
        batch, tpot = _decode_batch(rate, t.output_len, step, 1 / (1 - rate * work))
        own = _mean(t, lambda n: self.preprocess(n) + self.vit(n) + self.prefill(t, n))
        return mg1_wait(rate, work, spread) + decode_busy(batch) * step(batch) / 2 + own, tpot

    def _colocated(self, layout: Layout, t: Traffic) -> tuple[float, float]:
        rate = t.rate / layout.gpus
        return self._side_by_side(rate, t, encode_shares_gpu=True)

    def _side_by_side(self, rate: float, t: Traffic, encode_shares_gpu: bool, encoders: int = 1,
                      encode_rate: float | None = None) -> tuple[float, float]:
        """Prefill and decode processes time-slicing one GPU (and the encoder too when it shares it)."""
        encode_rate = rate if encode_rate is None else encode_rate
        per_image = self.costs.vit_per_image(max(1.0, t.mean_images)) / 1e3
        rho_e = encode_rate * t.image_share * t.mean_images * per_image / encoders
        rho_p = rate * _mean(t, lambda n: self.prefill(t, n))
        if rho_e >= 1 or rho_p >= 1:
            return math.inf, math.inf
        step = self.step(t)
        decode_slowdown = 1 + rho_p + (rho_e if encode_shares_gpu else 0)
        batch, tpot = _decode_batch(rate, t.output_len, step, decode_slowdown)
        if not math.isfinite(tpot):
            return math.inf, math.inf
        busy_d = decode_busy(batch)
        slow_p = 1 + busy_d + (rho_e if encode_shares_gpu else 0)
        slow_e = (1 + busy_d + rho_p) if encode_shares_gpu else 1
        encode = self._encode_stage(encode_rate, t, encoders, slow_e)
        prefill_s = _mean(t, lambda n: self.prefill(t, n)) * slow_p
        if rate * prefill_s >= 1 or not math.isfinite(encode):
            return math.inf, math.inf
        spread = _mean(t, lambda n: self.prefill(t, n) ** 2) * slow_p ** 2
        prefill = mg1_wait(rate, prefill_s, spread) + prefill_s + _mean(t, self.transfer)
        return encode + prefill, tpot

    def _encode_stage(self, rate: float, t: Traffic, encoders: int, slowdown: float = 1.0) -> float:
        """Mean encode latency over all requests (text requests: 0): queueing over images + own images."""
        if not t.counts or t.image_share == 0:
            return 0.0
        per_image = max(self.costs.vit_per_image(max(1.0, t.mean_images / encoders)) * slowdown,
                        self.costs.preprocess_ms / self.costs.preprocess_threads) / 1e3
        wait = mdc_wait(rate * t.image_share * t.mean_images, per_image, encoders)
        own = _mean(t, lambda n: self.preprocess(n, encoders) + self.vit(math.ceil(n / encoders)) * slowdown
                    if n else 0.0)
        return t.image_share * wait + own

    def _disaggregated(self, layout: Layout, t: Traffic) -> tuple[float, float]:
        lm_gpus = layout.gpus - layout.encoder_gpus
        if layout.shared_lm:
            encode = self._encode_stage(t.rate, t, layout.encoder_gpus)
            ttft, tpot = self._side_by_side(t.rate / lm_gpus, t, encode_shares_gpu=False)
            return encode + ttft, tpot
        encode = self._encode_stage(t.rate, t, layout.encoder_gpus)
        prefill_rate = t.rate / layout.prefill_gpus
        prefill_s = _mean(t, lambda n: self.prefill(t, n))
        if prefill_rate * prefill_s >= 1:
            return math.inf, math.inf
        spread = _mean(t, lambda n: self.prefill(t, n) ** 2)
        prefill = mg1_wait(prefill_rate, prefill_s, spread) + prefill_s + _mean(t, self.transfer)
        _, tpot = _decode_batch(t.rate / layout.decode_gpus, t.output_len, self.step(t))
        return encode + prefill, tpot


def layouts(gpus: int) -> list[Layout]:
    """Every layout the planner weighs on ``gpus`` GPUs."""
    out = [Layout("aggregated", gpus), Layout("colocated", gpus)]
    for encoder_gpus in range(1, gpus):
        lm = gpus - encoder_gpus
        out.append(Layout("disaggregated", gpus, encoder_gpus, shared_lm=True))
        out.extend(Layout("disaggregated", gpus, encoder_gpus, p, lm - p) for p in range(1, lm))
    return out


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
    costs = measure_costs(settings)
    planner = Planner(costs, settings.data_plane_gbs, embedding_bytes(settings))
    candidates = layouts(gpus)
    by_name = {layout.describe(): layout for layout in candidates}
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
                settings, from_attributes=True).model_dump(), "data_plane_gbs": settings.data_plane_gbs,
             "embedding_bytes": planner.hidden_bytes, "rates": results}, indent=1, default=_json_default))
    return 0


def _json_default(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    raise TypeError(type(value).__name__)


def describe_costs(c: Costs) -> str:
    vit = ", ".join(f"{c.vit_ms[b] / b:.1f} ms/image at batch {b}" for b in sorted(c.vit_ms))
    prefill = ", ".join(f"{tokens} tokens {ms:.1f} ms" for tokens, ms in sorted(c.prefill_ms.items()))
    decode = ", ".join(f"batch {b} @ {ctx} ctx {ms:.2f} ms" for b, ctx, ms in c.decode_ms)
    return (f"epd plan: {c.model} on {c.device} ({c.dtype}); {c.resolution} image = {c.image_tokens} tokens\n"
            f"  frontend: {c.media_ms:.1f} ms to decode one image, {c.media_threads} at a time\n"
            f"  ViT: {vit}; {_preprocessing(c)}\n"
            f"  prefill: {prefill}\n  decode step: {decode}")


def _preprocessing(c: Costs) -> str:
    if c.preprocess == "torch":
        return "preprocessing on the device (inside the ViT times)"
    return f"preprocessing {c.preprocess_ms:.1f} ms/image (CPU, {c.preprocess_threads} threads)"


def format_predictions(rate: float, predictions: list[Prediction], best: Prediction | None) -> str:
    lines = [f"\nrate {rate:g} req/s", f"  {'layout':58}{'TTFT ms':>10}{'TPOT ms':>10}"]
    for p in predictions:
        figures = f"{p.ttft_ms:10.1f}{p.tpot_ms:10.2f}" if p.stable else f"{'unstable':>20}"
        lines.append(f"  {p.layout:58}{figures}")
    if best is None:
        lines.append("  recommendation: none of these layouts keeps up with this rate; add GPUs or lower the rate")
    else:
        encoders = f", {best.encoders} encoder(s)" if best.encoders else ""
        lines.append(f"  recommended: {best.topology}{encoders} ({best.layout}) — predicted mean TTFT "
                     f"{best.ttft_ms:.1f} ms")
    return "\n".join(lines)
