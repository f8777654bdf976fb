"""`epd up`: one command brings the stack up on the embedded defaults and opens the API only once every
worker is listed; supervises it from the start (a worker that crashes while starting is started again, one
that keeps crashing stops the stack with its own last error line; once serving, a crash loop is retried,
not given up), runs CUDA MPS when workers share a GPU, scales the encoder tier with its load (never
leaving it without a ready encoder); SIGTERM, a terminal's Ctrl-C or the launcher's death leaves no
process behind, and a clean stop exits 0 with every process drained."""

from __future__ import annotations

import asyncio
import os
import signal
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
from tests.support import chat_messages, make_image
from tests.up_stack import UpStack, alive, cmdline, descendants, parent


def test_up_restarts_a_worker_killed_while_starting_serves_once_all_are_ready_and_sigterm_stops_everything(tiny_model):
    up = UpStack(tiny_model, "--encoders", "1", "--served-model-name", "my-vlm", "--data-max-mb", "123",
                 "--no-data-cuda-ipc", wait=False)
    try:
        deadline = time.monotonic() + 60
        while not up.pids("encoder"):
            assert time.monotonic() < deadline and up.process.poll() is None, up.events[-5:]
            time.sleep(0.05)
        killed = up.signal("encoder", signal.SIGKILL)  # before it could be ready: started again
        up.wait_ready()
        died = up.event("stack.worker_died")
        assert died["kind"] == "encoder" and died["pid"] == killed and died["status"] == -signal.SIGKILL
        family = descendants(up.process.pid)
        assert len(family) >= 4  # nats-server, encoder, language worker, frontend
        for kind in ("encoder", "language", "frontend"):  # the shared options given to epd up reach every process
            environ = Path(f"/proc/{up.pids(kind)[0]}/environ").read_bytes().split(b"\0")
            assert {b"EPD_DATA_MAX_MB=123", b"EPD_DATA_CUDA_IPC=false"} <= set(environ), kind
        # the frontend starts beside the workers and opens its port (the API) once every worker is listed:
        # it serves from its first request
        names = [(e.get("event"), e.get("service")) for e in up.events]
        opened = names.index(("frontend.listening", "epd-frontend"))
        assert ("frontend.waiting_for_workers", "epd-frontend") in names[:opened]
        assert {s for e, s in names[:opened] if e == "service.ready"} == {"epd-encoder", "epd-language"}
        assert httpx.get(f"{up.root}/health").json() == {"status": "ok"}
        assert [m["id"] for m in httpx.get(f"{up.api}/models").json()["data"]] == ["my-vlm"]
        reply = httpx.post(f"{up.api}/chat/completions", timeout=60, json={
            "model": "my-vlm", "messages": chat_messages("Hello", [make_image(3, 40, 60)]), "max_tokens": 3,
            "ignore_eos": True}).json()
        assert reply["model"] == "my-vlm"
        assert reply["usage"]["completion_tokens"] == 3  # every role works within its NATS permissions
        secrets_file = Path(up.ready["nats_client_credentials"])
        assert secrets_file.stat().st_mode & 0o777 == 0o600 and "EPD_NATS_PASSWORD=" in secrets_file.read_text()
        with pytest.raises(Exception):  # the embedded server refuses anyone without credentials
            asyncio.run(nats.connect(up.ready["nats"], allow_reconnect=False, max_reconnect_attempts=0,
                                     connect_timeout=2))
        assert up.stop() == 0
        time.sleep(0.5)
        assert not [p for p in family if alive(p)]
        # the frontend first (its requests finish while the workers serve), then the workers: all drained
        assert up.exits()[0] == ("frontend", 0)
        assert sorted(up.exits()) == [("encoder", 0), ("frontend", 0), ("language", 0)]
    finally:
        up.process.kill()


FAKE_MPS = """#!/bin/sh
# Stands in for nvidia-cuda-mps-control (no GPU here): -f runs "the daemon", stdin "quit" stops it.
if [ "$1" = "-f" ]; then
  echo $$ > "$CUDA_MPS_PIPE_DIRECTORY/daemon.pid"; touch "$CUDA_MPS_PIPE_DIRECTORY/control"
  trap 'exit 0' TERM; trap 'echo SIGINT >> "$MPS_RECORD"' INT; while true; do sleep 0.1; done
fi
read line; echo "$line" >> "$MPS_RECORD"; kill "$(cat "$CUDA_MPS_PIPE_DIRECTORY/daemon.pid")"
"""


def test_mps_daemon_of_the_stack_own_starts_reaches_every_worker_and_stops_last_on_ctrl_c(tiny_model, tmp_path):
    """A terminal's Ctrl-C reaches the launcher alone (its children run in process groups of their own):
    it drains the frontend, then the workers, and tells the MPS daemon to quit only once they all ended —
    a worker still using the daemon when it goes aborts (cudaErrorMpsRpcFailure). Exit status 0."""
    binary = tmp_path / "bin" / "nvidia-cuda-mps-control"
    binary.parent.mkdir()
    binary.write_text(FAKE_MPS)
    binary.chmod(0o755)
    record = tmp_path / "record"
    env = {"PATH": f"{binary.parent}:{os.environ['PATH']}", "MPS_RECORD": str(record)}
    up = UpStack(tiny_model, "--mps", "on", "--mps-shares", "encoder=40", env=env, terminal=True)
    family = descendants(up.process.pid)
    try:
        assert up.event("stack.mps")["enabled"] and up.ready["mps"]
        named = {p for p in descendants(up.process.pid) if "nvidia-cuda-mps-control" in cmdline(p)}
        # one daemon; a child it forks shows its command line too until it execs `sleep` (under load, 154 of
        # 5,645 listings of such a loop saw two)
        daemon = [p for p in named if parent(p) not in named]
        assert len(daemon) == 1, {p: (parent(p), cmdline(p)) for p in named}
        encoder = dict(v.split("=", 1) for v in Path(f"/proc/{up.pids('encoder')[0]}/environ").read_text()
                       .split("\0") if "=" in v)
        language = Path(f"/proc/{up.pids('language')[0]}/environ").read_text()
        assert encoder["CUDA_MPS_PIPE_DIRECTORY"] in language and encoder["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in language
        pipe = Path(encoder["CUDA_MPS_PIPE_DIRECTORY"])
        up.interrupt()
        assert up.process.wait(90) == 0
    finally:
        up.stop()
    assert record.read_text().split() == ["quit"] and not alive(daemon[0])  # asked to quit; no Ctrl-C reached it
    events = [e.get("event") for e in up.events]
    assert events.index("stack.mps_stopped") > max(i for i, e in enumerate(events) if e == "stack.process_exited")
    assert up.exits() == [("frontend", 0), *sorted(up.exits()[1:])] and {s for _, s in up.exits()} == {0}
    assert len(up.exits()) == 3 and not [p for p in family if alive(p)]
    assert not pipe.exists()  # the stack's private directory is gone with it


def test_ctrl_c_while_starting_stops_every_process_cleanly(tiny_model):
    up = UpStack(tiny_model, "--encoders", "1", "--pd", "split", wait=False, terminal=True)
    try:
        deadline = time.monotonic() + 60
        while len(up.pids("encoder") + up.pids("prefill") + up.pids("decode")) < 3:
            assert time.monotonic() < deadline and up.process.poll() is None, up.events[-5:]
            time.sleep(0.1)
        family = descendants(up.process.pid)
        time.sleep(1.0)  # loading its libraries, or its model
        up.interrupt()
        assert up.process.wait(90) == 0
        assert sorted(up.exits()) == [("decode", 0), ("encoder", 0), ("frontend", 0), ("prefill", 0)]
        assert up.event("stack.ready") is None and not [p for p in family if alive(p)]
    finally:
        up.stop()


def test_a_worker_that_keeps_failing_to_start_stops_the_stack_with_its_own_error(tiny_model):
    up = UpStack(tiny_model, "--encoders", "1", wait=False, env={"EPD_ENCODER_CACHE_MB": "-1"})
    try:
        assert up.process.wait(120) == 1
        failed = up.event("stack.failed")["error"]
        assert failed.startswith("the encoder process failed 3 times while starting (exit status 2)"), failed
        assert failed.endswith("epd encoder: --encoder-cache-mb (EPD_ENCODER_CACHE_MB) '-1': Input should be "
                               "greater than or equal to 0"), failed
        assert up.event("stack.ready") is None and up.count("stack.worker_died") == 2
        assert sorted(up.exits()) == [("frontend", 0), ("language", 0)]  # the rest was stopped cleanly
    finally:
        up.stop()


def test_mps_on_without_the_daemon_binary_fails_clearly(tiny_model, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    done = subprocess.run([sys.executable, "-m", "launcher.cli", "up", "--mps", "on", "--port", "0"],
                          env={**env, "PATH": str(Path(sys.executable).parent), "EPD_MODEL": str(tiny_model),
                               "EPD_LOG_FORMAT": "json"}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "nvidia-cuda-mps-control" in done.stderr


def test_a_serving_stack_restarts_a_crash_looping_worker_and_replaces_one_that_never_gets_ready(tiny_model, tmp_path):
    """Once the stack serves, a crash loop is reported with the worker's last error line and retried at the
    longest back-off, never given up; a worker that is not ready in time is reported, killed and restarted."""
    stack = Stack.start_nats({**os.environ, "EPD_MODEL": str(tmp_path / "no-such-model")})
    supervisor = Supervisor(stack, first_backoff=0.05, max_backoff=0.2, crash_limit=2, window=60)
    supervisor.serving = True
    try:
        slot = supervisor.start(Placement("encoder", None), 0)
        deadline = time.monotonic() + 120
        while supervisor.restarts < 2:  # started again after the second crash, which made it a crash loop
            assert time.monotonic() < deadline, "the crash loop was not retried"
            supervisor.check()
            time.sleep(0.05)
        assert "no-such-model' is not a checkpoint directory" in slot.last_error
        assert not slot.retired and len(slot.crashes) >= 2
    finally:
        stack.stop(grace=5)
    nowhere = Stack.start_nats({**os.environ, "EPD_MODEL": str(tiny_model)}, nats_url="nats://127.0.0.1:9")
    supervisor = Supervisor(nowhere, first_backoff=0.05, start_timeout=3)
    supervisor.serving = True
    try:
        slot = supervisor.start(Placement("encoder", None), 0)
        stuck = slot.process
        deadline = time.monotonic() + 60
        while supervisor.restarts < 1:
            assert time.monotonic() < deadline, "the stuck worker was not replaced"
            supervisor.check(listed=set())  # NATS lists nothing: it never gets ready
            time.sleep(0.05)
        assert stuck.poll() == -signal.SIGKILL and slot.running and slot.process is not stuck
    finally:
        nowhere.stop(grace=5)


def test_the_encoder_tier_grows_under_a_burst_and_an_idle_tier_stops_a_starting_encoder_first(tiny_model, reference):
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

        def pressure(clients: int, until) -> None:
            """``clients`` asking all the time until ``until()``; every answer exact."""
            done, stop = threading.Event(), time.monotonic() + 120

            def keep_asking(worker: int) -> list[tuple[int, str]]:
                answers = []
                while not done.is_set() and time.monotonic() < stop:
                    answers.append((worker, ask(worker)))
                return answers

            with ThreadPoolExecutor(clients) as pool:
                running = [pool.submit(keep_asking, w) for w in range(clients)]
                while not done.is_set() and time.monotonic() < stop:
                    time.sleep(0.2)
                    if until():
                        done.set()
                answered = [a for future in running for a in future.result()]
            assert until(), "the encoder tier did not change under load"
            assert answered and all(text == want[i % 6] for i, text in answered)

        def event(name: str) -> dict:
            deadline = time.monotonic() + 90
            while up.event(name) is None:
                assert time.monotonic() < deadline, f"no {name}"
                time.sleep(0.2)
            return up.event(name)

        (serving,) = up.pids("encoder")
        pressure(12, lambda: up.count("stack.scaled_out") == 1)
        (starting,) = [p for p in up.pids("encoder") if p != serving]
        os.kill(starting, signal.SIGSTOP)  # stuck while starting (under the burst it took ~50 s anyway)
        try:
            assert up.workers("encoder") == 1
            # idle now: the encoder that goes is the one still starting, never the only ready one
            assert event("stack.scaled_in")["ready"] is False and alive(serving)
        finally:
            os.kill(starting, signal.SIGCONT)  # it obeys the SIGTERM it got, and exits 0
        assert ask(0) == want[0]
        assert event("stack.worker_left")["status"] == 0 and up.pids("encoder") == [serving]
        assert up.count("stack.worker_died") == 0
    finally:
        assert up.stop() == 0


def test_an_encoder_tier_at_zero_grows_for_the_request_that_waits_for_it(tiny_model, reference):
    up = UpStack(tiny_model, "--encoders", "0:1", "--scale-down-after", "60")
    try:
        assert up.pids("encoder") == [] and httpx.get(f"{up.api}/models").status_code == 200
        image = make_image(11, 48, 40)
        reply = up.chat("From zero.", [image], max_tokens=4)  # waits for the encoder the launcher starts for it
        assert reply["choices"][0]["message"]["content"] == reference.text(
            reference.generate("From zero.", [image], 4, ignore_eos=True))
        assert up.event("stack.scaled_out")["waiting"] >= 1 and len(up.pids("encoder")) == 1
    finally:
        assert up.stop() == 0


def test_a_text_only_stack_refuses_images_at_once_and_its_killed_launcher_leaves_no_orphans(tiny_model):
    up = UpStack(tiny_model, "--encoders", "0", "--pd", "split")
    assert httpx.get(f"{up.root}/health").json() == {"status": "ok"}  # it needs no encoder
    refused = up.chat("What is this?", [make_image(4, 40, 40)], max_tokens=2)
    assert refused["status"] == 400 and refused["error"]["message"] == \
        "this server serves text only: image input is not accepted"
    assert up.chat("Hello", max_tokens=2)["usage"]["completion_tokens"] == 2
    family = descendants(up.process.pid)
    up.process.kill()  # no chance to clean up: the children must notice on their own
    up.process.wait()
    deadline = time.monotonic() + 30
    while [p for p in family if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    survivors = [p for p in family if alive(p)]
    assert not survivors, [Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")[:200] for p in survivors]
