"""The Qwen3-VL language model (dense and MoE), over the same paged KV cache and attention backends.

What differs from Qwen2-VL's (``shared.model.text``, whose norms and dense MLP it reuses):

- attention: no q/k/v bias, an explicit ``head_dim`` and an RMSNorm over each head of q and k (QK-norm)
  before rotary;
- interleaved M-RoPE: the frequency bands cycle through the (t, h, w) axes instead of taking three
  contiguous runs;
- MLP: a mixture of experts on the layers the config names (``shared.model.moe``);
- deepstack: features of intermediate ViT blocks are added to the image tokens' hidden states after
  each of the first decoder layers (``shared.model.deepstack``).
"""

from __future__ import annotations

import torch
from torch import nn

from shared.model.config import TextConfig
from shared.model.deepstack import Deepstack
from shared.model.moe import SparseMoeBlock
from shared.model.rope import MRotaryEmbedding
from shared.model.text import MLP, Attention as Qwen2Attention, RMSNorm, few_rows, few_rows_layer, token_embedding


class InterleavedMRotaryEmbedding(MRotaryEmbedding):
    """Band ``j`` follows axis ``j mod 3`` (t, h, w, t, h, w, …) while that axis has bands left in
    ``mrope_section``; the bands past the h and w runs follow t."""

    def init_buffers(self) -> None:
        super().init_buffers()
        if self.axis_of_band.is_meta:
            return  # until materialized (see ``MRotaryEmbedding.init_buffers``)
        band = torch.arange(self.head_dim // 2, device=self.axis_of_band.device)
        axis = torch.zeros_like(band)
        for a in (1, 2):
            axis[(band % 3 == a) & (band < 3 * self.section[a])] = a
        self.axis_of_band = axis


class Attention(Qwen2Attention):
    def __init__(self, config: TextConfig, layer: int):
        super().__init__(config, layer)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    @property
    def qk_norm(self) -> tuple[RMSNorm, RMSNorm]:
        return self.q_norm, self.k_norm  # the backend applies them: on GPU in its rotary kernel


class DecoderLayer(nn.Module):
    def __init__(self, config: TextConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        moe = config.moe
        self.mlp = SparseMoeBlock(moe, config.hidden_size) if moe and layer in moe.layers else MLP(config)

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


class Qwen3LanguageModel(nn.Module):
    """Embedding → decoder layers (deepstack after the first ones) → norm; ``logits`` as in Qwen2-VL."""

    def __init__(self, config: TextConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = token_embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        rotary = InterleavedMRotaryEmbedding if config.mrope_interleaved else MRotaryEmbedding
        self.rotary = rotary(config.head_dim, config.rope_theta, config.mrope_section)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(token_ids)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, batch, backend,
                deepstack: Deepstack | None = None) -> torch.Tensor:
        """``embeds`` ``[T, hidden]``, ``positions`` ``[3, T]`` → final hidden states ``[T, hidden]``.
        ``deepstack``: level ``i`` is added to the image rows after decoder layer ``i``."""
        cos, sin = self.rotary(positions, embeds.dtype)
        x, residual = embeds, None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, cos, sin, batch, backend)
            if deepstack is not None and i < deepstack.num_levels:
                # the same rounding order as the reference: (residual + mlp) + level
                x, residual = deepstack.add(x + residual, i), None
        if residual is None:
            return self.norm(x)
        return self.norm.add_forward(x, residual)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
