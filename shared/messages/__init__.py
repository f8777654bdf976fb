"""Typed messages, one module per channel, MessagePack on the wire, with a protocol version.

Every message is written with ``pack`` and read through ``unpack``, which validates types, limits and
the version: a peer that speaks another version gets a clear error instead of a misread field.
Nothing is ever pickled.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

PROTOCOL_VERSION = 3  # 2: video (EncodeJob.video, EncodeResult.timing, ImageSlot's video fields); 3: ImageSlot.cached

M = TypeVar("M", bound="Message")


class Message(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    v: int = PROTOCOL_VERSION


class ProtocolError(ValueError):
    """A message that does not decode as its schema (or speaks another protocol version)."""


_encoder = msgspec.msgpack.Encoder()
_decoders: dict[type, msgspec.msgpack.Decoder] = {}


def pack(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def unpack(kind: type[M], data: bytes) -> M:
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.msgpack.Decoder(kind)
    try:
        message = decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise ProtocolError(f"invalid {kind.__name__}: {err}") from None
    if message.v != PROTOCOL_VERSION:
        raise ProtocolError(f"{kind.__name__} speaks protocol v{message.v}; this build speaks v{PROTOCOL_VERSION}")
    return message
