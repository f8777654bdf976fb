"""The OpenAI framing every door shares: request bodies validated as HTTP validates them, 400s that
name the problem, the wire form of chunks, usage."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import ValidationError

from services.frontend.errors import ApiError
from services.frontend.protocol import ChatCompletionChunk, ChatCompletionRequest, PromptTokensDetails, Usage

if TYPE_CHECKING:
    from services.frontend.generation import Finished


def parse_request(data: bytes, limit: int) -> ChatCompletionRequest:
    """A chat request from its JSON body, validated exactly as the HTTP route validates it."""
    if len(data) > limit:
        raise ApiError(413, f"request body exceeds {limit} bytes")
    try:
        return ChatCompletionRequest.model_validate_json(data)
    except ValidationError as err:
        raise invalid_request(err.errors()) from None


def invalid_request(errors: list[dict]) -> ApiError:
    """A 400 naming the first problems (pydantic error dicts; FastAPI's carry a leading "body")."""
    problems = []
    for e in errors[:5]:
        where = ".".join(_location(e))
        problems.append(f"{where}: {e.get('msg', 'invalid')}" if where else e.get("msg", "invalid"))
    first = _location(errors[0]) if errors else []
    return ApiError(400, "invalid request: " + "; ".join(problems), first[0] if first else None)


def _location(error: dict) -> list[str]:
    return [str(p) for p in error.get("loc", ()) if p != "body"]


def chunk_json(chunk: ChatCompletionChunk) -> str:
    """The wire form of a chunk: unset fields left out, except in the usage chunk (as OpenAI sends it)."""
    return chunk.model_dump_json(exclude_none=chunk.usage is None)


def include_usage(request: ChatCompletionRequest) -> bool:
    return bool(request.stream_options and request.stream_options.include_usage)


def usage(finish: "Finished") -> Usage:
    return Usage(prompt_tokens=finish.prompt_tokens, completion_tokens=finish.completion_tokens,
                 total_tokens=finish.prompt_tokens + finish.completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=finish.cached_tokens))
