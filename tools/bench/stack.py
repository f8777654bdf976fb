"""An ``epd up`` stack in a subprocess, as a user would start it, for benchmarks.

Its log (JSON lines on stderr) is drained by a thread — a full pipe would block the stack — which keeps
the last lines for error messages, the ``stack.ready`` event (the API address, the topology, whether MPS
runs) and a count of every event that says a request did not go straight through (``EVENTS``), so a
benchmark can tell how many of a point's requests were resumed after a worker loss.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections import Counter, deque
from pathlib import Path

# Log events counted per stack: requests resumed on other workers, encode jobs retried, prefill jobs
# re-sent because their worker went away, and workers that died (the supervisor restarts them); and
# Triton compiles (``kernel.compiled``), each a stall of the thread that launched it, seconds at worst.
EVENTS = ("request.resume", "encode.failed", "prefill.worker_gone", "stack.worker_died", "stack.crash_loop",
          "kernel.compiled")


class StackProcess:
    def __init__(self, args: list[str], env: dict[str, str], cwd: Path, log: Path | None = None, port: int = 0):
        self.log = log.open("w", buffering=1) if log is not None else None  # every line, kept as it comes
        self.command = [sys.executable, "-m", "launcher.cli", "up", "--port", str(port), *args]
        self.process = subprocess.Popen(self.command, cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.tail: deque[str] = deque(maxlen=60)
        self.ready_event: dict = {}
        self.events: Counter[str] = Counter()
        self.compiles: list[dict] = []  # each kernel.compiled: kernel, ms, service, specialization, timestamp
        self._lock = threading.Lock()
        self._ready = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.process.stderr:
            self.tail.append(line.rstrip())
            if self.log is not None:
                self.log.write(line)
            try:
                event = json.loads(line)
            except ValueError:
                continue
            name = event.get("event") if isinstance(event, dict) else None
            if name in EVENTS:
                with self._lock:
                    self.events[name] += 1
                    if name == "kernel.compiled":
                        self.compiles.append({"kernel": event.get("kernel"), "ms": event.get("ms"),
                                              "service": event.get("service"),
                                              "specialization": event.get("specialization"),
                                              "timestamp": event.get("timestamp")})
            elif name == "stack.ready":
                self.ready_event = event
                self._ready.set()
        self._ready.set()
        if self.log is not None:
            self.log.close()

    @property
    def api(self) -> str:
        return self.ready_event.get("api", "")

    def ready_within(self, timeout: float) -> bool:
        """Whether ``stack.ready`` was logged within ``timeout`` seconds (the stack left running either way)."""
        self._ready.wait(timeout)
        return bool(self.api)

    def wait_ready(self, timeout: float) -> str:
        self._ready.wait(timeout)
        if not self.api:
            self.stop()
            raise RuntimeError("stack did not come up:\n" + "\n".join(self.tail))
        return self.api

    def counts(self) -> dict[str, int]:
        """Every counted event so far (take differences around a measurement)."""
        with self._lock:
            return {name: self.events[name] for name in EVENTS}

    def stop(self, timeout: float = 90) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
