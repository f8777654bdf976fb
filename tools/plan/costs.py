"""What this model costs on this hardware, measured in-process through our own tower and engine.

- media: the frontend's decode (and content hash) of one image of the workload's resolution and format;
- ViT: one batch of 1..N images of the workload's resolution (ms per batch); the image processor's
  CPU time per image, or, where encoders preprocess on the GPU, that work inside each ViT batch's time;
- prefill: one prompt of the workload's text plus 0..N images (ms, by prompt tokens);
- decode: one engine step at batch 1 and batch B, at a short and a long context (ms per step). The
  sequences are reserved with their KV in place (as a decode worker holds them), so no prefill is paid
  to set them up; the step's cost does not depend on the KV's values.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from shared.engine.sampling import SamplingParams
from shared.engine.sequence import ImageInput, Sequence
from shared.model.geometry import Grid, grid_tokens

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
        return cls(**data)


class Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def ms(self, fn, repeat: int = 3, warmup: int = 1) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeat):
            self._sync()
            start = time.perf_counter()
            fn()
            self._sync()
            times.append((time.perf_counter() - start) * 1e3)
        return min(times)  # other work on the machine only ever adds time

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def measure_media(settings) -> float:
    """ms for the frontend to decode one image of the workload's size, sent as the workload sends it."""
    import base64

    from tools.bench.dataset import data_url, make_image
    from services.frontend.media import decode_image

    width, height = settings.image_size
    payload = base64.b64decode(data_url(make_image(0, width, height), settings.image_format).split(",", 1)[1])
    return Timer(torch.device("cpu")).ms(lambda: decode_image(payload, width * height), repeat=5)


def measure_vision(settings, config, path, batches: list[int], mode: str) -> tuple[int, float, dict[int, float]]:
    """(tokens per image, CPU preprocess ms, {batch: ViT ms}); with ``mode`` torch, each batch's time
    includes moving its pixels to the device and preprocessing them there, as the encoder does."""
    from tools.bench.dataset import make_image
    from shared.model.loader import load_vision_tower
    from shared.model.processor import ImagePreprocessor, TorchImagePreprocessor

    device, dtype = settings.torch_device(), settings.torch_dtype()
    timer = Timer(device)
    width, height = settings.image_size
    pixels = np.asarray(make_image(0, width, height))
    tower = load_vision_tower(path, config, device, dtype, settings.load_format)
    if mode == "torch":
        prepare, source = TorchImagePreprocessor(path, dtype), torch.from_numpy(pixels.copy())
        grid, preprocess_ms = prepare.grid(height, width), 0.0

        def patches(batch: int) -> torch.Tensor:
            return torch.cat([prepare(source.to(device)) for _ in range(batch)])
    else:
        preprocess = ImagePreprocessor(path)
        preprocess_ms = timer.ms(lambda: preprocess(pixels))
        flat, grid = preprocess(pixels)
        one = torch.from_numpy(flat).to(device, dtype)

        def patches(batch: int) -> torch.Tensor:
            return one.repeat(batch, 1)
    vit_ms = {}
    with torch.inference_mode():
        for batch in batches:
            vit_ms[batch] = timer.ms(lambda: tower(patches(batch), [grid] * batch))
    tokens = grid_tokens(grid, config.vision.merge_size)
    return tokens, preprocess_ms, vit_ms


def measure_prefill(engine, config, timer: Timer, input_len: int, images: int, image_tokens: int,
                    grid: Grid, tag: str) -> float:
    device, dtype = engine.runner.device, engine.runner.dtype
    rng = np.random.default_rng(images)
    ids = rng.integers(16, config.text.vocab_size, input_len + TEMPLATE_TOKENS).tolist()
    slots = []
    for i in range(images):
        slots.append(ImageInput(len(ids) + 1, grid, torch.randn(image_tokens, config.embedding_width,
                                                                device=device, dtype=dtype)))
        ids += [config.vision_start_token_id] + [config.image_token_id] * image_tokens + [config.vision_end_token_id]
    count = [0]

    def once() -> None:
        count[0] += 1
        seq = Sequence(f"plan-{tag}-{count[0]}", list(ids), len(ids), SamplingParams(max_tokens=1, temperature=0),
                       images=slots)
        engine.add_prompt(seq)
        while engine.has_work():
            engine.step()

    return timer.ms(once, repeat=2)


def measure_decode(engine, config, timer: Timer, batch: int, context: int) -> float:
    """ms per decode step of ``batch`` sequences holding ``context`` tokens of KV each."""
    sampling = SamplingParams(max_tokens=1 << 20, ignore_eos=True, temperature=0)
    ids = [config.image_token_id + 1] * (context + 1)
    names = [f"plan-decode-{batch}-{context}-{i}" for i in range(batch)]
    for name in names:
        engine.reserve(Sequence(name, list(ids), context, sampling, num_computed=context))
        engine.activate(name)
    try:
        return timer.ms(engine.step, repeat=5, warmup=2)
    finally:
        for name in names:
            engine.abort(name)


def measure_costs(settings) -> Costs:
    """Every cost ``epd plan`` needs for ``settings``' workload (see the module's docstring)."""
    from shared.engine.builder import build_engine
    from shared.model.config import ModelConfig
    from shared.model.processor import preprocess_mode

    path = settings.model_path()
    config = ModelConfig.from_checkpoint(path)
    counts = [n for n in settings.image_counts() if n > 0]
    batches = sorted({1, min(4, max(counts, default=1)), max(counts, default=1)})
    mode = preprocess_mode(settings.preprocess, settings.torch_device())
    image_tokens, preprocess_ms, vit_ms = measure_vision(settings, config, path, batches, mode)
    grid = _grid(settings, path)
    # the same random prompt is timed again and again: a prefix cache would serve the repeats
    engine, _ = build_engine(settings.model_copy(update={"prefix_caching": False}), "both")
    timer = Timer(settings.torch_device())
    prefill_ms = {}
    for n in sorted({0, *_spread(counts)}):
        tokens = settings.input_len + TEMPLATE_TOKENS + n * (image_tokens + PER_IMAGE_TOKENS)
        prefill_ms[tokens] = measure_prefill(engine, config, timer, settings.input_len, n, image_tokens, grid, str(n))
    short = min(256, engine.max_model_len // 4)
    long = max(short + 1, min(4096, engine.max_model_len - 8))
    decode_ms = [(b, ctx, measure_decode(engine, config, timer, b, ctx))
                 for b, ctx in ((1, short), (settings.decode_batch, short), (settings.decode_batch, long))]
    return Costs(model=path.name, device=str(settings.torch_device()), dtype=str(settings.torch_dtype()),
                 resolution=settings.image_resolution, image_tokens=image_tokens, preprocess_ms=preprocess_ms,
                 preprocess_threads=settings.preprocess_threads, vit_ms=vit_ms, prefill_ms=prefill_ms,
                 decode_ms=decode_ms, preprocess=mode, media_ms=measure_media(settings),
                 media_threads=settings.media_threads)


def _grid(settings, path) -> Grid:
    from shared.model.geometry import ImageGeometry

    width, height = settings.image_size
    return ImageGeometry.from_checkpoint(path).grid(height, width)


def _spread(counts: list[int]) -> list[int]:
    """At most four image counts spanning ``counts`` (prefill is interpolated between them)."""
    if len(counts) <= 4:
        return counts
    picks = np.linspace(0, len(counts) - 1, 4).round().astype(int)
    return [counts[i] for i in picks]
