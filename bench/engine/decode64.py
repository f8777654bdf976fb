"""The decode step at batch 64 with 2,048-token contexts: graph replay and engine step, against the weights
(MoE: the experts the batch touches, counted) and the KV it reads over this run's copy bandwidth."""

from __future__ import annotations

import statistics
import time

from bench.engine.common import Bench, build_lm, decode_batch, experts_read, log
from bench.engine.roofline import decode_bytes
from shared.engine.kv_cache import KVCache


def run(bench: Bench, out: dict) -> None:
    engine, timer, cfg = build_lm(bench), bench.timer, bench.config
    runner = engine.runner
    batch, context = bench.decode_shape
    seqs = decode_batch(bench, "d64")
    engine.step()
    for seq in seqs:
        engine.blocks.may_append(seq)
    experts = experts_read(bench, seqs)
    rows = runner.stage_decode(seqs)
    if runner.graphs is not None:
        replay = timer.ms(lambda: runner.graphs.replay(rows), repeat=50, warmup=5)
    else:
        replay = timer.ms(lambda: runner.decode(seqs), repeat=3, warmup=1)
    walls = []
    for _ in range(20):
        t = time.perf_counter()
        engine.step()
        walls.append((time.perf_counter() - t) * 1e3)
    moved = decode_bytes(bench.lm, experts, batch * context * KVCache.bytes_per_block(cfg.text, 1, bench.dtype))
    floor = bench.bandwidth_ms(moved)
    for seq in seqs:
        engine.abort(seq.request_id)
    step = statistics.median(walls)
    out.update(batch=batch, context=context, graph_replay_ms=replay, engine_step_ms=step, bytes_GB=moved / 1e9,
               experts_read=experts, bandwidth_floor_ms=floor, share_of_bandwidth_limit=floor / replay,
               tokens_per_s=batch / (step / 1e3))
    log(f"decode b{batch}@{context}: replay {replay:.2f} ms (floor {floor:.2f} ms, {floor / replay:.0%} of limit), "
        f"engine step {step:.2f} ms")
