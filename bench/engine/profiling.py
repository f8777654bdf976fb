"""Kernel names and kernel-time tables from torch.profiler, for the sections that say where GPU time goes."""

from __future__ import annotations

import torch

from bench.engine.common import Bench


def kernel_name(name: str) -> str:
    """A trace kernel name made short: a Triton kernel's is its function's name already; others (cuBLAS,
    torch's own) lose ``void ``, their argument list and torch's namespaces, and are cut to 60 characters."""
    if name.isidentifier():
        return name
    name = name.removeprefix("void ")
    if name.endswith(")"):  # the argument list: from the "(" that closes at the end
        depth = 0
        for i in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                name = name[:i] or name
                break
    for noise in ("at::native::", "(anonymous namespace)::"):
        name = name.replace(noise, "")
    return name[:60]


def kernel_table(bench: Bench, fn, rows: int = 14) -> tuple[list[dict], float]:
    """The GPU kernels of one call of ``fn``, by name: the ``rows`` longest (launches, µs) and the total µs of
    all of them; empty off CUDA."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    if bench.device.type != "cuda":
        return [], 0.0
    kernels: dict[str, list[float]] = {}
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    for event in prof.events():
        if event.device_type.name == "CUDA":
            row = kernels.setdefault(kernel_name(event.name), [0, 0.0])
            row[0] += 1
            row[1] += event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:rows]
    return ([{"name": n, "launches": c, "us": round(t, 1)} for n, (c, t) in top],
            round(sum(t for _, t in kernels.values()), 1))
