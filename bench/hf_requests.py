#!/usr/bin/env python3
"""HF transformers ``generate()`` on the request set of bench/epd_vs_aggregated.py: the baseline of the
benchmarks issue's "aggregated >= 5x HF's request throughput".

The requests are built by the same code and settings as an epd_vs_aggregated.py point (its ``CASES`` and
``case_workload``, ``tools.bench.runner.prepare`` with the same warm-up count and seed): the same
prompts, the same images as the same JPEG data URLs. ``--seed S`` gives the requests of the point whose
seed is S: its first point when run with ``--workloads W --seed S`` (point n of a sweep has S + 100 n).
The requests of a shorter run are the first ones of a longer run with the same seed.

Each request runs alone, one after the other (HF has no continuous batching: batch 1 is its honest
serving mode), and its time covers what the server does for it: the data URLs decoded to pixels, the
checkpoint's image processor (PIL backend, as our encoders), the chat template with each image's
``<|vision_start|><|image_pad|>…<|vision_end|>`` expanded to its token count, then greedy ``generate()``
with the output length forced (min = max new tokens, as the server's ignore_eos). One untimed warm-up
request (the server's first warm-up request) goes first. After ``--max-seconds`` no new request starts;
the report covers the completed ones and says so.

Reported: request throughput (completed requests / their total time), the same for ``generate()`` alone,
mean latency, output tokens/s; JSON with the per-request figures, hardware, versions and command line.
Model: Qwen2.5-VL-7B architecture with random bf16 weights built from the ``qwen2.5-vl-7b`` preset's
config (no weights exist here; timing does not depend on their values when the output length is forced),
or with ``--tiny`` the built-in tiny checkpoint and the tiny workloads of epd_vs_aggregated.py.

    python3 bench/hf_requests.py --workload image-heavy --num-prompts 4 --out $OUT/hf_requests.json
    python bench/hf_requests.py --tiny --num-prompts 2 --out /tmp/hf.json      # CPU smoke test
"""

from __future__ import annotations

import argparse
import base64
import inspect
import io
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.epd_vs_aggregated import CASES, case_workload, hardware, tokenizer_dir, versions  # noqa: E402
from tools.bench.dataset import ImagePool, RequestSpec  # noqa: E402
from tools.bench.runner import prepare  # noqa: E402
from tools.bench.settings import BenchSettings, Workload  # noqa: E402
from shared.model.geometry import ImageGeometry, grid_tokens  # noqa: E402
from shared.model.processor import ImagePreprocessor  # noqa: E402
from shared.model.tokenizer import load_tokenizer  # noqa: E402

WARMUP_REQUESTS = 2  # as epd_vs_aggregated.measure(): the warm-up images come first in the pool


def log(*args):
    print(*args, flush=True)


def requests(case_name: str, tiny: bool, num_prompts: int, seed: int,
             checkpoint: str) -> tuple[BenchSettings, ImagePool, RequestSpec, list[RequestSpec]]:
    """The settings, images, first warm-up request and measured requests of an epd_vs_aggregated point."""
    case = next(c for c in CASES if c.name == case_name)
    settings = BenchSettings(label="hf generate()", num_prompts=num_prompts, seed=seed, warmup=WARMUP_REQUESTS,
                             tokenizer=checkpoint, **case_workload(case, tiny))
    pool, warm, measured = prepare(settings)
    return settings, pool, warm[0], measured


def load_model(checkpoint: str, tiny: bool, device: torch.device, dtype: torch.dtype):
    """The tiny checkpoint's weights, or the preset's architecture with random weights (as gpu_engine.py's
    ``hf`` section, but from the preset directory's config: its special-token ids are the tokenizer's)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    if tiny:
        return AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=dtype).to(device).eval()
    config = AutoConfig.from_pretrained(checkpoint)
    with torch.device(device):
        return AutoModelForImageTextToText.from_config(config, dtype=dtype).eval()


def decode_data_url(url: str) -> np.ndarray:
    """A data URL → RGB pixels, as the frontend decodes it."""
    with Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))) as image:
        return np.array(image.convert("RGB"), dtype=np.uint8)


class InputBuilder:
    """A request's OpenAI messages → ``generate()`` inputs, the way HF's Qwen2.5-VL processor builds them."""

    def __init__(self, checkpoint: str, model, device: torch.device):
        self.tokenizer = load_tokenizer(checkpoint)
        self.preprocess = ImagePreprocessor(checkpoint)
        self.merge_size = ImageGeometry.from_checkpoint(checkpoint).merge_size
        self.image_token_id = model.config.image_token_id
        self.device = device
        self.with_mm_types = "mm_token_type_ids" in inspect.signature(model.forward).parameters

    def __call__(self, messages: list[dict]) -> dict[str, torch.Tensor]:
        conversation, urls = self._template_messages(messages)
        rendered = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        inputs: dict[str, torch.Tensor] = {}
        if urls:
            patches, grids = zip(*(self.preprocess(decode_data_url(url)) for url in urls))
            pieces = rendered.split("<|image_pad|>")
            counts = [grid_tokens(g, self.merge_size) for g in grids]
            rendered = pieces[0] + "".join("<|image_pad|>" * n + pieces[i + 1] for i, n in enumerate(counts))
            inputs.update(pixel_values=torch.from_numpy(np.concatenate(patches)).to(self.device),
                          image_grid_thw=torch.tensor(grids, device=self.device))
        ids = self.tokenizer(rendered, return_tensors="pt").input_ids.to(self.device)
        inputs.update(input_ids=ids, attention_mask=torch.ones_like(ids))
        if self.with_mm_types:  # where generate() takes it, the images' 3-D (M-RoPE) positions come from it
            inputs["mm_token_type_ids"] = (ids == self.image_token_id).int()
        return inputs

    @staticmethod
    def _template_messages(messages: list[dict]) -> tuple[list[dict], list[str]]:
        """Image parts → the template's ``{"type": "image"}``, and the image URLs in order."""
        urls: list[str] = []
        conversation = []
        for message in messages:
            content = message["content"]
            if isinstance(content, list):
                urls += [p["image_url"]["url"] for p in content if p["type"] == "image_url"]
                content = [{"type": "image"} if p["type"] == "image_url" else p for p in content]
            conversation.append({"role": message["role"], "content": content})
        return conversation, urls


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_one(model, build: InputBuilder, pool: ImagePool, spec: RequestSpec, device: torch.device) -> dict:
    """One request, inputs built and generated; its times and token counts."""
    start = time.perf_counter()
    inputs = build(pool.messages(spec))
    synchronize(device)
    built = time.perf_counter()
    out = model.generate(**inputs, max_new_tokens=spec.output_len, min_new_tokens=spec.output_len,
                         do_sample=False, pad_token_id=model.generation_config.eos_token_id)
    synchronize(device)
    done = time.perf_counter()
    prompt_tokens = inputs["input_ids"].shape[1]
    return {"index": spec.index, "images": len(spec.image_ids), "prompt_tokens": prompt_tokens,
            "output_tokens": out.shape[1] - prompt_tokens, "inputs_ms": (built - start) * 1e3,
            "generate_ms": (done - built) * 1e3, "latency_ms": (done - start) * 1e3}


def run_all(model, build: InputBuilder, pool: ImagePool, specs: list[RequestSpec], device: torch.device,
            max_seconds: float) -> list[dict]:
    """The requests one after the other (at least one), none started after ``max_seconds``."""
    records = []
    start = time.perf_counter()
    for spec in specs:
        records.append(run_one(model, build, pool, spec, device))
        log(f"request {spec.index}: {records[-1]['images']} image(s), {records[-1]['prompt_tokens']} prompt tokens, "
            f"{records[-1]['latency_ms']:.0f} ms")
        if time.perf_counter() - start >= max_seconds:
            break
    return records


def summarize(records: list[dict], requested: int) -> dict:
    seconds = sum(r["latency_ms"] for r in records) / 1e3
    generate_seconds = sum(r["generate_ms"] for r in records) / 1e3
    return {"requested": requested, "completed": len(records), "stopped_by_time_budget": len(records) < requested,
            "duration_s": seconds,
            "request_throughput": len(records) / seconds,
            "generate_only_request_throughput": len(records) / generate_seconds,
            "output_throughput": sum(r["output_tokens"] for r in records) / seconds,
            "latency_ms_mean": statistics.mean(r["latency_ms"] for r in records),
            "inputs_ms_mean": statistics.mean(r["inputs_ms"] for r in records),
            "generate_ms_mean": statistics.mean(r["generate_ms"] for r in records),
            "prompt_tokens_mean": statistics.mean(r["prompt_tokens"] for r in records),
            "output_tokens_min": min(r["output_tokens"] for r in records)}


HEADER = ("| workload | system | requests | request throughput (req/s) | generate() only (req/s) | mean latency (ms) "
          "| output tok/s |\n|---|---|---|---|---|---|---|")


def row(workload: str, s: dict) -> str:
    requests_done = f"{s['completed']}" + (f" of {s['requested']} (time budget)" if s["stopped_by_time_budget"] else "")
    return (f"| {workload} | HF generate(), batch 1 | {requests_done} | {s['request_throughput']:.3f} "
            f"| {s['generate_only_request_throughput']:.3f} | {s['latency_ms_mean']:.0f} "
            f"| {s['output_throughput']:.1f} |")


def report(args, settings: BenchSettings, checkpoint: str, model, records: list[dict], requested: int) -> dict:
    """The run's JSON: summary, markdown row, per-request figures, request set, hardware, versions, command."""
    summary = summarize(records, requested)
    request_set = settings.model_dump(include=set(Workload.model_fields) | {"num_prompts", "seed", "warmup",
                                                                            "image_format"})
    parameter = next(model.parameters())
    config = {**request_set, "max_seconds": args.max_seconds, "tiny": args.tiny, "checkpoint": checkpoint,
              "device": str(parameter.device), "dtype": str(parameter.dtype).removeprefix("torch."),
              "attn_implementation": model.config._attn_implementation}
    return {"hardware": hardware(), "versions": versions(), "command": sys.argv, "workload": args.workload,
            "config": config, "summary": summary, "markdown": f"{HEADER}\n{row(args.workload, summary)}",
            "requests": records}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default=CASES[0].name, choices=[c.name for c in CASES])
    parser.add_argument("--num-prompts", type=int, default=4, help="requests measured (at most)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the epd_vs_aggregated.py point to match")
    parser.add_argument("--max-seconds", type=float, default=120.0,
                        help="no request starts after this many seconds of measuring")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test on the built-in tiny model")
    parser.add_argument("--out", default="", help="write the results to this JSON file")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    checkpoint = tokenizer_dir(args.tiny)
    settings, pool, warm, measured = requests(args.workload, args.tiny, args.num_prompts, args.seed, checkpoint)
    started = time.perf_counter()
    model = load_model(checkpoint, args.tiny, device, dtype)
    log(f"model on {device} ({dtype}) in {time.perf_counter() - started:.1f} s")
    build = InputBuilder(checkpoint, model, device)
    run_one(model, build, pool, warm, device)  # untimed warm-up
    records = run_all(model, build, pool, measured, device, args.max_seconds)
    result = report(args, settings, checkpoint, model, records, len(measured))
    log(f"\n{result['markdown']}")
    if result["summary"]["stopped_by_time_budget"]:
        log(f"stopped after {len(records)} of {len(measured)} requests: --max-seconds {args.max_seconds:g} reached")
    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
