"""The mixture-of-experts MLP of Qwen3-VL-MoE: a top-k router and SwiGLU experts stored as 3-D tensors.

Each token's router picks ``top_k`` of ``num_experts`` experts (softmax over all, top-k, renormalized
to sum to 1 with ``norm_topk_prob``); its output is the routing-weighted sum of those experts'
outputs. On GPU the experts run as two grouped GEMMs over the tokens sorted by expert, or for a few
tokens (decode) as two GEMVs that need no sorting (``shared.kernels.moe``); the torch path below is
the fp32 reference, looping over the experts a batch touches in the order HF transformers does, so
its sums round the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shared.kernels import enabled, moe as moe_kernels
from shared.model.config import MoEConfig


class Experts(nn.Module):
    """Every expert's weights in two tensors, in transformers 5's layout (out features before in)."""

    def __init__(self, config: MoEConfig, hidden: int):
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(config.num_experts, 2 * self.intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(config.num_experts, hidden, self.intermediate))

    def reference(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for expert in ids.unique().tolist():
            token, slot = torch.where(ids == expert)
            gate, up = F.linear(x[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert]) * weights[token, slot, None]
            out.index_add_(0, token, y)
        return out


class SparseMoeBlock(nn.Module):
    def __init__(self, config: MoEConfig, hidden: int):
        super().__init__()
        self.top_k = config.top_k
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(hidden, config.num_experts, bias=False)  # the router
        self.experts = Experts(config, hidden)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits ``[T, E]`` → routing weights (the model's dtype) and expert ids, both ``[T, top_k]``."""
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), ids

    finish_reads_input = True

    @property
    def first(self) -> nn.Linear:
        """The projection the block starts with: the router (``few_rows_layer`` fuses the norm into it)."""
        return self.gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(x, self.gate(x))

    def finish(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The experts for the router's ``logits`` of ``x``."""
        if x.is_cuda and enabled("moe"):  # routing and the experts in Triton kernels
            experts = self.experts
            return moe_kernels.moe(x, logits, experts.gate_up_proj, experts.down_proj, self.top_k,
                                   self.norm_topk_prob)[0]
        weights, ids = self.route(logits)
        return self.experts.reference(x, weights, ids)

    def checkpoint_layout(self, local: str, tensor: torch.Tensor) -> torch.Tensor:
        """The published Qwen3-VL-MoE checkpoints store experts as ``[E, in, out]``; transformers 5 (and
        we) as ``[E, out, in]``. Like transformers, a tensor already of our shape is taken as it is."""
        if local in ("experts.gate_up_proj", "experts.down_proj"):
            expected = getattr(self.experts, local.split(".", 1)[1]).shape
            if tensor.shape != expected and tensor.dim() == 3 and tensor.transpose(1, 2).shape == expected:
                return tensor.transpose(1, 2)
        return tensor
