"""Where the batch-1 decode step's time goes, kernel by kernel: ``decode1``'s CUDA-graph replay (its first
context; 32 tokens on a tiny model), 20 replays under torch.profiler, the first 2 dropped. A kernel's share
is how far its end extends the step's critical path past the kernels before it (under programmatic dependent
launch a kernel starts before the one ahead ends, so its duration counts waiting); the same replays timed
without the profiler beside it. The raw trace goes to ``--out``/timeline-trace.json.gz."""

from __future__ import annotations

import gzip
import json
import math
import statistics
import tempfile
from pathlib import Path

import torch

from bench.engine.common import Bench, build_lm, log, new_seq
from bench.engine.profiling import kernel_name


def run(bench: Bench, out: dict) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    if bench.device.type != "cuda":
        out["skipped"] = "no GPU: no CUDA graph to replay"
        return
    engine = build_lm(bench)
    runner = engine.runner
    if runner.graphs is None:
        out["skipped"] = "no CUDA graphs captured"
        return
    prompt = (bench.decode1_contexts if bench.big else [32])[0]
    seq = new_seq("timeline", list(range(100, 100 + prompt)), 10_000)
    n, drop = 20, 2

    def replays():
        for _ in range(n):
            runner.graphs.replay(rows)

    engine.add_prompt(seq)
    try:
        for _ in range(4):  # the prefill, then three tokens
            engine.step()
        engine.blocks.may_append(seq)  # room for the token a replay computes
        rows = runner.stage_decode([seq])
        for _ in range(10):
            runner.graphs.replay(rows)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            replays()
            torch.cuda.synchronize()
        replay_ms = bench.timer.ms(replays, repeat=5, warmup=1) / n  # the same back-to-back replays, unprofiled
    finally:
        engine.abort("timeline")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        raw = path.read_bytes()
    bench.out.mkdir(parents=True, exist_ok=True)
    (bench.out / "timeline-trace.json.gz").write_bytes(gzip.compress(raw))
    result = from_events(json.loads(raw)["traceEvents"], n, drop=drop, layers=bench.config.text.num_layers)
    out.update(replay_ms=replay_ms, context=prompt, **result)
    log(f"timeline: replay {replay_ms:.3f} ms unprofiled, profiled span {result['profiled_span_ms']:.3f} ms, "
        f"{result['replays']} replays of {result['kernels_per_step']} kernels (split by {result['split']}), "
        f"{result['per_layer_us']:.1f} µs a layer, {result['outside_layers_us']:.1f} µs outside")
    for k in result["by_kernel"]:
        log(f"  {k['name']:<60} {k['launches']:>6g} path {k['contribution_us']:>8.1f} µs, duration "
            f"{k['duration_us']:>8.1f}, gap {k['gap_us']:>7.1f}, a layer {k.get('contribution_per_layer_us', '')}")


def split_replays(kernels: list[dict], replays: int, gap_us: float) -> tuple[list[list[dict]], str]:
    """``kernels`` (sorted by start) cut into ``replays`` groups of equal count: where the GPU idled more than
    ``gap_us`` since the latest end; else by the launch each kernel's correlation id names (a graph's kernels
    share its launch's); else ``replays`` equal consecutive chunks (graph replays run in stream order)."""
    groups: list[list[dict]] = []
    latest = -math.inf
    for k in kernels:
        if k["ts"] - latest > gap_us:
            groups.append([])
        groups[-1].append(k)
        latest = max(latest, k["ts"] + k["dur"])
    if len(groups) == replays and len({len(g) for g in groups}) == 1:
        return groups, "gap"
    if all("correlation" in k.get("args", {}) for k in kernels):
        by_launch: dict = {}
        for k in kernels:
            by_launch.setdefault(k["args"]["correlation"], []).append(k)
        groups = sorted(by_launch.values(), key=lambda g: g[0]["ts"])
        if len(groups) == replays and len({len(g) for g in groups}) == 1:
            return groups, "correlation"
    if len(kernels) % replays:
        raise ValueError(f"{len(kernels)} kernels do not split into {replays} equal replays")
    size = len(kernels) // replays
    return [kernels[i:i + size] for i in range(0, len(kernels), size)], "equal chunks"


def from_events(events: list[dict], replays: int, drop: int = 2, layers: int | None = None,
                gap_us: float = 20.0) -> dict:
    """The timeline from a Chrome trace's events (``cat`` "kernel": ``ts``, ``dur`` in µs) of ``replays``
    consecutive graph replays, the first ``drop`` left out. Per replay, kernel by kernel in start order: its
    path share (its end past the latest end before it, or the replay's start; these sum to the replay's span),
    its duration, and its gap (idle time before it starts). Per short name, means a step; with ``layers``, the
    path share a layer of names launched at least once a layer."""
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: (e["ts"], e["ts"] + e["dur"]))
    if not kernels:
        raise ValueError("no kernel events in the trace")
    groups, split = split_replays(kernels, replays, gap_us)
    kept = groups[drop:]
    if not kept:
        raise ValueError(f"{len(groups)} replays, all dropped")
    totals: dict[str, dict] = {}
    spans = []
    for group in kept:
        start = latest = group[0]["ts"]
        for k in group:
            end = k["ts"] + k["dur"]
            row = totals.setdefault(kernel_name(k["name"]), {"launches": 0, "contribution_us": 0.0,
                                                              "duration_us": 0.0, "gap_us": 0.0})
            row["launches"] += 1
            row["contribution_us"] += max(0.0, end - latest)
            row["duration_us"] += k["dur"]
            row["gap_us"] += max(0.0, k["ts"] - latest)
            latest = max(latest, end)
        spans.append(latest - start)
    by_kernel = []
    for name, row in totals.items():
        entry = {"name": name, "launches": row["launches"] / len(kept)}
        entry.update({key: round(row[key] / len(kept), 2) for key in ("contribution_us", "duration_us", "gap_us")})
        if layers and entry["launches"] >= layers:
            entry["contribution_per_layer_us"] = round(entry["contribution_us"] / layers, 2)
        by_kernel.append(entry)
    by_kernel.sort(key=lambda e: -e["contribution_us"])
    path_us = sum(row["contribution_us"] for row in totals.values()) / len(kept)
    in_layers = sum(e["contribution_us"] for e in by_kernel if "contribution_per_layer_us" in e)
    period = (kept[-1][0]["ts"] - kept[0][0]["ts"]) / (len(kept) - 1) if len(kept) > 1 else None
    return {"split": split, "replays": len(kept), "kernels_per_step": len(kept[0]),
            "profiled_span_ms": statistics.mean(spans) / 1e3,
            "profiled_span_ms_range": [min(spans) / 1e3, max(spans) / 1e3],
            "profiled_period_ms": period and period / 1e3, "contribution_sum_ms": path_us / 1e3,
            "layers": layers, "per_layer_us": in_layers / layers if layers else None,
            "outside_layers_us": path_us - in_layers, "by_kernel": by_kernel}
