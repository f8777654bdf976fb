"""The compose stack, actually run: the image built from deploy/Dockerfile, deploy/docker-compose.yml up
(with deploy/compose.host.yml: host network, every socket on loopback), a chat request with an image
through the ``openai`` client, encoders scaled to two and back under load, and a decode container
SIGKILLed while requests stream, with none lost.

Needs a Docker engine (DOCKER_HOST, or the default socket) and Docker Compose v2; skipped, saying which
is missing, otherwise. No registry is needed: the base image is ``python:3.11-slim`` if the engine has it,
else one made here by deploy/base-image.sh (root and debootstrap); a CPU torch wheel found in
PIP_FIND_LINKS (or EPD_TORCH_WHEELS) is served to the build over loopback, else the build takes the CPU
wheel from PyTorch's index. Everything the test creates (containers, volumes, images) is removed at the
end; EPD_DOCKER_KEEP=1 keeps the images for the next run. Measured timings are printed (pytest -s).
"""

from __future__ import annotations

import asyncio
import functools
import http.server
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.support import chat_messages, endpoint_data, make_image, service_stats

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
CONTEXT = ("pyproject.toml", "README.md", "shared", "services", "launcher", "tools", "deploy/Dockerfile")
LONG = 240  # tokens per request in the kill test: long enough to kill mid-stream

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
TIMINGS: dict[str, float] = {}


def sh(*args: str, timeout: float = 600, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    run = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, env=env)
    if check and run.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {run.returncode}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    return run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- what this machine has

def compose_command() -> list[str]:
    """``docker compose`` (v2), or a ``docker-compose`` that is v2; v1 cannot read the compose file."""
    for command in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(command[0]) is None:
            continue
        run = subprocess.run([*command, "version", "--short"], capture_output=True, text=True, timeout=30)
        if run.returncode == 0 and re.match(r"v?2\.", run.stdout.strip()):
            return command
    return []


@pytest.fixture(scope="module")
def docker():
    if shutil.which("docker") is None:
        pytest.skip("no docker CLI (apt-get install docker.io)")
    run = subprocess.run(["docker", "version", "--format", "{{.Server.Version}}"], capture_output=True, text=True,
                         timeout=30)
    if run.returncode != 0:
        pytest.skip("no Docker engine reachable (DOCKER_HOST or the default socket): " + run.stderr.strip()[-200:]
                    + "; docs/deploy.md says how to start one here")
    compose = compose_command()
    if not compose:
        pytest.skip("no Docker Compose v2 (`docker compose`); compose v1 cannot read deploy/docker-compose.yml")
    return compose


def image_exists(tag: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", tag], capture_output=True, timeout=30).returncode == 0


def keep_images() -> bool:
    return os.environ.get("EPD_DOCKER_KEEP") == "1"


@pytest.fixture(scope="module")
def base_image(docker):
    """python:3.11-slim where the engine has it, else a Debian bookworm image made here."""
    for tag in (os.environ.get("BASE_IMAGE"), "python:3.11-slim", "epd-base:bookworm"):
        if tag and image_exists(tag):
            yield tag
            return
    if os.geteuid() != 0 or shutil.which("debootstrap") is None:
        pytest.skip("no base image (python:3.11-slim) in the engine and no way to make one here: "
                    "deploy/base-image.sh needs root and debootstrap")
    started = time.monotonic()
    tag = sh(str(DEPLOY / "base-image.sh"), "epd-base:bookworm", timeout=900).stdout.strip().splitlines()[-1]
    TIMINGS["base image (debootstrap + import)"] = time.monotonic() - started
    yield tag
    if not keep_images():
        sh("docker", "rmi", tag, check=False)


def cpu_torch_wheels() -> Path | None:
    """A folder holding the CPU wheel of the torch the Dockerfile pins, if this machine has one."""
    pinned = re.search(r'^ARG TORCH="?torch==([\w.]+)', (DEPLOY / "Dockerfile").read_text(), re.M)[1]
    folders = os.environ.get("EPD_TORCH_WHEELS", "").split() + os.environ.get("PIP_FIND_LINKS", "").split()
    for folder in folders:
        if Path(folder).is_dir() and list(Path(folder).glob(f"torch-{pinned}+cpu-cp311-*.whl")):
            return Path(folder)
    return None


class WheelServer:
    """A folder over HTTP on loopback, for the build's pip (the build runs on the host network)."""

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet: pip's requests are no news
            pass

    def __init__(self, folder: Path):
        handler = functools.partial(self.Handler, directory=str(folder))
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def epd_image(docker, base_image, tmp_path_factory):
    """deploy/Dockerfile built from a context of exactly what it copies (the legacy builder reads no
    per-Dockerfile ignore file, and a repository's .venv must not travel)."""
    context = tmp_path_factory.mktemp("context")
    for path in CONTEXT:
        source, target = ROOT / path, context / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(source, target)
    tag = "epd:test-kept" if keep_images() else f"epd:test-{uuid.uuid4().hex[:8]}"  # kept: layers reused next time
    args = ["--build-arg", f"BASE={base_image}"]
    wheels = cpu_torch_wheels()
    server = WheelServer(wheels) if wheels else None
    if server:
        pinned = re.search(r'^ARG TORCH="?torch==([\w.]+)', (DEPLOY / "Dockerfile").read_text(), re.M)[1]
        args += ["--build-arg", f"TORCH=torch=={pinned}+cpu", "--build-arg", f"TORCH_FIND_LINKS={server.url}"]
    started = time.monotonic()
    try:
        sh("docker", "build", "--network", "host", "-f", str(context / "deploy" / "Dockerfile"), "-t", tag, *args,
           str(context), timeout=1500)
    finally:
        if server:
            server.close()
    TIMINGS["epd image build"] = time.monotonic() - started
    yield tag
    if not keep_images():
        sh("docker", "rmi", "-f", tag, check=False)


# ---------------------------------------------------------------- the running stack

class ComposeStack:
    def __init__(self, compose: list[str], image: str):
        self.project = f"epdtest{uuid.uuid4().hex[:8]}"
        self.ports = {name: free_port() for name in ("NATS_PORT", "NATS_MONITOR_PORT", "FRONTEND_PORT",
                                                      "FRONTEND_HEALTH_PORT")}
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith("EPD_")}, "EPD_IMAGE": image,
                    **{k: str(v) for k, v in self.ports.items()}}
        self.command = [*compose, "-p", self.project, "-f", str(DEPLOY / "docker-compose.yml"),
                        "-f", str(DEPLOY / "compose.host.yml")]
        self.base_url = f"http://127.0.0.1:{self.ports['FRONTEND_PORT']}/v1"
        self.nats_url = f"nats://127.0.0.1:{self.ports['NATS_PORT']}"

    def compose(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return sh(*self.command, *args, timeout=timeout, env=self.env)

    def scale(self, **counts: int) -> None:
        flags = [f"--scale={kind}={count}" for kind, count in counts.items()]
        self.compose("up", "-d", "--no-build", "--no-recreate", *flags)

    def containers(self, kind: str) -> list[str]:
        return self.compose("ps", "-q", kind).stdout.split()

    def instance_of(self, container: str) -> str | None:
        """The NATS service instance a container runs (its ``service.ready`` log line)."""
        logs = sh("docker", "logs", container, check=False)
        for line in (logs.stdout + logs.stderr).splitlines():
            if '"service.ready"' in line:
                return json.loads(line)["instance"]
        return None

    async def stats(self, kind: str) -> list[dict]:
        import nats

        nc = await nats.connect(self.nats_url)
        try:
            return [{"instance": s["metadata"]["instance"], **endpoint_data(s)}
                    for s in await service_stats(nc, f"epd-{kind}", wait=0.5)]
        finally:
            await nc.close()

    async def until_listed(self, kind: str, count: int, timeout: float = 300) -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:
            found = await self.stats(kind)
            if len(found) == count:
                return found
            assert time.monotonic() < deadline, f"{len(found)} {kind} listed, not {count}"
            await asyncio.sleep(1)


@pytest.fixture(scope="module")
def stack(docker, epd_image, request):
    running = ComposeStack(docker, epd_image)
    started = time.monotonic()
    try:
        running.compose("up", "-d", "--no-build")
        asyncio.run(wait_until_serving(running))
        TIMINGS["compose up to serving"] = time.monotonic() - started
        yield running
    finally:
        if request.session.testsfailed:
            print(running.compose("logs", "--no-color", "--tail", "40", timeout=60).stdout[-20000:])
        stopped = time.monotonic()
        running.compose("down", "-v", "--remove-orphans", "--timeout", "40", timeout=300)
        TIMINGS["compose down"] = time.monotonic() - stopped
        print("\ntimings here (s): " + ", ".join(f"{k} {v:.0f}" for k, v in TIMINGS.items()), file=sys.stderr)


async def wait_until_serving(stack: ComposeStack, timeout: float = 400) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    health = f"http://127.0.0.1:{stack.ports['FRONTEND_HEALTH_PORT']}/ready"
    async with httpx.AsyncClient() as client:
        while True:
            try:
                if (await client.get(health, timeout=2)).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the frontend never became ready"
            await asyncio.sleep(1)
    for kind in ("encoder", "prefill", "decode"):
        await stack.until_listed(kind, 1, timeout=max(1.0, deadline - time.monotonic()))


def client(stack: ComposeStack):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=180)


async def model_name(api) -> str:
    return (await api.models.list()).data[0].id


async def chat(api, model: str, text: str, images=(), max_tokens: int = 16) -> dict:
    """One streamed request: its text, finish reason and token count (usage), or the error it met."""
    try:
        stream = await api.chat.completions.create(
            model=model, messages=chat_messages(text, list(images)), max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        parts, finish, tokens = [], None, None
        async for chunk in stream:
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                parts.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        return {"text": "".join(parts), "finish": finish, "tokens": tokens, "error": None}
    except Exception as err:  # recorded, then asserted on: a lost request must be seen, not raised half-way
        return {"error": f"{type(err).__name__}: {err}"}


# ---------------------------------------------------------------- the tests (in this order)

def test_a_chat_request_with_an_image_through_the_openai_client(stack):
    async def scenario():
        api = client(stack)
        model = await model_name(api)
        image = make_image(1, 96, 128)
        reply = await api.chat.completions.create(model=model, messages=chat_messages("What is this?", [image]),
                                                  max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 12
        assert reply.usage.prompt_tokens > 12  # the image's tokens are in the prompt
        streamed = await chat(api, model, "What is this?", [image], max_tokens=12)
        assert streamed["error"] is None
        assert streamed["text"] == reply.choices[0].message.content  # greedy: the same answer both ways
        images = [e["images"] for e in await stack.stats("encoder")]
        assert sum(images) >= 1  # the encoder container did the encoding

    asyncio.run(scenario())


def test_encoders_scale_to_two_and_back_losing_nothing(stack):
    async def scenario():
        api = client(stack)
        model = await model_name(api)
        started = time.monotonic()
        stack.scale(encoder=2)
        encoders = await stack.until_listed("encoder", 2)
        TIMINGS["second encoder up"] = time.monotonic() - started
        before = {e["instance"]: e["images"] for e in encoders}
        pictures = [[make_image(100 + 4 * i + j, 64, 64) for j in range(4)] for i in range(4)]
        results = await asyncio.gather(*(chat(api, model, "Compare them.", p) for p in pictures))
        assert all(r["error"] is None and r["finish"] == "length" for r in results), results
        after = {e["instance"]: e["images"] for e in await stack.stats("encoder")}
        assert all(after[i] > before[i] for i in before), f"an encoder got no images: {before} -> {after}"

        # Back to one while requests run: compose stops one encoder (SIGTERM), which drains what it holds.
        running = [asyncio.create_task(chat(api, model, "Again.", [make_image(200 + i, 64, 64)], max_tokens=32))
                   for i in range(6)]
        await asyncio.sleep(0.5)
        await asyncio.to_thread(stack.scale, encoder=1)
        results = await asyncio.gather(*running)
        assert all(r["error"] is None and r["finish"] == "length" for r in results), results
        await stack.until_listed("encoder", 1)
        assert len(stack.containers("encoder")) == 1
        assert (await chat(api, model, "Still there?", [make_image(300, 64, 64)]))["error"] is None

    asyncio.run(scenario())


def test_a_decode_container_killed_while_requests_stream_loses_none(stack):
    async def scenario():
        api = client(stack)
        model = await model_name(api)
        stack.scale(decode=2)
        await stack.until_listed("decode", 2)
        prompts = [(f"Tell story number {i}.", [make_image(400 + i, 64, 64)] if i % 2 else []) for i in range(6)]
        running = [asyncio.create_task(chat(api, model, text, images, max_tokens=LONG)) for text, images in prompts]
        victim = await serving_decode(stack)
        sh("docker", "kill", "--signal", "KILL", victim)
        results = await asyncio.gather(*running)
        lost = [(prompt[0], r) for prompt, r in zip(prompts, results)
                if r["error"] or r["finish"] != "length" or r["tokens"] != LONG]
        assert not lost, f"requests lost or cut short after the kill: {lost}"
        # Resumed, not restarted or spliced wrong: each answer is the one an undisturbed run gives.
        for (text, images), result in zip(prompts[:2], results[:2]):
            again = await chat(api, model, text, images, max_tokens=LONG)
            assert again["text"] == result["text"]

    asyncio.run(scenario())


async def serving_decode(stack: ComposeStack, timeout: float = 60) -> str:
    """The container of a decode worker that is running sequences right now."""
    containers = {stack.instance_of(c): c for c in stack.containers("decode")}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for worker in await stack.stats("decode"):
            if worker.get("running") and worker["instance"] in containers:
                return containers[worker["instance"]]
        await asyncio.sleep(0.1)
    raise AssertionError("no decode worker was running a sequence")
