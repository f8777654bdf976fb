"""What a language-model process holds on its GPU besides its KV pool, so that the pool is what is left.

A process's share of its GPU (``--gpu-memory-utilization``) covers everything it holds: the CUDA context
and libraries' workspaces (outside torch's allocator), its weights and captured graphs (in the allocator
when the pool is sized), and the working room of its largest step, which is allocated only when such a
step runs. The pool is sized before that step ever runs, so its room is counted here, not measured; the
launcher plans several processes on one GPU with the same figures (``launcher/memory.py``).
"""

from __future__ import annotations

from shared.model.config import TextConfig

GIB = 1 << 30
CONTEXT_BYTES = 1 * GIB  # CUDA context, cuBLAS / cuDNN workspaces, the caching allocator's fragments


def step_work_bytes(text: TextConfig, step_tokens: int, max_num_seqs: int, dtype_bytes: int) -> int:
    """Live tensors of an eager step of ``step_tokens`` tokens (the residual stream, q|k|v, the MLP's
    gate|up and its product; a mixture's top-k experts per token), and fp32 logits for every running row."""
    mlp = 2 * (text.moe.top_k * text.moe.intermediate_size if text.moe else text.intermediate_size)
    attention = (text.num_heads + 2 * text.num_kv_heads) * text.head_dim
    return step_tokens * (4 * text.hidden_size + attention + mlp) * dtype_bytes + max_num_seqs * text.vocab_size * 4


def kv_bytes_per_token(text: TextConfig, dtype_bytes: int) -> int:
    return 2 * text.num_layers * text.num_kv_heads * text.head_dim * dtype_bytes
