"""`epd up`: one command brings the stack up on the embedded defaults; SIGTERM or the launcher's death
leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import asyncio

import httpx
import nats
import pytest

from tests.support import data_url, make_image


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


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def start_up(tiny_model, *args) -> tuple[subprocess.Popen, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    env.update(EPD_MODEL=str(tiny_model), EPD_KV_CACHE_MB="32", EPD_LOG_FORMAT="json")
    process = subprocess.Popen([sys.executable, "-m", "launcher.cli", "up", "--port", "0", *args], env=env,
                               stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    for line in process.stderr:
        assert time.monotonic() < deadline, "stack did not come up"
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "stack.ready":
            # keep reading: children share this pipe, and a full pipe would block their logging
            threading.Thread(target=lambda: [None for _ in process.stderr], daemon=True).start()
            return process, event["api"], event
        assert event.get("event") != "stack.failed", line
    pytest.fail(f"epd up exited with {process.wait()} before it was ready")


def test_up_serves_then_sigterm_stops_everything(tiny_model):
    process, api, ready = start_up(tiny_model, "--encoders", "1")
    try:
        family = descendants(process.pid)
        assert len(family) >= 5  # nats-server, encoder, prefill, decode, frontend
        assert httpx.get(api.removesuffix("/v1") + "/health").json() == {"status": "ok"}
        image = {"type": "image_url", "image_url": {"url": data_url(make_image(3, 40, 60))}}
        reply = httpx.post(f"{api}/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": [image, {"type": "text", "text": "Hello"}]}],
            "max_tokens": 3, "temperature": 0}).json()
        assert reply["usage"]["completion_tokens"] == 3  # every role works within its NATS permissions
        secrets_file = Path(ready["nats_client_credentials"])
        assert secrets_file.stat().st_mode & 0o777 == 0o600 and "EPD_NATS_PASSWORD=" in secrets_file.read_text()
        with pytest.raises(Exception):  # the embedded server refuses anyone without credentials
            asyncio.run(nats.connect(ready["nats"], allow_reconnect=False, max_reconnect_attempts=0,
                                     connect_timeout=2))
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
        time.sleep(0.5)
        assert not [p for p in family if alive(p)]
    finally:
        process.kill()


def test_launcher_killed_leaves_no_orphans(tiny_model):
    process, _, _ = start_up(tiny_model, "--encoders", "1", "--decodes", "1")
    family = descendants(process.pid)
    process.kill()  # no chance to clean up: the children must notice on their own
    process.wait()
    deadline = time.monotonic() + 30
    while [p for p in family if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    survivors = [p for p in family if alive(p)]
    assert not survivors, [Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")[:200] for p in survivors]
