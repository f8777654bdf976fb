"""The OpenAI framing every door shares: request bodies validated as HTTP validates them, 400s that
name the problem, the wire form of chunks, usage."""

from __future__ import annotations

import msgspec
from pydantic import ValidationError

from services.frontend.errors import ApiError
from services.frontend.protocol import ChatCompletionRequest, PromptTokensDetails, Usage


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


_ENCODER = msgspec.json.Encoder()


def chunk_json(chunk: dict) -> str:
    """The wire form of a chunk (built with every key it must carry, nulls included): compact UTF-8 JSON,
    as ``json.dumps(ensure_ascii=False)`` writes it but for the spelling of some floats (1e-05 is
    0.00001), in 0.5–0.7 µs where ``json.dumps`` took 5.4–6.6 (a plain chunk; with logprobs 1.9 against 14)."""
    return _ENCODER.encode(chunk).decode()


def usage_of(generations) -> Usage:
    """Usage over a request's generations (a text completion has one per prompt), cached prompt tokens
    included."""
    prompt = sum(g.prompt_tokens for g in generations)
    completion = sum(g.completion_tokens for g in generations)
    cached = sum(g.cached_tokens for g in generations)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))
