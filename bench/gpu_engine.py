#!/usr/bin/env python3
"""Engine and vision-tower benchmark on the GPU machine, beside HF transformers and this run's own roofline.

For a preset's architecture (default Qwen2.5-VL-7B; ``--preset qwen3-vl-30b-a3b`` for the MoE model) with
random bf16 weights (timing does not depend on weight values), each section of ``bench/engine/`` (listed
there) measures one thing; ``--sections`` picks them (run in the order given). Results: ``--out``/gpu_engine.json,
one entry per section, with the machine's torch, transformers and triton versions and GPU.

    python3 bench/gpu_engine.py --out $OUT [--sections ceilings,decode1,hf] [--preset qwen3-vl-30b-a3b]
    python3 bench/gpu_engine.py --tiny --out /tmp/smoke      # every section on a tiny model (CPU works)
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine import SECTIONS  # noqa: E402
from bench.engine.common import Bench, log, preset_bench, tiny_bench  # noqa: E402
from shared.model.config import QWEN3_FAMILIES  # noqa: E402
from shared.model.presets import PRESETS  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench-results", help="directory for gpu_engine.json")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of: {', '.join(SECTIONS)}")
    parser.add_argument("--preset", default="qwen2.5-vl-7b", choices=sorted(PRESETS))
    parser.add_argument("--tiny", action="store_true", help="smoke-test on a tiny random model")
    parser.add_argument("--tiny-family", default="qwen2_5_vl", choices=["qwen2_5_vl", "qwen2_vl", *QWEN3_FAMILIES],
                        help="with --tiny: the tiny model's family")
    parser.add_argument("--kv-gb", type=float, default=24.0, help="the engine's KV pool")
    parser.add_argument("--decode1-contexts", default="128",
                        help="decode1: context lengths, comma-separated; the first is measured in full, the others "
                             "as the graph replay alone")
    parser.add_argument("--no-decode1-parts", dest="decode1_parts", action="store_false",
                        help="decode1: skip the replays without each part and the MoE and projection paths")
    parser.add_argument("--prefill-lengths", default="152,512,2132,8192",
                        help="prefill_sizes: prompt lengths in tokens, comma-separated")
    parser.add_argument("--prefill-graph-tokens", type=int, default=4096,
                        help="capture prefill steps of up to this many tokens piece by piece (0: eager), as "
                             "EPD_PREFILL_GRAPH_TOKENS does in a worker")
    parser.add_argument("--vit-graph-patches", type=int, default=16384,
                        help="vit_graphs: the largest forward (patches) captured")
    args = parser.parse_args(argv)
    args.sections = args.sections.split(",")
    if unknown := [name for name in args.sections if name not in SECTIONS]:
        parser.error(f"--sections: unknown {', '.join(unknown)} (of {', '.join(SECTIONS)})")
    return args


def make_bench(args: argparse.Namespace) -> Bench:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    options = dict(decode1_contexts=[int(c) for c in args.decode1_contexts.split(",")],
                   decode1_parts=args.decode1_parts, prefill_lengths=[int(n) for n in args.prefill_lengths.split(",")],
                   prefill_graph_tokens=args.prefill_graph_tokens, vit_graph_patches=args.vit_graph_patches,
                   kv_gb=args.kv_gb)
    if args.tiny:
        return tiny_bench(args.tiny_family, device, Path(args.out), **options)
    return preset_bench(args.preset, device, Path(args.out), **options)


def environment(device: torch.device) -> dict:
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    try:
        import transformers
        import triton

        env.update(transformers=transformers.__version__, triton=triton.__version__)
    except ImportError:
        pass
    return env


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench = make_bench(args)
    results: dict = {"env": environment(bench.device), "build": bench.build}
    log(f"env: {results['env']}")
    for name in args.sections:
        out = results[name] = {}
        try:
            SECTIONS[name](bench, out)
        except Exception as err:  # keep measuring the other sections
            out["error"] = f"{type(err).__name__}: {err}"
            log(f"{name} FAILED: {err}")
            traceback.print_exc()
    bench.out.mkdir(parents=True, exist_ok=True)
    (bench.out / "gpu_engine.json").write_text(json.dumps(results, indent=2, default=str))
    log(json.dumps(results, default=str))
    return 1 if any("error" in results[name] for name in args.sections) else 0


if __name__ == "__main__":
    sys.exit(main())
