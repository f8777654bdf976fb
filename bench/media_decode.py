#!/usr/bin/env python3
"""The frontend's CPU for one image: ``decode_image`` (JPEG decode, RGB pixels, content hash) as the floor
measures it (``tools.plan.costs.measure_media``: the workload's own images, least of five), and the
content hash alone, for each size.

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
                     "content_hash_ms": round(Timer(torch.device("cpu")).ms(lambda: content_hash(pixels), repeat=5), 2)})
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"python": sys.version.split()[0], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
