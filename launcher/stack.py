"""A running set of service processes on one NATS server: ``epd up``'s, and the tests' fixture.

Children inherit the ``EPD_*`` environment with the NATS URL (and their role's credentials) filled in,
run in process groups of their own and die with the launcher (``processes.py``), write their log through
the launcher's stderr (which keeps each one's last error line), and are stopped in order: the frontends
first (they stop taking requests and finish theirs while the workers still serve), then the workers,
each group with SIGTERM (they drain) and SIGKILL for any that outlive the grace period; then the
embedded server. A second stop signal (``hurry``) kills whatever is still draining.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import nats

from launcher.credentials import StackCredentials
from launcher.natsserver import EmbeddedNats
from launcher.processes import OutputTail, detach_service
from launcher.topology import KINDS
from shared.bus.directory import Directory
from shared.client import JobStreams
from shared.logging import get_logger
from shared.settings import nats_auth

log = get_logger(__name__)


@dataclass
class Stack:
    env: dict[str, str]
    nats: EmbeddedNats | None = None
    processes: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    credentials: StackCredentials | None = None  # per-role users of the embedded server, when secured
    outputs: dict[int, OutputTail] = field(default_factory=dict)  # by pid: each child's stderr, forwarded
    hurry: threading.Event = field(default_factory=threading.Event)  # set: stop kills instead of waiting

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

    @property
    def prefix(self) -> str:
        return self.env.get("EPD_SUBJECT_PREFIX", "epd")

    def spawn(self, kind: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        if kind not in KINDS:
            raise ValueError(f"unknown service kind {kind!r}")
        role = self.credentials.env(kind) if self.credentials else {}
        process = subprocess.Popen([sys.executable, "-m", f"services.{kind}", *args],
                                   env={**self.env, **role, **(env or {})}, preexec_fn=detach_service,
                                   stderr=subprocess.PIPE)
        self.outputs[process.pid] = OutputTail(process.stderr)
        self.processes.append((kind, process))
        return process

    def last_words(self, process: subprocess.Popen) -> str:
        """Why ``process`` (ended) failed, in its own words: its last error line, else its exit status."""
        tail = self.outputs.get(process.pid)
        words = tail.summary() if tail is not None else ""
        return words or exit_status(process.returncode)

    def forget(self, process: subprocess.Popen) -> None:
        """``process`` ended and was dealt with."""
        self.processes = [(k, p) for k, p in self.processes if p is not process]
        self.outputs.pop(process.pid, None)

    async def connect(self):
        """An admin connection (the launcher's own: readiness, stream set-up)."""
        return await nats.connect(servers=[self.nats_url], **self._auth())

    async def prepare_jobs(self) -> None:
        """Create the durable-job streams before any service runs, so jobs can be submitted at once (on a
        secured server clients may not create streams themselves)."""
        nc = await self.connect()
        try:
            await JobStreams(self.prefix).ensure(nc.jetstream())
        finally:
            await nc.close()

    async def wait_ready(self, counts: dict[str, int], timeout: float, prefix: str | None = None,
                         interrupted=lambda: False) -> str:
        """Until the NATS service API lists ``counts[kind]`` instances of every kind of this stack (or a
        child dies). A service registers only once it can serve, so listed means ready. Returns the
        frontend's HTTP address (host:port), which it bound itself when asked for port 0."""
        deadline = time.monotonic() + timeout
        nc = await self.connect()
        directory = Directory(nc, prefix or self.prefix)
        try:
            while True:
                self.check_alive()
                if interrupted():
                    raise RuntimeError("interrupted while starting")
                await directory.refresh(enough=lambda seen: all(seen.get(k, 0) >= n for k, n in counts.items()))
                seen = directory.counts()
                if all(seen.get(kind, 0) >= n for kind, n in counts.items()):
                    front = directory.of("frontend")
                    return front[0].metadata.get("http", "") if front else ""
                if time.monotonic() > deadline:
                    raise TimeoutError(f"services not ready in {timeout:g}s: expected {counts}, saw {seen}")
                await asyncio.sleep(0.2)
        finally:
            await nc.close()

    def _auth(self) -> dict:
        if self.credentials:
            return {"user": "admin", "password": self.credentials.passwords["admin"]}
        return nats_auth(*(self.env.get(f"EPD_NATS_{name}") for name in ("USER", "PASSWORD", "CREDS", "TLS_CA")))

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
        """Frontends, then workers, each group drained within ``grace`` seconds; then the embedded server.
        Every child's exit is logged (``stack.process_exited``): 0 for one that drained."""
        frontends = [(k, p) for k, p in self.processes if k == "frontend"]
        for group in (frontends, [(k, p) for k, p in self.processes if k != "frontend"]):
            self._stop_group(group, grace)
        self.processes.clear()
        self.outputs.clear()
        if self.nats is not None:
            self.nats.stop()

    def _stop_group(self, group: list[tuple[str, subprocess.Popen]], grace: float) -> None:
        for _, process in group:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for kind, process in group:
            while process.poll() is None and time.monotonic() < deadline and not self.hurry.is_set():
                time.sleep(0.05)
            if process.poll() is None:
                process.kill()
                log.warning("stack.process_killed", kind=kind, pid=process.pid, reason="stop asked twice"
                            if self.hurry.is_set() else f"still draining after {grace:g} s")
            process.wait()
            log.info("stack.process_exited", kind=kind, pid=process.pid, status=process.returncode)


def exit_status(status: int | None) -> str:
    """A process's end in words: "exit status 1", "killed by SIGKILL"."""
    if status is None:
        return "still running"
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exit status {status}"
