#!/usr/bin/env python3
"""The frontend's CPU for one image: ``decode_image`` (JPEG decode, RGB pixels, content hash) of a
generated image of each size, median of ``--repeats`` calls in one thread, and the content hash alone.

    python bench/media_decode.py --sizes 1920x1080,448x448 --out bench/results/media_decode-cpu.json
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(times), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1920x1080,448x448", help="WIDTHxHEIGHT, comma-separated")
    parser.add_argument("--format", default="JPEG")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import numpy as np
    from PIL import Image

    from services.frontend.media import content_hash, decode_image
    from tools.bench.dataset import make_image

    rows = []
    for size in args.sizes.split(","):
        width, height = (int(v) for v in size.split("x"))
        buf = io.BytesIO()
        make_image(0, width, height).save(buf, args.format)
        data = buf.getvalue()
        pixels = np.array(Image.open(io.BytesIO(data)).convert("RGB"))
        rows.append({"size": size, "format": args.format, "bytes": len(data),
                     "decode_image_ms": median_ms(lambda: decode_image(data, width * height), args.repeats),
                     "content_hash_ms": median_ms(lambda: content_hash(pixels), args.repeats)})
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"python": sys.version.split()[0], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
