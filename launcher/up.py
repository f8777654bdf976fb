"""``epd up``: the whole stack on one machine — an embedded nats-server (secured with per-role users), the
workers of the chosen topology, a frontend — supervised until Ctrl-C / SIGTERM.

1. the built-in model is written once (before the children race for it), the NATS server starts, the
   durable-job streams are created (clients may not create streams on a secured server);
2. CUDA MPS is started when workers share a GPU (``mps.py``);
3. every worker and the frontend start in supervised slots (``supervisor.py``); ``stack.ready`` is
   logged once the NATS service API lists them all;
4. until stopped: crashed workers are restarted, workers that exit cleanly are scale-in, and with
   ``--encoders MIN:MAX`` the encoder tier follows the load (``autoscale.py``);
5. on Ctrl-C / SIGTERM: every process gets SIGTERM and drains, stragglers are killed, then MPS and NATS stop.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Literal

from pydantic import Field

from launcher import mps
from launcher.autoscale import EncoderAutoscaler
from launcher.stack import Stack
from launcher.supervisor import Supervisor
from launcher.topology import Placement, TopologySettings
from services.frontend.settings import HttpListener
from shared.bus.directory import Directory
from shared.logging import configure_logging, get_logger

log = get_logger(__name__)


READY_TIMEOUT_S = 1800.0  # for every service to come up: a large checkpoint takes minutes to load
SCALE_UP_AFTER_S = 2.0  # --encoders MIN:MAX: seconds the tier must stay over --scale-up-load to grow


class UpSettings(HttpListener, TopologySettings):
    nats_url: str = Field("", description="use this NATS server; empty: start an embedded one on loopback, "
                                          "secured with generated per-role credentials")
    mps: Literal["auto", "on", "off"] = Field("auto", description="CUDA MPS for processes sharing a GPU: auto "
                                                                  "starts a daemon when they do and it exists")
    mps_shares: str = Field("", description="per-kind SM shares under MPS, e.g. encoder=40,language=100 "
                                            "(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE): to keep one kind from "
                                            "starving another")
    scale_up_load: float = Field(4.0, gt=0, description="--encoders MIN:MAX: add an encoder while the encode "
                                                        "jobs in flight per encoder stay above this")
    scale_down_after: float = Field(30.0, gt=0, description="--encoders MIN:MAX: seconds without an encode job "
                                                            "in flight before an encoder is removed")


def up(settings: UpSettings) -> int:
    configure_logging(settings.log_level, settings.log_format, "epd-up")
    mps.parse_shares(settings.mps_shares)  # refuse a bad value before anything starts
    try:
        return asyncio.run(_run(settings))
    except (RuntimeError, TimeoutError) as err:
        log.error("stack.failed", error=str(err))
        return 1


async def _run(settings: UpSettings) -> int:
    path = settings.model_path()  # writes the built-in model once, before the children race for it
    dummy_preset = settings.model and settings.load_format == "dummy"
    env = {**os.environ, "EPD_MODEL": settings.model if dummy_preset else str(path),
           "EPD_LOAD_FORMAT": settings.load_format, "EPD_SUBJECT_PREFIX": settings.subject_prefix}
    env.pop("EPD_HEALTH_PORT", None)  # one port per process: probes are for pods, not a local stack
    workdir = Path(tempfile.mkdtemp(prefix="epd-up-"))  # private (0700): MPS pipes, logs
    stack = Stack.start_nats(env, settings.nats_url, secure=True)
    daemon = None
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    try:
        daemon = _start_mps(settings, workdir, stack)
        if stack.nats is not None:
            await stack.prepare_jobs()
        supervisor = Supervisor(stack)
        shares = mps.parse_shares(settings.mps_shares) if daemon else {}
        for placement in settings.placements():
            supervisor.start(_with_share(placement, shares), len(supervisor.live(placement.kind)))
        supervisor.start(Placement("frontend", None), 0, "--host", settings.host, "--port", str(settings.port))
        counts = {**settings.worker_counts(), "frontend": 1}
        http = await stack.wait_ready(counts, READY_TIMEOUT_S, interrupted=stopping.is_set)
        log.info("stack.ready", api=f"http://{http}/v1", nats=stack.nats_url, topology=settings.topology,
                 pd=settings.pd, mps=daemon is not None,
                 nats_client_credentials=str(stack.write_client_credentials() or ""), **settings.worker_counts())
        await _supervise(settings, stack, supervisor, stopping, shares)
        return 0
    except RuntimeError as err:
        if stopping.is_set():
            return 0
        raise err
    finally:
        log.info("stack.stopping")
        await asyncio.to_thread(stack.stop, settings.drain_seconds + 5)
        if daemon is not None:
            daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)


async def _supervise(settings: UpSettings, stack: Stack, supervisor: Supervisor, stopping: asyncio.Event,
                     shares: dict[str, int]) -> None:
    nc = await stack.connect()
    directory = Directory(nc, settings.subject_prefix)
    directory.start()
    scaler = None
    if settings.encoder_scale.autoscaled:
        scaler = EncoderAutoscaler(supervisor, directory, settings.encoder_scale,
                                   lambda replica: _with_share(settings.placement("encoder", replica), shares),
                                   settings.scale_up_load, SCALE_UP_AFTER_S, settings.scale_down_after)
    try:
        while not stopping.is_set():
            now = time.monotonic()
            supervisor.check(now)
            if scaler is not None and directory.refreshed.is_set():
                scaler.step(now)
            try:
                await asyncio.wait_for(stopping.wait(), 0.2)
            except asyncio.TimeoutError:
                pass
    finally:
        await directory.stop()
        await nc.close()


def _start_mps(settings: UpSettings, workdir: Path, stack: Stack):
    use, why = mps.decide(settings.mps, settings.shared_gpus(), settings.device)
    log.info("stack.mps", enabled=use, reason=why)
    if not use:
        return None
    used = sorted({g for kind in settings.worker_counts() for g in settings.gpu_list(kind)})
    daemon = mps.MpsDaemon(workdir, ",".join(used))
    daemon.start()
    stack.env.update(daemon.env())
    return daemon


def _with_share(placement: Placement, shares: dict[str, int]) -> Placement:
    return replace(placement, sm_share=shares.get(placement.kind))
