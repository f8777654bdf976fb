#!/usr/bin/env python3
"""What cuDNN's fused attention costs the first time it meets a ViT batch of several same-size images.

`eva20-h200-q3-mixed` found a Qwen3-VL-30B-A3B aggregated worker's first two-image 1080p request with a
ViT forward of 824 ms against 62 ms for a one-image request before it (no Triton compile in between).
``sdpa.recurring`` moves a big shape to cuDNN at once, and its plan was measured at 45-60 ms — unless a
new kernel variant compiles (0.6-0.9 s, ``bench/attention_shapes.py``). This times, in one fresh process
per order so nothing is cached, cuDNN's first and steady call at Qwen3-VL's tower shapes ([images, 16
heads, length, 72 dims], bidirectional): one image, then two, then two of another size, then one of
that size; and the flash kernel's steady time beside each.

    python bench/vit_attention_batches.py --out results/vit_attention_batches.json   # on the GPU machine
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HEADS, DIM = 16, 72
# (images, tokens per image before the merger): 1080p (1088 x 1920 at patch 16), 720p, 448²
ORDERS = {
    "one_then_two": [(1, 8160), (2, 8160), (2, 3600), (1, 3600), (10, 784), (1, 784)],
    "two_first": [(2, 8160), (1, 8160), (3, 8160), (4, 8160)],
}


def child(order: str) -> list[dict]:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from shared.kernels import sdpa

    rows = []
    for images, n in ORDERS[order]:
        q, k, v = (torch.randn(images, HEADS, n, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        row = {"images": images, "tokens": n}
        for name, run in (("cudnn", lambda: sdpa._cudnn(q, k, v, False)), ("flash", lambda: sdpa._flash(q, k, v, False))):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run()
            torch.cuda.synchronize()
            first = (time.perf_counter() - t0) * 1e3
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                run()
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
            row[name] = {"first_ms": round(first, 2), "steady_ms": round(sorted(times)[2], 3)}
        print(order, row, flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", choices=sorted(ORDERS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child)))
        return
    out = {}
    for order in ORDERS:
        done = subprocess.run([sys.executable, __file__, "--child", order], capture_output=True, text=True, check=True)
        print(done.stdout, end="")
        out[order] = json.loads(next(l for l in done.stdout.splitlines() if l.startswith("RESULT "))[7:])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
