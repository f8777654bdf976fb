"""``epd up`` as its users run it, driven from the outside: a subprocess, its JSON log lines, its
children found in /proc, its state read from the frontend's /metrics — no NATS access needed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tests.support import chat_messages


def descendants(pid: int) -> set[int]:
    """All live processes below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def parent(pid: int) -> int:
    """``pid``'s parent (0 once it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class UpStack:
    """``wait=False``: return at once (``wait_ready`` later); ``terminal=True``: in a session of its own, as
    a shell runs a command in a terminal, so ``interrupt`` is a terminal's Ctrl-C."""

    def __init__(self, model: Path, *args: str, env: dict[str, str] | None = None, wait: bool = True,
                 terminal: bool = False):
        base = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
        base.update(EPD_MODEL=str(model), EPD_KV_CACHE_MB="32", EPD_LOG_FORMAT="json", **(env or {}))
        self.process = subprocess.Popen([sys.executable, "-m", "launcher.cli", "up", "--port", "0", *args], env=base,
                                        stderr=subprocess.PIPE, text=True, start_new_session=terminal)
        self.events: list[dict] = []
        self._ready = threading.Event()
        threading.Thread(target=self._read_logs, daemon=True).start()  # a full pipe would block the children
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = 240) -> None:
        if not self._ready.wait(timeout):
            self.stop()
            raise RuntimeError(f"epd up did not come up: {self.events[-5:]}")
        ready = self.event("stack.ready")
        if ready is None:
            raise RuntimeError(f"epd up failed: {self.events[-5:]}")
        self.ready = ready
        self.api = ready["api"]
        self.root = self.api.removesuffix("/v1")

    def interrupt(self) -> None:
        """A terminal's Ctrl-C: SIGINT to the whole foreground process group."""
        os.killpg(self.process.pid, signal.SIGINT)

    def exits(self) -> list[tuple[str, int]]:
        """(kind, exit status) of every process the launcher stopped, in the order they ended."""
        return [(e["kind"], e["status"]) for e in self.events if e.get("event") == "stack.process_exited"]

    def _read_logs(self) -> None:
        for line in self.process.stderr:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            self.events.append(event)
            if event.get("event") in ("stack.ready", "stack.failed"):
                self._ready.set()
        self._ready.set()

    def event(self, name: str) -> dict | None:
        return next((e for e in self.events if e.get("event") == name), None)

    def errors(self, last: int = 8) -> list[dict]:
        """The stack's latest error and exception log lines (for a failed assertion's message)."""
        return [e for e in self.events if e.get("level") in ("error", "critical") or "exception" in e][-last:]

    def count(self, name: str) -> int:
        return sum(1 for e in self.events if e.get("event") == name)

    def pids(self, kind: str) -> list[int]:
        """The live workers of one kind; a child a worker forked and has not exec'd yet carries its command
        line, so a match whose parent also matches is not counted."""
        found = {p for p in descendants(self.process.pid) if f"-m services.{kind}" in cmdline(p) and alive(p)}
        return sorted(p for p in found if parent(p) not in found)

    def signal(self, kind: str, sig: int, index: int = 0) -> int:
        pid = self.pids(kind)[index]
        os.kill(pid, sig)
        return pid

    def metrics(self) -> str:
        return httpx.get(f"{self.root}/metrics", timeout=10).text

    def series(self, name: str) -> list[tuple[dict[str, str], float]]:
        """(labels, value) of every series of one metric."""
        pattern = re.compile(rf'^{name}\{{(.*?)\}} ([-0-9.e+]+)$', re.M)
        return [(dict(re.findall(r'(\w+)="([^"]*)"', text)), float(value)) for text, value in pattern.findall(self.metrics())]

    def gauge(self, name: str, **labels) -> list[float]:
        """Values of one metric whose labels include ``labels``."""
        return [value for have, value in self.series(name) if all(have.get(k) == v for k, v in labels.items())]

    def workers(self, kind: str) -> int:
        values = self.gauge("epd_workers", kind=kind)
        return int(values[0]) if values else 0

    def wait_for_workers(self, kind: str, count: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while self.workers(kind) != count or len(self.pids(kind)) != count:
            assert time.monotonic() < deadline, f"{kind}: {self.workers(kind)} listed, want {count}"
            time.sleep(0.3)

    def wait_idle(self, timeout: float = 15) -> None:
        """No sequence running and no KV block held on any language-model worker, and no embeddings held
        at an encoder (every handle handed out was pulled or discarded; a loan to an encoder killed before
        it pulled lapses in 10 s)."""
        deadline = time.monotonic() + timeout
        while True:
            busy = [(labels, value) for labels, value in self.series("epd_service_stat")
                    if value and (labels.get("stat") in ("running", "kv_blocks_used", "reservations", "handoffs")
                                  or labels.get("stat") == "bytes_held"
                                  and labels.get("instance", "").startswith("encoder"))]
            if not busy:
                return
            if time.monotonic() >= deadline:
                notable = [e for e in self.events if e.get("level") in ("warning", "error")][-12:]
                raise AssertionError(f"work left behind: {busy}; last warnings: {notable}")
            time.sleep(0.2)

    def chat(self, text: str, images=(), max_tokens: int = 8, stream: bool = False, timeout: float = 120) -> dict:
        payload = {"messages": chat_messages(text, list(images)), "max_tokens": max_tokens, "temperature": 0,
                   "ignore_eos": True, "stream": stream}
        if not stream:
            response = httpx.post(f"{self.api}/chat/completions", json=payload, timeout=timeout)
            return {"status": response.status_code, **response.json()}
        return read_sse(f"{self.api}/chat/completions", payload, timeout)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(90)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def read_sse(url: str, payload: dict, timeout: float) -> dict:
    text, finish, error = [], None, None
    with httpx.stream("POST", url, json=payload, timeout=timeout) as response:
        if response.status_code != 200:
            return {"status": response.status_code, "error": response.read().decode()}
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]
                continue
            choice = event["choices"][0] if event.get("choices") else None
            if choice and choice["delta"].get("content"):
                text.append(choice["delta"]["content"])
            if choice and choice.get("finish_reason"):
                finish = choice["finish_reason"]
    return {"status": 200, "text": "".join(text), "finish": finish, "error": error}
