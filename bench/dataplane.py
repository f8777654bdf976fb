#!/usr/bin/env python3
"""Data plane benchmark: what moving a request's tensors costs on each transport, against raw TCP.

Payloads (Qwen2.5-VL-7B shapes, bf16):
  embeddings  four 1080p images: 4 tensors of 2,691 tokens x 3,584, pulled concurrently (77.2 MB)
  q3          ten 448x448 images for Qwen3-VL-30B-A3B with its deepstack levels: 10 tensors of 258 x 8,192
              (42.3 MB; Dynamo's request shape; run only when named in --payloads)
  kv          a 10,903-token prompt's KV cache: 28 layers x 2 x 10,903 x 4 KV heads x 128 (625.2 MB)
  small       one 4 KiB tensor, for the per-pull latency floor

Each transport's holder is a process of its own (``--serve``) started by this script; this process
pulls. The baseline is a raw TCP socket over loopback in the same run (iperf-style: one connection,
a reused receive buffer), and the same socket receiving into a fresh buffer per transfer as a pull must.

    python bench/dataplane.py [--transports ucx,ucx-tcp,zmq,zmq-ipc,inproc] [--repeat 5] [--json out.json]
    python bench/dataplane.py --device cuda      # GPU machine: UCX GPU-to-GPU against host-staged copies

Transports: ``ucx`` lets UCX choose (it chose TCP over loopback between two processes of one host
for host memory, cuda_ipc between GPUs);
``ucx-tcp`` forces UCX onto TCP (UCX_TLS=tcp: what crosses hosts without RDMA); ``zmq`` is TCP,
``zmq-ipc`` a Unix socket, ``zmq-cuda-ipc`` ZMQ's same-GPU path with the holder's export pool (GPU runs:
the holder stages the tensor in its pool, which the consumer mapped once, and the consumer copies device to
device, ``shared.dataplane.cuda_ipc``), ``zmq-cuda-ipc-each`` the same without a pool (each pull maps the
tensor's own block and unmaps it); ``inproc`` hands the tensor over within one process.

A payload is pulled into new tensors (``new``: ``DataPlane.pull_many``, so ZMQ's same-GPU path stages
one holder's tensors together and answers them at once) or into reused buffers (``into``: one pull each).

``--busy``: the consumer process also runs an engine's stand-in, a thread of 10 ms steps of GEMMs on a
stream of its own, each step synchronized; each figure then comes with ``stall_ms``, the longest any
other Python thread of the consumer waited (a 1 ms sleeper's worst lateness: the GIL held by a pull). GPU runs add
``ucx-host`` (the holder sends GPU memory, the consumer lands it in host memory and copies it up: the
services' default pull) and ``ucx-staged`` (a holder without UCX's CUDA transports copies to host
first). Every variant's first pull is checked bit for bit against the holder's tensors (same seed).
Imports only torch, the standard library and shared/dataplane (msgspec, pyzmq, structlog, ucxx). On a
GPU machine without them, carry wheels matching its CUDA major version: ucxx-cu13, libucxx-cu13,
libucx-cu13, rmm-cu13, librmm-cu13, rapids-logger (cu12 names for CUDA 12), msgspec, pyzmq, structlog;
cuda-core, cuda-bindings, numpy and nvidia-ml-py are expected there already.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.dataplane.handle import TensorHandle  # noqa: E402
from shared.dataplane.plane import DataPlane  # noqa: E402

PAYLOADS = {  # name → shapes of the tensors pulled together
    "embeddings": [(2691, 3584)] * 4,
    "kv": [(28, 2, 10903, 4, 128)],
    "small": [(2048,)],
    "q3": [(258, 8192)] * 10,
}
DTYPE = torch.bfloat16
VARIANTS = {  # name → (transport, holder's extra environment, data host, consumer lands on the host)
    "ucx": ("ucx", {}, "127.0.0.1", False),
    "ucx-tcp": ("ucx", {"UCX_TLS": "tcp"}, "127.0.0.1", False),
    "ucx-host": ("ucx", {}, "127.0.0.1", True),
    "ucx-staged": ("ucx", {"UCX_TLS": "tcp,sm,self"}, "127.0.0.1", True),
    "zmq": ("zmq", {}, "127.0.0.1", True),
    "zmq-ipc": ("zmq", {}, "ipc://" + tempfile.gettempdir(), True),
    "zmq-cuda-ipc": ("zmq", {}, "127.0.0.1", False),
    "zmq-cuda-ipc-each": ("zmq", {}, "127.0.0.1", False),
}
POOL_MB = {"zmq-cuda-ipc": 256}  # the holder's export pool (the services' default); others: none
SEED = 1234


def payload_tensors(device: str) -> dict[str, list[torch.Tensor]]:
    """The same tensors in holder and consumer (seeded), so a pull can be checked bit for bit."""
    g = torch.Generator(device=device).manual_seed(SEED)
    return {name: [torch.randn(s, dtype=DTYPE, device=device, generator=g) for s in shapes]
            for name, shapes in PAYLOADS.items()}


def nbytes(name: str) -> int:
    return sum(torch.Size(s).numel() * 2 for s in PAYLOADS[name])


# -- the holder process --------------------------------------------------------------------------------

async def serve(variant: str, device: str) -> None:
    """Publish on request: stdin lines name a payload and a count; stdout answers with the handles."""
    transport, _, host, _ = VARIANTS[variant]
    plane = DataPlane(transport, host=host, max_bytes=64 << 30, lease_seconds=600,
                      cuda_ipc_pool_mb=POOL_MB.get(variant, 0))
    await plane.start()
    tensors = payload_tensors(device)
    print(json.dumps({"ready": plane.address}), flush=True)
    while line := await asyncio.to_thread(sys.stdin.readline):
        ask = json.loads(line)
        handles = [[_handle_json(plane.publish(t, consumers=1)) for t in tensors[ask["payload"]]]
                   for _ in range(ask["count"])]
        print(json.dumps({"handles": handles, "stats": plane.stats()}), flush=True)
    await plane.stop()


def _handle_json(handle: TensorHandle) -> dict:
    return {f: getattr(handle, f) for f in handle.__struct_fields__}


def serve_tcp() -> None:
    """The baseline: send the number of bytes asked for, from one buffer, over one connection."""
    server = socket.create_server(("127.0.0.1", 0))
    print(json.dumps({"ready": server.getsockname()[1]}), flush=True)
    conn, _ = server.accept()
    payload = memoryview(torch.ones(max(nbytes(n) for n in PAYLOADS), dtype=torch.uint8).numpy())
    while ask := _recv_exact(conn, 8):
        conn.sendall(payload[:int.from_bytes(ask, "little")])


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            return b""
        data += chunk
    return data


# -- the consumer (this process) -----------------------------------------------------------------------

class Holder:
    def __init__(self, args: list[str], env: dict[str, str]):
        self.process = subprocess.Popen([sys.executable, __file__, *args], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env={**os.environ, **env})
        self.ready = self.read()["ready"]

    def read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"holder exited with {self.process.wait()}")
        return json.loads(line)

    def publish(self, payload: str, count: int) -> list[list[TensorHandle]]:
        self.process.stdin.write(json.dumps({"payload": payload, "count": count}) + "\n")
        self.process.stdin.flush()
        return [[TensorHandle(**h) for h in group] for group in self.read()["handles"]]

    def stop(self) -> None:
        self.process.stdin.close()
        self.process.wait(30)


def tcp_baseline(repeat: int) -> dict:
    holder = Holder(["--serve", "tcp"], {})
    conn = socket.create_connection(("127.0.0.1", holder.ready))
    reused = torch.empty(nbytes("kv"), dtype=torch.uint8).numpy()
    result = {}
    for name in PAYLOADS:
        size = nbytes(name)
        times = {"reused": [], "fresh": []}
        for i in range((50 if name == "small" else repeat) + 1):
            for mode in times:
                buffer = memoryview(reused if mode == "reused" else torch.empty(size, dtype=torch.uint8).numpy())
                start = time.perf_counter()
                conn.sendall(size.to_bytes(8, "little"))
                got = 0
                while got < size:
                    got += conn.recv_into(buffer[got:size], size - got)
                if i:  # the first round warms the connection and the reused buffer's pages
                    times[mode].append(time.perf_counter() - start)
        result[name] = {mode: _summary(t, size) for mode, t in times.items()}
    conn.close()
    holder.process.stdin.close()
    holder.process.kill()
    return result


class Consumer:
    """Pulls a payload's tensors concurrently: onto ``device``, or (``via_host``) into host memory and
    then up to the device, as a consumer without a GPU-capable transport must."""

    def __init__(self, plane: DataPlane, device: torch.device | None, via_host: bool, expected: dict):
        self.plane = plane
        self.device = device
        self.via_host = via_host and device is not None
        self.expected = expected

    async def pull(self, handles: list[TensorHandle], outs: list | None) -> list[torch.Tensor]:
        if not self.via_host and outs is None:  # one batch per holder where it can (ZMQ, same GPU)
            return await self.plane.pull_many(handles, device=self.device)
        if not self.via_host:
            return await asyncio.gather(*(self.plane.pull(h, device=self.device, out=o)
                                          for h, o in zip(handles, outs)))
        hosts = await asyncio.gather(*(self.plane.pull(h, out=o[0] if outs else None)
                                       for h, o in zip(handles, outs or [None] * len(handles))))
        if outs:
            return [o[1].copy_(t) for t, o in zip(hosts, outs)]
        return [t.to(self.device) for t in hosts]

    def buffers(self, payload: str) -> list:
        shapes = PAYLOADS[payload]
        if not self.via_host:
            return [torch.zeros(s, dtype=DTYPE, device=self.device) for s in shapes]
        return [(torch.zeros(s, dtype=DTYPE, pin_memory=True), torch.zeros(s, dtype=DTYPE, device=self.device))
                for s in shapes]

    def check(self, payload: str, tensors: list[torch.Tensor]) -> None:
        for got, want in zip(tensors, self.expected[payload]):
            if not torch.equal(got.view(torch.int16), want.to(got.device).view(torch.int16)):
                raise AssertionError(f"{payload}: pulled bytes differ from the holder's")


class Busy:
    """``--busy``: an engine's stand-in in the consumer (10 ms steps of GEMMs on a stream of its own, each
    synchronized), and a 1 ms sleeper whose worst lateness is the longest the GIL was kept from it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stop = threading.Event()
        self.steps = 0
        self.lateness = 0.0
        self.threads = [threading.Thread(target=self._steps, daemon=True),
                        threading.Thread(target=self._sleeper, daemon=True)]

    def __enter__(self):
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for thread in self.threads:
            thread.join()

    def _steps(self) -> None:
        a = torch.randn(8192, 8192, dtype=DTYPE, device=self.device)
        stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(stream):
            while not self.stop.is_set():
                for _ in range(9):  # ~1.1 ms each on an H200
                    a @ a
                stream.synchronize()
                self.steps += 1

    def _sleeper(self) -> None:
        last = time.perf_counter()
        while not self.stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            self.lateness = max(self.lateness, now - last - 0.001)
            last = now

    def reset(self) -> None:
        self.lateness = 0.0


async def measure(consumer: Consumer, holder_publish, payload: str, repeat: int, into: bool,
                  busy: Busy | None = None) -> dict:
    """Median time to pull a payload (its tensors concurrently): into new tensors, or into reused buffers."""
    groups = holder_publish(payload, repeat + 1)
    outs = consumer.buffers(payload) if into else None
    times = []
    for i, group in enumerate(groups):
        start = time.perf_counter()
        tensors = await consumer.pull(group, outs)
        if consumer.device is not None and consumer.device.type == "cuda":
            torch.cuda.synchronize(consumer.device)
        elapsed = time.perf_counter() - start
        if i == 0:  # the first pull also connects: checked, not timed
            consumer.check(payload, tensors)
            if busy is not None:
                busy.reset()
        else:
            times.append(elapsed)
        del tensors
    summary = _summary(times, nbytes(payload))
    if busy is not None:
        summary["stall_ms"] = busy.lateness * 1e3
    return summary


async def measure_all(consumer: Consumer, publish, args) -> dict:
    with Busy(consumer.device) if args.busy else contextlib.nullcontext() as busy:
        result = {"small": await measure(consumer, publish, "small", 50, into=False, busy=busy)}
        for payload in args.payloads.split(","):
            for into in (False, True):
                result[f"{payload}/{'into' if into else 'new'}"] = await measure(consumer, publish, payload,
                                                                                 args.repeat, into, busy)
        if busy is not None:
            result["busy_steps"] = busy.steps
    return result


async def run_variant(variant: str, args, device, expected) -> dict:
    if variant == "inproc":
        return await run_inproc(args, device, expected)
    transport, env, _, via_host = VARIANTS[variant]
    holder = Holder(["--serve", variant, "--device", args.holder_device], env)
    # the consumer's own transport does not matter; it maps a holder's GPU memory only where asked to
    plane = DataPlane("zmq", lease_seconds=600, cuda_ipc=variant.startswith("zmq-cuda-ipc"))
    await plane.start()
    try:
        return {**await measure_all(Consumer(plane, device, via_host, expected), holder.publish, args),
                "address": holder.ready}
    finally:
        await plane.stop()
        holder.stop()


async def run_inproc(args, device, expected) -> dict:
    holder = DataPlane("inproc", max_bytes=64 << 30, lease_seconds=600)
    consumer = DataPlane("inproc")
    await holder.start()
    await consumer.start()
    tensors = payload_tensors(args.holder_device)

    def publish(payload, count):
        return [[holder.publish(t) for t in tensors[payload]] for _ in range(count)]

    result = await measure_all(Consumer(consumer, device, False, expected), publish, args)
    await consumer.stop()
    await holder.stop()
    return result


def _summary(times: list[float], size: int) -> dict:
    median = statistics.median(times)
    return {"median_ms": median * 1e3, "best_ms": min(times) * 1e3, "gb_per_s": size / median / 1e9, "runs": len(times)}


def report(results: dict) -> None:
    """One line per transport: the small pull's latency, and each payload's time, rate and share of
    the raw TCP baseline: new tensors against a fresh receive buffer, reused buffers against reused."""
    base = results["tcp_baseline"]
    payloads = results["meta"]["payloads"]
    rows = [("tcp socket", f"{base['small']['reused']['median_ms'] * 1e3:.0f} us",
             *(_cell(base[p][m]) for p in payloads for m in ("fresh", "reused")))]
    for name, r in results["transports"].items():
        if "error" in r:
            rows.append((name, "error: " + r["error"][:80]))
            continue
        cells = [_cell(r[f"{p}/{m}"], base[p][b]) for p in payloads for m, b in (("new", "fresh"), ("into", "reused"))]
        rows.append((name, f"{r['small']['median_ms'] * 1e3:.0f} us", *cells))
    header = ("transport", "4 KiB pull", *(f"{p} {m}" for p in payloads for m in ("new", "into")))
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def _cell(stat: dict, base: dict | None = None) -> str:
    text = f"{stat['median_ms']:.1f} ms, {stat['gb_per_s']:.2f} GB/s"
    text += f" ({stat['gb_per_s'] / base['gb_per_s']:.0%})" if base else ""
    return text + (f", stall {stat['stall_ms']:.1f} ms" if "stall_ms" in stat else "")


def device_copies(device: torch.device, repeat: int) -> dict:
    """What staging through host memory costs by itself: the KV payload device→host and back."""
    gpu = torch.randn(PAYLOADS["kv"][0], dtype=DTYPE, device=device)
    result = {}
    for pinned in (False, True):
        host = torch.empty(gpu.shape, dtype=DTYPE, pin_memory=pinned)
        for name, copy in (("d2h", lambda: host.copy_(gpu)), ("h2d", lambda: gpu.copy_(host))):
            times = []
            for _ in range(repeat + 1):
                torch.cuda.synchronize(device)
                start = time.perf_counter()
                copy()
                torch.cuda.synchronize(device)
                times.append(time.perf_counter() - start)
            result[f"{name}{'-pinned' if pinned else ''}"] = _summary(times[1:], nbytes("kv"))
    return result


async def bench(args) -> dict:
    device = torch.device(args.device) if args.device != "cpu" else None
    results = {"meta": meta(args), "tcp_baseline": tcp_baseline(args.repeat), "transports": {}}
    if device is not None and device.type == "cuda":
        results["device_copies"] = device_copies(device, args.repeat)
        print("device_copies", json.dumps(results["device_copies"]), flush=True)
    expected = payload_tensors(args.holder_device)
    for variant in args.transports.split(","):
        try:
            results["transports"][variant] = await run_variant(variant, args, device, expected)
        except Exception as err:  # one transport missing (no ucxx here) must not lose the others' figures
            results["transports"][variant] = {"error": repr(err)}
        print(variant, json.dumps(results["transports"][variant]), flush=True)
    return results


def meta(args) -> dict:
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for module in ("zmq", "ucxx", "msgspec"):
        try:
            versions[module] = __import__(module).__version__
        except Exception:
            versions[module] = "absent"
    if versions["ucxx"] != "absent":
        versions["ucx"] = __import__("ucxx").__ucx_version__
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return {"host": platform.node(), "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "gpu": gpu, "load_average": os.getloadavg(), "versions": versions, "command": " ".join(sys.argv),
            "device": args.device, "payloads": args.payloads.split(","), "busy": args.busy, "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")},
            "when": time.strftime("%Y-%m-%d %H:%M:%S")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--transports", default="ucx,ucx-tcp,zmq,zmq-ipc,inproc")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="where pulled tensors land: cpu, cuda, cuda:1")
    parser.add_argument("--holder-device", default=None, help="where the holder keeps them (default: --device)")
    parser.add_argument("--json", type=Path, help="write the results here as well")
    parser.add_argument("--payloads", default="embeddings,kv", help="of embeddings, kv, q3 (small always runs)")
    parser.add_argument("--busy", action="store_true", help="the consumer runs 10 ms GEMM steps meanwhile (GPU)")
    args = parser.parse_args()
    if unknown := set(args.payloads.split(",")) - (set(PAYLOADS) - {"small"}):
        parser.error(f"--payloads: unknown {', '.join(sorted(unknown))}")
    if args.busy and not args.device.startswith("cuda"):
        parser.error("--busy needs --device cuda")
    if args.device == "cuda" and torch.cuda.device_count() > 1:
        args.device = "cuda:1"  # holder on GPU 0, consumer on GPU 1: the cross-GPU path
    if args.holder_device is None:
        args.holder_device = "cuda:0" if args.device.startswith("cuda") else "cpu"
    if args.serve == "tcp":
        return serve_tcp()
    if args.serve:
        return asyncio.run(serve(args.serve, args.holder_device))
    results = asyncio.run(bench(args))
    report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
