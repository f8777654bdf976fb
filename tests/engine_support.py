"""What the engine tests share: the tiny model's parts, prompts with their HF continuation, engines
built around one KV pool, and conversations (several turns, images) rendered as the frontend does."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from PIL import Image

from shared.engine.engine import Engine
from shared.engine.kv_cache import KVCache
from shared.engine.runner import ModelRunner
from shared.messages.sampling import SamplingParams
from shared.engine.sequence import ImageInput, Sequence
from shared.engine.settings import DEFAULT_TARGET_ITL_MS
from shared.model.config import ModelConfig
from shared.model.loader import load_language_model, load_vision_tower
from tests.support import hf_chat_inputs, make_image

PROMPTS = [
    ("Hello! How are you today?", []),
    ("Describe the image in one sentence.", [(1, 100, 150)]),
    ("What colour is the square?", [(2, 60, 200), (3, 90, 90)]),
    ("The quick brown fox jumps over the lazy dog.", []),
    ("A photo of a cat sitting on a red chair next to a window.", [(4, 56, 56)]),
    ("Numbers: 0 1 2 3", [(5, 140, 70), (6, 80, 80), (7, 30, 300)]),
    ("Encoder, prefill and decode run as separate services.", []),
    ("Café, naïve, über", [(8, 120, 90)]),
]


@pytest.fixture(scope="module")
def model_parts(tiny_model):
    config = ModelConfig.from_checkpoint(tiny_model)
    return config, load_language_model(tiny_model, config), load_vision_tower(tiny_model, config)


@pytest.fixture(scope="module")
def requests_with_reference(reference, model_parts):
    """Each prompt as (token ids, image inputs, max_tokens, HF's greedy continuation)."""
    built = []
    for i, (text, specs) in enumerate(PROMPTS):
        images = [make_image(*spec) for spec in specs]
        max_tokens = 6 + 3 * i
        messages = [{"role": "user", "content": [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]}]
        ids, image_inputs = engine_prompt(reference, model_parts, messages, images)
        built.append((ids, image_inputs, max_tokens, reference.generate(text, images, max_tokens)))
    return built


def make_engine(model_parts, num_blocks=256, block_size=16, max_num_seqs=256, role="both", backend=None,
                target_itl_s=DEFAULT_TARGET_ITL_MS / 1e3, **options) -> Engine:
    """An engine on the tiny model; ``options``: max_batched_tokens, chunked_prefill, prefix_caching. Its time
    budget is the default one, as served (its model learns from the steps; ``calibration.calibrate`` fits
    it first, as a worker does at start)."""
    config, lm, _ = model_parts
    cache = KVCache(config.text, num_blocks, block_size, torch.float32, "cpu")
    runner = ModelRunner(lm, cache, config.vision.merge_size, backend=backend(cache) if backend else None)
    return Engine(runner, config.eos_token_ids, max_model_len=(num_blocks - 1) * block_size, role=role,
                  max_num_seqs=max_num_seqs, target_itl_s=target_itl_s, **options)


def sequence(rid, request) -> Sequence:
    ids, images, max_tokens, _ = request
    return Sequence(f"r{rid}", list(ids), len(ids), SamplingParams(temperature=0, max_tokens=max_tokens),
                    images=images)


def run_to_completion(engine: Engine, joiners: dict[int, list[Sequence]] | None = None, plans=None) -> int:
    """Step until idle, adding ``joiners[k]`` before step ``k``; each step's plan goes to ``plans``."""
    steps = 0
    while engine.has_work() or (joiners and any(k >= steps for k in joiners)):
        for seq in (joiners or {}).pop(steps, []):
            engine.add_prompt(seq)
        if plans is not None:
            record_plans(engine, plans)
        engine.step()
        steps += 1
    return steps


def record_plans(engine: Engine, plans: list) -> None:
    """Make the engine's next step append its plan as [(request id, start, end, decoding)] to ``plans``."""
    schedule = engine.scheduler.schedule

    def recorded(*args):
        plan = schedule(*args)
        plans.append([(c.seq.request_id, c.start, c.end, c.seq.decoding) for c in plan.chunks])
        engine.scheduler.schedule = schedule
        return plan

    engine.scheduler.schedule = recorded


# -- conversations, rendered as the frontend does ---------------------------------------------------
def content_hash(image: Image.Image) -> str:
    pixels = np.asarray(image)
    return hashlib.blake2b(pixels.tobytes() + repr(pixels.shape).encode(), digest_size=20).hexdigest()


def hf_generate(reference, messages: list[dict], images: list[Image.Image], max_new_tokens: int) -> list[int]:
    inputs = hf_chat_inputs(reference, messages, images)
    with torch.no_grad():
        out = reference.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def engine_prompt(reference, model_parts, messages: list[dict], images: list[Image.Image]):
    """(token ids, ImageInputs with embeddings and content hashes) of a conversation."""
    config, _, tower = model_parts
    inputs = hf_chat_inputs(reference, messages, images)
    ids = inputs["input_ids"][0].tolist()
    if not images:
        return ids, []
    grids = [tuple(int(x) for x in g) for g in inputs["image_grid_thw"]]
    with torch.no_grad():
        embeds = tower(inputs["pixel_values"], grids).split([t * h * w // 4 for t, h, w in grids])
    starts = [j for j, t in enumerate(ids) if t == config.image_token_id and (j == 0 or ids[j - 1] != t)]
    return ids, [ImageInput(o, g, e, content_hash(i)) for o, g, e, i in zip(starts, grids, embeds, images)]


def user(text: str, images: int = 0) -> dict:
    return {"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": text}]}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}
