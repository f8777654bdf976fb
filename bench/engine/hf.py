"""HF transformers on the same architecture and random weights: its ``generate()`` decode step at batch 1
((t(65 tokens) − t(1 token)) / 64 after a 128-token prompt), and its vision tower for the ViT sections."""

from __future__ import annotations

import time

import torch

from bench.engine.common import Bench, lm_bytes, log
from shared.model.config import QWEN3_FAMILIES
from shared.model.presets import PRESETS


def hf_config(bench: Bench):
    from transformers import AutoConfig

    if bench.big:
        return AutoConfig.for_model(**dict(PRESETS[bench.preset]))
    return AutoConfig.from_pretrained(bench.checkpoint)


def run(bench: Bench, out: dict) -> None:
    from transformers import AutoModelForImageTextToText

    dev = bench.device
    needed = 1.1 * lm_bytes(bench.lm) if bench.lm is not None else 0
    if dev.type == "cuda" and needed > torch.cuda.mem_get_info(dev)[0]:
        out["skipped"] = f"HF's copy of the model ({needed / 1e9:.0f} GB) does not fit beside ours; run --sections hf alone"
        log("hf: skipped (memory)")
        return
    with torch.device(dev):
        model = AutoModelForImageTextToText.from_config(hf_config(bench), dtype=bench.dtype).eval()
    prompt = torch.randint(10, bench.vocab, (1, 128 if bench.big else 16), device=dev)

    def generate(n):
        with torch.no_grad():
            model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False)
        if dev.type == "cuda":
            torch.cuda.synchronize()

    generate(4)
    times = {}
    for n in (1, 65):
        t = time.perf_counter()
        generate(n)
        times[n] = time.perf_counter() - t
    out["decode_step_ms"] = (times[65] - times[1]) / 64 * 1e3
    log(f"hf generate: decode step {out['decode_step_ms']:.2f} ms")
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def vision_tower(bench: Bench):
    """HF's vision tower of the same architecture (random weights), without building its language model where
    the family allows (Qwen3-VL's is a model of its own)."""
    from transformers import AutoModel, AutoModelForImageTextToText

    config = hf_config(bench)
    with torch.device(bench.device):
        if bench.config.family in QWEN3_FAMILIES:
            return AutoModel.from_config(config.vision_config, dtype=bench.dtype).eval()
        return AutoModelForImageTextToText.from_config(config, dtype=bench.dtype).model.visual.eval()
