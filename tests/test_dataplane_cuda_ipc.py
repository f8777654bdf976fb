"""Pulls between two processes on one GPU: the holder's memory mapped over CUDA IPC, not copied through
host memory, through the holder's export pool (mapped once) or each tensor's own block. Needs a GPU
(skipped elsewhere; run on the GPU machine): the holder is a process of its own (``tests.dataplane_peer
hold-cuda``), the consumer this test's process. On CPU, what can be checked is that a consumer naming a
GPU still gets the bytes of a host tensor, and the pool's slot allocation."""

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
from shared.dataplane.store import DataPlaneError
from shared.dataplane.zmq_client import ZmqClient

ROOT = Path(__file__).resolve().parents[1]
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    flat = lambda t: t.contiguous().reshape(-1).view(torch.uint8).cpu()  # noqa: E731
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(flat(a), flat(b))


class Holder:
    def __init__(self, pool_mb: int = 0):
        self.process = subprocess.Popen([sys.executable, "-m", "tests.dataplane_peer", "hold-cuda", str(pool_mb)],
                                        cwd=ROOT,
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


@pytest.fixture(scope="module", params=[0, 256], ids=["each-block", "pool"])
def holder(request):
    """A holder that maps each tensor's own block, and one with a 256 MB export pool (every tensor of a
    publish fits it at once)."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA IPC needs a GPU")
    h = Holder(request.param)
    h.pool_mb = request.param
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
        if stats["bytes_held"] == stats["pool_bytes_used"] == 0 and stats["allocated_above_start"] <= 0 \
                or time.monotonic() > deadline:
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
        assert stats["pooled"] - before["pooled"] == (mappable if holder.pool_mb else 0)
        assert stats["pulls"] - before["pulls"] == len(handles)  # every pull acked
        assert stats["bytes_held"] == stats["pool_bytes_used"] == 0, stats  # every slot given back
        assert stats["allocated_above_start"] <= 0, stats  # blocks freed


@needs_gpu
async def test_a_batch_of_one_holders_tensors_comes_in_one_slot_or_one_by_one(holder):
    """``pull_many`` (a request's embeddings): with a pool, one reply and one copy for all (the tensors are
    views of one buffer); without, the holder answers ``unbatched`` and they come one by one."""
    want = expected()
    async with consumer() as plane:
        before = holder.stats()
        handles = {n: h for n, h in holder.publish().items() if h.nbytes}
        got = await plane.pull_many(list(handles.values()), device="cuda")
        assert all(t.device.type == "cuda" and same_bits(t, want[n]) for n, t in zip(handles, got))
        buffers = {t.untyped_storage().data_ptr() for t in got}
        assert len(buffers) == (1 if holder.pool_mb else len(handles))
        del got
        stats = await settled(holder)
        assert stats["mapped"] - before["mapped"] == len(handles)
        assert stats["pooled"] - before["pooled"] == (len(handles) if holder.pool_mb else 0)
        assert stats["pulls"] - before["pulls"] == stats["served"] - before["served"] == len(handles)
        assert stats["bytes_held"] == stats["pool_bytes_used"] == 0 and stats["allocated_above_start"] <= 0, stats


@needs_gpu
async def test_a_batch_with_a_wrong_token_is_pulled_one_by_one_and_that_one_refused(holder):
    async with consumer() as plane:
        handles = [h for h in holder.publish().values() if h.nbytes]
        right = handles[1]
        handles[1] = TensorHandle(**{f: getattr(right, f) for f in right.__struct_fields__} | {"token": "x"})
        with pytest.raises(DataPlaneError) as err:
            await plane.pull_many(handles, device="cuda")
        assert err.value.code == "forbidden"
        await plane.pull(right, device="cuda")  # the others' pulls go on; this one's tensor is still held
        stats = await settled(holder)  # so the next test starts from nothing held
        assert stats["bytes_held"] == stats["pool_bytes_used"] == 0, stats


@needs_gpu
async def test_the_export_pool_is_mapped_once_and_a_tensor_too_big_for_it_maps_its_own_block(monkeypatch):
    """Two rounds of pulls from a holder with a 16 MB pool: one mapping of the pool for every pull that
    fits it; the 64 and 128 MB tensors map their own blocks, each pull anew."""
    want = expected()
    mappings = []
    real = torch.UntypedStorage._new_shared_cuda

    def counted(*args):
        mappings.append(args[1])  # the memory handle
        return real(*args)

    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", counted)
    small = Holder(16)
    try:
        async with consumer() as plane:
            for _ in range(2):
                handles = small.publish()
                got = await asyncio.gather(*(plane.pull(h, device="cuda") for h in handles.values()))
                assert all(same_bits(t, want[n]) for n, t in zip(handles, got))
                del got
            stats = await settled(small)
            pooled = sum(1 for h in handles.values() if 0 < h.nbytes <= 16 << 20)
            assert stats["pooled"] == 2 * pooled and stats["mapped"] == 2 * (pooled + 2), stats
            assert len(mappings) == 1 + 2 * 2  # the pool once; big and pending in each round
            assert stats["pool_bytes_used"] == 0 and stats["allocated_above_start"] <= 0, stats
    finally:
        small.stop()


@needs_gpu
async def test_a_consumer_unmaps_the_pool_of_a_holder_that_is_gone():
    want = expected()
    gone = Holder(16)
    async with consumer() as plane:
        handles = gone.publish()
        assert same_bits(await plane.pull(handles["bf16"], device="cuda"), want["bf16"])
        peer = plane._clients["zmq"]._peers[handles["bf16"].address]
        assert len(peer.pools) == 1
        gone.process.kill()
        gone.process.wait(30)
        deadline = time.monotonic() + 10
        while (peer.pools or not peer.dead) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert peer.dead and not peer.pools
        with pytest.raises(DataPlaneError) as err:
            await plane.pull(handles["i64"], device="cuda")
        assert err.value.code == "unreachable"


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
        assert stats["pulls"] - before["pulls"] == len(handles)  # the refused one counted once, with its bytes
        assert stats["pool_bytes_used"] == 0, stats  # its slot given back
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
        from shared.dataplane.zmq_peer import ZmqPeer
        peer = ZmqPeer(holder._zmq_context(), handle.address)
        try:
            got = await peer.pull(handle, 10.0, gpu="GPU-" + "f" * 8 + "-ffff-ffff-ffff-" + "f" * 12)
            assert not isinstance(got, cuda_ipc.CudaIpc) and torch.equal(got.reshape(-1), tensor)
        finally:
            await peer.close()
        assert holder.stats()["mapped"] == 0
    finally:
        await client.close()
        await holder.stop()


async def test_a_holder_of_host_tensors_answers_a_batch_unbatched():
    """Any machine: a batch of the largest size fits the request cap, and a holder whose tensors are not on
    the GPU named says ``unbatched`` (the consumer then pulls them one by one)."""
    from shared.dataplane import wire
    from shared.dataplane.zmq_peer import ZmqPeer
    holder = DataPlane("zmq")
    await holder.start()
    peer = ZmqPeer(holder._zmq_context(), holder.address)
    try:
        handles = [holder.publish(torch.arange(i + 1, dtype=torch.float32)) for i in range(wire.MAX_BATCH)]
        gpu = "GPU-" + "f" * 8 + "-ffff-ffff-ffff-" + "f" * 12
        batch = wire.PullBatch([h.key for h in handles], [h.token for h in handles], [h.nbytes for h in handles],
                               gpu, "f" * 8)
        assert len(wire.encode(batch)) <= wire.BATCH_BYTES
        with pytest.raises(DataPlaneError) as err:
            await peer.pull_batch(handles, 10.0, gpu)
        assert err.value.code == "unbatched"
        assert holder.stats()["served"] == 0  # nothing counted for a batch not served
        got = await asyncio.gather(*(holder.pull(h) for h in handles[:2]))  # still there, one by one
        assert [t.tolist() for t in got] == [[0.0], [0.0, 1.0]]
    finally:
        await peer.close()
        await holder.stop()


def test_pool_slots_are_first_fit_aligned_and_merge_when_given_back():
    slots = cuda_ipc.Slots(8 * cuda_ipc.ALIGN)
    a = slots.take(1)  # rounded up to one alignment unit
    b = slots.take(3 * cuda_ipc.ALIGN - 7)
    c = slots.take(2 * cuda_ipc.ALIGN)
    assert (a, b, c) == (0, cuda_ipc.ALIGN, 4 * cuda_ipc.ALIGN) and slots.used == 6 * cuda_ipc.ALIGN
    assert slots.take(3 * cuda_ipc.ALIGN) is None  # two units left
    slots.give(b, 3 * cuda_ipc.ALIGN - 7)
    assert slots.take(3 * cuda_ipc.ALIGN) == b  # first fit: the hole b left
    slots.give(b, 3 * cuda_ipc.ALIGN)
    slots.give(a, 1)
    slots.give(c, 2 * cuda_ipc.ALIGN)  # merges with the hole before it and the free tail after it
    assert slots.free == [[0, 8 * cuda_ipc.ALIGN]] and slots.used == 0
    assert slots.take(8 * cuda_ipc.ALIGN) == 0
    with pytest.raises(ValueError):
        slots.give(0, 16 * cuda_ipc.ALIGN)  # beyond the pool
    slots.give(0, 8 * cuda_ipc.ALIGN)
    with pytest.raises(ValueError):
        slots.give(0, cuda_ipc.ALIGN)  # already free
    assert cuda_ipc.Slots(0).take(1) is None
    unit = cuda_ipc.ALIGN  # a batch's tensors in one slot: each start aligned, the slot's size last
    assert cuda_ipc.Slots.layout([1, unit + 1, unit]) == [0, unit, 3 * unit, 4 * unit]


def test_export_pool_slots_go_back_on_their_ack_or_after_the_lease():
    """The holder's slot book-keeping (no GPU: a pool's slots without its buffer): a slot is freed by an
    ack with its key and token only; when the pool is full, slots whose consumers never acked within the
    lease are taken back."""
    from types import SimpleNamespace

    from shared.dataplane.store import TensorStore
    from shared.dataplane.zmq_staging import ExportSlots

    slots = ExportSlots(TensorStore(1 << 20, lease_seconds=0.05), pool_bytes=4096)
    pool = SimpleNamespace(slots=cuda_ipc.Slots(4 * cuda_ipc.ALIGN))
    slots._pools[0] = pool
    a = slots.take(0, 2 * cuda_ipc.ALIGN, "a", "token-a")
    b = slots.take(0, 2 * cuda_ipc.ALIGN, "b", "token-b")
    assert a == (pool, 0) and b == (pool, 2 * cuda_ipc.ALIGN)
    assert slots.used_bytes == 4 * cuda_ipc.ALIGN
    slots.free("a", "wrong", 0)  # not its token: kept
    slots.free("b", "token-b", 0)  # not its slot: kept
    assert slots.take(0, cuda_ipc.ALIGN, "c", "token-c") is None  # full, nothing expired yet
    slots.free("a", "token-a", 0)
    assert slots.take(0, cuda_ipc.ALIGN, "c", "token-c") == (pool, 0)
    time.sleep(0.06)  # b's and c's consumers never ack
    assert slots.take(0, 4 * cuda_ipc.ALIGN, "d", "token-d") == (pool, 0)  # both taken back
    assert slots.used_bytes == 4 * cuda_ipc.ALIGN and set(slots._slots) == {("d", 0)}
