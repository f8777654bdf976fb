"""The decode step at batch 1 (a 128-token context; more with ``--decode1-contexts``): its CUDA-graph
replay and a whole engine step (schedule, stage inputs, replay, sample, sync), against the bytes it reads
over this run's copy bandwidth (MoE: attention, routers, LM head and the experts its token routes to,
counted). With ``--decode1-parts`` (the default) also what each part of the step gives (``decode1_parts``)."""

from __future__ import annotations

import statistics
import time

from bench.engine import decode1_parts
from bench.engine.common import Bench, build_lm, experts_read, log, new_seq
from bench.engine.roofline import decode_bytes
from shared.engine.kv_cache import KVCache


def run(bench: Bench, out: dict) -> None:
    build_lm(bench)
    contexts = bench.decode1_contexts if bench.big else [32]
    measure(bench, contexts[0], out)
    for context in contexts[1:]:  # the replay alone at longer contexts (the decode attention's splits)
        out[f"graph_replay_ms_at_{context}"] = replay_at(bench, context)
    if bench.decode1_parts:
        decode1_parts.run(bench, out)


def measure(bench: Bench, prompt: int, out: dict) -> None:
    engine, timer = bench.engine, bench.timer
    runner = engine.runner
    seq = new_seq("b1", list(range(100, 100 + prompt)), 10_000)
    engine.add_prompt(seq)
    engine.step()  # prefill
    for _ in range(3):
        engine.step()
    engine.blocks.may_append(seq)  # room for the token a replay computes
    experts = experts_read(bench, [seq])
    rows = runner.stage_decode([seq])
    replay = timer.ms(lambda: runner.graphs.replay(rows), repeat=200, warmup=10) if runner.graphs else None
    variants = decode1_parts.variants(bench, seq) if runner.graphs is not None and bench.decode1_parts else {}
    walls = []
    for _ in range(100):
        t = time.perf_counter()
        engine.step()
        walls.append((time.perf_counter() - t) * 1e3)
    engine.abort("b1")
    step = statistics.median(walls)
    moved = decode_bytes(bench.lm, experts, len(seq) * KVCache.bytes_per_block(bench.config.text, 1, bench.dtype))
    floor = bench.bandwidth_ms(moved)
    out.update(graph_replay_ms=replay, engine_step_ms=step, bandwidth_floor_ms=floor,
               weights_GB=bench.weights_bytes / 1e9, bytes_read_GB=moved / 1e9, experts_read=experts,
               ratio_to_floor=replay / floor if replay and floor else None, replay_ms_variants=variants)
    log(f"decode b1: graph replay {replay and round(replay, 3)} ms, engine step {step:.3f} ms, floor {floor:.2f} ms "
        f"({moved / 1e9:.2f} GB read, {experts} experts)")


def replay_at(bench: Bench, context: int) -> float | None:
    engine, runner = bench.engine, bench.engine.runner
    seq = new_seq("b1", [100 + i % 800 for i in range(context)], 10_000)
    engine.add_prompt(seq)
    while seq.num_output < 2:
        engine.step()
    engine.blocks.may_append(seq)
    rows = runner.stage_decode([seq])
    replay = bench.timer.ms(lambda: runner.graphs.replay(rows), repeat=200, warmup=10) if runner.graphs else None
    log(f"decode b1 at a {context}-token context: graph replay {replay and round(replay, 3)} ms")
    engine.abort("b1")
    return replay
