"""CUDA graphs for a transformer's layers, captured a piece between two attentions at a time: the language
model's prefill and mixed steps, the vision tower's forward.

Launched kernel by kernel, a short input waits on the host: on an H200, Qwen3-VL-30B-A3B's 152-token
prefill took 40 ms of which its kernels ran 10 — some 1,100 launches (norms, projections, the MoE's
routing and grouped GEMMs, attention) at ~30 µs of Python each, the GPU idle between them
(``bench/gpu_engine.py --sections prefill_sizes``); Qwen3-VL's tower took 16.7 ms for one 448² image
and 22.3 ms for ten (``tools.plan.floor``), the same launches whatever the patch count. Decode steps
are captured whole (``shared.engine.graphs``), but attention depends on the batch's layout — how many
prompts or images, where each starts, cached prefixes, decode rows riding along, windows — while
everything else in a layer works row by row and depends on the row count alone. So, as vLLM's piecewise
graphs do, the rest is captured per bucket of row counts and the attention stays eager:

- ``pre`` of layer i: ``residual += x``; ``h = norm_a(residual)``; ``qkv = h · W_qkvᵀ (+ b)``;
- the caller's attention over the real rows (eager), its output copied into the attention buffer;
- ``post`` of layer i: ``o = attention · W_oᵀ (+ b)``; ``residual += o``; ``h = norm_b(residual)``;
  ``x = mlp(h)``;
- after the last layer, the caller's own end (a final norm, the tower's merger) over ``residual + x``.

Both layer conventions fit: the language model's and Qwen2.5-VL's tower's (the residual add fused into
the next norm) and Qwen3-VL's tower's (``x = x + attn(norm1(x)); x = x + mlp(norm2(x))``: the same sums,
rounded in the same order). The pieces read and write four buffers ``[largest bucket, ·]`` every bucket
shares (x, residual, q|k|v, attention output); their intermediates come from one graph pool, free again
when each piece ends, so every piece of every bucket reuses the same memory. Rows are padded up to the
bucket: padding rows are zeroed at the start of each forward and, every op outside attention working
row by row, never reach a real row. The first layer starts from ``residual = input, x = 0`` (``residual
+ 0`` is the residual exactly, so no piece needs a variant without a residual). Work between two layers
(Qwen3-VL's deepstack: levels added to the LM's image rows, merged out of the tower's hidden states)
sees ``residual + x``, rounded, as the eager forward's hidden state, and leaves ``x = 0``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from shared.kernels import sdpa
from shared.logging import get_logger

log = get_logger(__name__)

# the language model's step sizes: at most 25 % more rows up to 1,024, at most 128 more above, where a step is
# bound by its kernels and padding costs what it adds (Qwen2.5-VL-7B's 2,132-token prefill: 52.5 ms padded to
# 2,304 against 49.5 ms eager; Qwen3-VL-30B-A3B's, still host-bound: 48.3 against 62.5 ms)
TOKEN_BUCKETS = (16, 32, 64, 128, 256, 384, 512, 640, 768, 896, *range(1024, 4097, 128), 5120, 6144, 7168, 8192)
# the vision tower's patch counts (a 448² image: 784 patches; ten: 7,840; a 1080p image: 8,160)
PATCH_BUCKETS = (256, 512, 768, 1024, 1536, *range(2048, 16385, 512))


def buckets(limit: int, ladder: tuple[int, ...] = TOKEN_BUCKETS) -> list[int]:
    """The ladder's buckets up to ``limit`` (``limit`` itself the last when it is not one)."""
    chosen = [b for b in ladder if b < limit]
    return chosen + [limit] if limit >= 1 else []


@dataclass(frozen=True)
class LayerParts:
    """The modules of one layer the pieces run: norm, q|k|v projection | attention | output projection, norm, MLP."""

    norm_a: nn.Module
    qkv: nn.Linear
    out: nn.Linear
    norm_b: nn.Module
    mlp: nn.Module


class Pieces:
    """``layers`` as pieces between attentions, for inputs of up to ``buckets[-1]`` rows; ``capture`` records
    each piece of each bucket as a CUDA graph (until then, or on CPU, the pieces run eagerly: the same
    arithmetic, as the CPU tests check it)."""

    def __init__(self, layers: list[LayerParts], bucket_sizes: list[int], name: str):
        self.layers = layers
        self.buckets = bucket_sizes
        self.name = name
        qkv = layers[0].qkv.weight
        device, dtype, rows = qkv.device, qkv.dtype, bucket_sizes[-1]
        self.x = torch.zeros(rows, qkv.shape[1], device=device, dtype=dtype)
        self.residual = torch.zeros_like(self.x)
        self.qkv = torch.zeros(rows, qkv.shape[0], device=device, dtype=dtype)
        self.attn = torch.zeros(rows, layers[0].out.weight.shape[1], device=device, dtype=dtype)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}  # bucket → pre 0, post 0, pre 1, …
        self.pool = None  # the graphs' memory pool, once captured
        self.layouts: LayoutGraphs | None = None  # a vision tower's whole forwards, per recurring layout

    def bucket(self, rows: int) -> int | None:
        return next((b for b in self.buckets if b >= rows), None)

    # -- the pieces ------------------------------------------------------------------------------------
    def _pre(self, rows: int, i: int) -> None:
        layer = self.layers[i]
        h = _add_norm(layer.norm_a, self.x[:rows], self.residual[:rows])
        _linear_into(layer.qkv, h, self.qkv[:rows])

    def _post(self, rows: int, i: int) -> None:
        layer = self.layers[i]
        h = _add_norm(layer.norm_b, layer.out(self.attn[:rows]), self.residual[:rows])
        self.x[:rows].copy_(layer.mlp(h))

    def _piece(self, rows: int, index: int) -> None:
        graphs = self.graphs.get(rows)
        if graphs is not None:
            graphs[index].replay()
        else:
            (self._post if index % 2 else self._pre)(rows, index // 2)

    # -- a forward --------------------------------------------------------------------------------------
    def run(self, first: torch.Tensor, attention: Callable[[int, torch.Tensor], torch.Tensor],
            between: dict[int, Callable[[torch.Tensor], None]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers over ``first`` ``[n, hidden]`` (n ≤ the largest bucket): ``attention(i, qkv)`` is layer
        i's attention over the real rows' q|k|v ``[n, ·]``, returning ``[n, ·]`` before the output projection;
        after layer i, ``between[i]`` gets the hidden state ``[n, hidden]`` (changes it in place or reads it).
        Returns (x, residual) ``[n, hidden]``, whose sum is the last layer's output."""
        n = first.shape[0]
        rows = self.bucket(n)
        x, residual, attn = self.x[:rows], self.residual[:rows], self.attn[:rows]
        residual[:n].copy_(first)
        residual[n:].zero_()
        attn[n:].zero_()
        x.zero_()
        for i in range(len(self.layers)):
            self._piece(rows, 2 * i)
            attn[:n].copy_(attention(i, self.qkv[:n]))
            self._piece(rows, 2 * i + 1)
            if between and i in between:  # as the eager forward's hidden state: residual + x, rounded
                residual.add_(x)
                x.zero_()
                between[i](residual[:n])
        return x[:n], residual[:n]

    @torch.inference_mode()
    def capture(self) -> None:
        """Each piece of each bucket as a CUDA graph, largest bucket first, all in one pool."""
        started = time.perf_counter()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        pool = None
        with torch.cuda.stream(stream):
            for rows in reversed(self.buckets):
                graphs = []
                for index in range(2 * len(self.layers)):
                    self._piece(rows, index)  # warm-up: compiles kernels, settles cuBLAS's workspace
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        self._piece(rows, index)
                    pool = graph.pool()
                    graphs.append(graph)
                self.graphs[rows] = graphs
        self.pool = pool
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.x.zero_(), self.residual.zero_(), self.qkv.zero_(), self.attn.zero_()
        log.info("piece_graphs.captured", model=self.name, buckets=self.buckets,
                 graphs=sum(map(len, self.graphs.values())), seconds=round(time.perf_counter() - started, 1))


def language_pieces(model: nn.Module, max_tokens: int) -> Pieces:
    """The language model's decoder layers (``shared.model.text``), for steps of up to ``max_tokens`` tokens."""
    parts = [LayerParts(layer.input_layernorm, layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                        layer.post_attention_layernorm, layer.mlp) for layer in model.layers]
    return Pieces(parts, buckets(max_tokens), "language")


def vision_pieces(tower: nn.Module, max_patches: int) -> Pieces:
    """A vision tower's blocks (``shared.model.vision``, ``shared.model.qwen3_vision``), for forwards of up to
    ``max_patches`` patches."""
    parts = [LayerParts(block.norm1, block.attn.qkv, block.attn.proj, block.norm2, block.mlp)
             for block in tower.blocks]
    return Pieces(parts, buckets(max_patches, PATCH_BUCKETS), "vision")


def capture(model: nn.Module, limit: int, layouts: int = 0) -> Pieces:
    """Capture the pieces of ``model`` (a language model: ``limit`` tokens; a vision tower: patches) and hand
    them to its forward. They need the weights alone (no KV): a language worker captures them before sizing
    its KV pool, which so leaves their memory to them. ``layouts``: a vision tower also captures up to that
    many whole forwards of recurring batch layouts (``LayoutGraphs``), in the same pool."""
    vision = hasattr(model, "blocks")
    pieces = (vision_pieces if vision else language_pieces)(model, limit)
    pieces.capture()
    if vision and layouts > 0:
        pieces.layouts = LayoutGraphs(pieces.pool, layouts, pieces.buckets[-1], model.patch_embed.proj.weight)
    model.pieces = pieces
    return pieces


@dataclass
class _LayoutGraph:
    graph: torch.cuda.CUDAGraph
    rows: int
    output: torch.Tensor  # the graph's, in its pool: copied out after every replay
    context: object  # the layout's device tensors the graph reads (rotary tables, indices): kept alive with it


class LayoutGraphs:
    """A vision tower's whole forward as one CUDA graph per recurring batch layout (the images' grids, in
    order), attention included.

    The pieces leave 27 eager attentions (and each layer's Python) to a forward, which the host must keep
    up with: ten 448² images through Qwen3-VL's tower queued their kernels in 15 ms of the forward's 25
    on an idle H200, and under a Dynamo-1024 load, the engine thread sharing the interpreter with the
    event loop, in 29 ms of 41 (the GPU waiting on the host throughout; ``vit_forward_launch`` beside
    ``vit_forward_gpu`` in the encoders' stats). A layout fixes every shape and index of a forward, so the
    graph of one replays the same kernels on the same addresses. Its patches are copied into one input
    buffer every layout's graph reads (the forwards of one tower run one at a time, in one thread), its
    output copied out after the replay (the layouts share the pieces' pool).

    A layout is captured at its ``after``-th forward (one-off mixes of images stay eager), attention in
    cuDNN where usable (``sdpa.settled``: a layout that recurs pays cuDNN's plan once, at capture; the flash
    kernel where that capture fails), at most ``limit`` layouts and only those of up to ``rows`` patches
    (larger forwards are bound by their kernels). A layout whose captures both fail stays eager for good,
    with a warning."""

    def __init__(self, pool, limit: int, rows: int, like: torch.Tensor, after: int = 2):
        self.pool = pool
        self.limit = limit
        self.rows = rows
        self.after = after
        self.device = like.device
        self.input = torch.zeros(rows, like.shape[1], device=like.device, dtype=like.dtype)
        self.entries: dict[tuple, _LayoutGraph] = {}
        self.seen: dict[tuple, int] = {}  # forwards per layout not captured yet (at most 1,024 layouts counted)
        self.failed: set[tuple] = set()
        self.replays = 0

    def run(self, key: tuple, patches: torch.Tensor, prepare: Callable[[], object],
            body: Callable[[torch.Tensor, object], torch.Tensor]) -> torch.Tensor | None:
        """``body(patches, prepare())`` — device work alone, no host syncs, no copies from the host — through
        the layout's graph (captured now when due); None when the layout runs eagerly (the caller runs it)."""
        entry = self.entries.get(key)
        if entry is None:
            entry = self._due(key, patches, prepare, body)
            if entry is None:
                return None
        self.input[:entry.rows].copy_(patches)  # in the tower's dtype, as its patch embedding takes them
        with torch.cuda.device(self.device):  # the graph launches on the current stream of the current device
            entry.graph.replay()
        self.replays += 1
        return entry.output.clone()

    def _due(self, key, patches, prepare, body) -> _LayoutGraph | None:
        rows = patches.shape[0]
        if key in self.failed or len(self.entries) >= self.limit or rows > self.rows:
            return None
        if key not in self.seen and len(self.seen) >= 1024:  # a long tail of one-off layouts: forget them
            self.seen.clear()
        self.seen[key] = self.seen.get(key, 0) + 1
        if self.seen[key] < self.after:
            return None
        del self.seen[key]
        started = time.perf_counter()
        for attention in ("cudnn", "flash"):  # a shape cuDNN refuses inside a capture gets the flash kernel
            try:
                entry = self._capture(rows, prepare, body, attention)
            except Exception as err:  # noqa: BLE001 -- any capture failure leaves the layout eager
                log.warning("layout_graph.capture_failed", patches=rows, attention=attention,
                            error=f"{type(err).__name__}: {err}"[:300])
                torch.cuda.synchronize(self.device)
                continue
            self.entries[key] = entry
            log.info("layout_graph.captured", patches=rows, layouts=len(self.entries), attention=attention,
                     seconds=round(time.perf_counter() - started, 3))
            return entry
        self.failed.add(key)
        return None

    @torch.inference_mode()
    def _capture(self, rows: int, prepare, body, attention: str) -> _LayoutGraph:
        context = prepare()
        x = self.input[:rows]
        caller = torch.cuda.current_stream(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(caller)
        with sdpa.settled(attention), torch.cuda.device(self.device), torch.cuda.stream(stream):
            body(x, context)  # warm-up: cuDNN's plan, Triton's compiles, cuBLAS's workspace
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            # not ``torch.cuda.graph``: it synchronizes the device and empties the allocator's caches (device
            # and pinned host memory), which a serving process would refill with fresh allocations; and
            # thread-local: the process's other threads (the event loop's pulls) keep using the device
            graph.capture_begin(*(() if self.pool is None else (self.pool,)), capture_error_mode="thread_local")
            try:
                output = body(x, context)
            finally:
                graph.capture_end()
        caller.wait_stream(stream)
        return _LayoutGraph(graph, rows, output, context)


def _add_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual += x`` in place (the buffer the next piece reads) and the norm of it."""
    add_forward = getattr(norm, "add_forward", None)
    if add_forward is None:  # LayerNorm (Qwen3-VL's tower): the sum, rounded, then the norm
        residual.add_(x)
        return norm(residual)
    h, summed = add_forward(x, residual)
    if summed is not residual:  # the torch path returns a new tensor; the fused kernel adds in place
        residual.copy_(summed)
    return h


def _linear_into(linear: nn.Linear, h: torch.Tensor, out: torch.Tensor) -> None:
    """``out = F.linear(h, linear.weight, linear.bias)``, written into ``out`` (the op ``F.linear`` runs)."""
    if linear.bias is None:
        torch.mm(h, linear.weight.t(), out=out)
    else:
        torch.addmm(linear.bias, h, linear.weight.t(), out=out)
