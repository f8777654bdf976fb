"""Checkpoints built as someone outside the project builds them, and HF's view of a multi-image prompt.

The project's tiny checkpoint (``shared.model.tiny``) fixes one geometry: windows of 2×2 merged patches,
one full-attention block, at most 64 tokens an image. The outside checkpoints here come straight from
transformers' config classes (``from_config`` + ``save_pretrained``, so config.json is what transformers
writes) and vary what the tiny one cannot show: the real models' 4×4-merged-patch windows, images of many
windows with partial edge windows, several full-attention blocks, deeper towers, other head sizes, the
Qwen2-VL family. Only the tokenizer, chat template and image-processor writer are the project's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image

from shared.model.qwen3_checkpoint import CHAT_TEMPLATE as QWEN3_TEMPLATE
from shared.model.tiny import CHAT_TEMPLATE, SPECIAL_TOKENS, image_processor_config, write_tokenizer
from tests.support import data_url, hf_chat_inputs


@dataclass(frozen=True)
class OutsideSpec:
    family: str
    vision: dict
    text: dict = field(default_factory=dict)
    max_pixels: int = 28 * 28 * 512  # up to 512 tokens an image: a 640×480 image spans 4×3 windows and more


OUTSIDE = {
    # the real models' window (112 px: 4×4 merged patches), two full-attention blocks
    "qwen2_5_vl-w112": OutsideSpec("qwen2_5_vl", dict(
        depth=4, hidden_size=32, intermediate_size=60, num_heads=2, window_size=112, fullatt_block_indexes=[1, 3])),
    # deeper, ViT head_dim 20 and LM head_dim 24 (neither a power of two), no full-attention block first
    "qwen2_5_vl-deep": OutsideSpec("qwen2_5_vl", dict(
        depth=6, hidden_size=40, intermediate_size=100, num_heads=2, window_size=112, fullatt_block_indexes=[2, 5]),
        text=dict(hidden_size=96, num_attention_heads=4, num_key_value_heads=4,
                  rope_scaling={"type": "mrope", "mrope_section": [4, 4, 4]})),
    # the other family: every block attends over the whole image; ViT head_dim 16 over 3 heads
    "qwen2_vl": OutsideSpec("qwen2_vl", dict(depth=3, embed_dim=48, num_heads=3, mlp_ratio=2)),
}
# Qwen3-VL dense: learned position table of 6×6, deepstack after the first and the last block
OUTSIDE_QWEN3 = OutsideSpec("qwen3_vl", dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2,
                                             num_position_embeddings=36, deepstack_visual_indexes=[0, 2]),
                            max_pixels=32 * 32 * 512)


def write_outside_checkpoint(path: Path, spec: OutsideSpec, seed: int = 0) -> Path:
    from transformers import (AutoModelForImageTextToText, AutoTokenizer, Qwen2_5_VLConfig, Qwen2VLConfig,
                              Qwen3VLConfig)

    qwen3 = spec.family == "qwen3_vl"
    path.mkdir(parents=True, exist_ok=True)
    write_tokenizer(path, vocab_size=600, chat_template=QWEN3_TEMPLATE if qwen3 else CHAT_TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2,
                rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, bos_token_id=ids["<|endoftext|>"],
                eos_token_id=ids["<|im_end|>"], initializer_range=0.2)
    if qwen3:  # head_dim 32 (× 4 heads ≠ hidden), Qwen3's interleaved M-RoPE
        del text["rope_scaling"]
        text.update(head_dim=32, max_position_embeddings=4096,
                    rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [6, 5, 5],
                                     "mrope_interleaved": True})
    text.update(spec.text)
    vision = dict(patch_size=16 if qwen3 else 14, spatial_merge_size=2, temporal_patch_size=2,
                  initializer_range=0.2, **spec.vision)
    if spec.family == "qwen2_5_vl" or qwen3:
        config_class = Qwen3VLConfig if qwen3 else Qwen2_5_VLConfig
        vision.setdefault("out_hidden_size", text["hidden_size"])
    else:
        config_class = Qwen2VLConfig
        vision.setdefault("hidden_size", text["hidden_size"])
    config = config_class(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                          video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                          vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.save_pretrained(path)
    processor = image_processor_config(spec.family, spec.max_pixels)
    (path / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    return path


Part = str | Image.Image  # a chat message's content, in order: text and images


LAYOUTS = ("images-first", "images-last", "interleaved")


def message_parts(images: list[Image.Image], layout: str) -> list[Part]:
    """One user turn's content with the images placed as ``layout`` says (one of ``LAYOUTS``)."""
    if layout == "images-first":
        return [*images, "Describe the images."]
    if layout == "images-last":
        return ["Compare these:", *images]
    parts: list = []
    for i, image in enumerate(images):
        parts += [f"Image {i + 1}:", image]
    return parts + ["Which one is brightest?"]


def openai_content(parts: list[Part]) -> list[dict]:
    """The same content as the OpenAI API takes it (images as PNG data URLs)."""
    return [{"type": "text", "text": p} if isinstance(p, str) else
            {"type": "image_url", "image_url": {"url": data_url(p)}} for p in parts]


def hf_inputs(reference, parts: list[Part]) -> dict:
    """HF's model inputs for one user turn of ``parts`` (text and images interleaved as given).
    ``reference`` is a ``tests.support.Reference``."""
    images = [p for p in parts if isinstance(p, Image.Image)]
    content = [{"type": "image"} if isinstance(p, Image.Image) else {"type": "text", "text": p} for p in parts]
    return hf_chat_inputs(reference, [{"role": "user", "content": content}], images)


def image_starts(ids: list[int], image_token_id: int) -> list[int]:
    """Where each run of image placeholder tokens begins."""
    return [i for i, t in enumerate(ids) if t == image_token_id and (i == 0 or ids[i - 1] != image_token_id)]
