"""The vision towers' whole forwards as CUDA graphs, one per recurring batch layout (``pieces.LayoutGraphs``).

GPU only (skipped elsewhere; run on the GPU machine): on CPU a tower never takes the graphs, and its
forward, split into ``layout`` and ``run`` for them, is what the other tower tests check against HF.
Each tiny random tower runs in float32, where attention takes the reference kernel on both paths, so a
replayed graph runs the kernels of the eager forward on the same inputs: the outputs are equal bit for
bit. In bf16 the graphs take cuDNN's attention where the eager forward starts in the flash kernel
(``sdpa.recurring``), so there they agree to bf16's rounding.
"""

from __future__ import annotations

import pytest
import torch

from shared.model import pieces
from shared.model.config import ModelConfig
from shared.model.loader import load_vision_tower
from shared.model.tiny import write_tiny_checkpoint

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
pytestmark = needs_gpu


@pytest.fixture(scope="module", params=["qwen3_vl_moe", "qwen2_5_vl"])
def tiny(request, tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), family=request.param)
    return path, ModelConfig.from_checkpoint(path), GRIDS[request.param]


def _tower(tiny, dtype=torch.float32, layouts: int = 8):
    path, config, _ = tiny
    tower = load_vision_tower(path, config, torch.device("cuda"), dtype)
    pieces.capture(tower, 1024, layouts)
    return tower


def _patches(config, grids, dtype, seed=0):
    rows = sum(t * h * w for t, h, w in grids)
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, config.vision.patch_dim, generator=generator).to("cuda", dtype)


def _eager(tower, patches, grids):
    held, tower.pieces = tower.pieces, None
    try:
        return tower(patches, grids)
    finally:
        tower.pieces = held


GRIDS = {"qwen3_vl_moe": [(1, 8, 12), (1, 16, 16), (1, 4, 4)], "qwen2_5_vl": [(1, 8, 16), (1, 16, 16), (1, 8, 8)]}


@torch.inference_mode()
def test_a_recurring_layout_replays_its_graph_with_the_eager_forwards_output(tiny):
    """The first forward of a layout runs through the pieces, the second captures its graph; from then on
    every forward of the layout replays it — with other patches each time, equal to the eager forward."""
    tower = _tower(tiny)
    _, config, grids = tiny
    layouts = tower.pieces.layouts
    for seed in range(4):
        patches = _patches(config, grids, torch.float32, seed)
        out = tower(patches, grids)
        torch.cuda.synchronize()
        assert torch.equal(out, _eager(tower, patches, grids)), seed
        assert (tuple(grids) in layouts.entries) == (seed >= 1)
    assert layouts.replays == 3 and not layouts.failed


@torch.inference_mode()
def test_layouts_are_keyed_by_every_image_and_its_order(tiny):
    """Two layouts of the same images in another order, or one image more, are graphs of their own; each
    output is its own forward's, also when the graphs replay one after another (one shared pool, outputs
    copied out)."""
    tower = _tower(tiny)
    _, config, base = tiny
    variants = [base, base[::-1], base + [base[0]]]
    inputs = [_patches(config, g, torch.float32, i) for i, g in enumerate(variants)]
    for _ in range(2):  # capture each
        for patches, grids in zip(inputs, variants):
            tower(patches, grids)
    outs = [tower(patches, grids) for patches, grids in zip(inputs, variants)]  # replays, back to back
    torch.cuda.synchronize()
    assert len(tower.pieces.layouts.entries) == 3
    for out, patches, grids in zip(outs, inputs, variants):
        assert torch.equal(out, _eager(tower, patches, grids))


@torch.inference_mode()
def test_the_limits_leave_forwards_eager(tiny):
    """No more than ``limit`` layouts are captured, none over the pieces' largest bucket; a layout whose
    captures fail (with cuDNN's attention, then the flash kernel's) stays eager (and correct) for good."""
    config = tiny[1]
    tower = _tower(tiny, layouts=1)
    layouts = tower.pieces.layouts
    first, second = [(1, 8, 8)], [(1, 8, 16)]
    big = [(1, 32, 40)]  # 1,280 patches: above the 1,024 of the pieces
    for grids in (first, first, second, second, big, big, big):
        patches = _patches(config, grids, torch.float32)
        assert torch.equal(tower(patches, grids), _eager(tower, patches, grids))
    assert list(layouts.entries) == [tuple(first)]

    tower = _tower(tiny)
    layouts = tower.pieces.layouts
    patches = _patches(config, second, torch.float32)
    run = tower.run

    def failing(x, layout, pieces=False):
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("not capturable")
        return run(x, layout, pieces)

    tower.run = failing
    for _ in range(3):
        assert torch.equal(tower(patches, second), _eager(tower, patches, second))
    assert layouts.failed == {tuple(second)} and not layouts.entries


@torch.inference_mode()
def test_a_capture_that_fails_in_cudnn_retries_with_the_flash_kernel(tiny):
    """A layout whose capture fails with cuDNN's attention (refused inside a graph) is captured with the
    flash kernel's instead."""
    from shared.kernels import sdpa

    _, config, grids = tiny
    tower = _tower(tiny, torch.bfloat16)
    layouts = tower.pieces.layouts
    run = tower.run

    def refusing_cudnn(x, layout, pieces=False):
        if torch.cuda.is_current_stream_capturing() and sdpa._sightings.settled == "cudnn":
            raise RuntimeError("cuDNN refused")
        return run(x, layout, pieces)

    tower.run = refusing_cudnn
    patches = _patches(config, grids, torch.bfloat16)
    eager = _eager(tower, patches, grids).float()
    for _ in range(3):
        out = tower(patches, grids).float()
    assert tuple(grids) in layouts.entries and not layouts.failed
    torch.testing.assert_close(out, eager, rtol=5e-2, atol=5e-2)


@torch.inference_mode()
def test_bf16_graphs_agree_with_the_eager_forward(tiny):
    """In bf16 a layout's graph takes cuDNN's attention where usable: the same embeddings to bf16's
    rounding as the eager forward (flash)."""
    _, config, grids = tiny
    tower = _tower(tiny, torch.bfloat16)
    patches = _patches(config, grids, torch.bfloat16)
    eager = _eager(tower, patches, grids).float()
    for _ in range(3):
        out = tower(patches, grids).float()
    assert tuple(grids) in tower.pieces.layouts.entries
    torch.testing.assert_close(out, eager, rtol=5e-2, atol=5e-2)
