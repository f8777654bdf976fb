"""`epd up`: one command brings the stack up on the embedded defaults, supervises it (a crash-looping
worker is given up, not the stack), runs CUDA MPS when workers share a GPU, scales the encoder tier with
its load; SIGTERM or the launcher's death leaves no process behind."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import nats
import pytest

from launcher.stack import Stack
from launcher.supervisor import Supervisor
from launcher.topology import Placement
from tests.support import make_image
from tests.up_stack import UpStack, alive, descendants


def test_up_serves_then_sigterm_stops_everything(tiny_model):
    up = UpStack(tiny_model, "--encoders", "1")
    try:
        family = descendants(up.process.pid)
        assert len(family) >= 4  # nats-server, encoder, language worker, frontend
        assert httpx.get(f"{up.root}/health").json() == {"status": "ok"}
        reply = up.chat("Hello", [make_image(3, 40, 60)], max_tokens=3)
        assert reply["usage"]["completion_tokens"] == 3  # every role works within its NATS permissions
        secrets_file = Path(up.ready["nats_client_credentials"])
        assert secrets_file.stat().st_mode & 0o777 == 0o600 and "EPD_NATS_PASSWORD=" in secrets_file.read_text()
        with pytest.raises(Exception):  # the embedded server refuses anyone without credentials
            asyncio.run(nats.connect(up.ready["nats"], allow_reconnect=False, max_reconnect_attempts=0,
                                     connect_timeout=2))
        assert up.stop() == 0
        time.sleep(0.5)
        assert not [p for p in family if alive(p)]
    finally:
        up.process.kill()


FAKE_MPS = """#!/bin/sh
# Stands in for nvidia-cuda-mps-control (no GPU here): -f runs "the daemon", stdin "quit" stops it.
if [ "$1" = "-f" ]; then
  echo $$ > "$CUDA_MPS_PIPE_DIRECTORY/daemon.pid"; touch "$CUDA_MPS_PIPE_DIRECTORY/control"
  trap 'exit 0' TERM; while true; do sleep 0.1; done
fi
read line; echo "$line" >> "$MPS_RECORD"; kill "$(cat "$CUDA_MPS_PIPE_DIRECTORY/daemon.pid")"
"""


def test_mps_daemon_of_the_stack_own_starts_reaches_every_worker_and_stops(tiny_model, tmp_path):
    binary = tmp_path / "bin" / "nvidia-cuda-mps-control"
    binary.parent.mkdir()
    binary.write_text(FAKE_MPS)
    binary.chmod(0o755)
    record = tmp_path / "record"
    env = {"PATH": f"{binary.parent}:{os.environ['PATH']}", "MPS_RECORD": str(record)}
    up = UpStack(tiny_model, "--mps", "on", "--mps-shares", "encoder=40", env=env)
    try:
        assert up.event("stack.mps")["enabled"] and up.ready["mps"]
        daemon = [p for p in descendants(up.process.pid) if "nvidia-cuda-mps-control" in Path(f"/proc/{p}/cmdline")
                  .read_bytes().decode(errors="replace")]
        assert len(daemon) == 1
        encoder = dict(v.split("=", 1) for v in Path(f"/proc/{up.pids('encoder')[0]}/environ").read_text()
                       .split("\0") if "=" in v)
        language = Path(f"/proc/{up.pids('language')[0]}/environ").read_text()
        assert encoder["CUDA_MPS_PIPE_DIRECTORY"] in language and encoder["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in language
        pipe = Path(encoder["CUDA_MPS_PIPE_DIRECTORY"])
    finally:
        assert up.stop() == 0
    assert record.read_text().strip() == "quit" and not alive(daemon[0])
    assert not pipe.exists()  # the stack's private directory is gone with it


def test_mps_on_without_the_daemon_binary_fails_clearly(tiny_model, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    done = subprocess.run([sys.executable, "-m", "launcher.cli", "up", "--mps", "on", "--port", "0"],
                          env={**env, "PATH": str(Path(sys.executable).parent), "EPD_MODEL": str(tiny_model),
                               "EPD_LOG_FORMAT": "json"}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "nvidia-cuda-mps-control" in done.stderr


def test_a_crash_looping_worker_is_given_up_and_the_rest_kept(tiny_model, tmp_path):
    stack = Stack.start_nats({**os.environ, "EPD_MODEL": str(tmp_path / "no-such-model")})
    supervisor = Supervisor(stack, first_backoff=0.05, max_backoff=0.2, crash_limit=3, window=60)
    try:
        slot = supervisor.start(Placement("encoder", None), 0)
        deadline = time.monotonic() + 120
        while not slot.retired:
            assert time.monotonic() < deadline, "the crash loop was not noticed"
            supervisor.check()
            time.sleep(0.05)
        assert len(slot.crashes) == 3 and supervisor.restarts == 2 and slot.process is None
    finally:
        stack.stop(grace=5)


def test_the_encoder_tier_grows_under_a_burst_and_shrinks_when_idle(tiny_model, reference):
    # six images asked over and over: every one must reach the encoders (with prefix routing the language
    # worker's cache would hold them after their first turn, and the frontend would leave them out)
    up = UpStack(tiny_model, "--encoders", "1:2", "--scale-up-load", "1", "--scale-down-after", "4",
                 env={"EPD_ENCODER_CACHE_MB": "0", "EPD_DRAIN_SECONDS": "20", "EPD_PREFIX_ROUTING": "false"})
    images = [make_image(900 + i, 48 + 4 * i, 56) for i in range(6)]
    want = [reference.text(reference.generate("Scale.", [image], 4, ignore_eos=True)) for image in images]
    try:
        def ask(i: int) -> str:
            reply = up.chat("Scale.", [images[i % 6]], max_tokens=4)
            assert reply["status"] == 200, reply
            return reply["choices"][0]["message"]["content"]

        scaling, stop = threading.Event(), time.monotonic() + 90

        def keep_asking(worker: int) -> list[tuple[int, str]]:  # steady pressure until the launcher scales out
            answers = []
            while not scaling.is_set() and time.monotonic() < stop:
                answers.append((worker, ask(worker)))
            return answers

        with ThreadPoolExecutor(12) as pool:
            running = [pool.submit(keep_asking, w) for w in range(12)]
            while not scaling.is_set() and time.monotonic() < stop:
                time.sleep(0.5)
                if up.count("stack.scaled_out") >= 1:
                    scaling.set()
            answered = [a for future in running for a in future.result()]
        assert up.count("stack.scaled_out") >= 1, "the encoder tier did not grow"
        assert answered and all(text == want[i % 6] for i, text in answered)
        # The burst made the decision; the new encoder starts without twelve clients on the two cores
        # (under them it took ~50 s), and the tier answers exactly with both encoders listed.
        up.wait_for_workers("encoder", 2)
        with ThreadPoolExecutor(6) as pool:
            assert list(pool.map(ask, range(6))) == want
        deadline = time.monotonic() + 90
        while up.workers("encoder") != 1 or len(up.pids("encoder")) != 1:
            assert time.monotonic() < deadline, "the idle tier did not shrink back to its minimum"
            time.sleep(0.5)
        assert up.count("stack.scaled_in") >= 1 and up.count("stack.worker_died") == 0
        assert ask(0) == want[0]
    finally:
        assert up.stop() == 0


def test_launcher_killed_leaves_no_orphans(tiny_model):
    up = UpStack(tiny_model, "--encoders", "1", "--pd", "split")
    family = descendants(up.process.pid)
    up.process.kill()  # no chance to clean up: the children must notice on their own
    up.process.wait()
    deadline = time.monotonic() + 30
    while [p for p in family if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    survivors = [p for p in family if alive(p)]
    assert not survivors, [Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")[:200] for p in survivors]
