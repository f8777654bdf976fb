#!/usr/bin/env python3
"""The frontend's CPU for one image: ``decode_image`` (JPEG decode, RGB pixels, content hash) as the floor
measures it (``tools.plan.costs.measure_media``: the workload's own images, least of five), and the
content hash alone, for each size; and for a request of ``--images`` of each size sent as data URLs, the
CPU its media stage costs the event-loop thread (``MediaLoader.load_media``, the frontend's pool of
``media_threads`` doing the rest; median of 30), beside the stage's wall time.

    python bench/media_decode.py --sizes 1920x1080,448x448 --out bench/results/media_decode-cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1920x1080,448x448", help="WIDTHxHEIGHT, comma-separated")
    parser.add_argument("--format", default="jpeg", choices=["jpeg", "png"])
    parser.add_argument("--images", type=int, default=10, help="images of one request, for the event-loop figure")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import numpy as np
    import torch

    from services.frontend.media import content_hash
    from tools.bench.dataset import make_image
    from tools.plan.costs import Timer, measure_media

    rows = []
    for size in args.sizes.split(","):
        width, height = (int(v) for v in size.split("x"))
        pixels = np.array(make_image(0, width, height).convert("RGB"))
        rows.append({"size": size, "format": args.format,
                     "decode_image_ms": round(measure_media(width, height, args.format), 2),
                     "content_hash_ms": round(Timer(torch.device("cpu")).ms(lambda: content_hash(pixels), repeat=5), 2),
                     **loop_cpu(width, height, args.format, args.images)})
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"python": sys.version.split()[0], "rows": rows}, indent=1))


def loop_cpu(width: int, height: int, image_format: str, count: int) -> dict:
    """One request's ``count`` images as data URLs through ``MediaLoader.load_media``: the event-loop
    thread's CPU (``time.thread_time``) and the wall time, medians of 30."""
    import asyncio
    import base64
    import io
    import statistics
    import time
    from concurrent.futures import ThreadPoolExecutor

    from services.frontend.media import MediaLoader
    from services.frontend.settings import FrontendSettings
    from tools.bench.dataset import make_image

    def url(seed: int) -> str:
        buffer = io.BytesIO()
        make_image(seed, width, height).convert("RGB").save(buffer, image_format.upper())
        return f"data:image/{image_format};base64," + base64.b64encode(buffer.getvalue()).decode()

    parts = [("image", url(seed)) for seed in range(count)]
    settings = FrontendSettings()
    with ThreadPoolExecutor(settings.media_threads) as pool:
        loader = MediaLoader(settings, pool)

        async def run() -> tuple[list[float], list[float]]:
            cpu, wall = [], []
            for _ in range(30):
                c, t = time.thread_time(), time.perf_counter()
                await loader.load_media(parts)
                cpu.append(time.thread_time() - c)
                wall.append(time.perf_counter() - t)
            await loader.close()
            return cpu, wall

        cpu, wall = asyncio.run(run())
    return {f"request_of_{count}_loop_cpu_ms": round(statistics.median(cpu) * 1e3, 2),
            f"request_of_{count}_media_wall_ms": round(statistics.median(wall) * 1e3, 2)}


if __name__ == "__main__":
    main()
