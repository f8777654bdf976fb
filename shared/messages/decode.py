"""Prefill → decode: a sequence whose prompt KV is computed, handed over to generate the rest."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from shared.dataplane.handle import TensorHandle
from shared.engine.sampling import SamplingParams
from shared.messages import Message
from shared.messages.prefill import MAX_PROMPT_TOKENS


class DecodeJob(Message, frozen=True, kw_only=True):
    request_id: Annotated[str, Meta(max_length=128)]
    token_ids: Annotated[list[int], Meta(min_length=2, max_length=MAX_PROMPT_TOKENS)]  # prompt + generated
    prompt_len: Annotated[int, Meta(ge=1)]
    rope_delta: int
    sampling: SamplingParams
    stream: Annotated[str, Meta(max_length=256)]
    kv: TensorHandle  # [layers, 2, len(token_ids) - 1, kv_heads, head_dim]


class DecodeAccepted(Message, frozen=True, kw_only=True):
    decode_id: str
