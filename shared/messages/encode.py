"""Frontend ⇄ encoder: one image to encode, and the handle of its embeddings."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from shared.dataplane.handle import TensorHandle
from shared.messages import Message

Grid = tuple[int, int, int]


class EncodeJob(Message, frozen=True, kw_only=True):
    request_id: Annotated[str, Meta(max_length=128)]
    image: TensorHandle  # decoded pixels, uint8 [H, W, 3], held by the frontend
    content_hash: Annotated[str, Meta(max_length=128)]  # over pixels, size and mode


class EncodeResult(Message, frozen=True, kw_only=True):
    embedding: TensorHandle  # [num_tokens, hidden], held by the encoder
    grid: Grid  # patch grid (t, h, w): all prefill needs for rotary positions
    encoder_id: str
    cached: bool = False
