"""Frontend ⇄ encoder: one image to encode, and the handle of its embeddings."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from shared.dataplane.handle import TensorHandle
from shared.messages import Message
from shared.model.geometry import Grid


class EncodeJob(Message, frozen=True, kw_only=True):
    request_id: Annotated[str, Meta(max_length=128)]
    image: TensorHandle  # decoded pixels, uint8 [H, W, 3], held by the frontend
    content_hash: Annotated[str, Meta(max_length=128)]  # over pixels, size and mode


class EncodeResult(Message, frozen=True, kw_only=True):
    embedding: TensorHandle  # [num_tokens, hidden], held by the encoder
    grid: Grid  # patch grid (t, h, w): all prefill needs for rotary positions
    encoder_id: str
    cached: bool = False


# Encoder ⇄ encoder: borrowing embeddings another encoder already holds (``<prefix>.encode.<instance>.fetch``).


class EmbeddingFetch(Message, frozen=True, kw_only=True):
    key: Annotated[str, Meta(max_length=128)]  # cache key: content hash + encoder fingerprint


class EmbeddingLoan(Message, frozen=True, kw_only=True):
    embedding: TensorHandle  # a fresh handle to the holder's cached embeddings, one pull
    grid: Grid


# The embedding index (JetStream KV, one bucket per subject prefix): cache key → the encoder holding it.


class EmbeddingHolder(Message, frozen=True, kw_only=True):
    instance: Annotated[str, Meta(max_length=64)]
