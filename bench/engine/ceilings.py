"""This run's own roofline: device copy bandwidth (read + write) and the bf16 matmul rate."""

from __future__ import annotations

import torch

from bench.engine.common import Bench, log


def run(bench: Bench, out: dict) -> None:
    dev, timer = bench.device, bench.timer
    n = (4 << 30) // 2 if dev.type == "cuda" else 1 << 24
    a = torch.randn(n, dtype=torch.bfloat16, device=dev)
    b = torch.empty_like(a)
    ms = timer.ms(lambda: b.copy_(a), repeat=5)
    bench.bandwidth = 2 * a.numel() * 2 / (ms / 1e3)
    size = 8192 if dev.type == "cuda" else 512
    x = torch.randn(size, size, dtype=torch.bfloat16, device=dev)
    y = torch.randn(size, size, dtype=torch.bfloat16, device=dev)
    mm = timer.ms(lambda: x @ y, repeat=10)
    bench.matmul_rate = 2 * size**3 / (mm / 1e3)
    del a, b, x, y
    out.update(copy_bandwidth_TBps=bench.bandwidth / 1e12, bf16_matmul_TFLOPs=bench.matmul_rate / 1e12)
    log(f"ceilings: copy {bench.bandwidth / 1e12:.2f} TB/s, bf16 matmul {bench.matmul_rate / 1e12:.0f} TFLOP/s")
