"""The stack's NATS API from the caller's side, and the contract the frontend serves it by.

- ``<prefix>.chat``: request/reply; the payload is an OpenAI chat-completions body (JSON). The reply is
  a ChatCompletion, or with ``"stream": true`` one message per ChatCompletionChunk and then an end
  marker (empty payload, header ``Epd-Stream: end``).
- ``<prefix>.jobs.submit``: durable jobs (JetStream work queue); the ChatCompletion lands on
  ``<prefix>.results.<job id>`` in a results stream.

Every error, wherever it appears, is an OpenAI error body (JSON) with the NATS service API's headers
``Nats-Service-Error`` (message) and ``Nats-Service-Error-Code`` (the HTTP status). docs/nats-api.md
is the full contract. Only nats-py is needed here: no model code is imported.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import nats
from nats.aio.client import Client
from nats.errors import NoRespondersError, TimeoutError as NatsTimeout
from nats.js.api import RetentionPolicy, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError

from shared.bus.calls import error_of
from shared.bus.subjects import Subjects
from shared.errors import ServiceError

STREAM_HEADER = "Epd-Stream"  # on a chat stream's last message: "end", or "error" beside the error headers
STREAM_END = "end"
STREAM_ERROR = "error"
JOB_ID_HEADER = "Epd-Job-Id"  # on every job result
MSG_ID_HEADER = "Nats-Msg-Id"  # JetStream's de-duplication id; a job's id when its body names none
JOB_CONSUMER = "frontend"  # the durable pull consumer every frontend shares
DEFAULT_RESULT_MAX_AGE = 24 * 3600.0
DUPLICATE_WINDOW = 120.0  # seconds JetStream drops a second message with the same Nats-Msg-Id

_NAME_UNSAFE = ">*. /\\\t\r\n"


class ChatError(ServiceError):
    """The stack answered with an error: ``status`` as over HTTP, ``body`` the OpenAI error body."""

    def __init__(self, status: int, message: str, body: dict | None = None):
        super().__init__(status, message)
        self.body = body or {"error": {"message": message, "type": "server_error", "param": None, "code": status}}

    def __str__(self) -> str:
        return f"{self.status}: {self.message}"


def valid_job_id(job_id: str) -> bool:
    """A job id becomes one subject token (``<prefix>.results.<id>``)."""
    return 0 < len(job_id) <= 128 and not any(c in _NAME_UNSAFE for c in job_id)


@dataclass(frozen=True)
class JobStreams:
    """The two JetStream streams of one stack: jobs waiting (work queue) and results kept for a while."""

    prefix: str = "epd"
    result_max_age: float = DEFAULT_RESULT_MAX_AGE

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.prefix)

    @property
    def jobs(self) -> str:
        return "EPD_JOBS_" + _stream_safe(self.prefix)

    @property
    def results(self) -> str:
        return "EPD_RESULTS_" + _stream_safe(self.prefix)

    def configs(self) -> list[StreamConfig]:
        jobs = StreamConfig(name=self.jobs, subjects=[self.subjects.jobs], retention=RetentionPolicy.WORK_QUEUE)
        # One result per job id: a job run twice (redelivered after a crash) leaves its latest answer.
        results = StreamConfig(name=self.results, subjects=[self.subjects.results("*")],
                               max_age=self.result_max_age, max_msgs_per_subject=1,
                               duplicate_window=min(DUPLICATE_WINDOW, self.result_max_age))
        return [jobs, results]

    async def ensure(self, js, update: bool = False) -> None:
        """Create the streams if missing; the launcher, frontends and (on an open server) submitters
        call it, in any order. On a secured server only the server-side roles may create streams: a
        submitter that finds none gets a 503 instead of waiting.

        ``update``: also bring an existing results stream to this ``result_max_age`` (the frontend
        owns that setting; a submitter leaves whatever is there).
        """
        for config in self.configs():
            try:
                info = await js.stream_info(config.name)
            except NotFoundError:
                try:
                    await js.add_stream(config)
                except BadRequestError:  # created meanwhile by someone else (10058: name in use)
                    await js.stream_info(config.name)
                except NatsTimeout:  # no permission to create it (a secured server): nobody set jobs up
                    raise ChatError(503, "durable jobs are not set up on this stack yet: start its frontend "
                                         "(or `epd up`) first") from None
                continue
            if update and config.max_age is not None and info.config.max_age != config.max_age:
                await js.update_stream(info.config.evolve(max_age=config.max_age,
                                                          duplicate_window=config.duplicate_window))


def _stream_safe(prefix: str) -> str:
    return "".join("_" if c in _NAME_UNSAFE else c for c in prefix)


@asynccontextmanager
async def _connected(nc_or_url: Client | str, prefix: str):
    if not isinstance(nc_or_url, str):
        yield nc_or_url
        return
    nc = await nats.connect(nc_or_url, inbox_prefix=Subjects(prefix).inbox("client"))
    try:
        yield nc
    finally:
        await nc.close()


def raise_for_error(headers: dict | None, data: bytes) -> None:
    """Raise ``ChatError`` when a message carries the NATS service API's error headers."""
    if (error := error_of(headers)) is None:
        return
    try:
        body = json.loads(data) if data else None
    except ValueError:
        body = None
    raise ChatError(error[0], error[1] or "request failed", body)


async def chat(nc_or_url: Client | str, request: dict, prefix: str = "epd", timeout: float = 300.0) -> dict:
    """One ChatCompletion (as a dict) for an OpenAI chat request; raises ``ChatError``."""
    body = json.dumps({**request, "stream": False}).encode()
    async with _connected(nc_or_url, prefix) as nc:
        try:
            msg = await nc.request(Subjects(prefix).chat, body, timeout=timeout)
        except NoRespondersError:
            raise ChatError(503, f"no frontend serves {Subjects(prefix).chat}") from None
        except NatsTimeout:
            raise ChatError(504, f"no answer within {timeout:g}s") from None
    raise_for_error(msg.headers, msg.data)
    return json.loads(msg.data)


async def chat_stream(nc_or_url: Client | str, request: dict, prefix: str = "epd",
                      timeout: float = 120.0) -> AsyncIterator[dict]:
    """The ChatCompletionChunks (dicts) of a streamed answer; ``timeout`` bounds the wait for each one."""
    subject = Subjects(prefix).chat
    body = json.dumps({**request, "stream": True}).encode()
    async with _connected(nc_or_url, prefix) as nc:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)  # before the request: no chunk can be missed
        try:
            await nc.publish(subject, body, reply=inbox)
            while True:
                try:
                    msg = await sub.next_msg(timeout=timeout)
                except NatsTimeout:
                    raise ChatError(504, f"no chunk within {timeout:g}s") from None
                headers = msg.headers or {}
                if headers.get("Status") == "503" and not msg.data:  # the server's "no responders"
                    raise ChatError(503, f"no frontend serves {subject}")
                raise_for_error(headers, msg.data)
                if headers.get(STREAM_HEADER) == STREAM_END:
                    return
                yield json.loads(msg.data)
        finally:
            await sub.unsubscribe()


async def submit_job(nc_or_url: Client | str, request: dict, prefix: str = "epd", job_id: str | None = None) -> str:
    """Queue a durable job; returns its id. Works with no frontend running: the job waits for one.

    Submitting the same ``job_id`` again within JetStream's duplicate window (2 min) is a no-op.
    """
    job_id = job_id or uuid.uuid4().hex
    if not valid_job_id(job_id):
        raise ValueError(f"job id {job_id!r} must be 1-128 characters without dots, spaces or wildcards")
    streams = JobStreams(prefix)
    body = json.dumps({"id": job_id, "request": request}).encode()
    async with _connected(nc_or_url, prefix) as nc:
        js = nc.jetstream()
        await streams.ensure(js)
        await js.publish(streams.subjects.jobs, body, headers={MSG_ID_HEADER: job_id}, stream=streams.jobs)
    return job_id


async def wait_result(nc_or_url: Client | str, job_id: str, prefix: str = "epd", timeout: float = 600.0) -> dict:
    """The ChatCompletion (dict) of a job, waiting up to ``timeout`` s for it; raises ``ChatError``."""
    streams = JobStreams(prefix)
    subject = streams.subjects.results(job_id)
    async with _connected(nc_or_url, prefix) as nc:
        js = nc.jetstream()
        await streams.ensure(js)
        live = await nc.subscribe(subject)  # before the look-up: a result stored meanwhile is seen live
        try:
            try:
                stored = await js.get_last_msg(streams.results, subject)
                headers, data = stored.headers, stored.data or b""
            except NotFoundError:
                try:
                    msg = await live.next_msg(timeout=timeout)
                except NatsTimeout:
                    raise ChatError(504, f"job {job_id} has no result after {timeout:g}s") from None
                headers, data = msg.headers, msg.data
        finally:
            await live.unsubscribe()
    raise_for_error(headers, data)
    return json.loads(data)
