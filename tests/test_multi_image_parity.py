"""Multi-image requests against HF transformers, on checkpoints built outside the project (tests/outside.py).

A matrix of image counts × sizes × placements in the text × checkpoints, compared at the level where a
divergence starts, so a failure names its stage:

1. the vision tower on the same pixel values (every image alone, all batched, the GPU's grouped attention);
2. the M-RoPE positions against ``get_rope_index``;
3. the engine's greedy tokens against ``generate()``, and its logits (teacher-forced on HF's tokens) against
   HF's; the encoder's device preprocessing (``TorchImagePreprocessor``) gives HF's patches.

Then the image geometry and device patches against HF's processor, the resize pass order against the
installed Pillow, video-shaped grids, config defaults, and two requests through the whole stack.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from PIL import Image

from shared.engine.block_manager import BlockManager
from shared.engine.engine import Engine
from shared.engine.kv_cache import KVCache
from shared.engine.runner import ModelRunner
from shared.messages.sampling import SamplingParams
from shared.engine.scheduler import Chunk
from shared.engine.sequence import ImageInput, Sequence
from shared.model.config import ModelConfig
from shared.model.geometry import ImageGeometry, grid_tokens
from shared.model.loader import load_language_model, load_vision_tower
from shared.model.processor import TorchImagePreprocessor
from shared.model.rope import mrope_positions
from tests.outside import (OUTSIDE, hf_inputs, image_starts, message_parts, openai_content,
                           write_outside_checkpoint)
from tests.support import Reference, RunningStack, make_image

MAX_TOKENS = 8

# (seed, height, width) per image, and where the images sit in the user's turn. Sizes are picked so that
# grids are not multiples of the 4×4-merged-patch window (partial edge windows), aspect ratios reach 1:40,
# tiny images are upscaled past min_pixels, and several images shrink in height while growing in width
# (200×300 → 196×308: the resize whose pass order Pillow 13 flips).
IMAGE_SETS = {
    "1-many-windows": ([(7, 700, 500)], "images-first"),
    "2-pair": ([(8, 120, 360), (9, 256, 256)], "images-last"),
    "3-project-sizes": ([(21, 60, 200), (22, 90, 90), (23, 140, 70)], "images-first"),
    "3-partial-windows": ([(1, 200, 300), (2, 470, 130), (3, 300, 420)], "interleaved"),
    "4-aspect-extremes": ([(4, 30, 900), (5, 900, 30), (6, 224, 224), (10, 50, 1200)], "interleaved"),
    # with the device preprocessing's old pass order, the first token already differed from HF's here
    "3-first-token": ([(918677, 144, 133), (986684, 140, 236), (313302, 51, 224)], "interleaved"),
    "5-tiny-and-large": ([(11, 1, 1), (12, 3, 40), (13, 40, 3), (14, 2, 2), (15, 500, 380)], "images-first"),
    "5-mixed": ([(16, 600, 100), (17, 37, 500), (18, 150, 610), (19, 56, 56), (20, 333, 250)], "images-last"),
}


@dataclass
class Case:
    """One request, and what HF makes of it (computed once, shared by the tests of the case)."""

    images: list[Image.Image]
    inputs: dict  # HF's model inputs
    grids: list
    starts: list[int]  # where each image's placeholder run begins
    expected: list[int]  # HF's greedy tokens
    hf_logits: torch.Tensor  # [len(expected), vocab]: the logits each of HF's tokens was picked from


class Outside:
    """One outside checkpoint: HF's model, and our vision tower and language model loaded from it."""

    def __init__(self, name: str, path):
        self.name, self.path = name, path
        self.reference = Reference(path)
        self.config = ModelConfig.from_checkpoint(path)
        self.tower = load_vision_tower(path, self.config)
        self.lm = load_language_model(path, self.config)
        self.merge = self.config.vision.merge_size
        self.cases: dict[str, Case] = {}

    def case(self, name: str) -> Case:
        if name not in self.cases:
            self.cases[name] = self._hf_case(*IMAGE_SETS[name])
        return self.cases[name]

    def _hf_case(self, specs, layout: str) -> Case:
        images = [make_image(*spec) for spec in specs]
        inputs = hf_inputs(self.reference, message_parts(images, layout))
        ids = inputs["input_ids"][0].tolist()
        with torch.no_grad():
            out = self.reference.model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False,
                                                output_logits=True, return_dict_in_generate=True)
        grids = [tuple(int(x) for x in g) for g in inputs["image_grid_thw"]]
        return Case(images, inputs, grids, image_starts(ids, self.config.image_token_id),
                    out.sequences[0, len(ids):].tolist(), torch.cat(out.logits).float())

    def embeddings(self, patches: torch.Tensor, grids: list) -> list[torch.Tensor]:
        with torch.no_grad():
            return list(self.tower(patches, grids).split([grid_tokens(g, self.merge) for g in grids]))

    def image_inputs(self, case: Case, embeds: list[torch.Tensor]) -> list[ImageInput]:
        return [ImageInput(o, g, e) for o, g, e in zip(case.starts, case.grids, embeds)]

    def generate(self, case: Case, embeds: list[torch.Tensor]) -> list[int]:
        cache = KVCache(self.config.text, 256, 16, torch.float32, "cpu")
        engine = Engine(ModelRunner(self.lm, cache, self.merge), self.config.eos_token_ids, max_model_len=255 * 16)
        ids = case.inputs["input_ids"][0].tolist()
        seq = Sequence("r", list(ids), len(ids), SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                       images=self.image_inputs(case, embeds))
        engine.add_prompt(seq)
        while engine.has_work():
            engine.step()
        return seq.output_ids

    def logits(self, case: Case, embeds: list[torch.Tensor]) -> torch.Tensor:
        """Our language model's logits over HF's prompt + HF's greedy tokens (one prefill, every row)."""
        ids = case.inputs["input_ids"][0].tolist() + case.expected[:-1]
        cache = KVCache(self.config.text, len(ids) // 16 + 2, 16, torch.float32, "cpu")
        runner = ModelRunner(self.lm, cache, self.merge)
        seq = Sequence("r", ids, len(ids), SamplingParams(temperature=0), images=self.image_inputs(case, embeds))
        BlockManager(cache.num_blocks, 16).allocate(seq, len(ids))
        with torch.inference_mode():
            inputs, positions, batch, levels = runner.prepare_prefill([Chunk(seq, 0, len(ids))])
            extra = {} if levels is None else {"deepstack": levels}
            return self.lm.logits(self.lm(inputs, positions, batch, runner.backend, **extra))


@pytest.fixture(scope="module", params=list(OUTSIDE))
def outside(request, tmp_path_factory) -> Outside:
    name = request.param
    return Outside(name, write_outside_checkpoint(tmp_path_factory.mktemp(name), OUTSIDE[name]))


def answer_rows(case: Case) -> slice:
    """Our rows that pick the answer's tokens (teacher-forced on HF's): from the prompt's last token on."""
    prompt = case.inputs["input_ids"].shape[1]
    return slice(prompt - 1, prompt - 1 + len(case.expected))


# -- 1. vision tower ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", IMAGE_SETS)
def test_vision_tower_matches_hf(outside, name):
    case = outside.case(name)
    pixels, thw = case.inputs["pixel_values"], case.inputs["image_grid_thw"]
    with torch.no_grad():
        expected = outside.reference.model.model.visual(pixels, grid_thw=thw).pooler_output
        batched = outside.tower(pixels, case.grids)
        grouped = outside.tower(pixels, case.grids, grouped=True)  # the GPU path's attention plan
        alone = torch.cat([outside.tower(p, [g]) for p, g in
                           zip(pixels.split([t * h * w for t, h, w in case.grids]), case.grids)])
    for got, how in ((batched, "batched"), (grouped, "grouped"), (alone, "one image at a time")):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4, msg=lambda m: f"{how}: {m}")


# -- 2. positions ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", IMAGE_SETS)
def test_rope_positions_match_hf(outside, name):
    case = outside.case(name)
    inputs = case.inputs
    expected, delta = outside.reference.model.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"],
        attention_mask=inputs["attention_mask"])
    positions, ours_delta = mrope_positions(inputs["input_ids"].shape[1], list(zip(case.starts, case.grids)),
                                            outside.merge)
    assert torch.equal(positions, expected[:, 0])
    assert ours_delta == int(delta)


# -- 3. greedy output and logits ------------------------------------------------------------------------
@pytest.mark.parametrize("name", IMAGE_SETS)
def test_engine_greedy_output_and_logits_match_hf(outside, name):
    case = outside.case(name)
    embeds = outside.embeddings(case.inputs["pixel_values"], case.grids)
    assert outside.generate(case, embeds) == case.expected
    torch.testing.assert_close(outside.logits(case, embeds)[answer_rows(case)], case.hf_logits, rtol=0, atol=1e-3)


@pytest.mark.parametrize("name", IMAGE_SETS)
def test_device_preprocessing_gives_hfs_patches(outside, name):
    """What a GPU encoder runs (``--preprocess torch``, the default there): patches made by tensor
    operations from the 8-bit pixels are HF's, bit for bit. (A float resize rounded after each pass left
    pixels up to two 8-bit steps off, which moved the logits by up to 0.011 here, 0.026 in the deeper tower;
    a resize pass in the other order than Pillow's moved them by 0.07-0.53.)"""
    case = outside.case(name)
    device = TorchImagePreprocessor(outside.path)
    patches = torch.cat([device(torch.from_numpy(np.asarray(image).copy())) for image in case.images])
    assert torch.equal(patches, case.inputs["pixel_values"])


# -- geometry and preprocessing -------------------------------------------------------------------------
def test_geometry_and_device_patches_match_the_hf_processor(outside):
    """For every size of the matrix: the frontend's placeholder count (``ImageGeometry``) is HF's grid, and
    the device preprocessor's patches are HF's."""
    geometry = ImageGeometry.from_checkpoint(outside.path)
    device = TorchImagePreprocessor(outside.path)
    processor = outside.reference.processor
    for spec in {spec for specs, _ in IMAGE_SETS.values() for spec in specs}:
        pixels = np.asarray(make_image(*spec))
        expected = processor(images=[pixels], return_tensors="pt", input_data_format="channels_last")
        grid = tuple(int(x) for x in expected["image_grid_thw"][0])
        assert geometry.grid(*pixels.shape[:2]) == grid, spec
        assert torch.equal(device(torch.from_numpy(pixels.copy())), expected["pixel_values"]), spec


def test_resize_pass_order_is_the_installed_pillows():
    """PIL's bicubic resize equals its two one-axis resizes in the order ``vertical_pass_first`` names, exactly,
    over shrinking and growing sides alike."""
    from shared.model.resample import vertical_pass_first

    rng, pixels = random.Random(0), np.random.default_rng(0)
    for _ in range(200):
        height, width, new_height, new_width = (rng.randint(2, 120) for _ in range(4))
        image = Image.fromarray(pixels.integers(0, 256, (height, width, 3), dtype=np.uint8))
        whole = image.resize((new_width, new_height), Image.BICUBIC)
        if vertical_pass_first(height, width, new_height, new_width):
            passes = image.resize((width, new_height), Image.BICUBIC).resize((new_width, new_height), Image.BICUBIC)
        else:
            passes = image.resize((new_width, height), Image.BICUBIC).resize((new_width, new_height), Image.BICUBIC)
        assert np.array_equal(np.asarray(whole), np.asarray(passes)), (height, width, new_height, new_width)


# -- video-shaped grids, config defaults ----------------------------------------------------------------
def test_video_shaped_grids_attend_frame_by_frame(outside):
    """Grids of several temporal patches (t > 1) beside still images: each frame its own full-attention
    segment, as in the reference."""
    grids = [(1, 8, 12), (2, 6, 10), (3, 4, 4), (1, 2, 14)]
    generator = torch.Generator().manual_seed(0)
    patches = torch.randn(sum(t * h * w for t, h, w in grids), outside.config.vision.patch_dim, generator=generator)
    with torch.no_grad():
        expected = outside.reference.model.model.visual(patches, grid_thw=torch.tensor(grids)).pooler_output
        got = outside.tower(patches, grids)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_config_defaults_are_the_ones_transformers_assumes():
    """A hand-written config.json that leaves out the M-RoPE split or the full-attention blocks is read as
    transformers reads it."""
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding

    text = dict(vocab_size=64, hidden_size=256, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1)
    vision = dict(depth=32, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=256)
    raw = dict(model_type="qwen2_5_vl", image_token_id=60, video_token_id=61, vision_start_token_id=62,
               vision_end_token_id=63, text_config=text, vision_config=vision)
    ours = ModelConfig.from_dict(raw)
    hf = Qwen2_5_VLConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    assert ours.text.mrope_section == tuple(Qwen2_5_VLRotaryEmbedding(hf.text_config).mrope_section)
    assert ours.vision.fullatt_blocks == tuple(hf.vision_config.fullatt_block_indexes)
    assert ours.vision.window_size == hf.vision_config.window_size


@pytest.mark.parametrize("act", ["silu", "gelu", "quick_gelu", "gelu_pytorch_tanh", "gelu_new", "relu"])
def test_vision_activations_are_transformers(act):
    from transformers.activations import ACT2FN

    from shared.model.vision import _activation

    x = torch.linspace(-6, 6, 101)
    torch.testing.assert_close(_activation(act)(x), ACT2FN[act](x))


def test_an_unknown_vision_activation_is_refused():
    from shared.model.vision import _activation

    with pytest.raises(ValueError, match="hidden_act"):
        _activation("mish")


# -- through the stack ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def outside_stack(nats_url, tmp_path_factory):
    """An outside checkpoint behind the whole stack, its encoder preprocessing as a GPU encoder does."""
    path = write_outside_checkpoint(tmp_path_factory.mktemp("outside-stack"), OUTSIDE["qwen2_5_vl-w112"])
    running = RunningStack(nats_url, path, env={"EPD_PREPROCESS": "torch"}).start(
        frontend_args=("--max-output-tokens", "64", "--max-body-bytes", "8000000"))
    yield running, Reference(path)
    running.stop()


@pytest.mark.parametrize("name", ["3-first-token", "5-mixed"])
def test_greedy_output_through_the_stack_equals_hf(outside_stack, name):
    stack, reference = outside_stack
    specs, layout = IMAGE_SETS[name]
    parts = message_parts([make_image(*spec) for spec in specs], layout)
    inputs = hf_inputs(reference, parts)
    with torch.no_grad():
        out = reference.model.generate(**inputs, max_new_tokens=16, do_sample=False)
    expected = out[0, inputs["input_ids"].shape[1]:].tolist()
    client = stack.client()
    response = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=16, temperature=0,
                                              messages=[{"role": "user", "content": openai_content(parts)}])
    assert response.choices[0].message.content == reference.text(expected)
    assert response.usage.prompt_tokens == inputs["input_ids"].shape[1]
    assert response.usage.completion_tokens == len(expected)
