"""Connecting to NATS: reconnect forever with a short back-off, replies on the role's own inbox."""

from __future__ import annotations

import nats
from nats.aio.client import Client

from shared.bus.subjects import Subjects
from shared.logging import get_logger

log = get_logger(__name__)


async def connect(settings, name: str, role: str) -> Client:
    """``role`` names the inbox prefix (``Subjects.inbox``) the role's NATS user may subscribe to."""
    client: list[Client] = []

    def closing() -> bool:
        return bool(client) and (client[0].is_draining or client[0].is_closed)

    async def on_error(err: Exception) -> None:
        log.warning("nats.error", error=str(err))

    async def on_disconnect() -> None:
        if not closing():
            log.warning("nats.disconnected")

    async def on_reconnect() -> None:
        log.info("nats.reconnected")

    nc = await nats.connect(
        name=name,
        inbox_prefix=Subjects(settings.subject_prefix).inbox(role),
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        connect_timeout=5,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        **settings.nats_options(),
    )
    client.append(nc)
    return nc
