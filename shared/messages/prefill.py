"""Frontend → prefill: the tokenized prompt, where its images go, and where to stream tokens."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from shared.dataplane.handle import TensorHandle
from shared.engine.sampling import SamplingParams
from shared.messages import Message
from shared.model.geometry import Grid

MAX_PROMPT_TOKENS = 1 << 20
MAX_IMAGES = 1024
# A prefill worker could not pull a job's image embeddings (their encoder stopped or died, or the lease
# ran out): the frontend encodes the images again and resubmits instead of failing the request.
EMBEDDINGS_GONE = 410


class ImageSlot(Message, frozen=True, kw_only=True):
    offset: Annotated[int, Meta(ge=0)]  # first placeholder token of this image in token_ids
    grid: Grid
    embedding: TensorHandle
    content_hash: Annotated[str, Meta(max_length=128)] = ""  # names the image's KV blocks in prefix caches


class PrefillJob(Message, frozen=True, kw_only=True):
    request_id: Annotated[str, Meta(max_length=128)]
    token_ids: Annotated[list[int], Meta(min_length=1, max_length=MAX_PROMPT_TOKENS)]
    images: Annotated[list[ImageSlot], Meta(max_length=MAX_IMAGES)] = []
    sampling: SamplingParams  # max_tokens counts from output_offset
    stream: Annotated[str, Meta(max_length=256)]  # subject the tokens go to
    output_offset: Annotated[int, Meta(ge=0)] = 0  # a resumed request: its last tokens were generated before


class PrefillAccepted(Message, frozen=True, kw_only=True):
    prefill_id: str
