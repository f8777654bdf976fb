"""``epd submit``: one chat request over NATS (an answer, ``--stream`` chunks, or a ``--durable`` job)."""

from __future__ import annotations

import asyncio
import json
import sys

import nats
from pydantic import Field
from pydantic_settings import CliPositionalArg

from shared.bus.subjects import Subjects
from shared.client import ChatError, chat, chat_stream, submit_job, wait_result
from shared.settings import BadSettings, CommonSettings


class SubmitSettings(CommonSettings):
    file: CliPositionalArg[str] = Field(description="the chat request (OpenAI JSON body); - reads stdin")
    stream: bool = Field(False, description="print the chunks (JSON lines) as they come")
    durable: bool = Field(False, description="queue a durable JetStream job and print its id")
    wait: bool = Field(False, description="with --durable: wait for the job's result and print it")
    timeout: float = Field(300.0, gt=0, description="seconds to wait for the answer (per chunk with --stream)")


def submit(settings: SubmitSettings) -> int:
    """Send one chat request over NATS; answers go to stdout, an error body to stderr (exit 1)."""
    if settings.stream and settings.durable or settings.wait and not settings.durable:
        raise BadSettings("epd submit: --stream is for direct requests; --wait needs --durable")
    try:
        text = sys.stdin.read() if settings.file == "-" else open(settings.file, encoding="utf-8").read()
        request = json.loads(text)
    except (OSError, UnicodeDecodeError) as err:
        raise BadSettings(f"epd submit: cannot read {settings.file}: {getattr(err, 'strerror', None) or err}") from None
    except ValueError as err:
        raise BadSettings(f"epd submit: {settings.file} is not a JSON request body: {err}") from None
    prefix, timeout = settings.subject_prefix, settings.timeout

    async def run() -> None:
        nc = await nats.connect(name="epd-submit", connect_timeout=5, allow_reconnect=False,
                                inbox_prefix=Subjects(prefix).inbox("client"), **settings.nats_options())
        try:
            if settings.durable:
                job_id = await submit_job(nc, request, prefix)
                print(json.dumps(await wait_result(nc, job_id, prefix, timeout)) if settings.wait else job_id)
            elif settings.stream:
                async for chunk in chat_stream(nc, request, prefix, timeout):
                    print(json.dumps(chunk), flush=True)
            else:
                print(json.dumps(await chat(nc, request, prefix, timeout)))
        finally:
            await nc.close()

    try:
        asyncio.run(run())
    except ChatError as err:
        print(json.dumps(err.body), file=sys.stderr)
        return 1
    return 0
