"""Frontend ⇄ encoder: one image or video clip to encode, and the handle of its embeddings.

A video job carries its sampled frames as one uint8 tensor ``[T, H, W, 3]`` and ``VideoSampling`` (which
frames of the clip they are, at what rate); the encoder resizes them within the video processor's
budget, and its result names the grid ``(t, h, w)`` and ``VideoTiming`` (when each temporal patch
happens) — all prefill needs for rotary positions.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from shared.dataplane.handle import TensorHandle
from shared.messages import Message
from shared.model.geometry import Grid


MAX_VIDEO_FRAMES = 4096


class VideoSampling(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which frames of a clip a video job's tensor holds."""

    source_fps: Annotated[float, Meta(gt=0, le=1000)]  # the clip's own frame rate
    total_frames: Annotated[int, Meta(ge=1)]  # frames in the whole clip
    frame_indices: Annotated[list[Annotated[int, Meta(ge=0)]], Meta(min_length=1, max_length=MAX_VIDEO_FRAMES)]


class VideoTiming(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """When a clip's temporal patches happen, in seconds."""

    second_per_grid: Annotated[float, Meta(gt=0)]  # one temporal patch's span (Qwen2.5-VL's second_per_grid_ts)
    timestamps: Annotated[list[float], Meta(max_length=MAX_VIDEO_FRAMES)]  # each patch's mean frame time (Qwen3-VL)


class EncodeJob(Message, frozen=True, kw_only=True):
    request_id: Annotated[str, Meta(max_length=128)]
    image: TensorHandle  # decoded pixels, uint8 [H, W, 3] (a video: [T, H, W, 3]), held by the frontend
    content_hash: Annotated[str, Meta(max_length=128)]  # over pixels, size and mode (a video: and its sampling)
    video: VideoSampling | None = None  # set for a video clip


class EncodeResult(Message, frozen=True, kw_only=True):
    embedding: TensorHandle  # [num_tokens, hidden], held by the encoder
    grid: Grid  # patch grid (t, h, w): all prefill needs for rotary positions
    encoder_id: str
    cached: bool = False
    timing: VideoTiming | None = None  # a video's


# Encoder ⇄ encoder: borrowing embeddings another encoder already holds (``<prefix>.encode.<instance>.fetch``).


class EmbeddingFetch(Message, frozen=True, kw_only=True):
    key: Annotated[str, Meta(max_length=128)]  # cache key: content hash + encoder fingerprint


class EmbeddingLoan(Message, frozen=True, kw_only=True):
    embedding: TensorHandle  # a fresh handle to the holder's cached embeddings, one pull
    grid: Grid


# The embedding index (JetStream KV, one bucket per subject prefix): cache key → the encoder holding it.


class EmbeddingHolder(Message, frozen=True, kw_only=True):
    instance: Annotated[str, Meta(max_length=64)]
