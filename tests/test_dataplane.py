"""The data plane on every transport: bit-exact moves between processes, clear refusals, leases that
free what a dead consumer never took, bounded holders, reused connections, advertised addresses."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import pytest
import torch

from shared.dataplane.handle import TensorHandle
from shared.dataplane.plane import DataPlane
from shared.dataplane.store import DataPlaneError
from tests.dataplane_peer import as_json, tensor_set

ROOT = Path(__file__).resolve().parents[1]
HAS_UCX = importlib.util.find_spec("ucxx") is not None
needs_ucx = pytest.mark.skipif(not HAS_UCX, reason="ucxx is not installed (the ucx extra, x86_64 only)")
NETWORK = [pytest.param("ucx", marks=needs_ucx), "zmq"]
ALL = [*NETWORK, "inproc"]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    flat = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731 (NaN-safe, -0.0-exact)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(flat(a), flat(b))


async def started(*planes: DataPlane) -> list[DataPlane]:
    for plane in planes:
        await plane.start()
    return list(planes)


async def stopped(*planes: DataPlane) -> None:
    for plane in planes:
        await plane.stop()


async def until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


# -- moving tensors ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def remote_holder():
    """Another process holding ``tensor_set()`` on UCX (forced onto TCP), ZMQ over TCP and ZMQ over IPC."""
    specs = ",".join([*(["ucx"] if HAS_UCX else []), "zmq", f"ipc:{tempfile.gettempdir()}"])
    process = subprocess.Popen([sys.executable, "-m", "tests.dataplane_peer", "hold", specs], cwd=ROOT,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "UCX_TLS": "tcp"})
    line = process.stdout.readline()
    assert line, f"holder exited with {process.wait()}"
    yield {address: {name: TensorHandle(**h) for name, h in handles.items()} for address, handles in json.loads(line).items()}
    process.stdin.close()
    assert process.wait(30) == 0


@pytest.fixture(scope="module")
def expected():
    return tensor_set()


@pytest.mark.parametrize("scheme", [pytest.param("ucx", marks=needs_ucx), "tcp", "ipc"])
async def test_every_dtype_and_shape_moves_bit_exactly_between_processes(remote_holder, expected, scheme):
    address = next(a for a in remote_holder if a.startswith(f"{scheme}://"))
    handles = remote_holder[address]
    assert handles["big"].nbytes > 100 << 20 and handles["empty"].nbytes == 0
    [consumer] = await started(DataPlane("zmq"))
    try:
        pulled = await asyncio.gather(*(consumer.pull(h) for h in handles.values()))  # all in flight at once
    finally:
        await stopped(consumer)
    for name, tensor in zip(handles, pulled):
        assert same_bits(tensor, expected[name]), name


async def test_inproc_hands_over_the_tensor_itself(expected):
    holder, consumer = await started(DataPlane("inproc"), DataPlane("inproc"))
    handles = {name: holder.publish(t) for name, t in expected.items()}
    for name, handle in handles.items():
        tensor = await consumer.pull(handle)
        assert same_bits(tensor, expected[name]), name
        if name != "transposed":  # a non-contiguous tensor is held as a contiguous copy
            assert tensor.data_ptr() == expected[name].data_ptr()
    assert holder.stats()["bytes_held"] == 0
    await stopped(consumer, holder)


@pytest.mark.parametrize("transport", ["zmq", "inproc"])
async def test_a_discarded_handle_is_freed_at_once_and_only_with_its_token(transport):
    """A consumer that will not pull after all (its request failed, its images encoded again) says so: the
    holder frees the tensor now, not at its lease, and a draining holder does not wait for it."""
    holder, consumer = await started(DataPlane(transport), DataPlane(transport))
    kept, dropped = holder.publish(torch.ones(4, 8)), holder.publish(torch.zeros(16, 8))
    forged = TensorHandle(**{**msgspec.structs.asdict(kept), "token": "not-its-token"})
    await consumer.discard([forged, dropped])
    await until(lambda: holder.stats()["bytes_held"] == kept.nbytes, 5, "the discarded tensor to be freed")
    with pytest.raises(DataPlaneError):
        await consumer.pull(dropped)
    await consumer.discard([holder.publish(torch.ones(2))])  # nothing waits on a holder's answer
    await asyncio.wait_for(asyncio.gather(consumer.pull(kept), holder.handed_out()), 5)
    await stopped(consumer, holder)


def test_the_wire_dtypes_are_torchs_with_their_sizes():
    from shared.dataplane.handle import ELEMENT_SIZES, dtype_name
    from shared.dataplane.tensor_bytes import DTYPES

    assert {name: dtype.itemsize for name, dtype in DTYPES.items()} == ELEMENT_SIZES
    assert all(dtype_name(dtype) == name for name, dtype in DTYPES.items())
    with pytest.raises(ValueError, match="cannot carry"):
        dtype_name(torch.complex64)


@pytest.mark.parametrize("transport", ALL)
async def test_pull_into_a_reused_buffer(transport):
    holder, consumer = await started(DataPlane(transport), DataPlane("zmq"))
    source = torch.randn(64, 1024, dtype=torch.float32)
    out = torch.empty(64 * 1024 * 4, dtype=torch.uint8)
    for round_ in range(2):
        tensor = await consumer.pull(holder.publish(source * round_), out=out)
        assert tensor.data_ptr() == out.data_ptr() and same_bits(tensor, source * round_)
    with pytest.raises(ValueError, match="bytes"):
        await consumer.pull(holder.publish(source), out=out[:-1])
    await stopped(consumer, holder)


async def test_pull_many_keeps_the_order_across_holders_and_this_process():
    """Handles of two holders and of the consumer's own store, interleaved: each tensor comes back in its
    handle's place (grouped by holder, each group one batch where the transport can)."""
    first, second, consumer = await started(DataPlane("zmq"), DataPlane("zmq"), DataPlane("zmq"))
    tensors = [torch.full((i + 1, 3), float(i)) for i in range(7)]
    holders = [first, second, consumer, first, first, second, consumer]
    handles = [h.publish(t) for h, t in zip(holders, tensors)]
    got = await consumer.pull_many(handles)
    assert all(torch.equal(g, t) for g, t in zip(got, tensors))
    await until(lambda: first.stats()["bytes_held"] == second.stats()["bytes_held"] == 0, 5, "every pull acked")
    assert await consumer.pull_many([]) == []
    await stopped(consumer, second, first)


async def test_a_pull_request_over_the_control_size_is_refused():
    """Requests are capped (batches at 4 KiB, single pulls at 256 bytes); the holder answers, and keeps
    serving."""
    from shared.dataplane import wire
    from shared.dataplane.zmq_peer import ZmqPeer
    holder, = await started(DataPlane("zmq"))
    peer = ZmqPeer(holder._zmq_context(), holder.address)
    tensor = torch.arange(10)
    handle = holder.publish(tensor)
    try:
        long = msgspec.structs.replace(handle, token="x" * 300)
        with pytest.raises(DataPlaneError) as err:
            await peer.pull(long, 10.0)
        assert err.value.code == "bad_request" and len(wire.encode(wire.PullRequest(long.key, long.token, 80))) > \
            wire.CONTROL_BYTES
        assert torch.equal(await peer.pull(handle, 10.0), tensor)
    finally:
        await peer.close()
        await stopped(holder)


# -- refusals, leases, bounds ------------------------------------------------------------------------

@pytest.mark.parametrize("transport", ALL)
async def test_refusals_are_clear_and_the_holder_keeps_serving(transport):
    holder, consumer = await started(DataPlane(transport), DataPlane("zmq"))
    tensor = torch.arange(1000, dtype=torch.int64)
    good = holder.publish(tensor)
    lapsing = holder.publish(tensor, lease=0.2)
    refusals = {
        "forbidden": msgspec.structs.replace(good, token="x" * len(good.token)),
        "not_found": msgspec.structs.replace(good, key="0" * len(good.key)),
        "expired": lapsing,
    }
    await asyncio.sleep(0.4)
    for code, handle in refusals.items():
        with pytest.raises(DataPlaneError) as refused:
            await consumer.pull(handle)
        assert refused.value.code == code and refused.value.message
    assert torch.equal(await consumer.pull(good), tensor)  # the holder still serves the rightful consumer
    await until(lambda: holder.stats()["bytes_held"] == 0, 5, "the pulled tensor to be freed")
    with pytest.raises(DataPlaneError) as again:
        await consumer.pull(good)  # one consumer: pulled once, then gone
    assert again.value.code == "not_found"
    await stopped(consumer, holder)


async def test_a_full_holder_refuses_instead_of_growing():
    holder, consumer = await started(DataPlane("inproc", max_bytes=1000), DataPlane("inproc"))
    first = holder.publish(torch.zeros(200, dtype=torch.float32))  # 800 of 1000 bytes
    with pytest.raises(DataPlaneError) as full:
        holder.publish(torch.zeros(100, dtype=torch.float32))
    assert full.value.code == "full" and holder.stats()["bytes_held"] == 800 and holder.stats()["refused"] == 1
    await consumer.pull(first)
    holder.publish(torch.zeros(100, dtype=torch.float32))  # room again once the first was pulled
    assert holder.stats()["bytes_held"] == 400
    await stopped(consumer, holder)


async def test_a_consumer_killed_mid_transfer_leaves_the_tensor_to_its_lease():
    """A real process pulling 1 GiB from a UCX and a ZMQ holder at once is SIGKILLed mid-transfer: the
    holders count no pull, keep serving others, and free the tensors when the lease runs out."""
    transports = ["ucx", "zmq"] if HAS_UCX else ["zmq"]
    holders = await started(*(DataPlane(t, lease_seconds=30) for t in transports))
    [other] = await started(DataPlane("zmq"))
    big = torch.ones(1 << 30, dtype=torch.uint8)
    consumer = subprocess.Popen([sys.executable, "-m", "tests.dataplane_peer", "pull"], cwd=ROOT,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert consumer.stdout.readline().strip() == "ready"
        warm = [h.publish(torch.zeros(1)) for h in holders]
        handles = [h.publish(big, lease=4.0) for h in holders]
        consumer.stdin.write(json.dumps({"warm": [as_json(h) for h in warm], "pull": [as_json(h) for h in handles]}) + "\n")
        consumer.stdin.flush()
        assert (await asyncio.to_thread(consumer.stdout.readline)).strip() == "pulling"  # the loop serves meanwhile
        await until(lambda: all(h.stats()["served"] == 2 for h in holders), 30, "both transfers to start")
        consumer.send_signal(signal.SIGKILL)
        assert consumer.wait(10) == -signal.SIGKILL
    finally:
        consumer.kill()
    for holder in holders:  # the warm-up pull counted; the big one did not
        assert holder.stats()["pulls"] == 1 and holder.stats()["bytes_held"] == big.numel()
        small = torch.arange(10)
        assert torch.equal(await other.pull(holder.publish(small)), small)  # still serving others
    await until(lambda: all(h.stats()["bytes_held"] == 0 for h in holders), 10, "the leases to free 1 GiB")
    assert all(h.stats()["expired"] == 1 for h in holders)
    await stopped(other, *holders)


@pytest.mark.parametrize("transport", NETWORK)
async def test_a_holder_that_is_gone_is_a_clear_error(transport):
    [holder] = await started(DataPlane(transport))
    handle = holder.publish(torch.zeros(10))
    await stopped(holder)
    [consumer] = await started(DataPlane("zmq"))  # the default 60 s pull timeout: it must not be waited out
    started_at = time.monotonic()
    with pytest.raises(DataPlaneError) as gone:
        await consumer.pull(handle)
    # ZMQ notices at once (a refused connection); UCX's connect gives up after its own 5 s timeout
    assert gone.value.code == "unreachable" and time.monotonic() - started_at < (5 if transport != "ucx" else 10)
    await stopped(consumer)


@pytest.mark.parametrize("transport", NETWORK)
async def test_concurrent_pulls_from_a_holder_that_died_connected_all_fail_clearly(transport):
    """The holder dies (-9) after a consumer's connection to it is up; every pull racing to it, and
    every pull after, is ``unreachable`` — none an internal error from a socket another pull closed
    (seen as a 500 when an encoder was killed before prefill pulled its embeddings)."""
    [consumer] = await started(DataPlane("zmq"))
    holder = subprocess.Popen([sys.executable, "-m", "tests.dataplane_peer", "hold", transport], cwd=ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        [published] = json.loads(holder.stdout.readline()).values()
        handles = [TensorHandle(**h) for name, h in published.items() if name != "big"]
        await consumer.pull(handles[0])  # connected
        holder.kill()
        holder.wait()
        for _ in range(3):  # a race, so several rounds: pulls before and after the peer is known dead
            results = await asyncio.gather(*(consumer.pull(h) for h in handles[1:] * 4), return_exceptions=True)
            assert all(isinstance(r, DataPlaneError) and r.code == "unreachable" for r in results), results
    finally:
        holder.kill()
        await stopped(consumer)


# -- connections and addresses -----------------------------------------------------------------------

@pytest.mark.parametrize("transport", NETWORK)
async def test_one_connection_per_holder_carries_many_concurrent_pulls(transport):
    holder, consumer = await started(DataPlane(transport), DataPlane("zmq"))
    tensors = [torch.full((1000,), float(i)) for i in range(32)]
    for _ in range(2):
        pulled = await asyncio.gather(*(consumer.pull(holder.publish(t)) for t in tensors))
        assert all(torch.equal(p, t) for p, t in zip(pulled, tensors))
    assert len(consumer._clients[transport]._peers) == 1
    if transport == "ucx":
        assert len(holder._server._connections) == 1
    await stopped(consumer, holder)


@pytest.mark.parametrize("transport", NETWORK)
async def test_addresses_advertise_a_reachable_interface_never_a_wildcard(transport):
    with pytest.raises(ValueError, match="data-advertise"):
        DataPlane(transport, host="0.0.0.0")
    with pytest.raises(ValueError, match="wildcard"):
        DataPlane(transport, host="0.0.0.0", advertise="0.0.0.0")
    [plane] = await started(DataPlane(transport, host="0.0.0.0", advertise="10.9.8.7"))
    scheme = "ucx" if transport == "ucx" else "tcp"
    assert plane.address.startswith(f"{scheme}://10.9.8.7:")
    assert plane.publish(torch.zeros(1)).address == plane.address
    await stopped(plane)
