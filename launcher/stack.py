"""``epd up``: the whole stack on one machine — an embedded nats-server and the services as processes.

Three topologies from one flag, with the same engine and model code:
- ``disaggregated`` (default): encoder, prefill and decode processes, each kind on its own GPUs
  (``--encoder-gpus 1,2 --prefill-gpus 0 --decode-gpus 0``);
- ``colocated``: the same processes, all on the same GPUs (``--gpus``);
- ``aggregated``: ``--aggregated N`` processes that each encode, prefill and decode with one engine.
Each process gets ``CUDA_VISIBLE_DEVICES`` from its kind's list, round-robin over its replicas.

Children inherit the ``EPD_*`` environment with the NATS URL and model filled in, die with the launcher
(``PR_SET_PDEATHSIG``), and are stopped in order on Ctrl-C / SIGTERM: SIGTERM (they drain), then SIGKILL
for any that outlive the grace period, then the embedded server.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import Literal

from pydantic import Field, model_validator

from shared.bus import service_stats
from shared.logging import configure_logging, get_logger
from launcher.credentials import StackCredentials
from launcher.natsserver import EmbeddedNats
from launcher.processes import die_with_parent
from shared.settings import CommonSettings

log = get_logger(__name__)

KINDS = ("encoder", "prefill", "decode", "aggregated", "frontend")
TOPOLOGIES = ("aggregated", "colocated", "disaggregated")


class UpSettings(CommonSettings):
    nats_url: str = Field("", description="use this NATS server; empty: start an embedded one (loopback)")
    nats_auth: bool = Field(True, description="the embedded server gets generated per-role credentials and "
                                              "subject permissions (--no-nats-auth: open, for debugging)")
    host: str = Field("127.0.0.1", description="HTTP listen address")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port of the OpenAI-compatible API")
    encoders: int = Field(1, ge=0, description="encoder processes (0: text-only; image requests get 503)")
    prefills: int = Field(1, ge=0, description="prefill processes")
    decodes: int = Field(1, ge=0, description="decode processes")
    ready_timeout: float = Field(300.0, gt=0, description="seconds to wait for every service to come up")
    topology: Literal["aggregated", "colocated", "disaggregated"] = Field(
        "disaggregated", description="disaggregated: E, P, D processes on their own GPUs; colocated: the same "
                                     "processes on the same GPUs (--gpus); aggregated: processes doing E+P+D each "
                                     "with one engine (the baseline)")
    aggregated: int = Field(1, ge=1, description="with --topology aggregated: how many E+P+D processes")
    gpus: str = Field("", description="GPU ids (CUDA_VISIBLE_DEVICES, comma separated) the services share, "
                                      "round-robin over replicas; empty: inherit CUDA_VISIBLE_DEVICES")
    encoder_gpus: str = Field("", description="disaggregated: the encoders' GPUs (default: --gpus)")
    prefill_gpus: str = Field("", description="disaggregated: the prefill workers' GPUs (default: --gpus)")
    decode_gpus: str = Field("", description="disaggregated: the decode workers' GPUs (default: --gpus)")

    @model_validator(mode="after")
    def _placement(self) -> "UpSettings":
        for name in ("gpus", "encoder_gpus", "prefill_gpus", "decode_gpus"):
            if any(not g or not g.replace("-", "").isalnum() for g in _split(getattr(self, name))):
                raise ValueError(f"--{name.replace('_', '-')} must be GPU ids separated by commas, e.g. 0,1")
        per_kind = [n for n in ("encoder_gpus", "prefill_gpus", "decode_gpus") if getattr(self, n)]
        if per_kind and self.topology != "disaggregated":
            raise ValueError(f"--{per_kind[0].replace('_', '-')} places one kind of service: it is for "
                             f"--topology disaggregated; {self.topology} puts every service on --gpus")
        counts = [n for n in ("encoders", "prefills", "decodes") if n in self.model_fields_set]
        if self.topology == "aggregated" and counts:
            raise ValueError(f"--{counts[0]} does not apply to --topology aggregated; use --aggregated N")
        if self.topology != "aggregated" and "aggregated" in self.model_fields_set:
            raise ValueError("--aggregated N is for --topology aggregated")
        return self

    def gpu_list(self, kind: str) -> list[str]:
        """The GPUs ``kind``'s replicas take turns on (empty: leave CUDA_VISIBLE_DEVICES as inherited)."""
        own = getattr(self, f"{kind}_gpus", "") if self.topology == "disaggregated" else ""
        return _split(own or self.gpus)

    def placements(self) -> list["Placement"]:
        """Every worker process of this topology (the frontend aside), with its GPUs."""
        out = []
        for kind, n in self.service_counts().items():
            if kind == "frontend":
                continue
            gpus = self.gpu_list(kind)
            out.extend(Placement(kind, gpus[i % len(gpus)] if gpus else None) for i in range(n))
        return out

    def service_counts(self) -> dict[str, int]:
        """What ``wait_ready`` waits for: every worker kind's count (zeros too), and the frontend."""
        if self.topology == "aggregated":
            return {"aggregated": self.aggregated, "frontend": 1}
        return {"encoder": self.encoders, "prefill": self.prefills, "decode": self.decodes, "frontend": 1}


@dataclass(frozen=True)
class Placement:
    kind: str
    gpu: str | None  # CUDA_VISIBLE_DEVICES of the process; None: inherited

    def env(self) -> dict[str, str]:
        return {} if self.gpu is None else {"CUDA_VISIBLE_DEVICES": self.gpu}


def _split(ids: str) -> list[str]:
    return [g.strip() for g in ids.split(",")] if ids.strip() else []


@dataclass
class Stack:
    """A running set of service processes (``epd up``, and the tests' fixture)."""

    env: dict[str, str]
    nats: EmbeddedNats | None = None
    processes: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    credentials: StackCredentials | None = None  # per-role users of the embedded server, when secured

    @classmethod
    def start_nats(cls, env: dict[str, str], nats_url: str = "", secure: bool = False) -> "Stack":
        """Use ``nats_url``, or start an embedded server (with generated per-role credentials if ``secure``)."""
        stack = cls(env=dict(env))
        if not nats_url:
            if secure:
                stack.credentials = StackCredentials.generate(env.get("EPD_SUBJECT_PREFIX", "epd"))
            stack.nats = EmbeddedNats(config_text=stack.credentials.server_config() if secure else "")
            nats_url = stack.nats.start()
        stack.env["EPD_NATS_URL"] = nats_url
        return stack

    @property
    def nats_url(self) -> str:
        return self.env["EPD_NATS_URL"]

    def spawn(self, kind: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        if kind not in KINDS:
            raise ValueError(f"unknown service kind {kind!r}")
        role = self.credentials.env(kind) if self.credentials else {}
        process = subprocess.Popen([sys.executable, "-m", f"services.{kind}", *args],
                                   env={**self.env, **role, **(env or {})}, preexec_fn=die_with_parent)
        self.processes.append((kind, process))
        return process

    async def wait_ready(self, counts: dict[str, int], timeout: float, prefix: str = "epd",
                         interrupted=lambda: False) -> str:
        """Until the NATS service API lists ``counts[kind]`` instances of every kind of this stack (or a
        child dies). A service registers only once it can serve, so listed means ready. Returns the
        frontend's HTTP address (host:port), which it bound itself when asked for port 0."""
        import nats

        deadline = time.monotonic() + timeout
        nc = await nats.connect(servers=[self.nats_url], **self._auth())
        try:
            while True:
                self.check_alive()
                if interrupted():
                    raise RuntimeError("interrupted while starting")
                stats = await service_stats(nc, wait=0.3)
                mine = [s for s in stats if (s.get("metadata") or {}).get("prefix") == prefix]
                seen = {kind: sum(1 for s in mine if s.get("name") == f"epd-{kind}") for kind in counts}
                if kind_counts_met(seen, counts):
                    front = [s for s in mine if s.get("name") == "epd-frontend"]
                    return (front[0].get("metadata") or {}).get("http", "") if front else ""
                if time.monotonic() > deadline:
                    raise TimeoutError(f"services not ready in {timeout:g}s: expected {counts}, saw {seen}")
                await asyncio.sleep(0.2)
        finally:
            await nc.close()

    def _auth(self) -> dict:
        if self.credentials:
            return {"user": "admin", "password": self.credentials.passwords["admin"]}
        if self.env.get("EPD_NATS_USER"):
            return {"user": self.env["EPD_NATS_USER"], "password": self.env.get("EPD_NATS_PASSWORD", "")}
        return {}

    def write_client_credentials(self) -> Path | None:
        """An env file with the ``client`` role's credentials (mode 0600), for `epd submit` and friends."""
        if not self.credentials or self.nats is None:
            return None
        path = self.nats.workdir / "nats-client.env"
        path.touch(mode=0o600)
        path.write_text("".join(f"{k}={v}\n" for k, v in {"EPD_NATS_URL": self.nats_url,
                                                            **self.credentials.env("client")}.items()))
        return path

    def check_alive(self) -> None:
        for kind, process in self.processes:
            if process.poll() is not None:
                raise RuntimeError(f"the {kind} process exited with status {process.returncode}")

    def stop(self, grace: float = 30.0) -> None:
        for _, process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for _, process in self.processes:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()
        if self.nats is not None:
            self.nats.stop()


def kind_counts_met(seen: dict[str, int], counts: dict[str, int]) -> bool:
    return all(seen.get(kind, 0) >= n for kind, n in counts.items())




def up(settings: UpSettings) -> int:
    configure_logging(settings.log_level, settings.log_format, "epd-up")
    path = settings.model_path()  # writes the built-in model once, before the children race for it
    env = {**os.environ, "EPD_MODEL": str(path) if not settings.model or settings.load_format != "dummy"
           else settings.model, "EPD_LOAD_FORMAT": settings.load_format, "EPD_SUBJECT_PREFIX": settings.subject_prefix}
    stack = Stack.start_nats(env, settings.nats_url, secure=settings.nats_auth)
    counts = settings.service_counts()
    stopping = False

    def request_stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    try:
        for placement in settings.placements():
            stack.spawn(placement.kind, env=placement.env())
        stack.spawn("frontend", "--host", settings.host, "--port", str(settings.port))
        http = asyncio.run(stack.wait_ready(counts, settings.ready_timeout, settings.subject_prefix,
                                            lambda: stopping))
        log.info("stack.ready", api=f"http://{http}/v1", nats=stack.nats_url, topology=settings.topology,
                 nats_client_credentials=str(stack.write_client_credentials() or ""),
                 **{kind: n for kind, n in counts.items() if kind != "frontend"})
        while not stopping:
            stack.check_alive()
            time.sleep(0.2)
        return 0
    except (RuntimeError, TimeoutError) as err:
        if stopping:
            return 0
        log.error("stack.failed", error=str(err))
        return 1
    finally:
        log.info("stack.stopping")
        stack.stop(settings.drain_seconds + 5)
