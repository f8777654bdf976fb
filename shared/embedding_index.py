"""Which encoder holds which image's embeddings: a JetStream key-value bucket shared by a stack.

Key: ``embedding_key(content_hash, fingerprint)``, value: ``EmbeddingHolder``. Encoders write it (claim
an image before encoding it, hand it over, forget it on eviction); the frontend reads it to route an
image to its holder, and an encoder that misses reads it to borrow from the holder instead of running
the ViT. Entries expire after the bucket's TTL unless the holder touches them again, so a crashed
encoder's entries fade on their own. The index is an optimization: every call here answers "unknown"
(``None``) rather than raise when JetStream is off, slow or unreachable.
"""

from __future__ import annotations

import hashlib
import re
import time

from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError

from shared.logging import get_logger
from shared.messages import ProtocolError, pack, unpack
from shared.messages.encode import EmbeddingHolder

log = get_logger(__name__)

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def bucket_name(prefix: str) -> str:
    """One bucket per stack: stacks sharing a NATS server (distinct subject prefixes) never mix."""
    return "EPD_EMBEDDINGS_" + _UNSAFE.sub("_", prefix)


def content_digest(header: str, *buffers) -> str:
    """40 hex characters naming media content: ``header`` (kind, mode, shape) and the pixel buffers. SHA-256
    cut to 160 bits, not BLAKE2b: the frontend hashes every decoded pixel (6.2 MB a 1080p image), and with the
    CPUs' SHA extensions SHA-256 takes 3.6 ms where BLAKE2b took 9.5 (a quarter of the image's decode and
    hash). Collision resistance as before (80 bits): a key another request could collide with would serve it
    someone else's embeddings."""
    h = hashlib.sha256(header.encode())
    for buffer in buffers:
        h.update(buffer)
    return h.hexdigest()[:40]


def embedding_key(content_hash: str, fingerprint: str) -> str:
    """The cache key of one image for one encoder configuration.

    ``content_hash`` covers the decoded pixels, their size and mode (see the frontend's ``content_hash``);
    ``fingerprint`` covers the image processor's settings and the vision weights. Hashed together, so the
    key is a valid KV key whatever the hash's characters, and of fixed length.
    """
    digest = hashlib.blake2b(digest_size=20)
    digest.update(fingerprint.encode())
    digest.update(b"\0")
    digest.update(content_hash.encode())
    return digest.hexdigest()


class EmbeddingIndex:
    """The bucket of one stack. ``create=False`` (the frontend) only binds to a bucket encoders made."""

    def __init__(self, nc, prefix: str, ttl: float = 900.0, create: bool = True, timeout: float = 1.0,
                 reopen: float = 10.0):
        self.nc = nc
        self.bucket = bucket_name(prefix)
        self.ttl = ttl
        self.create = create
        self.timeout = timeout
        self.reopen = reopen  # after a failed open, seconds before JetStream is asked again
        self.errors = 0
        self._kv = None
        self._next_open = 0.0

    async def open(self):
        """The bucket, or None while JetStream is unavailable (retried every few seconds, not per call)."""
        if self._kv is not None or time.monotonic() < self._next_open:
            return self._kv
        js = self.nc.jetstream(timeout=self.timeout)
        try:
            try:
                self._kv = await js.key_value(self.bucket)
            except BucketNotFoundError:
                if not self.create:
                    raise
                # Memory storage: the index is soft state, rebuilt by traffic; it need not survive NATS.
                self._kv = await js.create_key_value(KeyValueConfig(
                    bucket=self.bucket, history=1, ttl=self.ttl, storage=StorageType.MEMORY,
                    description="epd: image embedding cache key -> encoder instance holding it"))
        except Exception as err:
            self._next_open = time.monotonic() + self.reopen
            if self.create:
                log.warning("embedding_index.unavailable", bucket=self.bucket, error=repr(err))
        return self._kv

    async def holder(self, key: str) -> str | None:
        """The instance the index names for ``key``, or None (not indexed, or the index unavailable)."""
        kv = await self.open()
        if kv is None:
            return None
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:
            return None
        except Exception as err:
            self._failed("get", err)
            return None
        return _holder_of(entry.value)

    async def claim(self, key: str, instance: str) -> str | None:
        """Name ``instance`` as the holder unless someone is named already; returns that other holder.

        ``None`` means: encode it here (claimed now, already ours, or no index to ask).
        """
        kv = await self.open()
        if kv is None:
            return None
        try:
            await kv.create(key, pack(EmbeddingHolder(instance=instance)))
            return None
        except KeyWrongLastSequenceError:
            pass  # somebody holds it, or is encoding it right now
        except Exception as err:
            self._failed("create", err)
            return None
        holder = await self.holder(key)
        return None if holder in (None, instance) else holder

    async def announce(self, key: str, instance: str) -> None:
        """Name ``instance`` as the holder (taking over a stale entry, or restarting its TTL)."""
        kv = await self.open()
        if kv is None:
            return
        try:
            await kv.put(key, pack(EmbeddingHolder(instance=instance)))
        except Exception as err:
            self._failed("put", err)

    async def forget(self, key: str, instance: str) -> None:
        """Remove ``key`` if it still names ``instance`` (another holder's newer entry stays)."""
        kv = await self.open()
        if kv is None:
            return
        try:
            entry = await kv.get(key)
            if _holder_of(entry.value) == instance:
                await kv.delete(key, last=entry.revision)
        except (KeyNotFoundError, KeyWrongLastSequenceError):
            return  # gone already, or rewritten meanwhile by another holder
        except Exception as err:
            self._failed("delete", err)

    def _failed(self, op: str, err: Exception) -> None:
        self.errors += 1
        if isinstance(err, NotFoundError):  # the bucket itself is gone (deleted by hand): open it again
            self._kv = None
        if self.errors in (1, 10) or self.errors % 1000 == 0:
            log.warning("embedding_index.failed", op=op, error=repr(err), errors=self.errors)


def _holder_of(value: bytes | None) -> str | None:
    try:
        return unpack(EmbeddingHolder, value or b"").instance
    except ProtocolError:
        return None
