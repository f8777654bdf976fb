"""The aggregated worker's ViT under the engine's time budget: the forward-time model's fit, and the batches
cut to what the budget leaves while sequences decode (the tiny tower on CPU, the engine thread's loop)."""

from __future__ import annotations

import asyncio

import numpy as np
import torch

from services.encoder.batcher import VisionBatcher
from services.encoder.forward_time import SCALES, TRIALS, ForwardTimes, calibrate, features, layout_key
from shared.engine.loop import EngineLoop
from shared.engine.scheduler import BACKLOG_S
from shared.engine.sampling import SamplingParams
from shared.engine.sequence import Sequence
from shared.engine.warmup import calibrate as calibrate_steps
from tests.engine_support import make_engine, model_parts  # noqa: F401

# ms per forward, per image, per 10k patches, per 1e8 patch pairs: the 7B's tower on an H200 (a 1080p
# image ~35 ms in a batch of four)
H200_VIT = np.array([4.0, 1.5, 26.0, 2.0])
GRID = (1, 8, 12)  # 96 patches an image on the tiny tower


def forward_ms(grids) -> float:
    return float(H200_VIT @ features(grids))


def test_forward_time_fit_converges_and_follows_a_slower_gpu():
    """Calibrated on the start's trial forwards (exact), then 200 forwards of 1-6 images of 720p and
    1080p, 1.3x slower (an E/PD encoder on the same GPU would be): within 4 % of the new costs."""
    rng = np.random.default_rng(0)
    times = ForwardTimes()
    times.calibrate([(grids, forward_ms(grids) / 1e3) for grids in TRIALS])
    assert np.allclose(times.fit.theta, H200_VIT, rtol=3e-2) and len(SCALES) == 4
    sizes = [(1, 52, 92), (1, 78, 138)]

    def batch() -> list:
        return [sizes[i] for i in rng.integers(0, 2, rng.integers(1, 7))]

    for _ in range(200):
        grids = batch()
        times.observe(grids, 1.3 * forward_ms(grids) * (1 + 0.03 * rng.standard_normal()) / 1e3)
    errors = [abs(times.predict(g) * 1e3 / (1.3 * forward_ms(g)) - 1) for g in (batch() for _ in range(100))]
    assert np.mean(errors) < 0.04
    assert times.stats()["vit_time_error_count"] == 200


class Captured:
    """``LayoutGraphs`` as ``ForwardTimes`` reads it: the layouts captured (its graphs need a GPU)."""

    def __init__(self):
        self.entries: dict[tuple, object] = {}


def test_a_captured_layout_is_predicted_from_its_replays_which_stay_out_of_the_fit():
    """One 720p image recurs: its first forward is eager, its second captures the layout's graph (10x
    slow, once), then it replays in a fifth of its eager time. Its replays predict it (within 5 %); neither
    they nor the capture move the linear fit, so two 1080p images are still predicted at their eager time;
    a layout no longer captured is predicted by the fit again."""
    rng = np.random.default_rng(1)
    graphs = Captured()
    times = ForwardTimes(graphs=graphs)
    times.calibrate([(grids, forward_ms(grids) / 1e3) for grids in TRIALS])
    one, two = [(1, 52, 92)], [(1, 78, 138)] * 2
    eager = forward_ms(one)
    assert not times.graphed(one)
    times.observe(one, eager / 1e3, times.graphed(one))
    before = times.fit.theta.copy()
    graphed = times.graphed(one)
    graphs.entries[layout_key(one)] = object()  # captured during this forward
    times.observe(one, 10 * eager / 1e3, graphed)
    assert np.allclose(times.fit.theta, before)
    for _ in range(40):
        assert times.graphed(one)
        times.observe(one, eager / 5 * (1 + 0.02 * rng.standard_normal()) / 1e3, True)
    assert abs(times.predict(one) * 1e3 / (eager / 5) - 1) < 0.05
    assert np.allclose(times.fit.theta, before)
    assert abs(times.predict(two) * 1e3 / forward_ms(two) - 1) < 0.03
    graphs.entries.clear()
    times.observe(two, forward_ms(two) / 1e3, times.graphed(two))
    assert not times.replays and abs(times.predict(one) * 1e3 / eager - 1) < 0.03


def patches(tower, seed: int) -> torch.Tensor:
    return torch.randn(96, tower.config.patch_dim, generator=torch.Generator().manual_seed(seed))


def test_a_gap_with_no_time_left_forwards_one_image(model_parts):
    """A calibrated batcher given no time (the decode rows' next token is due): one image, the rest wait
    for the next gap; given time, or no budget, every queued image in one forward."""
    _, _, tower = model_parts

    async def gap(budget_s) -> tuple[list[int], int]:
        batcher = VisionBatcher(tower, asyncio.get_running_loop(), max_images=8, max_patches=10_000)
        batcher.forward_times = ForwardTimes()
        assert calibrate(tower, batcher.forward_times, 10_000) == len(TRIALS)
        sizes: list[int] = []
        forward = batcher._forward
        batcher._forward = lambda batch: sizes.append(len(batch)) or forward(batch)
        jobs = [batcher.encode(patches(tower, i), GRID) for i in range(3)]
        tokens = 96 // tower.config.merge_size ** 2  # an image's language-model tokens
        assert batcher.queued_tokens() == 3 * tokens  # what the scheduler's budget counts on their way
        await asyncio.to_thread(batcher.step, budget_s)
        left = batcher.queued
        assert batcher.queued_tokens() == left * tokens
        await asyncio.to_thread(batcher.step, None)  # the next gaps, no budget: the rest
        await asyncio.gather(*jobs)
        assert batcher.queued_tokens() == 0
        return sizes, left

    assert asyncio.run(gap(0.0)) == ([1, 2], 2)
    assert asyncio.run(gap(60.0)) == ([3], 0)
    assert asyncio.run(gap(None)) == ([3], 0)


def test_the_aggregated_engine_thread_splits_vit_batches_while_sequences_decode(model_parts):
    """The engine loop with the ViT attached, as the aggregated worker runs it, a sequence decoding: with a
    time budget no step can meet, held (it would yield to the images' tokens: the cuts are what is tested),
    each gap between two steps forwards one image (three images, three gaps, each followed by a step);
    without a budget, once an image a cut held back has waited past the backlog bound, or with the budget
    yielding to what is queued, the three go in one forward. The embeddings are the same either way."""
    _, _, tower = model_parts

    async def run(target_s: float, late: bool = False,
                  held: bool = True) -> tuple[list[tuple[int, int]], list[torch.Tensor]]:
        engine = make_engine(model_parts, target_itl_s=target_s)
        if held:
            engine.scheduler.yields = lambda: False
        calibrate_steps(engine)
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        engine.add_prompt(Sequence("talking", list(range(3, 40)), 37, params))
        while not engine.scheduler.running or not engine.scheduler.running[0].decoding:
            engine.step()  # its prompt, in this thread before the loop starts
        batcher = VisionBatcher(tower, asyncio.get_running_loop(), max_images=8, max_patches=10_000)
        if late:  # an image a cut held back has waited past the backlog bound
            batcher.waited_s = lambda: BACKLOG_S + 1.0
        if target_s:
            batcher.forward_times = ForwardTimes()
            calibrate(tower, batcher.forward_times, 10_000)
        loop = EngineLoop(engine, lambda outputs: None, lambda ids, message: None, asyncio.get_running_loop())
        loop.attach(batcher)
        forwards: list[tuple[int, int]] = []  # (images, engine steps so far)
        forward = batcher._forward
        batcher._forward = lambda batch: forwards.append((len(batch), loop.steps)) or forward(batch)
        jobs = [batcher.encode(patches(tower, i), GRID) for i in range(3)]
        loop.start()
        try:
            embeddings = await asyncio.gather(*jobs)
        finally:
            await asyncio.to_thread(loop.stop)
        assert engine.step_times is None or engine.step_times.observed > 0
        return forwards, embeddings

    paced, apart = asyncio.run(run(1e-6))
    plain, together = asyncio.run(run(0.0))
    backlogged, _ = asyncio.run(run(1e-6, late=True))
    yielded, _ = asyncio.run(run(1e-6, held=False))
    assert [n for n, _ in paced] == [1, 1, 1] and [n for n, _ in plain] == [3] and [n for n, _ in backlogged] == [3]
    assert [n for n, _ in yielded] == [3]
    steps = [s for _, s in paced]
    assert steps[0] < steps[1] < steps[2]  # an engine step between every two forwards
    for x, y in zip(apart, together):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
