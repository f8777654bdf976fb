"""Pulls between two processes on one GPU: the holder's memory mapped over CUDA IPC, not copied through
host memory. Needs a GPU (skipped elsewhere; run on the GPU machine): the holder is a process of its own
(``tests.dataplane_peer hold-cuda``), the consumer this test's process. On CPU, the one part that can be
checked is that a consumer naming a GPU still gets the bytes of a host tensor."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from shared.dataplane import cuda_ipc
from shared.dataplane.handle import TensorHandle
from shared.dataplane.plane import DataPlane
from shared.dataplane.zmq_transport import ZmqClient

ROOT = Path(__file__).resolve().parents[1]
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    flat = lambda t: t.contiguous().reshape(-1).view(torch.uint8).cpu()  # noqa: E731
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(flat(a), flat(b))


class Holder:
    def __init__(self):
        self.process = subprocess.Popen([sys.executable, "-m", "tests.dataplane_peer", "hold-cuda"], cwd=ROOT,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.address = self._answer("")["ready"]

    def _answer(self, ask: str) -> dict:
        if ask:
            self.process.stdin.write(ask + "\n")
            self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"holder exited with {self.process.wait()}")
        return json.loads(line)

    def publish(self) -> dict[str, TensorHandle]:
        return {name: TensorHandle(**h) for name, h in self._answer("publish").items()}

    def stats(self) -> dict:
        return self._answer("stats")

    def stop(self) -> None:
        self.process.stdin.close()
        self.process.wait(30)


@pytest.fixture(scope="module")
def holder():
    if not torch.cuda.is_available():
        pytest.skip("CUDA IPC needs a GPU")
    h = Holder()
    yield h
    h.stop()


def expected() -> dict[str, torch.Tensor]:
    from tests.dataplane_peer import cuda_set
    return cuda_set() | {"pending": torch.full((32 << 20,), 50.0, device="cuda")}


@contextlib.asynccontextmanager
async def consumer(cuda_ipc: bool = True):
    plane = DataPlane("zmq", cuda_ipc=cuda_ipc)
    await plane.start()
    try:
        yield plane
    finally:
        await plane.stop()


async def settled(holder: Holder, timeout: float = 10.0) -> dict:
    """The holder's stats once it holds nothing and its GPU memory is back where it started (acks arrive,
    then consumers' unmaps let torch free the blocks at the holder's next collect)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = holder.stats()
        if stats["bytes_held"] == 0 and stats["allocated_above_start"] <= 0 or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.1)


@needs_gpu
async def test_same_gpu_pulls_map_the_holders_memory(holder):
    want = expected()
    async with consumer() as plane:
        before = holder.stats()
        handles = holder.publish()
        got = await asyncio.gather(*(plane.pull(h, device="cuda") for h in handles.values()))
        for name, tensor in zip(handles, got):
            assert tensor.device.type == "cuda" and same_bits(tensor, want[name]), name
        del got
        stats = await settled(holder)
        mappable = sum(1 for h in handles.values() if h.nbytes)  # an empty tensor has no memory to map
        assert stats["mapped"] - before["mapped"] == mappable
        assert stats["pulls"] - before["pulls"] == len(handles)  # every pull acked
        assert stats["bytes_held"] == 0 and stats["allocated_above_start"] <= 0, stats  # blocks freed


@needs_gpu
async def test_pulls_into_a_reused_gpu_buffer(holder):
    want = expected()
    async with consumer() as plane:
        before = holder.stats()
        for _ in range(3):
            handles = holder.publish()
            handle = handles["offset_view"]
            out = torch.full(handle.shape, -1.0, dtype=torch.bfloat16, device="cuda")
            pulled = await plane.pull(handle, out=out)
            assert pulled.data_ptr() == out.data_ptr() and same_bits(out, want["offset_view"])
            await asyncio.gather(*(plane.pull(h, device="cuda") for h in handles.values() if h is not handle))
        stats = await settled(holder)
        assert stats["mapped"] - before["mapped"] == 3 * sum(1 for h in handles.values() if h.nbytes)
        assert stats["allocated_above_start"] <= 0, stats


@needs_gpu
async def test_pulls_to_host_or_without_ipc_carry_bytes(holder):
    want = expected()
    async with consumer() as host, consumer(cuda_ipc=False) as no_ipc:
        before = holder.stats()
        handles = holder.publish()
        to_host = await asyncio.gather(*(host.pull(h) for h in handles.values()))
        assert all(t.device.type == "cpu" and same_bits(t, want[n]) for n, t in zip(handles, to_host))
        handles = holder.publish()
        to_gpu = await asyncio.gather(*(no_ipc.pull(h, device="cuda") for h in handles.values()))
        assert all(t.device.type == "cuda" and same_bits(t, want[n]) for n, t in zip(handles, to_gpu))
        stats = await settled(holder)
        assert stats["mapped"] == before["mapped"] and stats["pulls"] - before["pulls"] == 2 * len(handles)


@needs_gpu
async def test_an_unmappable_description_falls_back_to_bytes(holder, monkeypatch):
    """A consumer that cannot map (simulated: the mapping call refuses) gets the bytes, releases the
    holder's reference, and stops asking that holder."""
    want = expected()
    calls = []

    def refuse(*args):
        calls.append(args)
        raise RuntimeError("cudaIpcOpenMemHandle: invalid argument")

    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", refuse)
    async with consumer() as plane:
        before = holder.stats()
        handles = holder.publish()
        big = await plane.pull(handles["big"], device="cuda")
        assert same_bits(big, want["big"]) and len(calls) == 1
        rest = [await plane.pull(h, device="cuda") for n, h in handles.items() if n != "big"]
        assert len(calls) == 1 and all(t.device.type == "cuda" for t in rest)
        del big, rest
        stats = await settled(holder)
        assert stats["mapped"] - before["mapped"] == 1
        assert stats["allocated_above_start"] <= 0, stats  # the refused mapping's block was released too


async def test_a_consumer_naming_a_gpu_gets_a_host_tensors_bytes():
    """Any machine: the GPU's name fits the request (ZMQ caps requests), a host tensor's holder ignores
    it and sends the bytes."""
    holder = DataPlane("zmq")
    await holder.start()
    client = ZmqClient(holder._zmq_context())
    try:
        tensor = torch.arange(1000, dtype=torch.float32)
        handle = holder.publish(tensor)
        peer_pull = await client.pull(handle, 10.0, None, None)  # no GPU: the plain path
        assert torch.equal(peer_pull, tensor)
        handle = holder.publish(tensor)
        from shared.dataplane.zmq_transport import _Peer
        peer = _Peer(holder._zmq_context(), handle.address)
        try:
            got = await peer.pull(handle, 10.0, gpu="GPU-" + "f" * 8 + "-ffff-ffff-ffff-" + "f" * 12)
            assert not isinstance(got, cuda_ipc.CudaIpc) and torch.equal(got.reshape(-1), tensor)
        finally:
            await peer.close()
        assert holder.stats()["mapped"] == 0
    finally:
        await client.close()
        await holder.stop()
