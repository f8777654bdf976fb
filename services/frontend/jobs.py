"""Durable batch jobs: chat requests queued in JetStream, answered by whichever frontend pulls them.

Jobs wait in a work-queue stream (``<prefix>.jobs.submit``) until a frontend of the shared durable
pull consumer takes one. The answer is stored in the results stream (``<prefix>.results.<job id>``)
*before* the job is acked, so a frontend that dies mid-job loses nothing: the job is redelivered.
A transient failure (no encoder/prefill/decode yet, a timeout, a full server: 5xx and 429) naks the
job with a growing delay, so jobs submitted before any worker runs complete once workers appear; a
request the stack can never answer (4xx) gets an error result at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass

from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import NotFoundError
from pydantic import BaseModel, ConfigDict, ValidationError

from services.frontend.errors import ApiError
from services.frontend.gateway import Gateway
from services.frontend.protocol import ChatCompletionRequest
from services.frontend.responses import invalid_request
from services.frontend.settings import FrontendSettings
from shared.aio import TaskSet, cancel_until_done
from shared.bus.calls import error_headers
from shared.client import JOB_CONSUMER, JOB_ID_HEADER, MSG_ID_HEADER, JobStreams, valid_job_id
from shared.logging import get_logger

log = get_logger(__name__)

_FETCH_WAIT = 0.5  # seconds one pull waits for a job; also how long stopping may take to notice
CONCURRENCY = 8  # jobs one frontend runs at once: batch work beside the interactive requests
ACK_WAIT = 60.0  # seconds without a progress signal before JetStream hands a job to another frontend
RETRY_DELAY = 1.0  # seconds before a transiently failed job is tried again; doubles each attempt, up to
RETRY_MAX_DELAY = 10.0  # so a job queued while the stack was down is answered within this of its recovery


class JobEnvelope(BaseModel):
    """What a submitter publishes: the chat request and, optionally, the job's id."""

    model_config = ConfigDict(extra="forbid")
    request: dict
    id: str | None = None


@dataclass
class Job:
    id: str
    request: ChatCompletionRequest | None = None
    error: ApiError | None = None  # the job can never be answered: its result is this error


def read_job(data: bytes, headers: dict | None, stream_seq: int) -> Job:
    """Id: the body's ``id``, else ``Nats-Msg-Id``, else ``seq-<stream sequence>`` (stable across redeliveries)."""
    fallback = f"seq-{stream_seq}"
    header_id = (headers or {}).get(MSG_ID_HEADER)
    header_id = header_id if header_id and valid_job_id(header_id) else None
    try:
        envelope = JobEnvelope.model_validate_json(data)
    except ValidationError as err:
        problem = invalid_request(err.errors())
        return Job(header_id or fallback, error=ApiError(400, "invalid job: " + problem.message, problem.param))
    job_id = envelope.id or header_id or fallback
    if not valid_job_id(job_id):
        return Job(fallback, error=ApiError(400, f"invalid job id {job_id!r}: 1-128 characters, no dots, "
                                                 "spaces or wildcards", "id"))
    try:
        request = ChatCompletionRequest.model_validate(envelope.request)
    except ValidationError as err:
        return Job(job_id, error=invalid_request(err.errors()))
    if request.stream:
        return Job(job_id, error=ApiError(400, "a job cannot stream; leave out 'stream' (or use the "
                                               "chat subject)", "stream"))
    return Job(job_id, request)


def transient(status: int) -> bool:
    """Worth retrying later: the stack is missing a stage, slow, or full."""
    return status >= 500 or status in (408, 429)


class JobWorker:
    """Pulls jobs while the frontend serves; at most ``CONCURRENCY`` run at once."""

    def __init__(self, gateway: Gateway, settings: FrontendSettings):
        self.gateway = gateway
        self.streams = JobStreams(settings.subject_prefix)
        self.slots = asyncio.Semaphore(CONCURRENCY)
        self.tasks = TaskSet("job")
        self.js = None
        self.done = self.failed = self.retried = 0
        self._loop_task: asyncio.Task | None = None
        self._stopping = asyncio.Event()

    def start(self, nc) -> None:
        self.js = nc.jetstream()
        self._loop_task = asyncio.create_task(self._pull_loop(), name="jobs")

    async def _subscribe(self):
        await self.streams.ensure(self.js, update=True)
        config = ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=ACK_WAIT)
        return await self.js.pull_subscribe(self.streams.subjects.jobs, durable=JOB_CONSUMER,
                                            stream=self.streams.jobs, config=config)

    async def _pull_loop(self) -> None:
        """Subscribe (retrying while JetStream is unreachable), then take one job per free slot."""
        sub, failures = None, 0
        try:
            while not self._stopping.is_set():
                try:
                    sub = sub or await self._subscribe()
                    msgs = await self._fetch(sub)
                    failures = 0
                except asyncio.TimeoutError:  # nats' TimeoutError too: no job waiting
                    continue
                except Exception as err:  # JetStream off or unreachable, stream deleted: set up again later
                    failures += 1
                    if failures in (1, 10) or failures % 100 == 0:
                        log.warning("jobs.unavailable", error=repr(err), attempts=failures,
                                    hint="the NATS server needs JetStream; --no-jobs turns jobs off")
                    await _unsubscribe(sub)
                    sub = None
                    with contextlib.suppress(asyncio.TimeoutError):  # a pause that stopping cuts short
                        await asyncio.wait_for(self._stopping.wait(), self._backoff(failures))
                    continue
                for msg in msgs:
                    self._spawn(msg)
        finally:
            # nats-py's drain would wait forever on a pull subscription's queue: leave it first.
            await _unsubscribe(sub)

    async def _fetch(self, sub) -> list:
        await self.slots.acquire()  # a job is pulled only when this frontend has room to run it
        try:
            return await sub.fetch(1, timeout=_FETCH_WAIT)
        except BaseException:
            self.slots.release()
            raise

    def _spawn(self, msg) -> None:
        self.tasks.spawn(self._run(msg)).add_done_callback(lambda _task: self.slots.release())

    async def _run(self, msg) -> None:
        if self._stopping.is_set():
            await msg.nak()  # fetched while stopping: let another frontend take it now
            return
        meta = msg.metadata
        job = read_job(msg.data, msg.headers, meta.sequence.stream)
        try:
            async with self._keep_alive(msg):
                if meta.num_delivered > 1 and await self._has_result(job.id):
                    await msg.ack()  # answered before, the ack was lost
                    return
                await self._answer(job, msg, meta.num_delivered)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await asyncio.shield(msg.nak())  # stopped mid-job: another frontend takes it now
            raise
        except Exception as err:  # e.g. the result could not be stored (JetStream gone): try again later
            log.warning("jobs.attempt_failed", job_id=job.id, error=repr(err))
            with contextlib.suppress(Exception):  # if even the nak is lost, JetStream redelivers after ack_wait
                await msg.nak(delay=self._backoff(meta.num_delivered))

    async def _answer(self, job: Job, msg, attempt: int) -> None:
        error = job.error
        if error is None:
            try:
                completion = await self.gateway.answer(job.request)
                await self._store(job.id, completion.model_dump_json().encode(), {})
                self.done += 1
                await msg.ack()
                return
            except ApiError as err:
                error = err
        if transient(error.status):
            self.retried += 1
            delay = self._backoff(attempt)
            log.info("jobs.retry", job_id=job.id, status=error.status, attempt=attempt, delay=delay)
            await msg.nak(delay=delay)
            return
        log.info("jobs.failed", job_id=job.id, status=error.status, error=error.message)
        await self._store(job.id, json.dumps(error.body()).encode(), error_headers(error.status, error.message))
        self.failed += 1
        await msg.ack()

    async def _store(self, job_id: str, payload: bytes, headers: dict[str, str]) -> None:
        headers = {**headers, JOB_ID_HEADER: job_id, MSG_ID_HEADER: job_id}
        await self.js.publish(self.streams.subjects.results(job_id), payload, headers=headers,
                              stream=self.streams.results)

    async def _has_result(self, job_id: str) -> bool:
        try:
            await self.js.get_last_msg(self.streams.results, self.streams.subjects.results(job_id))
            return True
        except NotFoundError:
            return False

    @contextlib.asynccontextmanager
    async def _keep_alive(self, msg):
        """Tell JetStream the job is still being worked on, so a long answer is not redelivered meanwhile."""
        async def beat():
            while True:
                await asyncio.sleep(ACK_WAIT / 3)
                await msg.in_progress()

        task = asyncio.create_task(beat(), name="job-keepalive")
        try:
            yield
        finally:  # in_progress() publishes, and nats-py's flush can swallow the cancel
            await cancel_until_done(task, timeout=5.0)

    @staticmethod
    def _backoff(attempt: int) -> float:
        return min(RETRY_DELAY * 2 ** min(max(attempt - 1, 0), 30), RETRY_MAX_DELAY)

    async def drain(self) -> None:
        """Stop taking jobs and let the running ones finish (a cancelled one is nak'ed for another frontend)."""
        self._stopping.set()
        if self._loop_task is not None:
            await asyncio.gather(self._loop_task, return_exceptions=True)
        await self.tasks.drain()

    async def stop(self) -> None:
        self._stopping.set()
        if self._loop_task is not None:
            await cancel_until_done(self._loop_task, timeout=5.0)
        await self.tasks.cancel()

    def stats(self) -> dict:
        return {"jobs_running": len(self.tasks), "jobs_done": self.done, "jobs_failed": self.failed,
                "jobs_retried": self.retried}


async def _unsubscribe(sub) -> None:
    if sub is not None:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
