#!/usr/bin/env python3
"""HF parity on the GPU through the aggregated worker (its ViT between engine steps, in the engine's
thread) and through E/PD (an encoder beside a joined language worker under MPS: the embeddings cross
processes through the encoder's export pool, CUDA IPC).

The CPU suite checks the same code paths, but on CPU there are no CUDA streams, graphs or IPC: whether the
engine reads an image's embeddings only after the forward that makes them, and whether the tower's graph
buffers and a pulled tensor's copy are complete when read, shows only on a GPU. So: a tiny random
checkpoint (fp32), ``epd up`` of each layout on CUDA, a long text request decoding throughout (so every
image arrives while an engine step runs), and image requests of one to three images of different sizes,
two at a time; each answer against HF ``generate()`` on CPU, and the layouts' answers against each other.
On the GPU our fp32 kernels are not bit-equal to HF's on CPU, so an answer may part from HF's at a
near-tie in every layout; a race would part the layouts. Exits 1 when they part.

    python3 bench/gpu_parity.py                      # Qwen2.5-VL tiny, both layouts
    python3 bench/gpu_parity.py --family qwen3_vl_moe --layouts E/PD+MPS --out $OUT/parity.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.model.tiny import write_tiny_checkpoint  # noqa: E402
from tests.support import Reference, make_image  # noqa: E402
from tests.up_stack import UpStack  # noqa: E402


def requests(count: int) -> list[tuple[str, list]]:
    sizes = [(56, 64), (120, 90), (200, 60), (64, 64), (90, 150)]
    out = []
    for i in range(count):
        images = [make_image(700 + 10 * i + j, *sizes[(i + j) % len(sizes)]) for j in range(1 + i % 3)]
        out.append((f"Describe picture {i}.", images))
    return out


LAYOUTS = {  # name → epd up flags
    "aggregated": ["--topology", "aggregated"],
    "E/PD+MPS": ["--topology", "colocated", "--pd", "joined", "--mps", "auto"],
}


def serve(path: Path, layout: str, cases: list, tokens: int, device: str) -> tuple[list[str], dict]:
    env = {"EPD_DEVICE": device, "EPD_DTYPE": "float32", "EPD_ENCODER_CACHE_MB": "0"}
    stack = UpStack(path, *LAYOUTS[layout], env=env)
    try:
        stop = threading.Event()

        def background() -> None:  # keeps the engine stepping while the images arrive
            while not stop.is_set():
                stack.chat("Tell a long story.", max_tokens=400, timeout=300)

        runner = threading.Thread(target=background, daemon=True)
        runner.start()
        time.sleep(1.0)
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda c: stack.chat(c[0], c[1], max_tokens=tokens, timeout=300), cases))
        stop.set()
        runner.join(timeout=300)
        stats = {labels.get("stat"): value for labels, value in stack.series("epd_service_stat")
                 if labels.get("service") in ("epd-aggregated", "epd-language")}
        texts = [r["choices"][0]["message"]["content"] if r["status"] == 200 else f"HTTP {r['status']}: {r}"
                 for r in results]
        return texts, stats
    finally:
        stack.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="qwen2_5_vl", help="tiny checkpoint family (shared/model/tiny.py)")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--device", default="cuda", help="cpu: the same run without streams (a smoke test)")
    parser.add_argument("--out", help="JSON report")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    args = parser.parse_args()
    layouts = args.layouts.split(",")
    if unknown := set(layouts) - set(LAYOUTS):
        parser.error(f"--layouts: unknown {', '.join(sorted(unknown))}")
    path = write_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="epd-parity-")), args.family)
    cases = requests(args.requests)
    reference = Reference(path)
    want = [reference.text(reference.generate(text, images, args.tokens, ignore_eos=True)) for text, images in cases]
    report = {"family": args.family, "requests": args.requests, "tokens": args.tokens}
    answers = []
    for layout in layouts:
        texts, stats = serve(path, layout, cases, args.tokens, args.device)
        answers.append(texts)
        matches = sum(t == w for t, w in zip(texts, want))
        report[layout] = {"matches": matches, "texts": texts, "stats": stats}
        print(f"{args.family} {layout}: {matches}/{len(want)} answers equal HF's; ViT batches "
              f"{stats.get('batches')}, images in place {stats.get('images_in_place')}, prompts {stats.get('prompts')}",
              flush=True)
    same = sum(len(set(a)) == 1 for a in zip(*answers))
    print(f"{args.family}: the {len(layouts)} layouts give the same answer to {same}/{len(cases)} requests",
          flush=True)
    report["hf"], report["layouts_agree"] = want, same
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0 if same == len(cases) else 1


if __name__ == "__main__":
    sys.exit(main())
