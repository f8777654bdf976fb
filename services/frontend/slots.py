"""A request's images → the prefill job's image slots: where each sits in the prompt, and what is sent
for it — its embeddings (made by the encoder tier, or the client's), its pixels (for a worker that encodes
in place), or nothing at all (``cached``: the target worker's prefix cache holds the KV of every one of
its tokens).

A slot is planned before anything is sent (``plan``): its placement and content hash name its tokens
in the prefix cache (``ImageSlot.spans``), which is what the intake router looks the prompt up by and
what decides which images may be left out (``inside``).
"""

from __future__ import annotations

import msgspec

from services.frontend.embeds import ImageEmbeds
from services.frontend.errors import ApiError
from services.frontend.prompt import Prompt
from shared.dataplane.handle import TensorHandle
from shared.engine.prefix import ImageSpan
from shared.logging import get_logger
from shared.messages.encode import EncodeResult
from shared.messages.prefill import ImageSlot

log = get_logger(__name__)


def plan(prompt: Prompt, images: list) -> list[ImageSlot]:
    """Each image's (and clip's) slot, with nothing sent yet."""
    slots = []
    for index, (offset, grid, image) in enumerate(zip(prompt.image_offsets, prompt.image_grids, images)):
        video = {}
        if (placed := prompt.videos.get(index)) is not None:
            video = dict(video=True, second_per_grid=placed.second_per_grid, frame_offsets=placed.frame_offsets)
        slots.append(ImageSlot(offset=offset, grid=grid, content_hash=image.content_hash, **video))
    return slots


def spans(slots: list[ImageSlot], merge: int) -> list[ImageSpan]:
    """The slots' placeholder runs as the prefix cache names them."""
    return [span for slot in slots for span in slot.spans(merge)]


def inside(slots: list[ImageSlot], cached_tokens: int, merge: int) -> set[int]:
    """The slots every token of which lies in the prompt's first ``cached_tokens`` tokens (one that
    straddles their end is not: its last tokens must be computed, from its embeddings)."""
    return {i for i, slot in enumerate(slots)
            if slot.content_hash and all(s.offset + s.num_tokens <= cached_tokens for s in slot.spans(merge))}


def cached(slot: ImageSlot) -> ImageSlot:
    return msgspec.structs.replace(slot, cached=True)


def given(slot: ImageSlot, handle: TensorHandle, image) -> ImageSlot:
    """What this frontend published for a slot: a client's embeddings, or for a worker that encodes in place
    the decoded pixels (a clip's sampled frames, with their sampling)."""
    if isinstance(image, ImageEmbeds):
        return msgspec.structs.replace(slot, embedding=handle)
    return msgspec.structs.replace(slot, pixels=handle, sampling=getattr(image, "sampling", None))


def with_embedding(slot: ImageSlot, result: EncodeResult) -> ImageSlot:
    """The encoder's embeddings, which must be of the grid (and a clip's timing) the prompt was built with."""
    if tuple(result.grid) != tuple(slot.grid):
        log.error("encode.grid_mismatch", frontend=slot.grid, encoder=tuple(result.grid))
        raise ApiError(500, "internal error: an image was encoded at another size than counted")
    if slot.video and (result.timing is None or abs(result.timing.second_per_grid - slot.second_per_grid) > 1e-9):
        log.error("encode.timing_mismatch", frontend=slot.second_per_grid, encoder=result.timing)
        raise ApiError(500, "internal error: a video was encoded with other timing than counted")
    return msgspec.structs.replace(slot, embedding=result.embedding)
