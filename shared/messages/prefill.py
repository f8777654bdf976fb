"""Frontend → prefill: the tokenized prompt, where its images go, and where to stream tokens; and the
prefix lookup that tells the frontend which worker to send it to and which images it need not send."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from shared.dataplane.handle import TensorHandle
from shared.engine.prefix import ImageSpan  # pure Python: no torch
from shared.messages import Message
from shared.messages.encode import MAX_VIDEO_FRAMES, VideoSampling
from shared.messages.sampling import SamplingParams
from shared.model.geometry import Grid

MAX_PROMPT_TOKENS = 1 << 20
MAX_IMAGES = 1024
# A prefill worker could not pull a job's image embeddings (their encoder stopped or died, or the lease
# ran out), or an image sent as ``cached`` is not in its prefix cache (evicted since the lookup): the
# frontend encodes every image again and resubmits, sending them all, instead of failing the request.
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
    mix both kinds: the worker pulls the embeddings and encodes the pixels. Or neither, ``cached``: the
    worker's prefix lookup said its cache holds the KV of every placeholder token of the image, so the
    frontend did not decode, encode or send it; the worker checks that again when it queues the prompt
    (which then starts at once) and answers ``EMBEDDINGS_GONE`` if it cannot.
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
    cached: bool = False

    def spans(self, merge: int) -> list[ImageSpan]:
        """The placeholder runs as the prefix cache names them: one, or one per temporal patch of a
        Qwen3-VL clip (named by the clip's hash and the patch's index)."""
        t, h, w = self.grid
        if not self.frame_offsets:
            return [ImageSpan(self.offset, t * h * w // (merge * merge), self.content_hash)]
        rows = h * w // (merge * merge)
        return [ImageSpan(offset, rows, f"{self.content_hash}#{i}" if self.content_hash else "")
                for i, offset in enumerate(self.frame_offsets)]


class PrefillJob(Message, frozen=True, kw_only=True):
    request_id: Annotated[str, Meta(max_length=128)]
    token_ids: Annotated[list[int], Meta(min_length=1, max_length=MAX_PROMPT_TOKENS)]
    images: Annotated[list[ImageSlot], Meta(max_length=MAX_IMAGES)] = []
    sampling: SamplingParams  # max_tokens counts from output_offset
    stream: Annotated[str, Meta(max_length=256)]  # subject the tokens go to
    output_offset: Annotated[int, Meta(ge=0)] = 0  # a resumed request: its last tokens were generated before


class PrefillAccepted(Message, frozen=True, kw_only=True):
    prefill_id: str


class PrefixLookup(Message, frozen=True, kw_only=True):
    """Frontend → one intake worker (``Subjects.prefix_lookup``): how many of these leading chain hashes
    of a prompt's full blocks (``shared.engine.prefix``, at the worker's ``kv_block_size``) does its prefix
    cache hold? Answered from the cache as it is (``PrefixFound``), without the engine thread: a hint
    for routing and for which images to leave out, which the worker checks again."""

    block_size: Annotated[int, Meta(ge=1)]
    hashes: Annotated[list[Annotated[str, Meta(max_length=64)]], Meta(max_length=MAX_PROMPT_TOKENS)]


class PrefixFound(Message, frozen=True, kw_only=True):
    blocks: Annotated[int, Meta(ge=0)]  # leading hashes of the lookup held (0: another block size, or none)
