"""The health endpoint (shared/health.py) over real sockets: what Kubernetes' probes and compose see.

/live answers while the event loop does (model loading included), /ready only while the service is
registered, taking work and connected to NATS.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from launcher.natsserver import EmbeddedNats
from shared import health
from shared.health import HealthServer
from shared.service import Service
from shared.settings import CommonSettings


async def http(port: int, raw: bytes) -> tuple[int | None, dict | None]:
    """Send ``raw`` to the health port; (status, JSON body), or (None, None) when it closed with no answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    if not answer:
        return None, None
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    assert int(headers["Content-Length"]) == len(body)
    assert headers["Content-Type"] == "application/json"
    return int(lines[0].split()[1]), json.loads(body)


async def get(port: int, path: str) -> tuple[int | None, dict | None]:
    return await http(port, f"GET {path} HTTP/1.1\r\nHost: probe\r\nUser-Agent: kube-probe/1.32\r\n\r\n".encode())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_live_ready_and_everything_else():
    state = {"now": "starting"}
    server = HealthServer("127.0.0.1", 0, lambda: state["now"])
    await server.start()
    try:
        assert await get(server.port, "/live") == (200, {"status": "alive"})
        assert await get(server.port, "/ready") == (503, {"status": "starting"})
        state["now"] = "ready"
        assert await get(server.port, "/ready") == (200, {"status": "ready"})
        assert await get(server.port, "/ready?probe=1") == (200, {"status": "ready"})
        state["now"] = "draining"
        assert await get(server.port, "/ready") == (503, {"status": "draining"})
        assert await get(server.port, "/live") == (200, {"status": "alive"})
        for path in ("/", "/health", "/readyz", "/live/x", "/metrics"):
            assert await get(server.port, path) == (404, {"status": "not found"})
        post = b"POST /ready HTTP/1.1\r\nContent-Length: 0\r\n\r\n"
        assert await http(server.port, post) == (404, {"status": "not found"})
        assert await http(server.port, b"nonsense\r\n\r\n") == (400, {"status": "bad request"})
    finally:
        await server.stop()
    with pytest.raises(ConnectionRefusedError):
        await get(server.port, "/live")


async def test_listens_where_the_data_plane_does_loopback_by_default():
    settings = CommonSettings(health_port=free_port())
    assert settings.data_host == "127.0.0.1"
    server = await health.start_health(settings, lambda: "ready")
    try:
        assert server.host == "127.0.0.1" and server.port == settings.health_port
        assert await get(server.port, "/live") == (200, {"status": "alive"})
    finally:
        await server.stop()
    assert await health.start_health(CommonSettings(), lambda: "ready") is None  # port 0: off


async def test_an_oversize_or_stalled_request_is_dropped_and_others_still_answered(monkeypatch):
    monkeypatch.setattr(health, "READ_TIMEOUT", 0.5)
    server = HealthServer("127.0.0.1", 0, lambda: "ready")
    await server.start()
    try:
        huge = b"GET /live HTTP/1.1\r\nX-Pad: " + b"a" * (2 * health.MAX_REQUEST_BYTES) + b"\r\n\r\n"
        assert await http(server.port, huge) == (None, None)
        # A client that sends half a request and waits: it does not hold up the next probe, and is cut off.
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /live HTTP/1.1\r\n")
        await writer.drain()
        assert await get(server.port, "/ready") == (200, {"status": "ready"})
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
    finally:
        await server.stop()


class SlowService(Service):
    """A service whose setup ("model loading") and drain wait for the test to release them."""

    kind = "healthtest"

    def __init__(self, settings):
        super().__init__(settings)
        self.loaded = asyncio.Event()
        self.drained = asyncio.Event()

    async def setup(self) -> None:
        await self.loaded.wait()

    async def drain(self) -> None:
        await self.drained.wait()


async def until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def _run_without_exit(service: Service) -> None:
    """What ``Service.run`` does, less its signal handlers and its ending of every other task (this
    test shares its event loop with the session); ``test_epd_encoder_probes`` runs the real ``run``."""
    server = await health.start_health(service.settings, service.readiness)
    await service.start()
    await service.stopping.wait()
    await service.stop()
    await server.stop()


async def test_a_service_is_live_while_loading_ready_when_serving_and_unready_while_draining(tmp_path):
    with EmbeddedNats(workdir=str(tmp_path / "nats")) as nats_server:
        port = free_port()
        service = SlowService(CommonSettings(nats_url=nats_server.url, health_port=port, drain_seconds=30))
        running = asyncio.create_task(_run_without_exit(service))
        try:
            await until(lambda: _answers(port))
            assert await get(port, "/live") == (200, {"status": "alive"})  # during "model loading"
            assert await get(port, "/ready") == (503, {"status": "starting"})

            service.loaded.set()
            await until(lambda: _status_is(port, 200))
            assert await get(port, "/ready") == (200, {"status": "ready"})

            service.stopping.set()  # SIGTERM
            await until(lambda: _status_is(port, 503))
            assert await get(port, "/ready") == (503, {"status": "draining"})
            assert await get(port, "/live") == (200, {"status": "alive"})  # draining is no reason to restart

            service.drained.set()
            await asyncio.wait_for(running, 15)
        finally:
            service.loaded.set()
            service.drained.set()
            service.stopping.set()
            await asyncio.wait_for(running, 15)
        with pytest.raises(ConnectionRefusedError):  # stopped last
            await get(port, "/live")


async def test_a_service_that_loses_nats_is_not_ready(tmp_path):
    nats_server = EmbeddedNats(workdir=str(tmp_path / "nats"))
    nats_server.start()
    port = free_port()
    service = SlowService(CommonSettings(nats_url=nats_server.url, health_port=port))
    service.loaded.set()
    service.drained.set()
    running = asyncio.create_task(_run_without_exit(service))
    try:
        await until(lambda: _status_is(port, 200))
        nats_server.stop()
        await until(lambda: _status_is(port, 503))
        assert await get(port, "/ready") == (503, {"status": "disconnected"})
        assert await get(port, "/live") == (200, {"status": "alive"})
    finally:
        nats_server.stop()
        service.stopping.set()
        await asyncio.wait_for(running, 30)


async def _answers(port: int) -> bool:
    try:
        await get(port, "/live")
        return True
    except OSError:
        return False


async def _status_is(port: int, status: int) -> bool:
    try:
        return (await get(port, "/ready"))[0] == status
    except OSError:  # not listening yet
        return False


def _encoder_process(port: int, env: dict[str, str]):
    """``epd encoder`` with its log in a file: a pipe nobody reads fills up with the log lines of its
    connection attempts, and the process then blocks writing them (also after a SIGTERM)."""
    log = tempfile.TemporaryFile()
    process = subprocess.Popen([sys.executable, "-m", "services.encoder", "--health-port", str(port)], env=env,
                               stdout=subprocess.DEVNULL, stderr=log)
    return process, log


def _tail(log) -> str:
    log.seek(0)
    return log.read().decode(errors="replace")[-2000:]


def test_epd_encoder_probes(nats_url, tiny_model):
    """A real ``epd encoder`` process with ``--health-port``: ready once it serves, gone after SIGTERM."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    env.update(EPD_NATS_URL=nats_url, EPD_MODEL=str(tiny_model), EPD_SUBJECT_PREFIX="health" + str(port))
    process, log = _encoder_process(port, env)
    try:
        async def ready() -> bool:
            assert process.poll() is None, _tail(log)
            try:
                return (await get(port, "/ready"))[0] == 200
            except OSError:
                return False

        asyncio.run(until(ready, timeout=120))
        assert asyncio.run(get(port, "/live")) == (200, {"status": "alive"})
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
        with pytest.raises(ConnectionRefusedError):
            asyncio.run(get(port, "/live"))
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_service_waiting_for_nats_obeys_sigterm(tiny_model):
    """NATS not there yet (compose starting out of order, a cluster rolling): the service retries the
    connection, is live meanwhile, and a SIGTERM still ends it at once."""
    port, nowhere = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    env.update(EPD_NATS_URL=f"nats://127.0.0.1:{nowhere}", EPD_MODEL=str(tiny_model))
    process, log = _encoder_process(port, env)
    try:
        async def live() -> bool:
            assert process.poll() is None, _tail(log)
            return await _answers(port)

        asyncio.run(until(live, timeout=120))
        assert asyncio.run(get(port, "/ready")) == (503, {"status": "starting"})
        time.sleep(1)  # a few connection attempts
        process.send_signal(signal.SIGTERM)
        assert process.wait(15) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


async def test_a_connect_to_nowhere_ends_when_cancelled_right_after_its_first_attempt():
    """What a SIGTERM does to a service still connecting: cancel nats-py's connect loop. A cancel landing
    within a few ms of a refused attempt is swallowed by the loop's clean-up about one time in ten, which
    then retries forever (the service hung past its stop); ``cancel_until_done`` cancels again."""
    import random

    import nats

    from shared.aio import cancel_until_done

    nowhere = free_port()
    random.seed(7)
    for _ in range(60):
        task = asyncio.create_task(nats.connect(f"nats://127.0.0.1:{nowhere}", max_reconnect_attempts=-1,
                                                reconnect_time_wait=0.5, connect_timeout=5, error_cb=_quiet))
        await asyncio.sleep(random.uniform(0, 0.003))
        assert await cancel_until_done(task, timeout=3.0), "the connect loop outlived its cancels"
        assert task.cancelled()


async def _quiet(error: Exception) -> None:
    """nats-py's error callback: a refused connection is what this test makes"""


async def test_a_task_set_ends_a_task_that_swallows_its_first_cancel():
    """nats-py's flush catches ``CancelledError``: a loop around ``publish`` cancelled mid-flush goes on to its
    next ``await``. A stop that cancelled once and waited would wait for ever."""
    from shared.aio import TaskSet

    swallowed = []

    async def publishing_loop() -> None:
        while True:
            try:
                await asyncio.sleep(10)  # the flush, cancelled
            except asyncio.CancelledError:
                if swallowed:  # the second cancel ends it, as the next await of a real loop would
                    raise
                swallowed.append(True)  # nats-py's ``except asyncio.CancelledError: pass``

    tasks = TaskSet("publishers")
    task = tasks.spawn(publishing_loop())
    await asyncio.sleep(0)
    await asyncio.wait_for(tasks.cancel(), 3)  # the second cancel comes 0.5 s after the first
    assert swallowed and task.cancelled() and len(tasks) == 0
