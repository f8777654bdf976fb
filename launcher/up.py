"""``epd up``: the whole stack on one machine — an embedded nats-server (secured with per-role users), the
workers of the chosen topology, a frontend — supervised until Ctrl-C / SIGTERM.

1. the options and the model are checked (a bad one: one line, exit status 2), the built-in model is
   written once (before the children race for it), the NATS server starts, the durable-job streams are
   created (clients may not create streams on a secured server);
2. CUDA MPS is started when workers share a GPU (``mps.py``);
3. every worker starts in a supervised slot (``supervisor.py``: one that crashes while starting is
   started again; one that keeps crashing stops the stack with its own last error line), and the frontend
   beside them (``--wait-for-workers``: it sets itself up meanwhile, and opens its port only once the NATS
   service API lists every worker started, so the API answers only when the stack can serve);
   ``stack.ready`` is logged once the frontend is listed too;
4. until stopped: crashed workers are restarted, workers that exit cleanly are scale-in, and with
   ``--encoders MIN:MAX`` the encoder tier follows the load (``autoscale.py``);
5. on Ctrl-C (the launcher alone gets it: its children run in process groups of their own), SIGTERM or
   SIGHUP: the frontend drains, then the workers, stragglers are killed (at once on a second signal),
   then NATS stops and the MPS daemon last; the exit status is 0.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import replace
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import Field

from launcher import mps
from launcher.autoscale import EncoderAutoscaler
from launcher.stack import Stack
from launcher.supervisor import Slot, Supervisor
from launcher.topology import Placement, TopologySettings
from services.frontend.settings import HttpListener, ServedName
from shared.bus.directory import Directory
from shared.logging import configure_logging, get_logger
from shared.settings import BadSettings, CommonSettings, GpuMemory

log = get_logger(__name__)

STEP_SECONDS = 0.2  # how often the launcher checks its processes
LIST_SECONDS = 1.0  # how often it reads the NATS service API once the stack serves


READY_TIMEOUT_S = 1800.0  # for a worker to come up (a large checkpoint takes minutes to load): past it, the
# stack fails to start, or (a restart, a scale-out) the worker is killed and started again
SCALE_UP_AFTER_S = 2.0  # --encoders MIN:MAX: seconds the tier must stay over --scale-up-load to grow
# the options every process shares, passed on as given to epd up (flag or EPD_ variable); the rest are the
# launcher's own (the NATS server, the model, the health port: one per pod) or set per process
FORWARDED = tuple(name for name in CommonSettings.model_fields
                  if name not in ("nats_url", "subject_prefix", "model", "load_format", "health_port")) \
    + ("gpu_memory_utilization",)


class UpSettings(GpuMemory, HttpListener, ServedName, TopologySettings):
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
    try:
        shares = mps.parse_shares(settings.mps_shares)
        path = settings.model_path()  # writes the built-in model once, before the children race for it
        plan = _plan_memory(settings, path)  # a stack that cannot fit its GPUs is refused before it starts
    except ValueError as err:
        raise BadSettings(f"epd up: {err}") from None
    configure_logging(settings.log_level, settings.log_format, "epd-up")
    try:
        return asyncio.run(_run(settings, path, shares, plan))
    except (RuntimeError, TimeoutError) as err:
        log.error("stack.failed", error=str(err))
        return 1


async def _run(settings: UpSettings, path: Path, shares: dict[str, int], plan: "MemoryPlan") -> int:
    dummy_preset = settings.model and settings.load_format == "dummy"
    env = {**os.environ, **forwarded(settings), "EPD_MODEL": settings.model if dummy_preset else str(path),
           "EPD_LOAD_FORMAT": settings.load_format, "EPD_SUBJECT_PREFIX": settings.subject_prefix}
    env.pop("EPD_HEALTH_PORT", None)  # one port per process: probes are for pods, not a local stack
    if plan.max_model_len:  # every process, the frontend too: it checks prompts against the context
        env["EPD_MAX_MODEL_LEN"] = str(plan.max_model_len)
    if sys.stderr.isatty():
        env.setdefault("FORCE_COLOR", "1")  # the children write to a pipe, which we forward to the terminal
    workdir = Path(tempfile.mkdtemp(prefix="epd-up-"))  # private (0700): MPS pipes, logs
    stack = Stack.start_nats(env, settings.nats_url, secure=True)
    daemon = None
    stopping = asyncio.Event()

    def stop() -> None:  # a second Ctrl-C: whatever still drains is killed
        if stopping.is_set():
            stack.hurry.set()
        stopping.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, stop)
    try:
        daemon = _start_mps(settings, workdir, stack)
        if stack.nats is not None:
            await stack.prepare_jobs()
        supervisor = Supervisor(stack, start_timeout=READY_TIMEOUT_S)
        plan.log()
        shares = shares if daemon else {}

        def place(placement: Placement) -> Placement:
            return replace(placement, sm_share=shares.get(placement.kind), memory=plan.of(placement))

        for placement in settings.placements():
            supervisor.start(place(placement), len(supervisor.live(placement.kind)))
        front = supervisor.start(Placement("frontend", None), 0, *_frontend_args(settings))
        nc = await stack.connect()
        directory = Directory(nc, settings.subject_prefix)
        try:
            http = await _start(settings, supervisor, directory, stopping, front)
            if http is not None:
                supervisor.serving = True
                log.info("stack.ready", api=f"http://{http}/v1", nats=stack.nats_url, topology=settings.topology,
                         pd=settings.pd, mps=daemon is not None,
                         nats_client_credentials=str(stack.write_client_credentials() or ""),
                         **settings.worker_counts())
                await _supervise(settings, supervisor, directory, stopping, place)
        finally:
            await nc.close()
        return 0
    finally:
        log.info("stack.stopping", hint="Ctrl-C again to stop at once")
        await asyncio.to_thread(stack.stop, settings.drain_seconds + 5)
        if daemon is not None:
            daemon.stop()  # last: a process still using it when it goes would abort
        shutil.rmtree(workdir, ignore_errors=True)


async def _start(settings: UpSettings, supervisor: Supervisor, directory: Directory,
                 stopping: asyncio.Event, front: Slot) -> str | None:
    """Every process until the service API lists it (restarting those that crash): the workers, then the
    frontend, which opens its port once it sees them. The frontend's HTTP address (host:port), or None when
    stopped first."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    workers_ready = False
    while not stopping.is_set():
        await directory.refresh(enough=lambda seen: all(seen.get(s.kind, 0) >= n for s, n in _wanted(supervisor)))
        supervisor.check(time.monotonic(), _pids(directory))
        workers = [s for s in supervisor.slots if s.kind != "frontend" and not s.retired]
        if not workers_ready and all(s.ready for s in workers):
            log.info("stack.workers_ready", **settings.worker_counts())
            workers_ready = True
        if workers_ready and front.ready:
            listed = [i for i in directory.of("frontend") if i.metadata.get("pid") == str(front.process.pid)]
            return listed[0].metadata.get("http", "") if listed else ""
        if time.monotonic() > deadline:
            waiting = sorted({s.kind for s in supervisor.slots if not s.ready and not s.retired})
            raise TimeoutError(f"not ready in {READY_TIMEOUT_S:g} s: {', '.join(waiting)}")
        await _pause(stopping, STEP_SECONDS)
    return None


def forwarded(settings: UpSettings) -> dict[str, str]:
    """The shared options given to ``epd up``, as the variables its children read (a GPU's memory plan
    overrides ``EPD_GPU_MEMORY_UTILIZATION`` and the encoders' ``EPD_DATA_MAX_MB`` where processes share
    it; NATS credentials are for a server of ``--nats-url``)."""
    given = {name: getattr(settings, name) for name in FORWARDED if name in settings.model_fields_set
             and (settings.nats_url or not name.startswith("nats_"))}  # the embedded server has its own users
    return {f"EPD_{name.upper()}": str(value).lower() if isinstance(value, bool) else str(value)
            for name, value in given.items() if value is not None}


def _frontend_args(settings: UpSettings) -> list[str]:
    args = ["--host", settings.host, "--port", str(settings.port)]
    if wanted := ",".join(f"{kind}={n}" for kind, n in settings.worker_counts().items() if n):
        args += ["--wait-for-workers", wanted]
    if settings.served_model_name:
        args += ["--served-model-name", settings.served_model_name]
    if settings.text_only:  # no encoder will ever serve: images and videos are refused at once (400)
        args += ["--limit-mm-per-prompt", "image=0,video=0"]
    return args


async def _supervise(settings: UpSettings, supervisor: Supervisor, directory: Directory, stopping: asyncio.Event,
                     place: Callable[[Placement], Placement]) -> None:
    scaler = None
    if settings.encoder_scale.autoscaled:
        scaler = EncoderAutoscaler(supervisor, directory, settings.encoder_scale,
                                   lambda replica: place(settings.placement("encoder", replica)),
                                   settings.scale_up_load, SCALE_UP_AFTER_S, settings.scale_down_after)
    listed_at = time.monotonic()
    while not stopping.is_set():
        now = time.monotonic()
        listed = None
        if now - listed_at >= LIST_SECONDS and directory.nc.is_connected:
            try:
                await directory.refresh()
                listed, listed_at = _pids(directory), now
            except Exception as err:  # the bus is restarting: processes are still supervised meanwhile
                log.warning("stack.listing_failed", error=str(err))
        supervisor.check(now, listed)
        if scaler is not None and listed is not None:
            scaler.step(now)
        await _pause(stopping, STEP_SECONDS)


def _wanted(supervisor: Supervisor):
    """(slot, how many of its kind) for every slot that should be listed: stop listening once they are."""
    slots = [s for s in supervisor.slots if not s.retired and not s.stopping]
    return [(s, sum(o.kind == s.kind for o in slots)) for s in slots]


def _pids(directory: Directory) -> set[int]:
    return {int(i.metadata["pid"]) for i in directory.instances if str(i.metadata.get("pid", "")).isdigit()}


async def _pause(stopping: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stopping.wait(), seconds)
    except asyncio.TimeoutError:
        pass


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


def _plan_memory(settings: UpSettings, path: Path) -> "MemoryPlan":
    """Each process's share of a GPU it shares with others, and the context every KV pool holds, shared GPU
    or not (nothing to plan on CPU)."""
    from launcher.memory import MemoryPlan

    if settings.device == "cpu" or not mps.gpus_present():
        return MemoryPlan()
    return MemoryPlan.for_stack(settings, path)
