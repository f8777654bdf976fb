"""Prefill/decode → frontend: the tokens of one request, in order, and how it ended."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from shared.messages import Message


class ErrorInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    status: int  # the HTTP status the client should see
    message: str


class TokenLogprob(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One output token's logprob and the most likely tokens' (most likely first)."""

    logprob: float
    top_ids: Annotated[list[int], Meta(max_length=20)] = []
    top_logprobs: Annotated[list[float], Meta(max_length=20)] = []


class TokenEvent(Message, frozen=True, kw_only=True):
    request_id: str
    index: Annotated[int, Meta(ge=0)]  # output position of token_ids[0] within its choice: the frontend orders by it
    token_ids: list[int] = []
    choice: Annotated[int, Meta(ge=0, lt=16)] = 0  # which of the request's n choices
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them
    finish_reason: str | None = None  # "stop" | "length" | "abort"; set on the choice's last event only
    error: ErrorInfo | None = None  # the request failed; no more events follow
    worker: str = ""  # instance that produced the event: the frontend watches it is still alive
    cached_tokens: int = 0  # prompt tokens the worker took from its prefix cache (on an attempt's first event)


def error_event(request_id: str, status: int, message: str, worker: str) -> TokenEvent:
    """The event that ends a request with an error (the frontend never reads it as a finish)."""
    return TokenEvent(request_id=request_id, index=0, error=ErrorInfo(status=status, message=message), worker=worker)
