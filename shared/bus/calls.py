"""Calling a service: request/reply with every failure explicit.

- nobody subscribed to the subject → 503 with ``no_responders`` (retrying the same subject cannot help);
- no answer in time → 504 (or 503 when the bus itself went away meanwhile);
- an error reply (the service API's ``Nats-Service-Error-Code``/``Nats-Service-Error`` headers) → that status.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from nats.aio.client import Client
from nats.errors import NoRespondersError, TimeoutError as NatsTimeout
from nats.micro.request import ERROR_CODE_HEADER, ERROR_HEADER

from shared.errors import ServiceError


class ServiceCallError(ServiceError):
    """A service answered with an error, nobody answered, or nobody answered in time."""

    def __init__(self, status: int, message: str, no_responders: bool = False):
        super().__init__(status, message)
        self.no_responders = no_responders


def error_headers(status: int, message: str) -> dict[str, str]:
    """The NATS service API's error headers (a header value cannot hold a line break)."""
    return {ERROR_HEADER: message.replace("\r", " ").replace("\n", " "), ERROR_CODE_HEADER: str(status)}


def error_of(headers: dict | None) -> tuple[int, str] | None:
    """(status, message) when a message carries the NATS service API's error headers, else None."""
    headers = headers or {}
    if ERROR_CODE_HEADER not in headers:
        return None
    try:
        status = int(headers[ERROR_CODE_HEADER])
    except ValueError:
        status = 500
    return status, headers.get(ERROR_HEADER, "")


async def call(nc: Client, subject: str, payload: bytes, timeout: float, what: str) -> bytes:
    """Request/reply; ``what`` names the callee in error messages ("no encoder is available")."""
    if not nc.is_connected:
        raise ServiceCallError(503, "the message bus is unavailable")
    try:
        msg = await nc.request(subject, payload, timeout=timeout)
    except NoRespondersError:
        raise ServiceCallError(503, f"no {what} is available", no_responders=True) from None
    except NatsTimeout:
        if not nc.is_connected:  # the bus went away while we waited: not the service's fault
            raise ServiceCallError(503, "the message bus is unavailable") from None
        raise ServiceCallError(504, f"the {what} did not answer within {timeout:g}s") from None
    if (error := error_of(msg.headers)) is not None:
        raise ServiceCallError(error[0], error[1] or f"{what} failed")
    return msg.data


async def gather_replies(nc: Client, subject: str, wait: float = 0.25, payload: bytes = b"",
                         enough: Callable[[list[bytes]], bool] | None = None) -> list[bytes]:
    """Every answer to one request within ``wait`` seconds (the NATS service API's discovery pattern);
    with ``enough``, those until ``enough(replies)`` holds, if it does sooner (a caller waiting for
    instances it knows of need not wait out the window)."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    replies: list[bytes] = []
    try:
        await nc.publish(subject, payload, reply=inbox)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while (left := deadline - loop.time()) > 0:
            try:
                msg = await sub.next_msg(timeout=left)
            except asyncio.TimeoutError:
                break
            if msg.data:  # an empty status message means nobody is subscribed
                replies.append(msg.data)
                if enough is not None and enough(replies):
                    break
    finally:
        await sub.unsubscribe()
    return replies


async def service_stats(nc: Client, service: str | None = None, wait: float = 0.25,
                        enough: Callable[[list[dict]], bool] | None = None) -> list[dict]:
    """STATS of every instance of ``service`` (e.g. ``epd-encoder``), or of every service; ``enough``: as
    ``gather_replies``', on the answers so far."""
    subject = "$SRV.STATS" + (f".{service}" if service else "")
    check = None if enough is None else (lambda replies: enough([json.loads(r) for r in replies]))
    return [json.loads(r) for r in await gather_replies(nc, subject, wait, enough=check)]


def endpoint_data(stats: dict) -> dict:
    """A service's own figures in a STATS answer (the ``data`` of its endpoints; every endpoint has the same)."""
    return next((e.get("data") or {} for e in stats.get("endpoints") or [] if e.get("data")), {})


async def ping(nc: Client, service: str, instance: str, timeout: float) -> bool | None:
    """Is ``instance`` of ``service`` still there? True: it answered; False: NATS says nobody is
    subscribed to its PING subject any more (its connection is gone, or it stopped) — evidence that
    does not depend on how busy it is; None: no answer in time (slow, or the bus is down): not evidence."""
    if not nc.is_connected:
        return None
    try:
        await nc.request(f"$SRV.PING.{service}.{instance}", b"", timeout=timeout)
        return True
    except NoRespondersError:
        return False
    except NatsTimeout:
        return None
