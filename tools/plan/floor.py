"""The floor of a request shape: its own compute, each part timed alone, in-process, on this machine.

For every request shape of the given workloads (a resolution, a text length, an image count): the
frontend's decoder over its images (in a pool of the frontend's size, as the frontend decodes them), one
ViT forward over its images (preprocessing included as the encoders do it), and the prefill of its
prompt to its first token with our engine. Its floor is the three one after another — what a request
alone costs before any queue, hop or fixed cost of a stack. One model load serves every shape; the same
measurements are written as ``epd plan`` costs per resolution (plus the decode steps and how a ViT
forward and the language model slow each other side by side), so the planner predicts from the very
numbers the floor is made of.

A video workload's request is one clip (``--video-*``, no images): the frontend's PyAV decode of the
clip as ``epd bench`` sends it (seeded H.264, decoded up to its last sampled frame), the ViT over its
sampled frames (the encoders' video processor, grid (t, h, w)), the prefill of its prompt with the clip's
video placeholders. ``epd plan`` models images, not clips: these rows have no costs entry.

    python -m tools.plan.floor --shapes '[{"image_resolution": "448x448", "image_count": 10}]' \\
        --model qwen2.5-vl-7b --load-format dummy --out floor.json

The shapes are ``Workload`` and ``VideoWorkload`` fields (``epd bench``'s); output: ``{"costs": {resolution:
Costs}, "shapes": [{resolution, input_len, images, prompt_tokens, media_ms, vit_ms, prefill_ms, floor_ms}],
"seconds": measuring time}``; a clip's row has ``videos``, ``video_seconds``, ``video_fps``, ``frames``,
``grid`` and ``video_tokens`` in place of ``images`` (``resolution``: the clip's).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from services.encoder.settings import Preprocessing
from services.frontend.settings import MEDIA_THREADS
from shared.engine.settings import EngineSettings
from shared.settings import parse_settings
from tools.bench.settings import VideoWorkload, Workload, parse_resolution
from tools.plan.cost_table import PER_IMAGE_TOKENS, TEMPLATE_TOKENS, Costs
from tools.plan.timeslice import measure_timeslice, ready_or_none, vit_child

if TYPE_CHECKING:
    from tools.plan.costs import EngineProbe, VisionProbe


class FloorSettings(Preprocessing, EngineSettings):
    shapes: str = Field(description="JSON list of workloads (epd bench's Workload fields) whose request shapes "
                                    "to measure")
    out: str = Field(description="the JSON file to write")
    max_num_seqs: int = Field(64, ge=1, description="the measuring engine's batch limit")
    kv_cache_mb: int = Field(8192, ge=0, description="KV pool of the measuring engine (MiB)")
    decode_batch: int = Field(32, ge=2, description="the larger batch decode steps are timed at")
    image_format: Literal["png", "jpeg"] = Field("jpeg", description="how clients send images")
    corun_seconds: float = Field(1.0, ge=0, description="seconds of each co-run measurement (0: skip them)")


class ShapeWorkload(Workload, VideoWorkload):
    """One workload of ``--shapes``: its images, or its clips."""


ClipShape = tuple[str, float, float, int]  # (resolution, seconds, fps, input_len) of a one-clip request


def request_shapes(workloads: list[ShapeWorkload]) -> dict[tuple[str, int], list[int]]:
    """{(resolution, input_len): image counts} over every image or text request the workloads send (0:
    text only, always measured: prefill is interpolated from it upwards)."""
    shapes: dict[tuple[str, int], set[int]] = {}
    for w in workloads:
        if w.video_count:
            continue
        counts = shapes.setdefault((w.image_resolution, w.input_len), {0})
        counts.update(n for n in w.image_counts() if n > 0)
    return {key: sorted(counts) for key, counts in shapes.items()}


def clip_shapes(workloads: list[ShapeWorkload]) -> list[ClipShape]:
    """Every clip request the workloads send: one clip a request, no images, no text-only share (the
    floor of a request mixing clips with images or of a mixed load is not measured: none of ours sends
    one)."""
    out: list[ClipShape] = []
    for w in workloads:
        if not w.video_count:
            continue
        if w.video_count != 1 or w.image_count or w.text_ratio:
            raise ValueError("a video workload's floor is measured for requests of one clip and no images "
                             "(video_count 1, image_count 0, text_ratio 0)")
        shape = (w.video_resolution, w.video_seconds, w.video_fps, w.input_len)
        if shape not in out:
            out.append(shape)
    return out


def measure_floor(settings: FloorSettings, workloads: list[ShapeWorkload]) -> dict:
    from shared.model.config import ModelConfig
    from tools.plan.costs import EngineProbe  # torch, the model: only to measure (shape_label's readers need neither)
    from shared.model.processor import preprocess_mode

    started = time.monotonic()
    path = settings.model_path()
    config = ModelConfig.from_checkpoint(path)
    mode = preprocess_mode(settings.preprocess, settings.torch_device())
    shapes = request_shapes(workloads)
    vision, seen = _vision(settings, path, config, mode, shapes)
    middle = _middle_image_shape(shapes)
    # a process of its own for the time-slicing measurement, started while this one loads the LM
    resolution, _, images = middle or ("", 0, 0)
    with vit_child(settings, resolution, images) as child:
        engine = EngineProbe(settings)
        result = _measure(settings, path, config, mode, shapes, middle, seen, vision, engine, ready_or_none(child))
        result["shapes"] += [_clip_row(vision, engine, clip) for clip in clip_shapes(workloads)]
    result["seconds"] = time.monotonic() - started
    return result


def _vision(settings, path, config, mode, shapes) -> tuple[VisionProbe, dict]:
    """The tower, and per resolution (tokens per image, preprocess ms, {images: ViT ms}, grid)."""
    from services.encoder.vision import GRAPH_PATCHES, LAYOUT_GRAPHS
    from tools.plan.costs import VisionProbe

    vision = VisionProbe(settings, config, path, mode, 0 if settings.enforce_eager else GRAPH_PATCHES, LAYOUT_GRAPHS)
    seen: dict[str, tuple] = {}
    for (resolution, _), counts in shapes.items():
        width, height = parse_resolution(resolution)
        images = sorted({1, *(n for n in counts if n > 0)} | set(seen.get(resolution, (0, 0, {}))[2]))
        tokens, pre_ms, vit_ms = vision.measure(width, height, images)
        seen[resolution] = (tokens, pre_ms, vit_ms, vision.unit(width, height, 1)[1])
    return vision, seen


def _middle_image_shape(shapes: dict[tuple[str, int], list[int]]) -> tuple[str, int, int] | None:
    """(resolution, input_len, images) of the median image request by pixels: the co-run measurements' shape."""
    image_shapes = sorted(((math.prod(parse_resolution(res)) * n, res, input_len, n)
                           for (res, input_len), counts in shapes.items() for n in counts if n))
    return image_shapes[len(image_shapes) // 2][1:] if image_shapes else None


def _measure(settings, path, config, mode, shapes, middle, seen, vision, engine, child) -> dict:
    from tools.plan.costs import measure_media, moe_fields

    prefill: dict[int, float] = {}  # prompt tokens → ms (a text prompt is the same at every resolution)
    rows = []
    for (resolution, input_len), counts in shapes.items():
        width, height = parse_resolution(resolution)
        tokens, pre_ms, vit_ms, grid = seen[resolution]
        for n in counts:
            prompt = input_len + TEMPLATE_TOKENS + n * (tokens + PER_IMAGE_TOKENS)
            if prompt not in prefill:
                prefill[prompt] = engine.prefill_ms(input_len, n, tokens, grid)
            media = measure_media(width, height, settings.image_format, n, MEDIA_THREADS) if n else 0.0
            vit = vit_ms[n] + math.ceil(n / settings.preprocess_threads) * pre_ms if n else 0.0
            rows.append({"resolution": resolution, "input_len": input_len, "images": n, "prompt_tokens": prompt,
                         "media_ms": media, "vit_ms": vit, "prefill_ms": prefill[prompt],
                         "floor_ms": media + vit + prefill[prompt]})
    decode = engine.decode_steps(settings.decode_batch)
    corun = _corun(settings, middle, seen, vision, engine, child) if settings.corun_seconds > 0 and middle else {}
    costs = {}
    for resolution, (tokens, pre_ms, vit_ms, _) in seen.items():
        width, height = parse_resolution(resolution)
        mine = [r for r in rows if r["resolution"] == resolution]
        costs[resolution] = Costs(
            model=path.name, device=str(settings.torch_device()), dtype=str(settings.torch_dtype()),
            resolution=resolution, image_tokens=tokens, preprocess_ms=pre_ms,
            preprocess_threads=settings.preprocess_threads, vit_ms=vit_ms,
            prefill_ms={r["prompt_tokens"]: r["prefill_ms"] for r in mine}, decode_ms=decode, preprocess=mode,
            media_ms=measure_media(width, height, settings.image_format), media_threads=MEDIA_THREADS,
            corun=corun, media_batch_ms={r["images"]: r["media_ms"] for r in mine}, **moe_fields(config)).to_json()
    return {"model": path.name, "device": str(settings.torch_device()), "costs": costs, "shapes": rows,
            "hidden_bytes": config.text.hidden_size * settings.torch_dtype().itemsize}


def _clip_row(vision: VisionProbe, engine: EngineProbe, clip: ClipShape) -> dict:
    """One clip request's floor: the frontend decoding the clip, the ViT over its sampled frames
    (preprocessing as the encoders do it), the prefill of its prompt."""
    from tools.bench.video import make_clip
    from tools.plan.costs import measure_clip_media

    resolution, seconds, fps, input_len = clip
    geometry = vision.video.geometry
    media, decoded = measure_clip_media(make_clip(0, seconds, fps, *parse_resolution(resolution)), geometry)
    tokens, pre_ms, forward_ms, grid = vision.measure_clip(decoded.pixels)
    s = decoded.sampling
    ids, slots = engine.clip_inputs(input_len, grid, geometry, geometry.timing(s.frame_indices, s.total_frames,
                                                                               s.source_fps))
    prefill = engine.timer.ms(engine.prefill(ids, slots), repeat=2)
    vit = forward_ms + pre_ms  # one clip, one preprocessing thread
    return {"resolution": resolution, "input_len": input_len, "videos": 1, "video_seconds": seconds,
            "video_fps": fps, "frames": decoded.num_frames, "grid": list(grid), "video_tokens": tokens,
            "prompt_tokens": len(ids), "media_ms": media, "vit_ms": vit, "prefill_ms": prefill,
            "floor_ms": media + vit + prefill}


def shape_label(row: dict) -> str:
    """A floor row's request shape, e.g. ``3 x 448x448, 128 in`` or ``20 s 720p clip (40 frames), 128 in``."""
    if "video_seconds" in row:
        return f"{row['video_seconds']:g} s {row['resolution']} clip ({row['frames']} frames), {row['input_len']} in"
    return f"{row['images']} x {row['resolution']}, {row['input_len']} in"


def _corun(settings, middle, seen, vision, engine, child) -> dict[str, float]:
    """Co-run factors on the median image request's ViT forward and prefill (optional: a failure leaves
    the planner its documented assumptions, never the floor unmeasured)."""
    from tools.plan.costs import measure_corun

    resolution, input_len, n = middle
    tokens, _, _, grid = seen[resolution]
    prompt = engine.prompt(input_len, n, tokens, grid)
    corun: dict[str, float] = {}
    try:
        corun.update(measure_corun(vision, engine, parse_resolution(resolution), n, prompt, settings.decode_batch,
                                   settings.corun_seconds))
        if child is not None:
            corun.update(measure_timeslice(child, engine, settings.decode_batch, prompt, settings.corun_seconds))
    except Exception as err:  # noqa: BLE001 - reported, and the floor still written
        print(f"tools.plan.floor: co-run measurement failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
    return corun


def main(argv: list[str]) -> int:
    settings = parse_settings(FloorSettings, argv, "python -m tools.plan.floor")
    workloads = [ShapeWorkload(**w) for w in json.loads(settings.shapes)]
    try:
        clip_shapes(workloads)
    except ValueError as err:  # before loading anything
        raise SystemExit(f"python -m tools.plan.floor: {err}") from None
    result = measure_floor(settings, workloads)
    Path(settings.out).write_text(json.dumps(result, indent=1))
    for row in result["shapes"]:
        print(f"floor {shape_label(row)} ({row['prompt_tokens']} tokens): media {row['media_ms']:.1f} + ViT "
              f"{row['vit_ms']:.1f} + prefill {row['prefill_ms']:.1f} = {row['floor_ms']:.1f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
