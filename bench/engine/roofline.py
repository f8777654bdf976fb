"""Floors for the engine benchmark: the bytes a decode step must read and the FLOPs a prefill or a ViT
forward must do, for dense and mixture-of-experts models alike.

A decode step reads every weight it uses once: for a dense model all of them (the input embedding
table aside: one row per token), for a MoE model everything but the experts (attention, norms, the
routers, the LM head) plus the experts the batch's tokens actually route to — counted in an eager
forward of the same batch (``TouchedExperts``), not assumed. Prefill FLOPs count the active
parameters per token (``top_k`` experts, not all) and causal attention over the query width
(heads × head_dim, which Qwen3 decouples from the hidden size).
"""

from __future__ import annotations

from torch import nn

from shared.model.config import ModelConfig, VisionConfig
from shared.model.moe import Experts, SparseMoeBlock


def _bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def expert_bytes(lm: nn.Module) -> int:
    """Bytes of one expert of one layer (its gate, up and down rows); 0 for a dense model."""
    for module in lm.modules():
        if isinstance(module, Experts):
            return _bytes([module.gate_up_proj, module.down_proj]) // module.gate_up_proj.shape[0]
    return 0


def shared_weight_bytes(lm: nn.Module) -> int:
    """Bytes every decode step reads whatever the routing: all weights but the experts and the input
    embedding table (unless the LM head shares it)."""
    experts = {id(p) for m in lm.modules() if isinstance(m, Experts) for p in m.parameters()}
    skip = set() if lm.config.tie_word_embeddings else {id(lm.embed_tokens.weight)}
    return _bytes(p for p in lm.parameters() if id(p) not in experts | skip)


class TouchedExperts:
    """Within the block: how many distinct experts each MoE layer's router picked, per forward pass
    (eager only: counting syncs with the host). Read from the router's logits (the top k of the
    softmax are the top k logits), so the kernels' path and the reference path count alike."""

    def __init__(self, lm: nn.Module):
        self.blocks = [m for m in lm.modules() if isinstance(m, SparseMoeBlock)]
        self.counts: list[int] = []

    def _count(self, block: SparseMoeBlock, logits) -> None:
        self.counts.append(logits.topk(block.top_k, dim=-1).indices.unique().numel())

    def __enter__(self) -> "TouchedExperts":
        for block in self.blocks:  # every path (forward, or the few-rows layer) ends in finish(x, logits)
            def finish(x, logits, block=block, inner=block.finish):
                self._count(block, logits)
                return inner(x, logits)
            block.finish = finish
        return self

    def __exit__(self, *exc) -> None:
        for block in self.blocks:
            del block.finish  # the class's method again

    def per_step(self) -> int:
        """Experts read by one forward (every MoE layer once), from the last forward recorded."""
        return sum(self.counts[-len(self.blocks):]) if self.blocks else 0


def decode_bytes(lm: nn.Module, experts_read: int, kv_bytes: int) -> int:
    return shared_weight_bytes(lm) + experts_read * expert_bytes(lm) + kv_bytes


def prefill_flops(config: ModelConfig, tokens: int) -> float:
    """One prefill of ``tokens`` tokens of one sequence, logits of the last token only."""
    t = config.text
    q_width, kv_width = t.num_heads * t.head_dim, t.num_kv_heads * t.head_dim
    attention_params = t.hidden_size * (2 * q_width + 2 * kv_width)  # q, k, v and o projections
    per_layer = []
    for layer in range(t.num_layers):
        if t.moe and layer in t.moe.layers:
            mlp = t.moe.top_k * 3 * t.hidden_size * t.moe.intermediate_size + t.hidden_size * t.moe.num_experts
        else:
            mlp = 3 * t.hidden_size * t.intermediate_size
        per_layer.append(attention_params + mlp)
    linear = 2 * tokens * sum(per_layer)
    attention = 2 * tokens * tokens * q_width * t.num_layers  # causal: half of 4·T²·width per layer
    return linear + attention + 2 * t.hidden_size * t.vocab_size


def vit_flops(vision: VisionConfig, patches: int, images: int) -> float:
    """``images`` images of ``patches`` patches each through the tower (full attention per image)."""
    w, merged = vision.width, vision.width * vision.merge_size ** 2
    blocks = vision.depth * (2 * patches * (4 * w * w + 2 * w * vision.mlp_hidden) + 4 * patches * patches * w)
    mergers = (1 + len(vision.deepstack_layers)) * 2 * (patches // vision.merge_size ** 2) * (
        merged * merged + merged * vision.out_dim)
    return images * (2 * patches * vision.patch_dim * w + blocks + mergers)
