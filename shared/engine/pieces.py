"""CUDA graphs for prefill and mixed steps, captured a piece between two attentions at a time.

A prefill step launched kernel by kernel is bound by the host when its prompt is short: on an H200,
Qwen3-VL-30B-A3B's 152-token prefill took 40 ms, of which its kernels ran 10 — some 1,100 launches
(norms, projections, the MoE's routing and grouped GEMMs, attention) at ~30 µs of Python each, the GPU
idle between them (``bench/gpu_engine.py --sections prefill_sizes``). Decode steps are captured whole
(``shared.engine.graphs``), but a prefill step's attention depends on the batch's layout — how many
prompts, where each starts, cached prefixes, decode rows riding along — while everything else in a
decoder layer works row by row and depends on the token count alone. So, as vLLM's piecewise graphs
do, the rest is captured per bucket of token counts and the attention stays eager:

- ``pre`` of layer i: ``residual += x``; ``h = input_norm(residual)``; ``qkv = h · W_qkvᵀ``;
- the backend's attention over the step's real rows (eager), its output copied into the attention buffer;
- ``post`` of layer i: ``o = attention · W_oᵀ``; ``residual += o``; ``h = post_norm(residual)``;
  ``x = mlp(h)``;
- after the last layer the final norm (eager, one kernel).

The pieces read and write four buffers ``[largest bucket, ·]`` that every bucket shares (x, residual,
q|k|v, attention output); their intermediates come from one graph pool, free again when each piece
ends, so every piece of every bucket reuses the same memory. A step's rows are padded up to the bucket:
the padding rows are zeroed at the start of each step and, every op outside attention working row by
row, never reach a real row. The first layer starts from ``residual = embeddings, x = 0`` (the sum
``residual + 0`` is the residual exactly, so no piece needs a variant without a residual); Qwen3-VL's
deepstack levels are added between pieces as the eager forward adds them (``residual + x``, rounded,
then the level added to the image rows).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from shared.logging import get_logger

log = get_logger(__name__)

# token counts a step is padded up to: at most 25 % more rows up to 1,024, at most 128 more above, where a step is
# bound by its kernels and padding costs what it adds (Qwen2.5-VL-7B's 2,132-token prefill: 52.5 ms padded to
# 2,304 against 49.5 ms eager; Qwen3-VL-30B-A3B's, still host-bound: 48.3 against 62.5 ms)
BUCKETS = (16, 32, 64, 128, 256, 384, 512, 640, 768, 896, *range(1024, 4097, 128), 5120, 6144, 7168, 8192)


def buckets(max_tokens: int) -> list[int]:
    """The buckets up to ``max_tokens`` (``max_tokens`` itself the last when it is not one)."""
    chosen = [b for b in BUCKETS if b < max_tokens]
    return chosen + [max_tokens] if max_tokens >= 1 else []


class Pieces:
    """The decoder layers of ``model`` as pieces between attentions, for steps of up to ``max_tokens``
    tokens; ``capture`` records each piece of each bucket as a CUDA graph (else the pieces run eagerly:
    the same arithmetic, as the CPU tests check it)."""

    def __init__(self, model: nn.Module, max_tokens: int):
        self.layers = list(model.layers)
        self.norm = model.norm
        self.buckets = buckets(max_tokens)
        first = self.layers[0]
        weight = first.self_attn.qkv_proj.weight
        device, dtype = weight.device, weight.dtype
        hidden, rows = weight.shape[1], self.buckets[-1]
        self.x = torch.zeros(rows, hidden, device=device, dtype=dtype)
        self.residual = torch.zeros(rows, hidden, device=device, dtype=dtype)
        self.qkv = torch.zeros(rows, weight.shape[0], device=device, dtype=dtype)
        self.attn = torch.zeros(rows, first.self_attn.o_proj.weight.shape[1], device=device, dtype=dtype)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}  # bucket → pre 0, post 0, pre 1, …

    def bucket(self, tokens: int) -> int | None:
        return next((b for b in self.buckets if b >= tokens), None)

    # -- the pieces ------------------------------------------------------------------------------------
    def _pre(self, rows: int, i: int) -> None:
        layer = self.layers[i]
        h = _add_norm(layer.input_layernorm, self.x[:rows], self.residual[:rows])
        _linear_into(layer.self_attn.qkv_proj, h, self.qkv[:rows])

    def _post(self, rows: int, i: int) -> None:
        layer = self.layers[i]
        o = layer.self_attn.o_proj(self.attn[:rows])
        h = _add_norm(layer.post_attention_layernorm, o, self.residual[:rows])
        self.x[:rows].copy_(layer.mlp(h))

    def _piece(self, rows: int, index: int) -> None:
        graphs = self.graphs.get(rows)
        if graphs is not None:
            graphs[index].replay()
        else:
            (self._post if index % 2 else self._pre)(rows, index // 2)

    # -- a step -----------------------------------------------------------------------------------------
    def forward(self, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch, backend,
                deepstack=None) -> torch.Tensor:
        """The decoder layers and the final norm over ``embeds`` ``[T, hidden]`` (T ≤ the largest bucket):
        what ``LanguageModel.forward`` returns, its attention run by ``backend`` over ``batch``."""
        tokens = embeds.shape[0]
        rows = self.bucket(tokens)
        x, residual, attn = self.x[:rows], self.residual[:rows], self.attn[:rows]
        residual[:tokens].copy_(embeds)
        residual[tokens:].zero_()
        attn[tokens:].zero_()
        x.zero_()
        for i, layer in enumerate(self.layers):
            self._piece(rows, 2 * i)
            attn[:tokens].copy_(layer.self_attn.attend(self.qkv[:tokens], cos, sin, batch, backend))
            self._piece(rows, 2 * i + 1)
            if deepstack is not None and i < deepstack.num_levels:  # as the eager forward: (residual + x) + level
                residual.add_(x)
                x.zero_()
                deepstack.add(residual, i)
        return self.norm.add_forward(x[:tokens], residual[:tokens])[0]

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
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.x.zero_(), self.residual.zero_(), self.qkv.zero_(), self.attn.zero_()
        log.info("prefill_graphs.captured", buckets=self.buckets, graphs=sum(map(len, self.graphs.values())),
                 seconds=round(time.perf_counter() - started, 1))


def capture(model: nn.Module, max_tokens: int) -> Pieces:
    """Capture ``model``'s pieces for steps of up to ``max_tokens`` tokens and hand them to its forward. They
    need the weights alone (no KV): a worker captures them before sizing its KV pool, which so leaves their
    memory to them."""
    pieces = Pieces(model, max_tokens)
    pieces.capture()
    model.pieces = pieces
    return pieces


def _add_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual += x`` in place (the buffer the next piece reads) and the norm of it."""
    h, summed = norm.add_forward(x, residual)
    if summed is not residual:  # the torch path returns a new tensor; the fused kernel adds in place
        residual.copy_(summed)
    return h


def _linear_into(linear: nn.Linear, h: torch.Tensor, out: torch.Tensor) -> None:
    """``out = F.linear(h, linear.weight, linear.bias)``, written into ``out`` (the op ``F.linear`` runs)."""
    if linear.bias is None:
        torch.mm(h, linear.weight.t(), out=out)
    else:
        torch.addmm(linear.bias, h, linear.weight.t(), out=out)
