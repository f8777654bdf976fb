#!/usr/bin/env python3
"""What a same-GPU pull's CUDA IPC calls cost, the GPU idle and busy, and whether they hold the GIL.

The holder is a child process that exports ten 258 x 8,192 bf16 views of one tensor (a Qwen3-VL-30B-A3B
request's embeddings of ten 448x448 images with their deepstack levels); this process maps, copies and
unmaps them, timing each call: one mapping per pull (``per-tensor``, the ZMQ transport before its export
pool), one mapping kept for the ten (``batched``), and copies from a pool mapped once (``pool``). ``busy``:
a thread of this process runs 10 ms steps of GEMMs on a stream of its own meanwhile, as an engine does;
``ticker_max_gap_ms`` is the longest a 1 ms sleeper thread waited (the GIL held by a call). The
transport's own figures are bench/dataplane.py's (``--busy``).

    python3 bench/ipc_calls.py [OUT.json]        # GPU machine
"""
import json
import multiprocessing as mp
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec  # noqa: E402
import torch  # noqa: E402

from shared.dataplane import cuda_ipc  # noqa: E402

N, ROWS, WIDTH = 10, 258, 8192


def holder(conn):
    torch.cuda.init()
    pool = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    pool_desc = cuda_ipc.export(pool, None)
    conn.send_bytes(msgspec.msgpack.encode(pool_desc))
    while True:
        cmd = conn.recv_bytes()
        if cmd == b"stop":
            return
        batch = torch.randn(N * ROWS, WIDTH, dtype=torch.bfloat16, device="cuda")
        views = list(batch.split([ROWS] * N))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        descs = [cuda_ipc.export(v, None) for v in views]
        export_ms = (time.perf_counter() - t0) * 1e3
        # stage into the pool too (what a pool would do at pull time)
        t0 = time.perf_counter()
        pool[:batch.numel() * 2].copy_(batch.view(-1).view(torch.uint8))
        torch.cuda.synchronize()
        stage_ms = (time.perf_counter() - t0) * 1e3
        conn.send_bytes(msgspec.msgpack.encode({"descs": descs, "export_ms": export_ms, "stage_ms": stage_ms}))
        conn.recv_bytes()  # consumer done
        del views, batch, descs


class Busy:
    """An engine-like thread: 10 ms of GEMMs a step on its own stream, synchronized per step."""
    def __init__(self):
        self.stop = threading.Event()
        self.steps = 0
        self.a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
        self.stream = torch.cuda.Stream()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        with torch.cuda.stream(self.stream):
            while not self.stop.is_set():
                for _ in range(9):
                    self.a @ self.a
                self.stream.synchronize()
                self.steps += 1


class Ticker:
    """Largest gap between a Python thread's wakeups (1 ms sleeps): the GIL held elsewhere."""
    def __init__(self):
        self.stop = threading.Event()
        self.max_gap = 0.0
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        last = time.perf_counter()
        while not self.stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            self.max_gap = max(self.max_gap, now - last)
            last = now


def one_round(conn, pool_base, mode):
    conn.send_bytes(b"go")
    msg = msgspec.msgpack.decode(conn.recv_bytes())
    descs = [msgspec.convert(d, cuda_ipc.CudaIpc) for d in msg["descs"]]
    nbytes = ROWS * WIDTH * 2
    dev = torch.device("cuda", 0)
    stream = cuda_ipc._stream(0)
    t = {"export": msg["export_ms"], "stage": msg["stage_ms"]}
    t0 = time.perf_counter()
    if mode == "per-tensor":
        opens = copies = closes = 0.0
        outs = []
        for d in descs:
            a = time.perf_counter()
            with torch.cuda.stream(stream):
                st = torch.UntypedStorage._new_shared_cuda(0, d.handle, d.block_bytes, d.block_offset, d.counter,
                                                          d.counter_offset, d.event, d.event_sync)
            b = time.perf_counter()
            with torch.cuda.stream(stream):
                src = torch.empty(0, dtype=torch.uint8, device=dev).set_(st, d.byte_offset, (nbytes,))
                out = torch.empty(nbytes, dtype=torch.uint8, device=dev)
                out.copy_(src, non_blocking=True)
                stream.synchronize()
            c = time.perf_counter()
            with torch.cuda.stream(stream):
                del src, st
            e = time.perf_counter()
            opens += b - a
            copies += c - b
            closes += e - c
            outs.append(out)
        t.update(open=opens * 1e3, copy=copies * 1e3, close=closes * 1e3)
    elif mode == "batched":  # one mapping for all: they share a block
        keep = []
        a = time.perf_counter()
        with torch.cuda.stream(stream):
            for d in descs:
                keep.append((torch.UntypedStorage._new_shared_cuda(0, d.handle, d.block_bytes, d.block_offset,
                                                                   d.counter, d.counter_offset, d.event,
                                                                   d.event_sync), d))
        b = time.perf_counter()
        with torch.cuda.stream(stream):
            for st, d in keep:
                src = torch.empty(0, dtype=torch.uint8, device=dev).set_(st, d.byte_offset, (nbytes,))
                torch.empty(nbytes, dtype=torch.uint8, device=dev).copy_(src, non_blocking=True)
            stream.synchronize()
        c = time.perf_counter()
        with torch.cuda.stream(stream):
            del keep, src
        e = time.perf_counter()
        t.update(open=(b - a) * 1e3, copy=(c - b) * 1e3, close=(e - c) * 1e3)
    else:  # pool: mapped once; release the per-tensor references unused
        for d in descs:
            cuda_ipc.release(d)
        a = time.perf_counter()
        with torch.cuda.stream(stream):
            for i in range(N):
                torch.empty(nbytes, dtype=torch.uint8, device=dev).copy_(pool_base[i * nbytes:(i + 1) * nbytes],
                                                                         non_blocking=True)
                stream.synchronize()  # one sync per pull, as the transport does
        c = time.perf_counter()
        t.update(open=0.0, copy=(c - a) * 1e3, close=0.0)
    t["total"] = (time.perf_counter() - t0) * 1e3
    conn.send_bytes(b"done")
    return t


def main():
    torch.empty(1, device="cuda")  # this process's context first
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=holder, args=(child,), daemon=True)
    p.start()
    pool_desc = msgspec.convert(msgspec.msgpack.decode(parent.recv_bytes()), cuda_ipc.CudaIpc)
    t0 = time.perf_counter()
    st = torch.UntypedStorage._new_shared_cuda(0, pool_desc.handle, pool_desc.block_bytes, pool_desc.block_offset,
                                              pool_desc.counter, pool_desc.counter_offset, pool_desc.event,
                                              pool_desc.event_sync)
    pool_base = torch.empty(0, dtype=torch.uint8, device="cuda").set_(st, pool_desc.byte_offset, (256 << 20,))
    map_pool_ms = (time.perf_counter() - t0) * 1e3
    out = {"map_pool_ms": map_pool_ms, "device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    for load in ("idle", "busy"):
        busy = Busy() if load == "busy" else None
        if busy:
            busy.thread.start()
            time.sleep(0.5)
        for mode in ("per-tensor", "batched", "pool"):
            rounds = []
            tick = Ticker()
            tick.thread.start()
            for _ in range(12):
                rounds.append(one_round(parent, pool_base, mode))
            tick.stop.set()
            tick.thread.join()
            rounds = rounds[2:]
            summary = {k: round(statistics.median(r[k] for r in rounds), 3) for k in rounds[0]}
            summary["total_max"] = round(max(r["total"] for r in rounds), 3)
            summary["ticker_max_gap_ms"] = round(tick.max_gap * 1e3, 2)
            out[f"{load}/{mode}"] = summary
            print(load, mode, summary, flush=True)
        if busy:
            busy.stop.set()
            busy.thread.join()
            out[f"{load}/steps"] = busy.steps
    parent.send_bytes(b"stop")
    p.join(10)
    print(json.dumps(out, indent=1))
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
