"""Frontend → prefill: the tokenized prompt, where its images go, and where to stream tokens."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from shared.dataplane.handle import TensorHandle
from shared.messages import Message
from shared.messages.encode import MAX_VIDEO_FRAMES, VideoSampling
from shared.messages.sampling import SamplingParams
from shared.model.geometry import Grid

MAX_PROMPT_TOKENS = 1 << 20
MAX_IMAGES = 1024
# A prefill worker could not pull a job's image embeddings (their encoder stopped or died, or the lease
# ran out): the frontend encodes the images again and resubmits instead of failing the request.
EMBEDDINGS_GONE = 410


class ImageSlot(Message, frozen=True, kw_only=True):
    """An image's (or a video clip's) placeholder run(s) and embeddings.

    A video's placeholders are the video token. Qwen2-VL and Qwen2.5-VL place a clip as one run of
    ``t·h·w/merge²`` tokens; Qwen3-VL as one run per temporal patch with its timestamp text between them
    (``frame_offsets``: where each run starts; ``offset`` is the first). ``second_per_grid`` spaces the
    temporal positions of Qwen2.5-VL (× the model's ``tokens_per_second``); 0 for images.

    A slot carries either its ``embedding`` rows ``[t·h·w/merge², embedding_width]`` (float; made by the
    encoder tier, or a client's precomputed ones that the frontend holds) or, for a worker that encodes in
    place (aggregated: metadata ``encodes_in_place``), its decoded ``pixels`` (uint8 ``[H, W, 3]``; a clip's
    sampled frames ``[T, H, W, 3]``, with their ``sampling``), which that worker encodes itself. One job may
    mix both kinds: the worker pulls the embeddings and encodes the pixels.
    """

    offset: Annotated[int, Meta(ge=0)]  # first placeholder token of this image in token_ids
    grid: Grid
    embedding: TensorHandle | None = None
    pixels: TensorHandle | None = None  # held by the frontend; only for a worker that encodes in place
    sampling: VideoSampling | None = None  # a clip's pixels: which frames of the clip they are
    content_hash: Annotated[str, Meta(max_length=128)] = ""  # names the image's KV blocks in prefix caches
    video: bool = False
    second_per_grid: Annotated[float, Meta(ge=0)] = 0.0
    frame_offsets: Annotated[list[Annotated[int, Meta(ge=0)]], Meta(max_length=MAX_VIDEO_FRAMES)] = []


class PrefillJob(Message, frozen=True, kw_only=True):
    request_id: Annotated[str, Meta(max_length=128)]
    token_ids: Annotated[list[int], Meta(min_length=1, max_length=MAX_PROMPT_TOKENS)]
    images: Annotated[list[ImageSlot], Meta(max_length=MAX_IMAGES)] = []
    sampling: SamplingParams  # max_tokens counts from output_offset
    stream: Annotated[str, Meta(max_length=256)]  # subject the tokens go to
    output_offset: Annotated[int, Meta(ge=0)] = 0  # a resumed request: its last tokens were generated before


class PrefillAccepted(Message, frozen=True, kw_only=True):
    prefill_id: str
