"""Two hosts for real: network namespaces joined by a veth link, a NATS cluster of two routed servers,
the services split across them, and a request served end to end with its tensors crossing the link.

    host A (netns)  nats-server, encoder (UCX data plane), decode
    host B (netns)  nats-server, prefill (ZMQ data plane), frontend
    A <-veth-> B    the only path between them; the test reaches B's NATS and HTTP over a second veth.

Services on different hosts find each other through NATS only. Embeddings go A → B over UCX (forced
onto TCP, as between hosts without RDMA: the namespaces would otherwise share memory), pixels B → A
and the KV cache B → A over ZMQ. Needs root and iproute2; skipped with the reason elsewhere.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import msgspec
import pytest

from launcher.stack import Stack
from launcher.natsserver import nats_server_binary
from launcher.processes import die_with_parent
from tests.support import chat_messages, make_image, settled

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 8


def _why_not() -> str:
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    probe = f"epdprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` is not permitted here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class TwoHosts:
    """Namespaces A and B, veth A<->B (the link the tensors cross) and root<->B (the test's way in)."""

    def __init__(self):
        tag = f"{os.getpid() % 100000}{random.randint(0, 99)}"
        self.a, self.b = f"epdA{tag}", f"epdB{tag}"
        net = self._free_subnet()
        hosts = list(net.hosts())
        self.ip_a, self.ip_b = str(hosts[0]), str(hosts[1])  # the A<->B link: 10.x.y.1/30, .2/30
        self.root_ip, self.ip_b_outside = str(hosts[4]), str(hosts[5])  # root<->B: 10.x.y.5/30, .6/30
        self.links = (f"vab{tag}", f"vba{tag}", f"vrb{tag}", f"vbr{tag}")

    @staticmethod
    def _free_subnet() -> ipaddress.IPv4Network:
        taken = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
        while True:
            net = ipaddress.ip_network(f"10.{random.randint(200, 250)}.{random.randint(0, 255)}.0/29")
            if f" {'.'.join(str(net.network_address).split('.')[:3])}." not in taken:
                return net

    def create(self) -> None:
        ab, ba, rb, br = self.links
        for ns in (self.a, self.b):
            ip("netns", "add", ns)
            ip("-n", ns, "link", "set", "lo", "up")
        ip("link", "add", ab, "netns", self.a, "type", "veth", "peer", "name", ba, "netns", self.b)
        ip("link", "add", rb, "type", "veth", "peer", "name", br, "netns", self.b)
        for ns, dev, addr in ((self.a, ab, self.ip_a), (self.b, ba, self.ip_b), (self.b, br, self.ip_b_outside)):
            ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
        ip("addr", "add", f"{self.root_ip}/30", "dev", rb)
        ip("link", "set", rb, "up")

    def destroy(self) -> None:
        for ns in (self.a, self.b):  # a namespace's veths (and their peers) go with it
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.links[2]], capture_output=True)

    def run(self, ns: str, argv: list[str], env: dict[str, str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", ns, *argv], env=env, cwd=ROOT,
                                preexec_fn=die_with_parent, **kwargs)


def nats_config(workdir: Path, name: str, listen: str, cluster_ip: str, peer_ip: str) -> Path:
    config = workdir / f"{name}.conf"
    config.write_text(f'server_name: {name}\nlisten: "{listen}:4222"\nports_file_dir: "{workdir}"\n'
                      f'cluster {{ name: epd-two-hosts, listen: "{cluster_ip}:6222", '
                      f'routes: ["nats-route://{peer_ip}:6222"] }}\n')
    return config


@contextmanager
def nats_cluster(hosts: TwoHosts, workdir: Path):
    servers = [hosts.run(ns, [nats_server_binary(), "-c", str(nats_config(workdir, name, listen, me, peer))],
                         dict(os.environ), stdout=subprocess.DEVNULL, stderr=open(workdir / f"{name}.log", "ab"))
               for ns, name, listen, me, peer in ((hosts.a, "nats-a", hosts.ip_a, hosts.ip_a, hosts.ip_b),
                                                  (hosts.b, "nats-b", "0.0.0.0", hosts.ip_b, hosts.ip_a))]
    try:
        deadline = time.monotonic() + 15
        while sum(1 for _ in workdir.glob("*.ports")) < 2:
            assert all(s.poll() is None for s in servers), "a nats-server exited: see its log in " + str(workdir)
            assert time.monotonic() < deadline, "the nats-servers did not start"
            time.sleep(0.05)
        yield
    finally:
        for server in servers:
            server.terminate()
            server.wait(10)


@pytest.fixture(scope="module")
def two_hosts():
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    hosts = TwoHosts()
    try:
        hosts.create()
        yield hosts
    finally:
        hosts.destroy()


def handles_in(message) -> list[dict]:
    """Every tensor handle inside a decoded message, whatever its schema."""
    if isinstance(message, dict):
        found = [message] if {"transport", "address", "key", "token"} <= message.keys() else []
        return found + [h for v in message.values() for h in handles_in(v)]
    if isinstance(message, list):
        return [h for v in message for h in handles_in(v)]
    return []


async def serve_one_request(stack: Stack, prefix: str, base_url: str, text: str, images) -> tuple[str, list[tuple[str, dict]]]:
    """The request through the openai client, and every handle that crossed NATS meanwhile (by subject)."""
    import nats
    from openai import OpenAI

    seen: list[tuple[str, dict]] = []
    nc = await nats.connect(stack.nats_url)

    async def record(msg):
        try:
            seen.extend((msg.subject, h) for h in handles_in(msgspec.msgpack.decode(msg.data)))
        except msgspec.DecodeError:
            pass  # not MessagePack (service API JSON): no handles

    await nc.subscribe(f"{prefix}.>", cb=record)
    await settled(nc)
    client = OpenAI(base_url=base_url, api_key="test", max_retries=0)
    response = await asyncio.to_thread(lambda: client.chat.completions.create(
        model=client.models.list().data[0].id, messages=chat_messages(text, images), max_tokens=MAX_TOKENS,
        temperature=0))
    await nc.flush()
    await nc.close()
    return response.choices[0].message.content, seen


def test_a_request_is_served_across_two_hosts(two_hosts, tiny_model, reference):
    hosts = two_hosts
    prefix = "two" + str(os.getpid())
    base = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    base.update(EPD_MODEL=str(tiny_model), EPD_SUBJECT_PREFIX=prefix, EPD_KV_CACHE_MB="64", EPD_DRAIN_SECONDS="5",
                EPD_LOG_LEVEL=os.environ.get("TEST_LOG_LEVEL", "warning"), UCX_TLS="tcp")
    on_a = {**base, "EPD_NATS_URL": f"nats://{hosts.ip_a}:4222", "EPD_DATA_HOST": hosts.ip_a}
    on_b = {**base, "EPD_NATS_URL": f"nats://{hosts.ip_b}:4222", "EPD_DATA_HOST": hosts.ip_b}
    services = [(hosts.a, "encoder", {**on_a, "EPD_TRANSPORT": "ucx"}, []),
                (hosts.a, "decode", {**on_a, "EPD_TRANSPORT": "ucx"}, []),
                (hosts.b, "prefill", {**on_b, "EPD_TRANSPORT": "zmq"}, []),
                (hosts.b, "frontend", {**on_b, "EPD_TRANSPORT": "zmq", "EPD_JOBS": "false"},
                 ["--host", hosts.ip_b_outside, "--port", "0"])]
    stack = Stack(env={"EPD_NATS_URL": f"nats://{hosts.ip_b_outside}:4222"})
    with tempfile.TemporaryDirectory(prefix="epd-two-hosts-") as workdir, nats_cluster(hosts, Path(workdir)):
        try:
            for ns, kind, env, args in services:
                stack.processes.append((kind, hosts.run(ns, [sys.executable, "-m", f"services.{kind}", *args], env)))
            http = asyncio.run(stack.wait_ready({"encoder": 1, "prefill": 1, "decode": 1, "frontend": 1},
                                                timeout=120, prefix=prefix))
            text, images = "Describe the image.", [make_image(31, 120, 90)]
            content, seen = asyncio.run(serve_one_request(stack, prefix, f"http://{http}/v1", text, images))
        finally:
            stack.stop(grace=15)

    assert content == reference.text(reference.generate(text, images, MAX_TOKENS))
    by_kind = {"pixels": [h for s, h in seen if s == f"{prefix}.encode" or s.startswith(f"{prefix}.encode.")],
               "embeddings": [h for s, h in seen if s == f"{prefix}.prefill" or s.startswith(f"{prefix}.prefill.")],
               "kv": [h for s, h in seen if s.startswith(f"{prefix}.decode.")]}
    assert all(by_kind.values()), f"expected pixel, embedding and KV handles on NATS, saw {seen}"
    for kind, transport, host in (("pixels", "zmq", hosts.ip_b), ("embeddings", "ucx", hosts.ip_a),
                                  ("kv", "zmq", hosts.ip_b)):
        scheme = "ucx" if transport == "ucx" else "tcp"
        for handle in by_kind[kind]:
            assert handle["transport"] == transport and handle["address"].startswith(f"{scheme}://{host}:"), (kind, handle)
