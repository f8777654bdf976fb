"""Broadcast control: every stage listens and drops the request's work."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from shared.messages import Message


class Cancel(Message, frozen=True, kw_only=True):
    request_id: Annotated[str, Meta(max_length=128)]
    reason: str = "client disconnected"


def cancelled_request(data: bytes) -> str | None:
    """The request id a ``Cancel`` names, or None for a message that is not one (ignored, not fatal)."""
    from shared.messages import unpack

    try:
        return unpack(Cancel, data).request_id
    except ValueError:
        return None
