"""The chat API over NATS request/reply: ``<prefix>.chat``, queue group "frontend".

Same request schema, validation, admission and errors as ``POST /v1/chat/completions`` (through the
same ``Gateway``); only the framing is NATS's: one reply (ChatCompletion or error), or for a stream one
message per chunk, then an end marker or an error message. Errors carry the NATS service API's
``Nats-Service-Error``/``Nats-Service-Error-Code`` headers (the code being the HTTP status) and the
OpenAI error body.
"""

from __future__ import annotations

import json
from contextlib import aclosing

from services.frontend.errors import ApiError
from services.frontend.gateway import Gateway
from services.frontend.generation import FLUSH
from services.frontend.responses import chunk_json, parse_request
from shared.bus.service_api import Endpoint, Request
from shared.bus.subjects import QUEUE, Subjects
from shared.client import STREAM_END, STREAM_ERROR, STREAM_HEADER
from shared.errors import ServiceError


def error_body(err: ServiceError) -> bytes:
    api = err if isinstance(err, ApiError) else ApiError(err.status, err.message)
    return json.dumps(api.body()).encode()


def chat_endpoint(gateway: Gateway, subjects: Subjects, max_body_bytes: int, limit: int) -> Endpoint:
    """``limit``: room beyond the admission limit, so a flood is answered 429 at once, not left queued."""

    async def serve(request: Request) -> bytes | None:
        body = parse_request(request.data, max_body_bytes)
        if not body.stream:
            return (await gateway.answer(body)).model_dump_json().encode()
        request.error_extra = {STREAM_HEADER: STREAM_ERROR}  # an error from here on ends the stream
        generation = await gateway.start(body)
        async with aclosing(gateway.chunks(generation)) as chunks:
            async for chunk in chunks:
                if chunk is not FLUSH:  # a message a chunk: nothing to join
                    await request.respond(chunk_json(chunk).encode())
        await request.respond(b"", headers={STREAM_HEADER: STREAM_END})
        return None

    return Endpoint("chat", subjects.chat, QUEUE["frontend"], serve, limit, error_body=error_body)
