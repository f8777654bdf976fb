"""What every section shares: the run's settings and state (``Bench``), the timer, the engine built once
from a preset's architecture with random weights, and the prompts the sections feed it."""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shared.engine.engine import Engine
from shared.engine.kv_cache import KVCache
from shared.engine.runner import ModelRunner
from shared.engine.sampling import SamplingParams
from shared.engine.sequence import ImageInput, Sequence
from shared.engine.warmup import warm_thread
from shared.model import pieces
from shared.model.config import ModelConfig
from shared.model.geometry import ImageGeometry
from shared.model.loader import load_language_model
from shared.model.presets import PRESETS, materialize_preset


def log(*args) -> None:
    print(*args, flush=True)


class Timer:
    """Median milliseconds of ``fn`` over ``repeat`` runs (CUDA events on GPU, perf_counter on CPU)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def ms(self, fn, repeat: int = 20, warmup: int = 3) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeat):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)


@dataclass
class Bench:
    """One run: its options, the model's shapes, and what the sections build and measure on the way (the
    engine, once; this run's copy bandwidth and matmul rate, the floors' denominators)."""

    device: torch.device
    preset: str
    big: bool  # the preset's real shapes; False: a tiny random model (a smoke test, CPU works)
    config: ModelConfig
    geometry: ImageGeometry
    checkpoint: Path  # the preset's (or the tiny model's) config, tokenizer and processors
    out: Path
    decode1_contexts: list[int] = field(default_factory=lambda: [128])
    decode1_parts: bool = True
    prefill_lengths: list[int] = field(default_factory=lambda: [152, 512, 2132, 8192])
    prefill_graph_tokens: int = 4096
    vit_graph_patches: int = 16384
    kv_gb: float = 24.0
    build: dict = field(default_factory=dict)  # how the engine was built (graph capture, attention plans)
    engine: Engine | None = None
    lm: torch.nn.Module | None = None
    weights_bytes: int = 0
    bandwidth: float | None = None  # bytes/s, from the ceilings section
    matmul_rate: float | None = None  # FLOP/s, from the ceilings section

    def __post_init__(self) -> None:
        self.timer = Timer(self.device)
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.grid_1080p = self.geometry.grid(1080, 1920)  # (1, 78, 138) for Qwen2.5-VL, (1, 68, 120) for Qwen3-VL
        self.vocab = min(1000, self.config.text.vocab_size)
        per_block = KVCache.bytes_per_block(self.config.text, 16, self.dtype)
        self.kv_blocks = int(self.kv_gb * 1e9 // per_block) if self.big else 2048
        self.max_len = 16384 if self.big else 2048
        self.max_batch = 64 if self.big else 8
        self.decode_shape = (64, 2048) if self.big else (8, 64)  # the batch sections' rows × context

    def bandwidth_ms(self, nbytes: float) -> float:
        """Milliseconds to move ``nbytes`` at this run's copy bandwidth (inf without the ceilings section)."""
        return nbytes / (self.bandwidth or math.inf) * 1e3

    def compute_ms(self, flops: float) -> float:
        return flops / (self.matmul_rate or math.inf) * 1e3


def preset_config(name: str) -> ModelConfig:
    raw = dict(PRESETS[name])
    raw.update(eos_token_id=2, image_token_id=6, video_token_id=7, vision_start_token_id=3, vision_end_token_id=4)
    return ModelConfig.from_dict(raw)


def preset_bench(preset: str, device: torch.device, out: Path, **options) -> Bench:
    checkpoint = materialize_preset(preset)
    return Bench(device, preset, True, preset_config(preset), ImageGeometry.from_checkpoint(checkpoint), checkpoint,
                 out, **options)


def tiny_bench(family: str, device: torch.device, out: Path, **options) -> Bench:
    import tempfile

    from shared.model.tiny import write_tiny_checkpoint

    checkpoint = write_tiny_checkpoint(tempfile.mkdtemp(), family=family)
    return Bench(device, "tiny", False, ModelConfig.from_checkpoint(checkpoint),
                 ImageGeometry.from_checkpoint(checkpoint), checkpoint, out, **options)


def lm_bytes(lm: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in lm.parameters())


def new_seq(rid: str, tokens: list[int], max_tokens: int, images=None) -> Sequence:
    return Sequence(rid, tokens, len(tokens), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                    images=images or [])


def build_lm(bench: Bench) -> Engine:
    """The language model and an engine on it, built once per run as a serving worker builds them: decode
    graphs, prefill graphs between the attentions, the engine thread's attention plans."""
    if bench.engine is not None:
        return bench.engine
    cfg, dev = bench.config, bench.device
    t = time.perf_counter()
    lm = load_language_model(None, cfg, dev, bench.dtype, load_format="dummy")
    cache = KVCache(cfg.text, bench.kv_blocks, 16, bench.dtype, dev)
    runner = ModelRunner(lm, cache, cfg.vision.merge_size)
    engine = Engine(runner, (2,), bench.max_len, "both", max_num_seqs=bench.max_batch,
                    max_batched_tokens=16384, prefix_caching=False)  # repeated prompts compute each time
    if dev.type == "cuda":
        runner.capture_graphs(bench.max_batch, bench.max_len)
        if bench.prefill_graph_tokens:  # as a serving worker does (engine.settings.PREFILL_GRAPH_TOKENS)
            before, started = torch.cuda.memory_reserved(dev), time.perf_counter()
            pieces.capture(lm, bench.prefill_graph_tokens)
            bench.build["prefill_graphs"] = {"max_tokens": bench.prefill_graph_tokens,
                                             "seconds": round(time.perf_counter() - started, 1),
                                             "reserved_MB": (torch.cuda.memory_reserved(dev) - before) / 2**20}
    started = time.perf_counter()  # what a worker's engine thread does before serving (this thread steps here)
    bench.build["warm_thread"] = {"attention_plans": warm_thread(engine),
                                  "ms": round((time.perf_counter() - started) * 1e3, 1)}
    embedding = lm.embed_tokens.weight
    bench.weights_bytes = lm_bytes(lm) - (0 if cfg.text.tie_word_embeddings else embedding.numel() * embedding.element_size())
    bench.lm, bench.engine = lm, engine
    log(f"built LM ({lm_bytes(lm) / 1e9:.2f} GB, KV pool {cache.nbytes / 1e9:.1f} GB) in {time.perf_counter() - t:.1f}s; "
        f"{bench.build}")
    return engine


def forced_logits(engine: Engine, prompt: list[int], forced: list[int]) -> list[torch.Tensor]:
    """Logits of a prefill and of decode steps fed ``forced`` tokens (the same inputs for every variant)."""
    runner = engine.runner
    logits: list[torch.Tensor] = []
    sample = runner.sampler.sample
    runner.sampler.sample = lambda lg, *a: logits.append(lg[-1].float().cpu()) or sample(lg, *a)
    try:
        seq = new_seq(f"forced-{id(engine)}-{len(logits)}", list(prompt), len(forced) + 1)
        engine.add_prompt(seq)
        engine.step()
        for token in forced:
            seq.token_ids[-1] = token
            engine.step()
        engine.abort(seq.request_id)
    finally:
        runner.sampler.sample = sample
    return logits


def graph_replay_ms(bench: Bench, fn) -> float:
    """``fn`` run once (its kernels compile outside the capture), captured in a CUDA graph, and that graph's
    median replay in ms."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench.timer.ms(graph.replay, repeat=50, warmup=5)


def image_prompt(bench: Bench) -> tuple[list[int], list[ImageInput]]:
    """The four-1080p-image prompt of 10,903 tokens (a tiny one on the tiny model), its embeddings random
    rows as encoders ship them: Qwen3-VL's carry the deepstack levels too."""
    grid, images = (bench.grid_1080p, 4) if bench.big else ((1, 8, 8), 2)
    per_image = grid[1] * grid[2] // 4
    text = 10_903 - images * per_image if bench.big else 40
    tokens = [11] * (text // 2)
    slots = []
    for _ in range(images):
        slots.append(ImageInput(len(tokens), grid, torch.randn(per_image, bench.config.embedding_width,
                                                               dtype=bench.dtype, device=bench.device)))
        tokens += [6] * per_image
    tokens += [12] * (text - text // 2)
    return tokens, slots


def run_prefill(engine: Engine, tokens: list[int], images) -> None:
    seq = new_seq("prefill", list(tokens), 1, images=images)
    engine.add_prompt(seq)
    while engine.has_work():  # one step, or one per chunk
        engine.step()


def decode_batch(bench: Bench, name: str) -> list[Sequence]:
    """A running batch (64 × 2,048 tokens; 8 × 64 on the tiny model) whose KV was written straight into the
    pool (random values)."""
    engine, cfg = build_lm(bench), bench.config
    runner = engine.runner
    batch, context = bench.decode_shape
    seqs = []
    for i in range(batch):
        token = 10 + (i * 7919) % (bench.vocab - 10)  # distinct tokens: a MoE batch routes as real ones do
        seq = Sequence(f"{name}-{i}", [token] * context, context - 1,
                       SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True), num_computed=context - 1)
        engine.reserve(seq)
        slots = torch.tensor(runner.cache.slots(seq.block_table, 0, context - 1))
        runner.cache.scatter(slots, torch.randn(cfg.text.num_layers, 2, context - 1, cfg.text.num_kv_heads,
                                                cfg.text.head_dim, dtype=bench.dtype))
        engine.activate(seq.request_id)
        seqs.append(seq)
    return seqs


@contextlib.contextmanager
def without_pieces(model):
    """``model`` (a language model or a tower) runs its plain forward inside the block."""
    held, model.pieces = model.pieces, None
    try:
        yield
    finally:
        model.pieces = held


def experts_read(bench: Bench, seqs: list[Sequence]) -> int:
    """Experts one decode step of ``seqs`` reads (summed over MoE layers), from an eager step (a count syncs,
    so not in the graph); 0 for a dense model."""
    from bench.engine.roofline import TouchedExperts, expert_bytes

    lm, runner = bench.lm, bench.engine.runner
    if not expert_bytes(lm):
        return 0
    graphs, runner.graphs = runner.graphs, None
    try:
        with TouchedExperts(lm) as touched:
            runner.decode(seqs)
    finally:
        runner.graphs = graphs
    return touched.per_step()
