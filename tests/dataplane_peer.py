"""A data plane peer in a process of its own, for tests/test_dataplane.py.

    python -m tests.dataplane_peer hold ucx,zmq,ipc:DIR   publish ``tensor_set()`` on each plane, print the
                                                          handles as one JSON line, serve until stdin closes
    python -m tests.dataplane_peer pull                   print "ready", read {"warm": [...], "pull": [...]}
                                                          handles from stdin, pull the warm ones (connecting
                                                          to each holder), print "pulling", pull the rest
    python -m tests.dataplane_peer hold-cuda [POOL_MB]    (GPU) a ZMQ holder of ``cuda_set()`` (an export pool
                                                          of POOL_MB, default none): each stdin line "publish"
                                                          prints fresh handles, "stats" the plane's stats and
                                                          the GPU memory torch holds beside its pool
"""

from __future__ import annotations

import asyncio
import json
import sys

import torch

from shared.dataplane.handle import TensorHandle
from shared.dataplane.plane import DataPlane

BIG_BYTES = 110 << 20


def tensor_set(seed: int = 7) -> dict[str, torch.Tensor]:
    """Every dtype the plane carries, odd shapes, zero-size ones, special floats and one > 100 MB."""
    g = torch.Generator().manual_seed(seed)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45])
    return {
        "f32": torch.cat([torch.randn(10, generator=g), special]).reshape(3, 5),
        "bf16": torch.randn(2, 3, 4, generator=g).bfloat16(),
        "f16": torch.randn(17, generator=g).half(),
        "f64_scalar": torch.tensor(3.141592653589793, dtype=torch.float64),
        "i64": torch.randint(-(2**62), 2**62, (7,), generator=g),
        "i32": torch.randint(-(2**31), 2**31 - 1, (5, 1, 3), generator=g, dtype=torch.int32),
        "i16": torch.randint(-(2**15), 2**15 - 1, (9,), generator=g, dtype=torch.int16),
        "i8": torch.randint(-128, 127, (4, 4), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (3, 2, 2, 1, 1, 1, 1, 2), generator=g, dtype=torch.uint8),  # 8 dims
        "bool": torch.rand(4, 4, generator=g) > 0.5,
        "empty": torch.empty(0, dtype=torch.uint8),
        "empty_3d": torch.empty(3, 0, 2, dtype=torch.float32),
        "transposed": torch.arange(24, dtype=torch.float32).reshape(4, 6).t(),  # published as a copy
        "big": torch.randint(0, 256, (BIG_BYTES // 2,), generator=g, dtype=torch.int16).view(torch.bfloat16)
        .reshape(55, -1),
    }


def cuda_set(seed: int = 11) -> dict[str, torch.Tensor]:
    """GPU tensors as producers leave them: a view at an offset into a larger block, one that a kernel
    still writes when it is published (``pending``: all 50.0 once done), an empty one, 64 MB."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    block = torch.randn(40, 1024, generator=g, device="cuda").bfloat16()
    return {"bf16": torch.randn(3, 5, 7, generator=g, device="cuda").bfloat16(),
            "offset_view": block[13:29],  # contiguous, storage offset 13 rows
            "i64": torch.randint(-(2**62), 2**62, (9,), generator=g, device="cuda"),
            "empty": torch.empty(0, 4, device="cuda"),
            "big": torch.randint(0, 256, (64 << 20,), generator=g, device="cuda", dtype=torch.uint8)}


def as_json(handle: TensorHandle) -> dict:
    return {f: getattr(handle, f) for f in handle.__struct_fields__}


async def hold(specs: str) -> None:
    planes = [_plane(spec) for spec in specs.split(",")]
    for plane in planes:
        await plane.start()
    tensors = tensor_set()
    handles = {p.address: {name: as_json(p.publish(t)) for name, t in tensors.items()} for p in planes}
    print(json.dumps(handles), flush=True)
    await asyncio.to_thread(sys.stdin.read)
    for plane in planes:
        await plane.stop()


def _plane(spec: str) -> DataPlane:
    if spec.startswith("ipc:"):
        return DataPlane("zmq", host="ipc://" + spec[len("ipc:"):])
    return DataPlane(spec)


async def hold_cuda(pool_mb: int) -> None:
    plane = DataPlane("zmq", cuda_ipc_pool_mb=pool_mb)
    await plane.start()
    tensors = cuda_set()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated() + (pool_mb << 20)  # the pool, allocated at the first pull
    print(json.dumps({"ready": plane.address}), flush=True)
    while line := (await asyncio.to_thread(sys.stdin.readline)).strip():
        if line == "publish":
            handles = {name: as_json(plane.publish(t.clone())) for name, t in tensors.items()}
            pending = torch.zeros(32 << 20, device="cuda")  # 128 MB: 50 passes take milliseconds
            for _ in range(50):
                pending.add_(1.0)
            handles["pending"] = as_json(plane.publish(pending))  # no synchronize: the event orders it
            del pending
            print(json.dumps(handles), flush=True)
        elif line == "stats":
            torch.cuda.synchronize()
            print(json.dumps({**plane.stats(), "allocated_above_start": torch.cuda.memory_allocated() - baseline}),
                  flush=True)
    await plane.stop()


async def pull() -> None:
    plane = DataPlane("zmq")
    await plane.start()
    print("ready", flush=True)
    ask = json.loads(await asyncio.to_thread(sys.stdin.readline))
    await asyncio.gather(*(plane.pull(TensorHandle(**h)) for h in ask["warm"]))  # connections up first
    print("pulling", flush=True)
    tensors = await asyncio.gather(*(plane.pull(TensorHandle(**h)) for h in ask["pull"]))
    print("pulled", [t.shape for t in tensors], flush=True)
    await plane.stop()


if __name__ == "__main__":
    mode = sys.argv[1]
    asyncio.run(hold(sys.argv[2]) if mode == "hold" else
                hold_cuda(int(sys.argv[2]) if len(sys.argv) > 2 else 0) if mode == "hold-cuda" else pull())
