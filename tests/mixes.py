"""What the property tests draw: vision configurations of every supported family, written as checkpoints the
way someone outside the project writes them, and mixes of images (and video clips) of any size.

``PROPERTY_EXAMPLES=N`` (environment) runs every property with N freshly random examples instead of CI's few
fixed ones.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from shared.model.tiny import image_processor_config

EXAMPLES = int(os.environ.get("PROPERTY_EXAMPLES", "0"))


def budget(ci: int, shrink: bool = True) -> settings:
    """``ci`` fixed examples (the same on every run: derandomized), or ``PROPERTY_EXAMPLES`` random ones."""
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else [])
    return settings(max_examples=EXAMPLES or ci, derandomize=not EXAMPLES, deadline=None, database=None,
                    phases=phases, suppress_health_check=list(HealthCheck))


# -- vision configurations --------------------------------------------------------------------------------
@dataclass(frozen=True)
class VisionSpec:
    family: str  # qwen2_vl | qwen2_5_vl | qwen3_vl
    vision: dict  # the HF vision_config's fields
    min_tokens: int  # the image processor's pixel bounds, in merged patches
    max_tokens: int

    @property
    def factor(self) -> int:
        return self.vision["patch_size"] * self.vision["spatial_merge_size"]


@st.composite
def vision_specs(draw, families=("qwen2_vl", "qwen2_5_vl", "qwen3_vl")) -> VisionSpec:
    family = draw(st.sampled_from(families))
    depth = draw(st.integers(1, 4))
    heads = draw(st.integers(1, 3))
    width = heads * draw(st.sampled_from([4, 8, 12, 16]))  # head_dim a multiple of 4: the 2-D rotary halves it
    patch, merge = draw(st.sampled_from([2, 3, 14, 16])), draw(st.sampled_from([1, 2, 2, 3]))
    vision = dict(depth=depth, num_heads=heads, patch_size=patch, spatial_merge_size=merge,
                  temporal_patch_size=draw(st.integers(1, 3)), initializer_range=0.2)
    blocks = st.lists(st.integers(0, depth - 1), unique=True).map(sorted)
    if family == "qwen2_vl":
        vision.update(embed_dim=width, mlp_ratio=draw(st.integers(1, 3)))
    elif family == "qwen2_5_vl":
        # windows of 1-4 merged patches a side, also sizes that are no multiple of one (HF floors them)
        window = merge * patch * draw(st.integers(1, 4)) + draw(st.sampled_from([0, 0, 1, patch]))
        vision.update(hidden_size=width, intermediate_size=draw(st.sampled_from([20, 36, 60])), window_size=window,
                      fullatt_block_indexes=draw(blocks))
    else:
        vision.update(hidden_size=width, intermediate_size=draw(st.sampled_from([20, 36])),
                      num_position_embeddings=draw(st.sampled_from([4, 9, 16, 36, 64])),
                      deepstack_visual_indexes=draw(blocks))
    low = draw(st.integers(1, 4))
    return VisionSpec(family, vision, low, draw(st.integers(low + 4, 64)))


TEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, bos_token_id=0, eos_token_id=1)


def write_vision_checkpoint(path: Path, spec: VisionSpec, seed: int = 0):
    """A checkpoint of ``spec``'s tower (with a one-layer language model) from transformers' config classes and
    ``save_pretrained``, and its image processor's settings; returns HF's model."""
    from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig

    text, vision = dict(TEXT), dict(spec.vision)
    if spec.family == "qwen3_vl":
        text.update(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                                  "mrope_section": [4, 2, 2], "mrope_interleaved": True})
        config = Qwen3VLConfig(text_config=text, vision_config={**vision, "out_hidden_size": 32})
    else:
        text["rope_scaling"] = {"type": "mrope", "mrope_section": [2, 3, 3]}
        if spec.family == "qwen2_5_vl":
            config = Qwen2_5_VLConfig(text_config=text, vision_config={**vision, "out_hidden_size": 32})
        else:
            config = Qwen2VLConfig(text_config=text, vision_config={**vision, "hidden_size": 32})
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    area = spec.factor ** 2
    processor = image_processor_config(spec.family, area * spec.max_tokens)
    processor.update(patch_size=vision["patch_size"], merge_size=vision["spatial_merge_size"],
                     temporal_patch_size=vision["temporal_patch_size"])
    if "size" in processor:
        processor["size"] = {"shortest_edge": area * spec.min_tokens, "longest_edge": area * spec.max_tokens}
    else:
        processor["min_pixels"] = area * spec.min_tokens
    (path / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    return model


def hf_visual(model, family: str, patches: torch.Tensor, grids: list) -> torch.Tensor:
    """HF's vision tower: one row per merged patch (Qwen3-VL: the deepstack levels beside it, as ours ships it)."""
    with torch.no_grad():
        out = model.model.visual(patches, grid_thw=torch.tensor(grids))
    if family == "qwen3_vl":
        return torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)
    return out.pooler_output


# -- images -----------------------------------------------------------------------------------------------
@st.composite
def image_sizes(draw) -> tuple[int, int]:
    """(height, width): tiny (upscaled past the minimum), any, or elongated up to 1:150 (the processors' limit is
    1:200); sides are whatever they are, no multiples of the patch or the merge asked for."""
    kind = draw(st.sampled_from(["tiny", "any", "any", "elongated"]))
    if kind == "tiny":
        h, w = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    elif kind == "any":
        h, w = draw(st.integers(8, 400)), draw(st.integers(8, 400))
    else:
        h = draw(st.integers(1, 20))
        w = draw(st.integers(h * 10, min(h * 150, 1500)))
    return (w, h) if draw(st.booleans()) else (h, w)


@dataclass(frozen=True)
class Item:
    """One image of a request (pixels of ``size``), or a video clip (``frames`` temporal patches of a grid)."""

    seed: int
    size: tuple[int, int] = (0, 0)
    frames: int = 0  # > 0: a clip
    clip_grid: tuple[int, int] = (0, 0)  # a clip's merged rows and columns

    def pixels(self) -> np.ndarray:
        return np.random.default_rng(self.seed).integers(0, 256, (*self.size, 3), dtype=np.uint8)


@st.composite
def items(draw, videos: bool = True) -> Item:
    seed = draw(st.integers(0, 2**31))
    if videos and draw(st.integers(0, 4)) == 0:
        return Item(seed, frames=draw(st.integers(2, 3)), clip_grid=(draw(st.integers(1, 5)), draw(st.integers(1, 5))))
    return Item(seed, size=draw(image_sizes()))


def requests(max_requests: int = 1, videos: bool = True):
    """Requests of 1-6 items each."""
    return st.lists(st.lists(items(videos), min_size=1, max_size=6), min_size=1, max_size=max_requests)


@dataclass
class Patches:
    """A request's items as the tower takes them: patches ``[N, patch_dim]`` and one grid per item."""

    rows: torch.Tensor
    grids: list = field(default_factory=list)

    def split(self) -> list[torch.Tensor]:
        return list(self.rows.split([t * h * w for t, h, w in self.grids]))


def patches_of(request: list[Item], processor, merge: int, patch_dim: int) -> Patches:
    """Images through HF's image processor (its PIL backend, as our encoders' ``--preprocess pil``); a clip's
    patches drawn at random (their preprocessing is checked against HF's own in tests/test_video_geometry.py)."""
    rows, grids = [], []
    for item in request:
        if item.frames:
            h, w = (merge * n for n in item.clip_grid)
            rows.append(torch.randn(item.frames * h * w, patch_dim, generator=torch.Generator().manual_seed(item.seed)))
            grids.append((item.frames, h, w))
            continue
        out = processor(images=[item.pixels()], return_tensors="pt", input_data_format="channels_last")
        rows.append(out["pixel_values"])
        grids.append(tuple(int(x) for x in out["image_grid_thw"][0]))
    return Patches(torch.cat(rows), grids)
