"""The Qwen2-VL / Qwen2.5-VL language model (both families share it), over a paged KV cache.

Tokens of a batch travel packed, ``[T, hidden]``, with no padding: the attention backend reads the
batch layout (prefill sequences or decode rows) from ``batch``. Projections are fused (q|k|v and
gate|up) so a step makes fewer, larger matrix products; the loader fuses the checkpoint's tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shared.kernels import enabled, fused, gemv
from shared.model.config import TextConfig
from shared.model.rope import MRotaryEmbedding


def token_embedding(vocab_size: int, hidden_size: int) -> nn.Embedding:
    """An ``nn.Embedding`` whose weight is left uninitialized: the loader fills it. Models are built on the
    meta device, where Embedding's own normal_ init runs torch's Python reference, whose first call
    imports torch._dynamo (~1 s of CPU in every language worker)."""
    return nn.Embedding(vocab_size, hidden_size, _weight=torch.empty(vocab_size, hidden_size))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and enabled("fused"):
            return fused.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add fused into the norm on GPU."""
        if x.is_cuda and enabled("fused"):
            return fused.add_rms_norm(x, residual, self.weight, self.eps), residual
        residual = residual + x
        return self(residual), residual


class Attention(nn.Module):
    def __init__(self, config: TextConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.fused_offsets = [0, self.q_size, self.q_size + self.kv_size]  # where q, k, v start in qkv_proj
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)

    qk_norm = None  # Qwen3: (q's norm, k's norm) over each head before rotary

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch, backend) -> torch.Tensor:
        return self.o_proj(self.attend(self.qkv_proj(x), cos, sin, batch, backend))

    def attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch, backend) -> torch.Tensor:
        """The fused projection's output ``[T, q|k|v]`` → attention's ``[T, heads · head_dim]``, before ``o_proj``."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        # (QK-norm,) rotary, cache write, attention
        out = backend.forward(self.layer, q, k, v, cos, sin, batch, qk_norm=self.qk_norm)
        return out.reshape(-1, self.q_size)


class MLP(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.fused_offsets = [0, self.intermediate]  # gate, then up
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    finish_reads_input = False

    @property
    def first(self) -> nn.Linear:
        """The projection the MLP starts with (``few_rows_layer`` fuses the norm before it into it)."""
        return self.gate_up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(x, self.gate_up_proj(x))

    def finish(self, x: torch.Tensor | None, gate_up: torch.Tensor) -> torch.Tensor:
        """The rest after ``first``."""
        if gate_up.is_cuda and enabled("fused"):
            act = fused.silu_mul(gate_up)
            if few_rows(act) and gemv.suits(self.down_proj.weight):
                return gemv.linear(act, self.down_proj.weight)
            return self.down_proj(act)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def few_rows(x: torch.Tensor) -> bool:
    """Whether ``x``'s rows go through ``shared.kernels.gemv`` (decode at batch 1, on GPU: ``gemv.MAX_ROWS``)."""
    return x.is_cuda and enabled("gemv") and x.shape[0] <= gemv.MAX_ROWS


def few_rows_layer(layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None, cos, sin, batch, backend):
    """A decoder layer's forward for a few rows: each projection whose weight ``gemv.suits`` a GEMV with the
    RMSNorm before it fused in (``shared.kernels.gemv``), launched back to back with the layer's other
    Triton kernels (``shared.kernels.launch``); larger ones as in ``DecoderLayer.forward``. Same inputs,
    outputs and rounding points as that."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv, residual, _ = norm_then(layer.input_layernorm, x, residual, attn.qkv_proj)
    out = attn.attend(qkv, cos, sin, batch, backend)
    o = gemv.linear(out, attn.o_proj.weight) if gemv.suits(attn.o_proj.weight) else attn.o_proj(out)
    first, residual, h = norm_then(layer.post_attention_layernorm, o, residual, mlp.first, keep=mlp.finish_reads_input)
    return mlp.finish(h, first), residual


def norm_then(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None, linear: nn.Linear, keep: bool = False):
    """``linear(norm(x + residual))`` → (that, the new residual, the normalized rows where ``keep``)."""
    if gemv.suits(linear.weight):
        return gemv.norm_linear(x, residual, norm.weight, norm.eps, linear.weight, linear.bias, keep=keep)
    h, residual = (norm(x), x) if residual is None else norm.add_forward(x, residual)
    return linear(h), residual, h


class DecoderLayer(nn.Module):
    """Subclasses change the attention (``attention``) and which MLP a layer has (``make_mlp``)."""

    attention = Attention

    def __init__(self, config: TextConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self.attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = self.make_mlp(config, layer)

    def make_mlp(self, config: TextConfig, layer: int) -> nn.Module:
        return MLP(config)

    def forward(self, x, residual, cos, sin, batch, backend):
        """``x`` is the previous layer's output not yet added to ``residual`` (None: ``x`` is the whole
        hidden state, as for the first layer and after a deepstack injection)."""
        if few_rows(x):
            return few_rows_layer(self, x, residual, cos, sin, batch, backend)
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, cos, sin, batch, backend)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class LanguageModel(nn.Module):
    """Embedding → decoder layers → norm; ``logits`` applies the LM head to the rows that need it.
    Subclasses change the layers (``decoder_layer``) and the rotary embedding (``make_rotary``)."""

    decoder_layer = DecoderLayer
    pieces = None  # shared.model.pieces.Pieces once captured: prefill steps up to their size run there

    def __init__(self, config: TextConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = token_embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.decoder_layer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = self.make_rotary(config)

    def make_rotary(self, config: TextConfig) -> MRotaryEmbedding:
        return MRotaryEmbedding(config.head_dim, config.rope_theta, config.mrope_section)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(token_ids)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, batch, backend) -> torch.Tensor:
        """``embeds`` ``[T, hidden]``, ``positions`` ``[3, T]`` → final hidden states ``[T, hidden]``."""
        cos, sin = self.rotary(positions, embeds.dtype)
        if self.in_pieces(embeds, batch):
            return self.through_pieces(embeds, cos, sin, batch, backend)
        x, residual = embeds, None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, batch, backend)
        return self.norm.add_forward(x, residual)[0]

    def in_pieces(self, embeds: torch.Tensor, batch) -> bool:
        """Whether this forward runs through ``pieces``: prefill and mixed steps they have a bucket for
        (decode steps have graphs of their own, captured through the plain forward)."""
        return self.pieces is not None and batch.is_prefill and self.pieces.bucket(embeds.shape[0]) is not None

    def through_pieces(self, embeds, cos, sin, batch, backend, between=None) -> torch.Tensor:
        """``forward`` through ``pieces``: each layer's attention eager, the rest CUDA graphs."""
        x, residual = self.pieces.run(
            embeds, lambda i, qkv: self.layers[i].self_attn.attend(qkv, cos, sin, batch, backend), between)
        return self.norm.add_forward(x, residual)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
