"""Property: for any mix of images and video clips, and any vision configuration of the supported families,
the embeddings our encoder returns for a request are HF's vision tower's on the same pixels (float32).

Hypothesis draws the configuration (``tests/mixes.py``: the family; patch, merge and temporal patch sizes;
width, heads, depth; Qwen2.5-VL's window — also sizes that are no multiple of a merged patch — and its
full-attention blocks; Qwen3-VL's position table and deepstack blocks), writes it as a checkpoint with
transformers' config classes and ``save_pretrained``, and draws requests of 1-6 items: images of any pixel
size (1×1 up, sides no multiple of the patch or the merge, aspect ratios to 1:150, smaller and larger than a
window) and video clips of 2-3 temporal patches among them. Then:

1. the frontend's patch grid (``ImageGeometry``, which sizes the prompt) is HF's processor's, and the GPU
   encoders' device preprocessing (``TorchImagePreprocessor``) gives HF's patches bit for bit;
2. our tower on HF's pixel values equals HF's tower: its plain forward, the GPU's grouped attention plan,
   the forward through the pieces (what the CUDA graphs capture, run eagerly), and one item at a time;
3. the encoder's batcher, given several requests' items at once and packing them into forwards as it
   does (of up to ``max_images`` / ``max_patches``), gives each request HF's embeddings of its own items.

The issue-40 example (Qwen2.5-VL, 56-pixel windows, full attention in block 1 of two, images of 64×64,
200×100 and 90×150 pixels in one request) is kept as an explicit example of 2 and 3.

CI runs a few fixed examples of each property (seconds). ``PROPERTY_EXAMPLES=300 python -m pytest
tests/test_vision_properties.py`` runs 300 fresh random ones of each.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
from pathlib import Path

import torch
from hypothesis import example, given
from hypothesis import strategies as st

from services.encoder.batcher import VisionBatcher
from shared.model.config import ModelConfig
from shared.model.geometry import ImageGeometry, grid_tokens
from shared.model.loader import load_vision_tower
from shared.model.pieces import vision_pieces
from shared.model.processor import TorchImagePreprocessor, load_image_processor
from tests.mixes import (Item, VisionSpec, budget, hf_visual, image_sizes, patches_of, requests, vision_specs,
                         write_vision_checkpoint)

# The issue's checkpoint and request: (height, width) of 64×64, 200×100 and 90×150 pixels (width × height)
ISSUE_40 = VisionSpec("qwen2_5_vl", dict(depth=2, hidden_size=32, intermediate_size=60, num_heads=2, patch_size=14,
                                         spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                                         fullatt_block_indexes=[1], initializer_range=0.2), 4, 512)
ISSUE_40_IMAGES = [Item(0, (64, 64)), Item(1, (100, 200)), Item(2, (150, 90))]


def assert_embeddings_equal(got: torch.Tensor, expected: torch.Tensor, how: str) -> None:
    # float32 against float32, the same arithmetic in another order: relative to the embeddings' scale
    scale = max(1.0, expected.abs().max().item())
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * scale, msg=lambda m: f"{how}: {m}")


class Checkpoint:
    """A drawn configuration written to a temporary directory: HF's model and processor, our tower."""

    def __init__(self, spec: VisionSpec, directory: str):
        path = Path(directory)
        self.spec = spec
        self.hf = write_vision_checkpoint(path, spec)
        self.processor = load_image_processor(path)
        config = ModelConfig.from_checkpoint(path)
        self.tower = load_vision_tower(path, config)
        self.merge = config.vision.merge_size
        self.patch_dim = config.vision.patch_dim

    def patches(self, request: list[Item]):
        return patches_of(request, self.processor, self.merge, self.patch_dim)

    def expected(self, request: list[Item]) -> list[torch.Tensor]:
        """HF's embeddings of the request's items (the request alone in HF's forward), one tensor per item."""
        patches = self.patches(request)
        out = hf_visual(self.hf, self.spec.family, patches.rows, patches.grids)
        return list(out.split([grid_tokens(g, self.merge) for g in patches.grids]))


@given(spec=vision_specs(), sizes=st.lists(image_sizes(), min_size=1, max_size=6))
@budget(ci=12)
def test_the_prompt_grid_and_device_patches_are_the_processors(spec, sizes):
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory)
        write_vision_checkpoint(path, spec)
        geometry, device = ImageGeometry.from_checkpoint(path), TorchImagePreprocessor(path)
        processor = load_image_processor(path)
        for size in sizes:
            pixels = Item(0, size).pixels()
            expected = processor(images=[pixels], return_tensors="pt", input_data_format="channels_last")
            assert geometry.grid(*size) == tuple(int(x) for x in expected["image_grid_thw"][0]), size
            assert torch.equal(device(torch.from_numpy(pixels)), expected["pixel_values"]), size


@given(spec=vision_specs(), request=requests().map(lambda r: r[0]))
@example(spec=ISSUE_40, request=ISSUE_40_IMAGES)
@budget(ci=16)
def test_the_tower_equals_hfs_on_any_mix(spec, request):
    with tempfile.TemporaryDirectory() as directory:
        checkpoint = Checkpoint(spec, directory)
        tower = checkpoint.tower
        patches = checkpoint.patches(request)
        expected = hf_visual(checkpoint.hf, spec.family, patches.rows, patches.grids)
        with torch.no_grad():
            plain = tower(patches.rows, patches.grids)
            grouped = tower(patches.rows, patches.grids, grouped=True)  # the GPU path's attention plan
            alone = torch.cat([tower(rows, [grid]) for rows, grid in zip(patches.split(), patches.grids)])
            tower.pieces = vision_pieces(tower, patches.rows.shape[0] + 7)  # padded to a bucket
            try:
                pieces = tower(patches.rows, patches.grids)
            finally:
                tower.pieces = None
    for got, how in ((plain, "packed"), (grouped, "grouped"), (alone, "one item at a time"), (pieces, "pieces")):
        assert_embeddings_equal(got, expected, f"{how}, grids {patches.grids}")


@given(spec=vision_specs(), batch=requests(max_requests=3), max_images=st.integers(1, 8),
       max_patches=st.integers(1, 4096), order=st.randoms(use_true_random=False))
@example(spec=ISSUE_40, batch=[ISSUE_40_IMAGES, [Item(3, (30, 500))]], max_images=8, max_patches=4096,
         order=random.Random(0))
@budget(ci=10)
def test_the_encoders_batches_give_each_request_hfs_embeddings(spec, batch, max_images, max_patches, order):
    with tempfile.TemporaryDirectory() as directory:
        checkpoint = Checkpoint(spec, directory)
        queued = [(r, i, rows, grid) for r, request in enumerate(batch)
                  for i, (rows, grid) in enumerate(zip(*_split(checkpoint.patches(request))))]
        order.shuffle(queued)  # the requests' items arrive interleaved
        got, forwards = asyncio.run(_encode(checkpoint.tower, queued, max_images, max_patches))
        if len(queued) <= max_images and sum(rows.shape[0] for _, _, rows, _ in queued) <= max_patches:
            assert forwards == 1  # every request's items in one forward
        for r, request in enumerate(batch):
            for i, expected in enumerate(checkpoint.expected(request)):
                assert_embeddings_equal(got[r, i], expected, f"request {r} item {i}")


def _split(patches) -> tuple[list[torch.Tensor], list]:
    return patches.split(), patches.grids


async def _encode(tower, queued: list, max_images: int, max_patches: int) -> tuple[dict, int]:
    """Everything queued before the batcher's thread starts, so it packs the forwards deterministically."""
    batcher = VisionBatcher(tower, asyncio.get_running_loop(), max_images, max_patches)
    futures = {(r, i): batcher.encode(rows, grid, group=f"request-{r}") for r, i, rows, grid in queued}
    batcher.start()
    try:
        return {key: await future for key, future in futures.items()}, batcher.batches
    finally:
        await asyncio.to_thread(batcher.stop)


def test_the_issue_40_request_packs_into_one_forward_as_hf_runs_it():
    """The issue's three images in one forward of our tower, in every order, against HF's forward of the same
    order (windows of 2×2 merged patches, partial windows at the edges of the 200×100 and 90×150 images)."""
    import itertools

    with tempfile.TemporaryDirectory() as directory:
        checkpoint = Checkpoint(ISSUE_40, directory)
        for order in itertools.permutations(ISSUE_40_IMAGES):
            patches = checkpoint.patches(list(order))
            with torch.no_grad():
                got = checkpoint.tower(patches.rows, patches.grids)
            assert_embeddings_equal(got, hf_visual(checkpoint.hf, "qwen2_5_vl", patches.rows, patches.grids),
                                    f"order {[item.size for item in order]}")

