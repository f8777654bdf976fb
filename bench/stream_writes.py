#!/usr/bin/env python3
"""The frontend's CPU per streamed token when tokens come faster than it writes them.

A real nats-server (the launcher's embedded one); S streaming chat answers, each a real TokenStream,
Generation (the tiny checkpoint's tokenizer), ChatOutput and the app's server-sent events, written to
a loopback TCP socket whose other end a thread drains; a second process publishes T token events per
answer onto their subjects as fast as NATS takes them — the frontend's side of a stack whose language
workers outrun it. Measured: the consumer process's CPU seconds per token and the writes per token,
with events at hand joined into one write (``JOINED_EVENTS``, the default) and with one write per
event (``--joined 1``, what the frontend did before), same run.

    python bench/stream_writes.py --streams 32 --tokens 400 --out bench/results/stream_writes-cpu.json

``--stack``: instead, a real ``epd up --topology aggregated`` on the built-in tiny model and S streaming
chat requests of T tokens over HTTP; the frontend process's CPU seconds (``/proc``) per streamed token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def publish(url: str, streams: int, tokens: int, ids: list[int], start: float) -> None:
    """Every answer's tokens (``ids`` over and over), round-robin over the answers (one engine step after
    another)."""
    import nats

    from shared.messages import pack
    from shared.messages.stream import TokenEvent

    async def run():
        nc = await nats.connect(url)
        payloads = [[pack(TokenEvent(request_id=f"r{s}", index=i, token_ids=[ids[(i + s) % len(ids)]],
                                     finish_reason="length" if i == tokens - 1 else None))
                     for s in range(streams)] for i in range(tokens)]
        time.sleep(max(0.0, start - time.time()))
        for i in range(tokens):
            for s in range(streams):
                await nc.publish(f"bench.stream.{s}", payloads[i][s])
        await nc.flush()
        await nc.close()

    asyncio.run(run())


async def consume(url: str, streams: int, tokens: int, joined: int, tokenizer, ids: list[int]) -> dict:
    import nats

    from services.frontend import app
    from services.frontend.chat_output import ChatOutput
    from services.frontend.generation import Generation, OutputOptions, Timing
    from services.frontend.logprobs import TokenText
    from services.frontend.protocol import ChatCompletionRequest
    from services.frontend.stream import TokenStream
    from shared.engine.sampling import SamplingParams

    class Pipeline:
        def __init__(self):
            self.tokenizer = tokenizer

        def cancel_soon(self, *_):
            pass

        def finished(self, _):
            pass

    class Slot:
        def release(self):
            pass

    app.JOINED_EVENTS = joined
    nc = await nats.connect(url)
    output = ChatOutput("bench", TokenText(tokenizer))
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], stream=True)
    answers, sockets = [], []
    for s in range(streams):
        stream = TokenStream(nc, f"bench.stream.{s}", directory=None, first_token_timeout=60, token_timeout=60)
        await stream.open()
        stream.expect(f"r{s}", "")
        generation = Generation(Pipeline(), f"r{s}", None, [], SamplingParams(max_tokens=tokens + 1), OutputOptions(),
                                stream, Slot(), Timing(arrived=time.time()))
        answers.append(app._sse(output.chunks(generation, request)))
        sockets.append(socket.socketpair())
    received = [0]

    def drain(sock):
        while data := sock.recv(1 << 16):
            received[0] += len(data)

    readers = [threading.Thread(target=drain, args=(b,), daemon=True) for _, b in sockets]
    for r in readers:
        r.start()
    writes = [0]

    async def write(answer, sock):
        loop = asyncio.get_running_loop()
        async for data in answer:
            writes[0] += 1
            await loop.sock_sendall(sock, data.encode())
        sock.shutdown(socket.SHUT_WR)

    for a, _ in sockets:
        a.setblocking(False)
    start = time.time() + 1.0
    publisher = multiprocessing.get_context("spawn").Process(target=publish, args=(url, streams, tokens, ids, start))
    publisher.start()
    await asyncio.sleep(max(0.0, start - time.time()))
    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(write(answer, a) for answer, (a, _) in zip(answers, sockets)))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    publisher.join()
    for r in readers:
        r.join(5)
    await nc.close()
    total = streams * tokens
    return {"joined_events": joined, "tokens": total, "wall_s": round(wall, 3), "tokens_per_s": round(total / wall),
            "cpu_us_per_token": round(cpu / total * 1e6, 1), "writes_per_token": round(writes[0] / total, 3),
            "bytes": received[0]}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _session(leader: int) -> list[int]:
    """The processes of the session ``leader`` started (the stack runs in a session of its own)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.getsid(int(entry.name)) == leader:
                pids.append(int(entry.name))
        except ProcessLookupError:
            continue
    return pids


def stack_frontend(streams: int, tokens: int) -> dict:
    """The frontend's CPU per token while a tiny aggregated stack streams ``streams`` answers at once."""
    import httpx

    from tools.bench.stack import StackProcess

    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    stack = StackProcess(["--topology", "aggregated"], {**env, "EPD_LOG_FORMAT": "json"}, Path.cwd())
    try:
        api = stack.wait_ready(240)
        frontend = next(pid for pid in _session(stack.process.pid)
                        if b"services.frontend" in Path(f"/proc/{pid}/cmdline").read_bytes())

        def answer(i: int) -> int:
            body = {"messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{api}/chat/completions", json=body, timeout=300) as response:
                return sum(1 for line in response.iter_lines() if line.startswith("data: {"))

        answer(-1)
        cpu0, t0 = cpu_seconds(frontend), time.perf_counter()
        threads = [threading.Thread(target=answer, args=(i,)) for i in range(streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        cpu, wall = cpu_seconds(frontend) - cpu0, time.perf_counter() - t0
    finally:
        stack.stop()
    total = streams * tokens
    return {"stack": "aggregated, tiny", "tokens": total, "wall_s": round(wall, 2), "tokens_per_s": round(total / wall),
            "frontend_cpu_us_per_token": round(cpu / total * 1e6, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=400, help="tokens per answer")
    parser.add_argument("--joined", default="64,1", help="JOINED_EVENTS values to compare, comma-separated")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--stack", action="store_true", help="a real tiny stack over HTTP instead (see above)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.stack:
        rows = []
        for _ in range(args.repeats):
            rows.append(stack_frontend(args.streams, args.tokens))
            print(json.dumps(rows[-1]), flush=True)
        if args.out:
            args.out.write_text(json.dumps({"streams": args.streams, "tokens": args.tokens, "cpus": os.cpu_count(),
                                            "python": sys.version.split()[0], "rows": rows}, indent=1))
        return

    from transformers import AutoTokenizer

    from launcher.natsserver import EmbeddedNats
    from shared.model.tiny import default_tiny_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(default_tiny_checkpoint())
    ids = tokenizer(" ".join(["the quick brown fox jumps over the lazy dog and reads the image"] * 4))["input_ids"]
    rows = []
    with EmbeddedNats() as server:
        for _ in range(args.repeats):
            for joined in [int(j) for j in args.joined.split(",")]:
                row = asyncio.run(consume(server.url, args.streams, args.tokens, joined, tokenizer, ids))
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.out:
        args.out.write_text(json.dumps({"streams": args.streams, "tokens": args.tokens, "cpus": os.cpu_count(),
                                        "python": sys.version.split()[0], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
