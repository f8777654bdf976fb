"""The compose stacks, actually run, as the README starts them.

The image is built by Compose itself on the host network (deploy/compose.host.yml), torch from this
machine's wheel folder served on loopback where it has one (TORCH_FIND_LINKS). Users come from `epd
credentials`, their files owned by another user than the image's (as for anyone whose uid is not 1000).

- The secured stack on its own compose network (docker-compose.yml + compose.auth.yml): NATS published
  nowhere and reached through the network only, an anonymous client refused, the ``client`` role unable
  to publish work, an image chat through the published API.
- The secured stack on the host network (+ compose.host.yml): an image chat and a text one through the
  ``openai`` client, NATS and the API on loopback only, the same NATS checks, nats-server running as epd
  with no capabilities and the users in a file only epd reads; encoders scaled to two (both encode) and
  back under load, nothing lost; then E/P/D (``--profile split``) and a decode container SIGKILLed while
  requests stream, none lost.

Needs a Docker engine (DOCKER_HOST, or the default socket) and Docker Compose v2; skipped, saying which
is missing, otherwise. No registry is needed: the base image is ``python:3.11-slim`` if the engine has it,
else one made here by deploy/base-image.sh (root and debootstrap); a CPU torch wheel found in
PIP_FIND_LINKS (or EPD_TORCH_WHEELS) is served to the build, else the build takes the CPU wheel from
PyTorch's index. Everything the test creates (containers, volumes, networks, images) is removed at the
end; EPD_DOCKER_KEEP=1 keeps the images for the next run. Measured timings are printed (pytest -s).
"""

from __future__ import annotations

import asyncio
import contextlib
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

from tests.support import chat_messages, endpoint_data, make_image, service_stats, settled

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
BASE, HOST, AUTH = (str(DEPLOY / name) for name in ("docker-compose.yml", "compose.host.yml", "compose.auth.yml"))
LONG = 240  # tokens per request in the kill test: long enough to kill mid-stream
WHEEL_PORT = 18765  # a fixed port when free: the URL is a build argument, part of the torch layer's cache key

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


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without EPD_* (a setting here must not leak into the stack), plus ``extra``."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("EPD_")}, **extra}


@contextlib.contextmanager
def timed(name: str):
    """Records how long the block took under ``name`` in TIMINGS."""
    started = time.monotonic()
    yield
    TIMINGS[name] = time.monotonic() - started


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
    yield compose
    print("\ntimings here (s): " + ", ".join(f"{k} {v:.0f}" for k, v in TIMINGS.items()), file=sys.stderr)


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
    with timed("base image (debootstrap + import)"):
        tag = sh(str(DEPLOY / "base-image.sh"), "epd-base:bookworm", timeout=900).stdout.strip().splitlines()[-1]
    yield tag
    if not keep_images():
        sh("docker", "rmi", tag, check=False)


def pinned_torch() -> str:
    return re.search(r'^ARG TORCH="?torch==([\w.]+)', (DEPLOY / "Dockerfile").read_text(), re.M)[1]


def cpu_torch_wheels() -> Path | None:
    """A folder holding the CPU wheel of the torch the Dockerfile pins, if this machine has one."""
    folders = os.environ.get("EPD_TORCH_WHEELS", "").split() + os.environ.get("PIP_FIND_LINKS", "").split()
    for folder in folders:
        if Path(folder).is_dir() and list(Path(folder).glob(f"torch-{pinned_torch()}+cpu-cp311-*.whl")):
            return Path(folder)
    return None


class WheelServer:
    """A folder over HTTP on loopback, for the build's installer (the build runs on the host network)."""

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet: the installer's requests are no news
            pass

    def __init__(self, folder: Path):
        handler = functools.partial(self.Handler, directory=str(folder))
        try:
            self.server = http.server.ThreadingHTTPServer(("127.0.0.1", WHEEL_PORT), handler)
        except OSError:
            self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def epd_image(docker, base_image):
    """The image as Compose builds it offline: the host overlay's build on the host network, the wheel
    folder as TORCH_FIND_LINKS."""
    tag = "epd:test-kept" if keep_images() else f"epd:test-{uuid.uuid4().hex[:8]}"  # kept: layers reused next time
    env = clean_env(EPD_IMAGE=tag, BASE_IMAGE=base_image)
    wheels = cpu_torch_wheels()
    server = WheelServer(wheels) if wheels else None
    if server:
        env["TORCH_FIND_LINKS"] = server.url
    try:
        with timed("epd image build (compose)"):
            sh(*docker, "-p", f"epdbuild{uuid.uuid4().hex[:8]}", "-f", BASE, "-f", HOST, "build", timeout=1500, env=env)
    finally:
        if server:
            server.close()
    yield tag
    if not keep_images():
        sh("docker", "rmi", "-f", tag, check=False)


@pytest.fixture(scope="module")
def secrets(tmp_path_factory) -> Path:
    """``epd credentials --out DIR``; as root, the files are then given to uid 4242: readable neither by the
    image's user (1000) nor by anyone but their owner, as for a user whose uid is not the image's."""
    folder = tmp_path_factory.mktemp("secrets")
    sh(epd_executable(), "credentials", "--out", str(folder), env=clean_env())
    if os.geteuid() == 0:
        for path in [folder, *folder.iterdir()]:
            os.chown(path, 4242, 4242)
    return folder


def epd_executable() -> str:
    beside_python = Path(sys.executable).parent / "epd"
    return str(beside_python) if beside_python.exists() else shutil.which("epd") or "epd"


# ---------------------------------------------------------------- a running stack

class ComposeStack:
    """One compose project: the base file plus ``overlays``; on the host network when compose.host.yml is
    among them, else on its own compose network with the API published on a free host port."""

    def __init__(self, compose: list[str], image: str, overlays: list[str], secrets: Path):
        self.compose_cli = compose
        self.project = f"epdtest{uuid.uuid4().hex[:8]}"
        self.host_network = HOST in overlays
        names = ("NATS_PORT", "NATS_MONITOR_PORT", "FRONTEND_PORT", "FRONTEND_HEALTH_PORT")
        self.ports = {name: free_port() for name in (names if self.host_network else names[2:3])}
        self.secrets = secrets
        self.env = clean_env(EPD_IMAGE=image, SECRETS_DIR=str(secrets), **{k: str(v) for k, v in self.ports.items()})
        self.files = [arg for path in (BASE, *overlays) for arg in ("-f", path)]
        self.profiles: list[str] = []
        self.base_url = f"http://127.0.0.1:{self.ports['FRONTEND_PORT']}/v1"
        self.nats_url = f"nats://127.0.0.1:{self.ports['NATS_PORT']}" if self.host_network else ""

    def compose(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        profiles = [arg for profile in self.profiles for arg in ("--profile", profile)]
        return sh(*self.compose_cli, "-p", self.project, *self.files, *profiles, *args, timeout=timeout,
                  env=self.env, check=check)

    @contextlib.contextmanager
    def running(self, request, name: str):
        try:
            with timed(f"{name}: compose up to serving"):
                self.compose("up", "-d", "--no-build")
                if not self.host_network:  # NATS is reached through the compose network: its address there
                    (nats,) = self.containers("nats")
                    address = sh("docker", "inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}}"
                                 "{{end}}", nats).stdout.strip()
                    self.nats_url = f"nats://{address}:4222"
                asyncio.run(self.until_serving())
            yield self
        finally:
            if request.session.testsfailed:
                print(self.compose("logs", "--no-color", "--tail", "40", timeout=60, check=False).stdout[-20000:])
            with timed(f"{name}: compose down"):
                self.compose("down", "-v", "--remove-orphans", "--timeout", "40", timeout=300)

    def credentials(self, role: str) -> dict[str, str]:
        """The ``user``/``password`` of ``role`` from the env file `epd credentials` wrote."""
        env = dict(line.split("=", 1) for line in (self.secrets / f"{role}.env").read_text().split())
        return {"user": env["EPD_NATS_USER"], "password": env["EPD_NATS_PASSWORD"]}

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

        nc = await nats.connect(self.nats_url, **self.credentials("admin"))
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

    async def until_routed(self, kind: str, count: int, timeout: float = 60) -> None:
        """Until the frontend's own listing (its /metrics republish it, up to a second old) has ``count``
        instances of ``kind``: what NATS lists, the frontend routes to only from its next poll on."""
        import httpx

        deadline = time.monotonic() + timeout
        pattern = re.compile(rf'^epd_service_stat{{instance="([^"]+)",service="epd-{kind}",', re.M)
        async with httpx.AsyncClient() as http:
            while True:
                metrics = (await http.get(self.base_url.removesuffix("/v1") + "/metrics", timeout=5)).text
                if len(set(pattern.findall(metrics))) == count:
                    return
                assert time.monotonic() < deadline, f"the frontend does not list {count} {kind}"
                await asyncio.sleep(0.5)

    async def until_serving(self, timeout: float = 400) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        ready = (f"http://127.0.0.1:{self.ports['FRONTEND_HEALTH_PORT']}/ready" if self.host_network
                 else f"http://127.0.0.1:{self.ports['FRONTEND_PORT']}/health")
        async with httpx.AsyncClient() as http:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(ready, timeout=2)).status_code == 200:
                        break
                assert time.monotonic() < deadline, "the frontend never became ready"
                await asyncio.sleep(1)
        for kind in ("encoder", "language"):
            await self.until_listed(kind, 1, timeout=max(1.0, deadline - time.monotonic()))


@pytest.fixture(scope="module")
def secured(docker, epd_image, secrets, request):
    """docker-compose.yml + compose.host.yml + compose.auth.yml, for the rest of the module."""
    with ComposeStack(docker, epd_image, [HOST, AUTH], secrets).running(request, "host + auth") as stack:
        yield stack


def bridge_networks_work() -> bool:
    name = f"epdtest{uuid.uuid4().hex[:8]}"
    made = subprocess.run(["docker", "network", "create", name], capture_output=True, timeout=60).returncode == 0
    if made:
        subprocess.run(["docker", "network", "rm", name], capture_output=True, timeout=60)
    return made


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


async def an_image_chat_is_answered(stack: ComposeStack) -> None:
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
    assert sum(e["images"] for e in await stack.stats("encoder")) >= 1  # the encoder container encoded it


async def nats_refuses_anonymous_and_keeps_the_client_role_off_work(stack: ComposeStack) -> None:
    """No credentials: refused. The ``client`` role (client.env): publishing on a work subject is a
    permissions violation and reaches no worker; asking for a chat over NATS is what it may do."""
    import nats

    from shared.bus.subjects import Subjects
    from shared.client import chat as nats_chat

    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(stack.nats_url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=5)
    violations: list[str] = []

    async def on_error(err: Exception) -> None:
        violations.append(str(err))

    subjects = Subjects("epd")
    work = [subjects.encode, subjects.prefill, subjects.decode, subjects.cancel, subjects.stream("r1")]
    caller = await nats.connect(stack.nats_url, inbox_prefix=subjects.inbox("client"), error_cb=on_error,
                                allow_reconnect=False, **stack.credentials("client"))
    watcher = await nats.connect(stack.nats_url, allow_reconnect=False, **stack.credentials("admin"))
    try:
        watched = [await watcher.subscribe(subject) for subject in work]
        await settled(watcher)
        for subject in work:
            await caller.publish(subject, b"{}")
        await settled(caller)
        await asyncio.sleep(1)
        assert [s.subject for s in watched if s.pending_msgs] == []
        assert sorted(v for v in violations if "permissions violation for publish" in v.lower()) == sorted(
            f'nats: permissions violation for publish to "{subject}"' for subject in work), violations
        model = await model_name(client(stack))
        answer = await nats_chat(caller, {"model": model, "messages": [{"role": "user", "content": "Hi"}],
                                          "max_tokens": 4, "ignore_eos": True}, timeout=120)
        assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 4
    finally:
        await caller.close()
        await watcher.close()


def listening_addresses(port: int) -> set[str]:
    """Addresses with a TCP socket listening on ``port`` in this network namespace (/proc/net/tcp{,6})."""
    found = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = b"".join(bytes.fromhex(address[i:i + 8])[::-1] for i in range(0, len(address), 8))
                found.add(socket.inet_ntop(family, raw))
    return found


# ---------------------------------------------------------------- the tests (in this order)

def test_the_secured_stack_on_its_own_network_publishes_only_the_api(docker, epd_image, secrets, request):
    if not bridge_networks_work():
        pytest.skip("this engine cannot make a bridge network (docker network create failed)")
    stack = ComposeStack(docker, epd_image, [AUTH], secrets)
    with stack.running(request, "auth alone"):
        (nats,) = stack.containers("nats")
        assert sh("docker", "port", nats).stdout.strip() == ""  # NATS is published nowhere
        (frontend,) = stack.containers("frontend")
        published = sh("docker", "port", frontend, "8000").stdout.split()
        assert published and all(p.endswith(f":{stack.ports['FRONTEND_PORT']}") for p in published)
        asyncio.run(an_image_chat_is_answered(stack))
        asyncio.run(nats_refuses_anonymous_and_keeps_the_client_role_off_work(stack))


def test_a_chat_with_an_image_and_a_text_one_through_the_openai_client(secured):
    async def scenario():
        await an_image_chat_is_answered(secured)
        api = client(secured)
        text = await chat(api, await model_name(api), "Say something.", max_tokens=8)
        assert text["error"] is None and text["finish"] == "length" and text["tokens"] == 8

    asyncio.run(scenario())


def test_nats_and_the_api_listen_on_loopback_only(secured):
    for name in ("NATS_PORT", "NATS_MONITOR_PORT", "FRONTEND_PORT", "FRONTEND_HEALTH_PORT"):
        assert listening_addresses(secured.ports[name]) == {"127.0.0.1"}, name


def test_nats_refuses_anonymous_clients_and_the_client_role_cannot_publish_work(secured):
    asyncio.run(nats_refuses_anonymous_and_keeps_the_client_role_off_work(secured))


def test_nats_runs_as_epd_and_only_epd_reads_the_users(secured, secrets):
    (nats,) = secured.containers("nats")
    status = sh("docker", "exec", nats, "cat", "/proc/1/status").stdout  # PID 1 is nats-server itself
    fields = dict(line.split(":", 1) for line in status.splitlines())
    assert fields["Name"].strip() == "nats-server"
    assert fields["Uid"].split() == ["1000"] * 4 and fields["CapEff"].strip() == "0" * 16
    assert fields["NoNewPrivs"].strip() == "1"
    copied = sh("docker", "exec", nats, "stat", "-c", "%U %a", "/run/nats/nats-auth.conf").stdout.split()
    assert copied == ["epd", "400"]
    on_host = secrets / "nats-auth.conf"
    assert on_host.stat().st_mode & 0o777 == 0o600  # left as `epd credentials` wrote it


def test_encoders_scale_to_two_and_back_losing_nothing(secured):
    async def scenario():
        api = client(secured)
        model = await model_name(api)
        started = time.monotonic()
        secured.scale(encoder=2)
        encoders = await secured.until_listed("encoder", 2)
        await secured.until_routed("encoder", 2)
        TIMINGS["second encoder up"] = time.monotonic() - started
        before = {e["instance"]: e["images"] for e in encoders}
        pictures = [[make_image(100 + 4 * i + j, 64, 64) for j in range(4)] for i in range(4)]
        results = await asyncio.gather(*(chat(api, model, "Compare them.", p) for p in pictures))
        assert all(r["error"] is None and r["finish"] == "length" for r in results), results
        after = {e["instance"]: e["images"] for e in await secured.stats("encoder")}
        assert all(after[i] > before[i] for i in before), f"an encoder got no images: {before} -> {after}"

        # Back to one while requests run: compose stops one encoder (SIGTERM), which drains what it holds.
        running = [asyncio.create_task(chat(api, model, "Again.", [make_image(200 + i, 64, 64)], max_tokens=32))
                   for i in range(6)]
        await asyncio.sleep(0.5)
        await asyncio.to_thread(secured.scale, encoder=1)
        results = await asyncio.gather(*running)
        assert all(r["error"] is None and r["finish"] == "length" for r in results), results
        await secured.until_listed("encoder", 1)
        assert len(secured.containers("encoder")) == 1
        assert (await chat(api, model, "Still there?", [make_image(300, 64, 64)]))["error"] is None

    asyncio.run(scenario())


def test_split_a_decode_container_killed_while_requests_stream_loses_none(secured):
    async def scenario():
        api = client(secured)
        model = await model_name(api)
        started = time.monotonic()
        secured.profiles = ["split"]  # E/P/D: prefill and decode workers in place of the language worker
        secured.scale(language=0, prefill=1, decode=2)
        await secured.until_listed("prefill", 1)
        await secured.until_listed("decode", 2)
        await secured.until_listed("language", 0)
        for kind, count in (("prefill", 1), ("decode", 2), ("language", 0)):
            await secured.until_routed(kind, count)
        TIMINGS["E/PD to E/P/D"] = time.monotonic() - started
        prompts = [(f"Tell story number {i}.", [make_image(400 + i, 64, 64)] if i % 2 else []) for i in range(6)]
        running = [asyncio.create_task(chat(api, model, text, images, max_tokens=LONG)) for text, images in prompts]
        victim = await serving_decode(secured)
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
