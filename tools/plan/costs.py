"""What this model costs on this hardware, measured in-process through our own tower and engine.

- media: the frontend's decode (and content hash) of images of the workload's resolution and format,
  one, or several at once in a pool of the frontend's size; or of one video clip (PyAV: decoded up to
  its last sampled frame, the sampled frames kept);
- ViT: one forward over 1..N images of a resolution (ms per forward); the image processor's CPU time per
  image, or, where encoders preprocess on the GPU, that work inside each forward's time; the same over a
  clip's sampled frames through the video processor, grid (t, h, w);
- prefill: one prompt of the workload's text plus 0..N images (ms, by prompt tokens), first token sampled;
  or plus one clip's video placeholders, laid out as the frontend lays them;
- decode: one engine step at batch 1 and batch B, at a short and a long context (ms per step). The
  sequences are reserved with their KV in place (as a decode worker holds them), so no prefill is paid
  to set them up; the step's cost does not depend on the KV's values. Each row decodes a token of its
  own: rows of one token route alike through a mixture of experts, reading k experts a layer where B
  real tokens read up to E (Qwen3-VL-30B-A3B, 32 rows on a fresh pool, counted on the CPU: 8 experts a
  layer with one token, 114-119 with their own). Floors measured before this gave every row one token:
  their batch-B steps read fewer experts than serving does;
- co-run: a ViT forward beside decode steps, and beside a prefill, each in a thread of its own on a CUDA
  stream of its own, against each alone: how much two processes slow each other when their kernels run
  side by side (what CUDA MPS does; one process's two streams are its closest in-process stand-in); and
  the same with the ViT in a second process (``timeslice.py``), which the GPU time-slices without MPS.
"""

from __future__ import annotations

import base64
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from shared.engine.sequence import ImageInput, Sequence
from shared.messages.sampling import SamplingParams
from shared.model.geometry import Grid, grid_tokens
from shared.model.rope import video_time_interval
from shared.model.video import VideoGeometry, VideoTiming
from services.frontend.settings import MEDIA_THREADS
from tools.plan.cost_table import PER_IMAGE_TOKENS, TEMPLATE_TOKENS, Costs  # noqa: F401 - named here too


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


def measure_media(width: int, height: int, fmt: str, count: int = 1, threads: int = 1) -> float:
    """ms for the frontend's decoder to decode ``count`` images of this size, sent as ``fmt`` data as the
    workload sends them, ``threads`` at a time (as its pool does)."""
    from tools.bench.dataset import data_url, make_image
    from services.frontend.media import decode_image

    payloads = [base64.b64decode(data_url(make_image(i, width, height), fmt).split(",", 1)[1]) for i in range(count)]
    with ThreadPoolExecutor(threads) as pool:
        return Timer(torch.device("cpu")).ms(lambda: list(pool.map(lambda p: decode_image(p, width * height),
                                                                   payloads)), repeat=5)


def measure_clip_media(data: bytes, geometry: VideoGeometry) -> tuple[float, "DecodedVideo"]:  # noqa: F821
    """(ms for the frontend's decoder to decode and sample one clip, the frames it sampled): one clip a
    request, so one thread of the frontend's pool (PyAV's frame threads inside it)."""
    from services.frontend.video import VideoLimits, decode_video

    # measuring, not refusing: the frontend's own limits are its settings'
    limits = VideoLimits(max_seconds=600, max_fps=240, max_frames=768, max_frame_pixels=1 << 30, decode_timeout=600)
    decoded = decode_video(data, geometry, limits)  # and the warm-up
    return Timer(torch.device("cpu")).ms(lambda: decode_video(data, geometry, limits), warmup=0), decoded


class VisionProbe:
    """The vision tower, loaded once, timed on batches of images of any size, preprocessed as the
    encoders do (``mode`` torch: on the device, inside the timed forward; pil: on CPU, timed apart);
    ``graph_patches``: forwards of up to that many patches as CUDA graphs (``vision.GRAPH_PATCHES``), and
    ``layout_graphs`` whole forwards of recurring batch layouts (``services.encoder.vision.LAYOUT_GRAPHS``)."""

    def __init__(self, settings, config, path, mode: str, graph_patches: int = 0, layout_graphs: int = 0):
        from shared.model.loader import load_vision_tower

        self.device, self.dtype = settings.torch_device(), settings.torch_dtype()
        self.config, self.path, self.mode = config, path, mode
        self.tower = load_vision_tower(path, config, self.device, self.dtype, settings.load_format)
        if self.device.type == "cuda" and graph_patches:  # as encoders run it
            from shared.model import pieces

            pieces.capture(self.tower, graph_patches, layout_graphs)
        self.timer = Timer(self.device)
        self._video = None

    @property
    def video(self) -> "VideoPreprocessor":  # noqa: F821
        """The encoders' video processor (made on first use: image-only floors never need it)."""
        from shared.model.video_processor import VideoPreprocessor

        if self._video is None:
            self._video = VideoPreprocessor.from_checkpoint(self.path, self.dtype)
        return self._video

    def unit(self, width: int, height: int, batch: int) -> tuple[Callable[[], torch.Tensor], Grid, float]:
        """(one forward over ``batch`` images, their grid, CPU preprocessing ms per image)."""
        from tools.bench.dataset import make_image
        from shared.model.processor import ImagePreprocessor, TorchImagePreprocessor

        pixels = np.asarray(make_image(0, width, height))
        if self.mode == "torch":
            prepare, source = TorchImagePreprocessor(self.path, self.dtype), torch.from_numpy(pixels.copy())
            grid = prepare.grid(height, width)

            def forward() -> torch.Tensor:  # as an encoder's batch of one size: stacked, prepared together
                pixels = source if batch == 1 else torch.stack([source] * batch)
                return self.tower(prepare(pixels.to(self.device)), [grid] * batch)
            return forward, grid, 0.0
        preprocess = ImagePreprocessor(self.path)
        preprocess_ms = self.timer.ms(lambda: preprocess(pixels))
        flat, grid = preprocess(pixels)
        one = torch.from_numpy(flat).to(self.device, self.dtype)
        return (lambda: self.tower(one.repeat(batch, 1), [grid] * batch)), grid, preprocess_ms

    def measure(self, width: int, height: int, batches: list[int]) -> tuple[int, float, dict[int, float]]:
        """(tokens per image, CPU preprocess ms per image, {batch: ms per forward})."""
        vit_ms, preprocess_ms, grid = {}, 0.0, None
        with torch.inference_mode():
            for batch in batches:
                forward, grid, preprocess_ms = self.unit(width, height, batch)
                vit_ms[batch] = self.timer.ms(forward)
        return grid_tokens(grid, self.config.vision.merge_size), preprocess_ms, vit_ms

    def clip_unit(self, frames: np.ndarray) -> tuple[Callable[[], torch.Tensor], Grid, float]:
        """(one forward over a clip's sampled frames ``[T, H, W, 3]`` uint8, its grid, CPU preprocessing ms),
        the frames through the video processor as the encoders do (torch: on the device, in the forward)."""
        video, source = self.video, torch.from_numpy(np.ascontiguousarray(frames))
        grid = video.grid(*frames.shape[:3])
        if self.mode == "torch":
            return (lambda: self.tower(video(source.to(self.device))[0], [grid])), grid, 0.0
        preprocess_ms = self.timer.ms(lambda: video(source))
        patches = video(source)[0].to(self.device)
        return (lambda: self.tower(patches, [grid])), grid, preprocess_ms

    def measure_clip(self, frames: np.ndarray) -> tuple[int, float, float, Grid]:
        """(placeholder tokens, CPU preprocess ms, ms per forward, grid) of one clip."""
        with torch.inference_mode():
            forward, grid, preprocess_ms = self.clip_unit(frames)
            return grid_tokens(grid, self.config.vision.merge_size), preprocess_ms, self.timer.ms(forward), grid


class EngineProbe:
    """Our engine (prefill and decode in one), timed on prompts and decode batches."""

    def __init__(self, settings):
        from shared.engine.builder import build_engine

        # the same random prompts are timed again and again: a prefix cache would serve the repeats; and the
        # steps are timed as they come, not cut to a time budget
        self.engine, self.config = build_engine(settings.model_copy(update={"prefix_caching": False,
                                                                            "target_itl_ms": 0}), "both")
        self.timer = Timer(settings.torch_device())
        self.path = settings.model_path()
        self._count = 0

    def prompt(self, input_len: int, images: int, image_tokens: int, grid: Grid) -> Callable[[], None]:
        """One prefill of ``input_len`` text tokens (+ the template) and ``images`` images, to its first token."""
        config = self.config
        ids, slots = self._text(input_len, images), []
        for _ in range(images):
            slots.append(ImageInput(len(ids) + 1, grid, self._embeds(image_tokens)))
            ids += [config.vision_start_token_id] + [config.image_token_id] * image_tokens + [config.vision_end_token_id]
        return self.prefill(ids, slots)

    def clip_inputs(self, input_len: int, grid: Grid, geometry: VideoGeometry,
                    timing: VideoTiming) -> tuple[list[int], list[ImageInput]]:
        """The prompt of ``input_len`` text tokens (+ the template) and one clip of ``grid``: its video
        placeholders as the frontend lays them out (``PromptBuilder._place_video``) and the engine's
        inputs as the language worker makes them (``intake.image_inputs``). Qwen2-VL / Qwen2.5-VL: one run
        of video tokens, temporal positions ``second_per_grid`` apart; Qwen3-VL: a run per temporal patch,
        after its ``<t seconds>`` timestamp."""
        config = self.config
        t, h, w = grid
        per_patch = h * w // config.vision.merge_size ** 2
        ids, embeds = self._text(input_len, t), self._embeds(t * per_patch)
        start, video, end = config.vision_start_token_id, config.video_token_id, config.vision_end_token_id
        if geometry.rule != "qwen3":
            interval = video_time_interval(config.vision.tokens_per_second, timing.second_per_grid)
            slots = [ImageInput(len(ids) + 1, grid, embeds, time_interval=interval)]
            return ids + [start] + [video] * (t * per_patch) + [end], slots
        from transformers import AutoTokenizer

        tokenizer, slots = AutoTokenizer.from_pretrained(self.path), []
        for i, seconds in enumerate(timing.timestamps):
            ids += tokenizer.encode(f"<{seconds:.1f} seconds>", add_special_tokens=False) + [start]
            slots.append(ImageInput(len(ids), (1, h, w), embeds[i * per_patch:(i + 1) * per_patch]))
            ids += [video] * per_patch + [end]
        return ids, slots

    def _text(self, input_len: int, seed: int) -> list[int]:
        rng = np.random.default_rng(seed)
        return rng.integers(16, self.config.text.vocab_size, input_len + TEMPLATE_TOKENS).tolist()

    def _embeds(self, tokens: int) -> torch.Tensor:
        runner = self.engine.runner
        return torch.randn(tokens, self.config.embedding_width, device=runner.device, dtype=runner.dtype)

    def prefill(self, ids: list[int], slots: list[ImageInput]) -> Callable[[], None]:
        """One prefill of the prompt ``ids`` with its image (or clip) inputs ``slots``, to its first token."""

        def once() -> None:
            self._count += 1
            seq = Sequence(f"plan-prefill-{self._count}", list(ids), len(ids),
                           SamplingParams(max_tokens=1, temperature=0), images=slots)
            self.engine.add_prompt(seq)
            while self.engine.has_work():
                self.engine.step()
        return once

    def prefill_ms(self, input_len: int, images: int, image_tokens: int, grid: Grid) -> float:
        # five after two warm-ups, the least: on an H200 a 152-token Qwen3-VL-30B-A3B prefill took 17 ms
        # or, now and then, 28-31 ms, and the least of two once gave the floor 24.6 ms
        return self.timer.ms(self.prompt(input_len, images, image_tokens, grid), repeat=5, warmup=2)

    @contextlib.contextmanager
    def decoding(self, batch: int, context: int) -> Iterator[Callable[[], None]]:
        """``batch`` running sequences holding ``context`` tokens of KV each; yields one decode step."""
        sampling = SamplingParams(max_tokens=1 << 20, ignore_eos=True, temperature=0)
        self._count += 1
        tokens = np.random.default_rng(self._count).integers(16, self.config.text.vocab_size, batch).tolist()
        names = [f"plan-decode-{self._count}-{i}" for i in range(batch)]
        for name, token in zip(names, tokens):  # a token each: a MoE batch routes as real tokens do
            self.engine.reserve(Sequence(name, [token] * (context + 1), context, sampling, num_computed=context))
            self.engine.activate(name)
        try:
            yield self.engine.step
        finally:
            for name in names:
                self.engine.abort(name)

    def decode_ms(self, batch: int, context: int) -> float:
        """ms per decode step of ``batch`` sequences holding ``context`` tokens of KV each."""
        with self.decoding(batch, context) as step:
            return self.timer.ms(step, repeat=5, warmup=2)

    def decode_steps(self, batch: int) -> list[tuple[int, int, float]]:
        """Steps at batch 1 and ``batch`` over short contexts, and at ``batch`` over long ones (4,096
        tokens, or what the pool holds for ``batch`` sequences: a large model's KV per token is larger)."""
        blocks = self.engine.blocks
        short = min(256, self.engine.max_model_len // 4)
        fits = blocks.num_free * blocks.block_size // batch - 2 * blocks.block_size
        long = max(short + 1, min(4096, self.engine.max_model_len - 8, fits))
        return [(b, ctx, self.decode_ms(b, ctx)) for b, ctx in ((1, short), (batch, short), (batch, long))]


def corun(first: Callable[[], object], second: Callable[[], object], device: torch.device,
          seconds: float) -> tuple[float, float]:
    """(first's time per call beside second / alone, the same for second): each calls its function in a
    loop, in a thread and on a CUDA stream of its own. A loop keeps going until both have measured for
    ``seconds``, so every measured call of the slower one has the other running beside it."""
    alone = [_loops([fn], device, seconds)[0] for fn in (first, second)]
    together = _loops([first, second], device, seconds)
    return together[0] / alone[0], together[1] / alone[1]


def _loops(fns: list[Callable[[], object]], device: torch.device, seconds: float) -> list[float]:
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)  # inputs made on the default stream are ready for the loops' streams
    ready = threading.Barrier(len(fns))
    measured = threading.Semaphore(0)
    done = threading.Event()
    per_call = [0.0] * len(fns)
    errors: list[BaseException] = []

    def loop(i: int) -> None:
        try:
            stream = torch.cuda.Stream(device) if cuda else None
            sync = stream.synchronize if cuda else (lambda: None)
            with torch.inference_mode(), (torch.cuda.stream(stream) if cuda else contextlib.nullcontext()):
                fns[i]()  # warm
                sync()
                ready.wait()
                start, calls = time.perf_counter(), 0
                while True:
                    fns[i]()
                    sync()
                    calls += 1
                    if not per_call[i] and time.perf_counter() - start >= seconds:
                        per_call[i] = (time.perf_counter() - start) / calls * 1e3
                        measured.release()
                    if done.is_set():
                        return
        except BaseException as err:  # noqa: BLE001 - reported by the caller
            errors.append(err)
            ready.abort()
            measured.release()

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(len(fns))]
    for thread in threads:
        thread.start()
    for _ in fns:
        measured.acquire()
    done.set()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return per_call


def measure_corun(vision: VisionProbe, engine: EngineProbe, image_size: tuple[int, int], images: int,
                  prompt: Callable[[], None], decode_batch: int, seconds: float) -> dict[str, float]:
    """{"vit|decode", "decode|vit", "vit|prefill", "prefill|vit": slowdown} (see the module docstring)."""
    forward, _, _ = vision.unit(*image_size, images)
    with engine.decoding(decode_batch, min(1024, engine.engine.max_model_len // 2)) as step:
        vit_decode, decode_vit = corun(forward, step, vision.device, seconds)
    vit_prefill, prefill_vit = corun(forward, prompt, vision.device, seconds)
    return {"vit|decode": vit_decode, "decode|vit": decode_vit, "vit|prefill": vit_prefill, "prefill|vit": prefill_vit}


def measure_costs(settings, decode_batch: int) -> Costs:
    """Every cost ``epd plan`` needs for ``settings``' workload (see the module's docstring)."""
    from shared.model.config import ModelConfig
    from shared.model.processor import preprocess_mode
    from tools.plan.timeslice import measure_timeslice, ready_or_none, vit_child

    path = settings.model_path()
    config = ModelConfig.from_checkpoint(path)
    counts = [n for n in settings.image_counts() if n > 0]
    batches = sorted({1, min(4, max(counts, default=1)), max(counts, default=1)})
    mode = preprocess_mode(settings.preprocess, settings.torch_device())
    vision = VisionProbe(settings, config, path, mode)
    width, height = settings.image_size
    image_tokens, preprocess_ms, vit_ms = vision.measure(width, height, batches)
    grid = _grid(settings, path)
    corun_images = min(4, max(counts, default=1))
    with vit_child(settings, settings.image_resolution, corun_images) as child:  # starts while the LM loads
        engine = EngineProbe(settings)
        child = ready_or_none(child)
        prefill_counts = sorted({0, *spread(counts)})
        prefill_ms = {}
        for n in prefill_counts:
            tokens = settings.input_len + TEMPLATE_TOKENS + n * (image_tokens + PER_IMAGE_TOKENS)
            prefill_ms[tokens] = engine.prefill_ms(settings.input_len, n, image_tokens, grid)
        corun = {}
        if settings.corun_seconds > 0:
            prompt = engine.prompt(settings.input_len, prefill_counts[len(prefill_counts) // 2], image_tokens, grid)
            corun = measure_corun(vision, engine, (width, height), corun_images, prompt, decode_batch,
                                  settings.corun_seconds)
            if child is not None:
                corun.update(measure_timeslice(child, engine, decode_batch, prompt, settings.corun_seconds))
        decode_ms = engine.decode_steps(decode_batch)
    return Costs(model=path.name, device=str(settings.torch_device()), dtype=str(settings.torch_dtype()),
                 resolution=settings.image_resolution, image_tokens=image_tokens, preprocess_ms=preprocess_ms,
                 preprocess_threads=settings.preprocess_threads, vit_ms=vit_ms, prefill_ms=prefill_ms,
                 decode_ms=decode_ms, preprocess=mode, media_ms=measure_media(width, height, settings.image_format),
                 media_threads=MEDIA_THREADS, corun=corun, **moe_fields(config))


def moe_fields(config) -> dict[str, int]:
    """``Costs``' mixture-of-experts fields of a ``ModelConfig`` (0: dense)."""
    moe = config.text.moe
    return {"moe_experts": moe.num_experts if moe else 0, "moe_top_k": moe.top_k if moe else 0}


def _grid(settings, path) -> Grid:
    from shared.model.geometry import ImageGeometry

    width, height = settings.image_size
    return ImageGeometry.from_checkpoint(path).grid(height, width)


def spread(counts: list[int]) -> list[int]:
    """At most four image counts spanning ``counts`` (prefill is interpolated between them)."""
    if len(counts) <= 4:
        return counts
    picks = np.linspace(0, len(counts) - 1, 4).round().astype(int)
    return [counts[i] for i in picks]
