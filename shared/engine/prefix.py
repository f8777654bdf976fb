"""Chain hashes of a prompt's full KV blocks: the keys of the prefix cache, and of prefix-affine routing.

Pure Python (no torch): the frontend imports it to hash a prompt exactly as the engine does, so it can
send a prefill job to the worker that holds the job's longest cached prefix (and leave out the images
inside that prefix: their KV is there).

Block ``i`` covers tokens ``[i·B, (i+1)·B)``. Its hash covers the hash of block ``i-1`` and what block ``i``
holds: text tokens by id; image placeholder tokens by (the image's content hash, its token count, the
offset inside the image) — every image uses the same placeholder id, but not the same embeddings.
Equal hashes therefore mean equal KV for one model: a token's KV depends on every token before it,
which the chain covers, and its M-RoPE position follows from those tokens and the images' grids, which
the content hash fixes (it covers the pixel size). Only full blocks are hashed, and the chain ends at
the first block that touches an image with no content hash (its KV cannot be named).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from typing import NamedTuple

_ROOT = b"epd-prefix-v1"  # the parent of block 0; a new encoding gets a new root, so old hashes never match


class ImageSpan(NamedTuple):
    """Where one image's placeholder run sits in the prompt, and what the image is."""

    offset: int  # first placeholder token
    num_tokens: int
    content_hash: str  # over the decoded pixels (frontend); empty: unknown, not cacheable


def cacheable_blocks(prompt_len: int, block_size: int) -> int:
    """How many leading blocks of a prompt its cached prefix may cover: its last token is always computed,
    for the logits of the first output token."""
    return max(0, prompt_len - 1) // block_size


def block_hashes(token_ids: Sequence[int], images: Iterable[ImageSpan | tuple[int, int, str]], block_size: int,
                 start_block: int = 0, parent: str | None = None) -> list[str]:
    """Hex hashes of the full blocks ``start_block, start_block + 1, …`` of ``token_ids``.

    ``parent`` is the hash of block ``start_block - 1`` (None for block 0): the engine extends a
    sequence's chain this way as its blocks fill. The list is shorter than the number of full blocks
    when the chain meets an image without a content hash.
    """
    spans = sorted(ImageSpan(*image) for image in images)
    hashes: list[str] = []
    previous = bytes.fromhex(parent) if parent else _ROOT
    first_image = 0  # images ending before the current block are behind us for good
    for block in range(start_block, len(token_ids) // block_size):
        low, high = block * block_size, (block + 1) * block_size
        while first_image < len(spans) and spans[first_image].offset + spans[first_image].num_tokens <= low:
            first_image += 1
        digest = hashlib.blake2b(previous, digest_size=16)
        cursor = low
        for image in spans[first_image:]:
            if image.offset >= high:
                break
            if not image.content_hash:
                return hashes
            _update_text(digest, token_ids[cursor:max(cursor, image.offset)])
            cursor = min(high, image.offset + image.num_tokens)
            _update_image(digest, image, max(low, image.offset) - image.offset, cursor - max(low, image.offset))
        _update_text(digest, token_ids[cursor:high])
        previous = digest.digest()
        hashes.append(previous.hex())
    return hashes


def _update_text(digest, tokens: Sequence[int]) -> None:
    if tokens:
        digest.update(b"T" + struct.pack(f"<I{len(tokens)}q", len(tokens), *tokens))


def _update_image(digest, image: ImageSpan, first: int, count: int) -> None:
    """``count`` placeholder tokens starting ``first`` tokens into ``image``."""
    name = image.content_hash.encode()
    digest.update(b"I" + struct.pack("<I", len(name)) + name + struct.pack("<qqq", image.num_tokens, first, count))
