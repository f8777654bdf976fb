"""The chat API over NATS request/reply: ``<prefix>.chat``, queue group "frontend".

Same request schema, validation, admission and errors as ``POST /v1/chat/completions``; the bodies
come from ``responses``, only the framing is NATS's: one reply (ChatCompletion or error), or for a
stream one message per chunk, then an end marker or an error message. Errors carry the NATS service
API's ``Nats-Service-Error``/``Nats-Service-Error-Code`` headers, the code being the HTTP status.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import aclosing

from nats.micro.request import ERROR_CODE_HEADER, ERROR_HEADER, Request
from nats.micro.service import Service

from services.frontend.errors import ApiError
from services.frontend.responses import admit, answer, chunk_json, chunks, include_usage, parse_request
from shared.bus import QUEUE
from shared.client import STREAM_END, STREAM_ERROR, STREAM_HEADER
from shared.logging import get_logger

log = get_logger(__name__)


class ChatEndpoint:
    """Each request runs in its own tracked task: nats-py would run one subscription's handlers in turn."""

    def __init__(self, frontend):
        self.frontend = frontend
        # Room beyond the admission limit, so a flood is answered 429 at once rather than left queued.
        self.slots = asyncio.Semaphore(2 * frontend.settings.max_concurrent_requests)
        self.tasks: set[asyncio.Task] = set()
        self.errors = 0

    async def add_to(self, service: Service) -> None:
        await service.add_endpoint(name="chat", subject=self.frontend.subjects.chat, queue_group=QUEUE["frontend"],
                                   handler=self._admit)

    async def _admit(self, request: Request) -> None:
        await self.slots.acquire()
        task = asyncio.create_task(self._serve(request), name="nats-chat")
        self.tasks.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        self.slots.release()

    async def _serve(self, request: Request) -> None:
        stream = False
        try:
            body = parse_request(request.data, self.frontend.settings.max_body_bytes)
            stream = body.stream
            if stream:
                await self._stream(request, body)
            else:
                completion = await answer(self.frontend, body)
                await request.respond(completion.model_dump_json().encode())
        except ApiError as err:
            await self._fail(request, err, stream)
        except asyncio.CancelledError:
            await self._fail(request, ApiError(503, "the frontend is shutting down"), stream)
            raise
        except Exception:
            log.exception("nats_chat.failed")
            await self._fail(request, ApiError(500, "internal error"), stream)

    async def _stream(self, request: Request, body) -> None:
        generation = await admit(self.frontend, body)
        try:
            async with aclosing(chunks(self.frontend, generation, include_usage(body))) as stream:
                async for chunk in stream:
                    await request.respond(chunk_json(chunk).encode())
        finally:
            self.frontend.admission.release()
        await request.respond(b"", headers={STREAM_HEADER: STREAM_END})

    async def _fail(self, request: Request, err: ApiError, stream: bool) -> None:
        self.errors += 1
        headers = error_headers(err)
        if stream:
            headers[STREAM_HEADER] = STREAM_ERROR
        try:
            await request.respond(json.dumps(err.body()).encode(), headers=headers)
        except Exception:  # no reply subject, or the connection is gone: nobody to tell
            log.warning("nats_chat.reply_failed", status=err.status)

    async def drain(self) -> None:
        if self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)


def error_headers(err: ApiError) -> dict[str, str]:
    """The NATS service API's error headers (a header value cannot hold a line break)."""
    message = err.message.replace("\r", " ").replace("\n", " ")
    return {ERROR_HEADER: message, ERROR_CODE_HEADER: str(err.status)}
