"""Images recognised by their bytes: a chat client sends every image again each turn, and one this frontend
decoded before need not be decoded again to be named — its content hash and size are remembered under a
hash of the bytes as received. ``MediaLoader`` decodes a recognised image only if it must be sent (its
KV is not in the target worker's prefix cache).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

SEEN_IMAGES = 16384  # images remembered by their bytes (~200 bytes each)


@dataclass(frozen=True)
class RecognisedImage:
    """An image whose bytes were decoded here before: what the prompt needs (its content hash and size)
    without its pixels, and its bytes as received for ``MediaLoader.decode`` should it be sent."""

    content_hash: str
    height: int
    width: int
    data: bytes | str  # a fetch's body, or a data URL's base64 payload


class SeenImages:
    """The bytes hash of images decoded here → (content hash, height, width), least recently used out.
    Keys are SHA-256 of the bytes as received, tagged by what they are (a data URL's base64 text and a
    fetched body of the same bytes are different things); values come from decoding those very bytes."""

    def __init__(self, capacity: int = SEEN_IMAGES):
        self.capacity = capacity
        self._entries: OrderedDict[bytes, tuple[str, int, int]] = OrderedDict()
        self._lock = threading.Lock()  # the media threads share it

    @staticmethod
    def key(tag: bytes, data: bytes | str) -> bytes:
        digest = hashlib.sha256(tag)  # SHA-256: the SHA extensions make it the fastest here (content_digest)
        digest.update(data.encode("ascii") if isinstance(data, str) else data)
        return digest.digest()

    def recall(self, key: bytes, data: bytes | str) -> RecognisedImage | None:
        with self._lock:
            known = self._entries.get(key)
            if known is not None:
                self._entries.move_to_end(key)
        return None if known is None else RecognisedImage(*known, data)

    def remember(self, key: bytes, image) -> None:
        """``image``: the ``DecodedImage`` those bytes decoded to."""
        with self._lock:
            self._entries[key] = (image.content_hash, image.height, image.width)
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
