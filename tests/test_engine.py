"""The engine against HF generate(), token for token (fp32, CPU, tiny checkpoint), and its block accounting."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from shared.messages.sampling import SamplingParams
from shared.engine.sequence import ImageInput, Sequence, Status
from tests.engine_support import (make_engine, model_parts, requests_with_reference, run_to_completion,  # noqa: F401
                                  sequence)
from tests.support import make_image, tower_plain_and_in_pieces


def test_single_request(model_parts, requests_with_reference):
    engine = make_engine(model_parts)
    seq = sequence(2, requests_with_reference[2])
    engine.add_prompt(seq)
    run_to_completion(engine)
    assert seq.output_ids == requests_with_reference[2][3]
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_eight_concurrent_requests_in_one_batch(model_parts, requests_with_reference):
    engine = make_engine(model_parts)
    seqs = [sequence(i, r) for i, r in enumerate(requests_with_reference)]
    for seq in seqs:
        engine.add_prompt(seq)
    assert len(engine.step()) == 8  # one batched prefill of all eight prompts, of different lengths
    assert len(engine.step()) == 8  # then one decode step for all eight
    run_to_completion(engine)
    for seq, (_, _, _, expected) in zip(seqs, requests_with_reference):
        assert seq.output_ids == expected, seq.request_id
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_the_engine_times_each_prompt_from_queued_to_its_first_chunk_to_its_first_token(
        model_parts, requests_with_reference, monkeypatch):
    """``prompt_wait`` (queued → the step with its first chunk begins) and ``prompt_prefill`` (that step →
    its first token), once per prompt, also when the step budget splits prompts over several steps and
    decode rows ride along. A clock that moves one second per step makes the sums exact."""
    import time

    clock = {"now": 0.0}
    monkeypatch.setattr(time, "monotonic", lambda: clock["now"])
    engine = make_engine(model_parts, max_batched_tokens=48)
    seqs = [sequence(i, r) for i, r in enumerate(requests_with_reference[:4])]
    for seq in seqs:
        engine.add_prompt(seq)
    first: dict[str, float] = {}
    while engine.has_work():
        clock["now"] += 1
        for out in engine.step():
            first.setdefault(out.request_id, clock["now"])
    stats = engine.timing_stats()
    assert stats["prompt_wait_count"] == stats["prompt_prefill_count"] == len(seqs)
    assert stats["prompt_wait_seconds_total"] == sum(s.started for s in seqs)  # all queued at 0
    assert stats["prompt_prefill_seconds_total"] == sum(first[s.request_id] - s.started for s in seqs)
    assert any(first[s.request_id] > s.started for s in seqs)  # the budget split a prompt over steps
    assert max(s.started for s in seqs) > 1  # and made one wait


def test_requests_joining_mid_decode(model_parts, requests_with_reference):
    engine = make_engine(model_parts)
    seqs = [sequence(i, r) for i, r in enumerate(requests_with_reference)]
    joiners = {0: seqs[:2], 3: seqs[2:5], 7: seqs[5:]}
    run_to_completion(engine, joiners)
    for seq, (_, _, _, expected) in zip(seqs, requests_with_reference):
        assert seq.output_ids == expected, seq.request_id
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_preempted_request_resumes_exactly(model_parts, requests_with_reference):
    # A pool just big enough for the longest sequence: running several at once forces swap-outs.
    longest = max(len(r[0]) + r[2] for r in requests_with_reference)
    engine = make_engine(model_parts, num_blocks=(longest + 3) // 4 + 3, block_size=4)
    swaps = []
    original = engine.swap_out
    engine.swap_out = lambda seq: (swaps.append(seq.request_id), original(seq))
    seqs = [sequence(i, r) for i, r in enumerate(requests_with_reference)]
    for seq in seqs:
        engine.add_prompt(seq)
    run_to_completion(engine)
    assert swaps, "the pool was large enough that nothing was preempted"
    for seq, (_, _, _, expected) in zip(seqs, requests_with_reference):
        assert seq.output_ids == expected, seq.request_id
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_blocks_all_free_after_finish_abort_and_failure(model_parts, requests_with_reference):
    engine = make_engine(model_parts)
    seqs = [sequence(i, r) for i, r in enumerate(requests_with_reference[:4])]
    for seq in seqs:
        engine.add_prompt(seq)
    engine.step()  # prefill
    engine.step()  # one decode step
    engine.abort(seqs[0].request_id)  # cancelled while running
    waiting = sequence(9, requests_with_reference[5])
    engine.add_prompt(waiting)
    engine.abort(waiting.request_id)  # cancelled while waiting
    reserved = Sequence("kv", [1, 2, 3, 4, 5], 4, SamplingParams(temperature=0), num_computed=4)
    engine.reserve(reserved)
    engine.abort("kv")  # a KV transfer that failed half-way
    run_to_completion(engine)
    assert engine.blocks.num_free == engine.blocks.num_blocks
    assert not engine.reserved and not engine.has_work()


def test_prefill_role_streams_kv_that_decode_continues(model_parts, requests_with_reference):
    """Prefill on one engine streaming KV per layer group (the layer hook), landed in a reservation on
    another engine as it arrives, decode there: the same tokens as HF."""
    prefill = make_engine(model_parts, role="prefill")
    decode = make_engine(model_parts, role="decode")
    request = requests_with_reference[5]
    seq = sequence(5, request)
    moved = Sequence(seq.request_id, [0] * len(seq), len(seq), seq.sampling, num_computed=len(seq))
    decode.reserve(moved)  # room first, before any KV exists
    landed = []

    def on_layer_done(layer, spans):
        (span,) = spans
        assert span.seq is seq and (span.start, span.end) == (0, len(seq))
        kv = prefill.read_kv(seq, slice(layer, layer + 1), span.start, span.end)
        decode.write_kv(moved.request_id, kv, slice(layer, layer + 1), span.start)
        landed.append(layer)

    prefill.add_prompt(seq)
    (out,) = prefill.step(on_layer_done)
    assert landed == list(range(model_parts[0].text.num_layers))
    assert out.finish_reason is None and prefill.blocks.num_free == prefill.blocks.num_blocks
    moved.token_ids, moved.rope_delta = list(seq.token_ids), seq.rope_delta
    decode.activate(moved.request_id)
    run_to_completion(decode)
    assert moved.output_ids == request[3]
    assert decode.blocks.num_free == decode.blocks.num_blocks


def test_short_prompts_start_first_and_passed_over_prompts_are_not_starved():
    """Shortest waiting prompt first (a text prompt does not wait behind an image prompt); one passed
    over for longer than the window goes first; window 0 is first come, first served. Whole prompts
    (no chunking): the image prompt gets a step of its own; chunked: it fills the rest of the budget."""
    from shared.engine.block_manager import BlockManager
    from shared.engine.scheduler import Scheduler

    def prompt(rid: str, tokens: int) -> Sequence:
        return Sequence(rid, [1] * tokens, tokens, SamplingParams(max_tokens=4))

    def first_prefills(window: float, passed_over_for: float = 0.0, chunked: bool = False) -> list[list[str]]:
        scheduler = Scheduler(BlockManager(1024, 16), max_num_seqs=8, max_batched_tokens=1000, swapper=None,
                              priority_window=window, chunked=chunked)
        for rid, tokens in (("images", 900), ("text-a", 60), ("text-b", 50)):
            scheduler.add_waiting(prompt(rid, tokens))
        scheduler.waiting[0].arrival -= passed_over_for
        steps = []
        for _ in range(2):
            chunks = [c for c in scheduler.schedule().chunks if not c.seq.decoding]
            steps.append([f"{c.seq.request_id}:{c.num_tokens}" for c in chunks])
            for c in chunks:  # what the engine does after the step
                c.seq.num_computed = c.end
        return steps

    assert first_prefills(window=2.0) == [["text-b:50", "text-a:60"], ["images:900"]]
    assert first_prefills(window=2.0, passed_over_for=3.0) == [["images:900", "text-b:50"], ["text-a:60"]]
    assert first_prefills(window=0.0) == [["images:900", "text-a:60"], ["text-b:50"]]
    assert first_prefills(window=2.0, chunked=True) == [["text-b:50", "text-a:60", "images:890"], ["images:10"]]
    assert first_prefills(window=2.0, passed_over_for=3.0, chunked=True) == [["images:900", "text-b:50", "text-a:50"],
                                                                           ["text-a:10"]]


def test_batched_vision_equals_one_image_at_a_time(model_parts, tiny_model):
    """Images of different sizes in one packed ViT forward give each image's own result (fp32, CPU), and
    the grouped attention of the GPU path agrees with the per-segment one."""
    import numpy as np

    from shared.model.processor import ImagePreprocessor

    _, _, tower = model_parts
    pre = ImagePreprocessor(tiny_model)
    images = [np.asarray(make_image(s, h, w)) for s, h, w in [(1, 100, 150), (2, 56, 56), (3, 140, 70), (4, 56, 56)]]
    patches, grids = zip(*(pre(i) for i in images))
    single = [tower(torch.from_numpy(p), [g]) for p, g in zip(patches, grids)]
    batched = tower(torch.cat([torch.from_numpy(p) for p in patches]), list(grids))
    torch.testing.assert_close(batched, torch.cat(single), rtol=1e-5, atol=1e-5)
    grouped = tower(torch.cat([torch.from_numpy(p) for p in patches]), list(grids), grouped=True)
    torch.testing.assert_close(grouped, batched, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the GPU's arithmetic: on the GPU machine"))])
def test_preprocessing_on_the_device_matches_the_checkpoints_processor(tiny_model, device):
    """The torch preprocessor (what encoders run on a GPU) gives HF's PIL processor's patches and grid, bit for
    bit: downscaled past max_pixels, upscaled past min_pixels, rounded to the patch grid, as is, and sides
    scaled very unequally (which recent Pillow resamples columns first). tests/test_vision_properties.py
    draws more sizes and processor settings."""
    import numpy as np

    from shared.model.processor import ImagePreprocessor, TorchImagePreprocessor

    pil, on_device = ImagePreprocessor(tiny_model), TorchImagePreprocessor(tiny_model)
    for seed, height, width in [(1, 600, 900), (2, 20, 30), (3, 100, 150), (4, 56, 56), (5, 300, 200),
                                (6, 200, 300), (7, 14, 8), (8, 9, 700)]:
        pixels = np.asarray(make_image(seed, height, width))
        expected, grid = pil(pixels)
        got = on_device(torch.from_numpy(pixels.copy()).to(device)).cpu()
        assert on_device.grid(height, width) == grid
        assert torch.equal(got, torch.from_numpy(expected)), (height, width)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the GPU's kernels: on the GPU machine"))])
def test_the_device_preprocessor_prepares_images_of_one_size_together_as_each_alone(tiny_model, device):
    """Images of one size stacked ``[n, H, W, 3]`` give each image's patches, in order, bit for bit as
    one at a time: resized (both passes), or already on the grid."""
    import numpy as np

    from shared.model.processor import TorchImagePreprocessor

    prepare = TorchImagePreprocessor(tiny_model)
    for height, width in [(100, 150), (56, 56), (600, 900)]:
        images = [torch.from_numpy(np.asarray(make_image(seed, height, width)).copy()).to(device) for seed in (7, 8, 9)]
        together = prepare(torch.stack(images))
        alone = torch.cat([prepare(image) for image in images])
        assert together.shape == alone.shape and torch.equal(together, alone), (height, width)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host pixels to a GPU: on the GPU machine")
def test_the_vision_batcher_stacks_host_pixels_on_the_device():
    """An encoder's pulled pixels (host memory, pageable or pinned) land in their slices of one stack on the
    device, each image intact and in order; pixels already there are stacked there."""
    from types import SimpleNamespace

    from services.encoder.batcher import VisionBatcher

    batcher = SimpleNamespace(device=torch.device("cuda"))
    sources = [torch.randint(0, 256, (56, 84, 3), dtype=torch.uint8) for _ in range(3)]
    sources[1] = sources[1].pin_memory()
    stacked = VisionBatcher._together(batcher, sources)
    assert stacked.is_cuda and torch.equal(stacked.cpu(), torch.stack(sources))
    on_device = VisionBatcher._together(batcher, [s.cuda() for s in sources])
    assert torch.equal(on_device, stacked)
    assert torch.equal(VisionBatcher._together(batcher, sources[:1]).cpu(), sources[0])


def test_the_vision_batcher_prepares_a_forwards_images_of_one_size_together(model_parts, tiny_model):
    """A forward whose images share a size prepares them in one call (stacked), the others one by one,
    and each image's embeddings are those it gets in a forward of its own."""
    import asyncio

    import numpy as np

    from services.encoder.batcher import VisionBatcher
    from shared.model.processor import TorchImagePreprocessor

    _, _, tower = model_parts
    prepare = TorchImagePreprocessor(tiny_model)
    calls: list[int] = []

    class Counting(TorchImagePreprocessor):
        def __call__(self, pixels):
            calls.append(1 if pixels.dim() == 3 else pixels.shape[0])
            return super().__call__(pixels)

    counting = Counting(tiny_model)
    images = [np.asarray(make_image(s, h, w)) for s, h, w in [(21, 100, 150), (22, 100, 150), (23, 56, 56),
                                                              (24, 100, 150)]]

    async def encode(prepare, max_images) -> list[torch.Tensor]:
        batcher = VisionBatcher(tower, asyncio.get_running_loop(), max_images=max_images, max_patches=10_000,
                                prepare=prepare)
        jobs = [batcher.encode(torch.from_numpy(i.copy()), prepare.grid(*i.shape[:2]), group="r") for i in images]
        batcher.start()
        try:
            return await asyncio.gather(*jobs)
        finally:
            await asyncio.to_thread(batcher.stop)

    alone = asyncio.run(encode(prepare, 1))
    together = asyncio.run(encode(counting, 4))
    assert calls == [2, 1, 1]  # the first two (one size), the third (another), the fourth (after it)
    assert all(t.is_inference() for t in together)  # the forward runs without autograd's bookkeeping
    for a, b in zip(alone, together):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_the_vision_thread_is_warmed_before_the_batcher_starts_serving(model_parts, monkeypatch):
    """cuDNN's plans are the calling thread's: the warm-up runs in the thread that forwards, and ``start``
    returns only after it (an encoder registers after ``start``). That thread's log lines, and the engine
    thread's, name the service as the event loop's do."""
    import asyncio

    import structlog

    from services.encoder.batcher import VisionBatcher
    from shared.engine.loop import EngineLoop

    _, _, tower = model_parts
    warmed: list[tuple[str, dict]] = []

    def warm(self) -> int:
        time.sleep(0.2)
        warmed.append((threading.current_thread().name, structlog.contextvars.get_contextvars()))
        return 1

    monkeypatch.setattr(VisionBatcher, "warm", warm)

    async def run():
        structlog.contextvars.bind_contextvars(service="epd-test")
        batcher = VisionBatcher(tower, asyncio.get_running_loop(), max_images=4, max_patches=10_000)
        batcher.start()
        try:
            assert warmed == [("vision", {"service": "epd-test"})]
        finally:
            await asyncio.to_thread(batcher.stop)
        loop = EngineLoop(make_engine(model_parts), lambda outputs: None, lambda ids, message: None,
                          asyncio.get_running_loop())
        loop.start()
        try:
            assert await loop.call(lambda engine: structlog.contextvars.get_contextvars()) == {"service": "epd-test"}
        finally:
            await asyncio.to_thread(loop.stop)

    asyncio.run(run())


def test_the_vision_batcher_mixes_requests_only_up_to_the_graphs_patches(model_parts):
    """Past ``mix_patches`` a forward takes no other request's images (they wait for the next forward),
    while one request's own images still ride one forward past it; below it, requests share forwards.
    Each image's embeddings are the same however the forwards fell."""
    import asyncio

    from services.encoder.batcher import VisionBatcher

    _, _, tower = model_parts
    grid = (1, 8, 12)  # 96 patches an image
    dim = tower.config.patch_dim

    def patches(seed: int) -> torch.Tensor:
        return torch.randn(96, dim, generator=torch.Generator().manual_seed(seed))

    async def encode(groups: list[str], mix: int | None) -> tuple[list[torch.Tensor], list[int]]:
        batcher = VisionBatcher(tower, asyncio.get_running_loop(), max_images=32, max_patches=10_000,
                                mix_patches=mix)
        sizes: list[int] = []
        forward = batcher._forward
        batcher._forward = lambda batch: sizes.append(len(batch)) or forward(batch)
        jobs = [batcher.encode(patches(i), grid, group=g) for i, g in enumerate(groups)]
        batcher.start()
        try:
            return await asyncio.gather(*jobs), sizes
        finally:
            await asyncio.to_thread(batcher.stop)

    for groups, mixed in ((["a", "a", "a", "b"], [3, 1]), (["a", "b", "b"], [2, 1])):
        together, one = asyncio.run(encode(groups, None))
        apart, sizes = asyncio.run(encode(groups, 200))
        assert one == [len(groups)] and sizes == mixed, groups
        for x, y in zip(together, apart):
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)


def test_the_device_preprocessor_reads_the_settings_hf_resolves(tiny_model, tmp_path):
    """``PixelSteps`` (read without transformers) are the HF processor's own: from the checkpoint's config,
    and the class defaults where a config leaves them out."""
    import json
    import shutil

    from shared.model.processor import PixelSteps, load_image_processor

    bare = shutil.copytree(tiny_model, tmp_path / "bare")
    config = json.loads((bare / "preprocessor_config.json").read_text())
    kept = {k: v for k, v in config.items() if k not in PixelSteps.__dataclass_fields__}
    (bare / "preprocessor_config.json").write_text(json.dumps(kept))
    for path in (tiny_model, bare):
        hf = load_image_processor(path)
        steps = PixelSteps.from_checkpoint(path)
        assert (steps.do_resize, steps.resample, steps.do_rescale, steps.do_normalize) == \
            (hf.do_resize, int(hf.resample), hf.do_rescale, hf.do_normalize)
        assert steps.rescale_factor == hf.rescale_factor
        assert steps.image_mean == tuple(hf.image_mean) and steps.image_std == tuple(hf.image_std)


def test_the_vision_batcher_preprocesses_pixels_it_is_given(model_parts, tiny_model):
    """Pixels queued to a batcher with ``prepare`` come out as the embeddings of the PIL path's patches,
    however the images were grouped into forwards."""
    import asyncio

    import numpy as np

    from services.encoder.batcher import VisionBatcher
    from shared.model.processor import ImagePreprocessor, TorchImagePreprocessor

    _, _, tower = model_parts
    pil, on_device = ImagePreprocessor(tiny_model), TorchImagePreprocessor(tiny_model)
    images = [np.asarray(make_image(s, h, w)) for s, h, w in [(11, 100, 150), (12, 300, 200), (13, 56, 56)]]

    async def encode(prepare) -> list[torch.Tensor]:
        batcher = VisionBatcher(tower, asyncio.get_running_loop(), max_images=2, max_patches=10_000, prepare=prepare)
        batcher.start()
        try:
            if prepare is None:
                jobs = [batcher.encode(torch.from_numpy(p), g) for p, g in map(pil, images)]
            else:
                jobs = [batcher.encode(torch.from_numpy(i.copy()), prepare.grid(*i.shape[:2])) for i in images]
            return await asyncio.gather(*jobs)
        finally:
            await asyncio.to_thread(batcher.stop)

    reference, prepared = asyncio.run(encode(None)), asyncio.run(encode(on_device))
    for ref, got in zip(reference, prepared):
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)  # the same patches, in other forwards


def test_between_engine_steps_the_vit_encodes_everything_queued(model_parts, tiny_model):
    """The aggregated process's ViT runs in the engine thread: one call between two engine steps encodes
    every image queued by then (in batches of ``max_images``), not just one batch."""
    import asyncio

    import numpy as np

    from services.encoder.batcher import VisionBatcher
    from shared.model.processor import ImagePreprocessor

    _, _, tower = model_parts
    pil = ImagePreprocessor(tiny_model)
    inputs = [pil(np.asarray(make_image(s, 56, 84))) for s in (21, 22, 23)]

    async def one_engine_gap() -> tuple[int, int, bool]:
        batcher = VisionBatcher(tower, asyncio.get_running_loop(), max_images=1, max_patches=10_000)
        jobs = [batcher.encode(torch.from_numpy(p), g) for p, g in inputs]
        assert batcher.has_work()
        await asyncio.to_thread(batcher.step)
        await asyncio.sleep(0)  # the futures settle on the loop
        return batcher.batches, batcher.queued, all(job.done() for job in jobs)

    assert asyncio.run(one_engine_gap()) == (3, 0, True)


def test_an_image_arriving_while_the_vit_runs_is_encoded_in_the_same_gap(model_parts, tiny_model):
    """A request's images arrive one job at a time: the one that lands during the gap's first forward is
    encoded before the engine steps again, unless the gap's ViT budget is spent."""
    import asyncio

    import numpy as np

    from services.encoder.batcher import VisionBatcher
    from services.encoder.vit_inputs import QueuedImage
    from shared.model.processor import ImagePreprocessor

    _, _, tower = model_parts
    pil = ImagePreprocessor(tiny_model)
    (first, grid1), (second, grid2) = [pil(np.asarray(make_image(s, 56, 84))) for s in (31, 32)]

    async def one_gap(budget_s: float) -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        batcher = VisionBatcher(tower, loop, max_images=1, max_patches=10_000)
        late = QueuedImage(torch.from_numpy(second), grid2, loop.create_future())

        def arrives_meanwhile(patches: torch.Tensor) -> torch.Tensor:  # runs inside the first forward
            batcher._queue.put(late)
            return patches

        job = batcher.encode(torch.from_numpy(first), grid1, prepare=arrives_meanwhile)
        await asyncio.to_thread(batcher.step, budget_s)
        await asyncio.sleep(0)
        assert job.done()
        return batcher.batches, batcher.queued

    assert asyncio.run(one_gap(budget_s=60)) == (2, 0)
    assert asyncio.run(one_gap(budget_s=0)) == (1, 1)  # budget spent: the late image waits one step


@pytest.mark.parametrize("driver", ["vision thread", "engine gap"])
def test_an_encoder_forward_waits_for_the_rest_of_its_request(model_parts, tiny_model, driver):
    """An encoder's vision thread, or the aggregated engine thread's gap between steps: a request's first
    image waits (up to the sibling wait) for the others the encoder has received but not queued yet, so
    they ride one forward; with no wait it goes alone."""
    import asyncio

    import numpy as np

    from services.encoder.batcher import VisionBatcher
    from shared.model.processor import ImagePreprocessor

    _, _, tower = model_parts
    pil = ImagePreprocessor(tiny_model)
    (first, grid1), (second, grid2) = [pil(np.asarray(make_image(s, 56, 84))) for s in (41, 42)]

    async def request(wait_s: float) -> tuple[int, int]:
        arriving = {"r": 1}  # the second image's pixels are still being pulled
        batcher = VisionBatcher(tower, asyncio.get_running_loop(), max_images=8, max_patches=10_000,
                                sibling_wait_s=wait_s, pending=lambda group: arriving.get(group, 0))
        if driver == "vision thread":
            batcher.start()
        gaps = []
        try:
            jobs = [batcher.encode(torch.from_numpy(first), grid1, group="r")]
            if driver == "engine gap":  # the engine thread calls step() between its steps
                gaps.append(asyncio.ensure_future(asyncio.to_thread(batcher.step)))
            if wait_s:
                await asyncio.sleep(0.05)  # the second pull takes a while: the first image waits for it
                assert not jobs[0].done()
            else:
                await asyncio.wait_for(jobs[0], 60)  # forwarded alone, at once
            jobs.append(batcher.encode(torch.from_numpy(second), grid2, group="r"))
            arriving["r"] = 0
            if driver == "engine gap" and not wait_s:
                await asyncio.wait_for(gaps[0], 60)
                gaps.append(asyncio.ensure_future(asyncio.to_thread(batcher.step)))  # the next gap
            await asyncio.wait_for(asyncio.gather(*jobs, *gaps), 60)
            return batcher.batches, batcher.waited
        finally:
            await asyncio.to_thread(batcher.stop)

    assert asyncio.run(request(wait_s=30)) == (1, 1)
    assert asyncio.run(request(wait_s=0)) == (2, 0)


def in_place_setup(model_parts, requests_with_reference, tiny_model):
    """What the in-place test starts from: an engine with a sequence decoding throughout, request R
    (``r9``, two images) to be parked, its images' patches, and an ``on_done`` hook per image that
    places the embeddings into R's parked prompt from the forwarding thread."""
    import numpy as np

    from shared.model.processor import ImagePreprocessor

    pil = ImagePreprocessor(tiny_model)
    engine = make_engine(model_parts)
    busy = sequence(0, requests_with_reference[0])
    busy.sampling = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)  # decodes throughout
    engine.add_prompt(busy)
    _, image_inputs, _, hf_tokens = requests_with_reference[2]
    parked_seq = sequence(9, requests_with_reference[2])
    parked_seq.images = []
    patches = [pil(np.asarray(make_image(*spec))) for spec in [(2, 60, 200), (3, 90, 90)]]
    assert [g for _, g in patches] == [i.grid for i in image_inputs]

    def placer(loop, parked):
        def place(index: int):
            image = image_inputs[index]
            return lambda embeds: loop.post(lambda e: parked.fill(e, index, [
                ImageInput(image.offset, image.grid, embeds, image.content_hash)]))
        return place

    return engine, busy, parked_seq, patches, hf_tokens, placer


def test_a_prompt_encoded_in_place_enters_the_engine_in_the_gap_that_encodes_its_images(
        model_parts, requests_with_reference, tiny_model):
    """The aggregated worker's in-place path (services/aggregated/in_place.py): request R's prompt waits
    parked, its two images queued for the ViT; the engine thread's gap between steps encodes them and the
    batcher's completion hook places each into R's prompt there, so R is prefilled in the first step
    after the gap, beside prompt P, while a sequence decodes throughout — no wait for a prompt to come
    back. R's greedy tokens are HF's."""
    import asyncio

    from services.aggregated.in_place import Parked
    from services.encoder.batcher import VisionBatcher
    from shared.engine.loop import EngineLoop

    _, _, tower = model_parts
    engine, busy, parked_seq, patches, hf_tokens, placer = in_place_setup(
        model_parts, requests_with_reference, tiny_model)
    waiting = sequence(3, requests_with_reference[3])
    steps: list[dict[str, int]] = []
    at: dict[str, int] = {}

    def record(outputs) -> None:
        steps.append({out.request_id: out.index for out in outputs})

    async def in_place() -> None:
        loop = EngineLoop(engine, record, lambda ids, message: None, asyncio.get_running_loop())
        batcher = VisionBatcher(tower, asyncio.get_running_loop(), max_images=8, max_patches=10_000)
        loop.attach(batcher)
        parked = Parked(parked_seq, [None, None], 0.0, lambda seconds: at.setdefault("entered", loop.steps),
                        lambda message: None)
        loop.start()

        def in_the_gap(pixels: torch.Tensor) -> torch.Tensor:  # the engine thread, inside the gap
            if "gap" not in at:
                engine.add_prompt(waiting)
                at["gap"] = loop.steps  # every step so far had outputs: the index of the first step after the gap
            return pixels

        place = placer(loop, parked)
        try:
            await loop.call(lambda e: None)  # the engine is stepping
            jobs = [batcher.encode(torch.from_numpy(p), g, prepare=in_the_gap, group="r9", on_done=place(i))
                    for i, (p, g) in enumerate(patches)]
            await asyncio.wait_for(asyncio.gather(*jobs), 60)
            while parked_seq.status is not Status.FINISHED:
                await asyncio.sleep(0.01)
        finally:
            await asyncio.to_thread(loop.stop)

    asyncio.run(in_place())
    assert at["entered"] == at["gap"]  # placed before the step after the gap
    assert sorted(steps[at["gap"]]) == ["r0", "r3", "r9"]  # R's prefill beside P's, in that very step
    assert parked_seq.output_ids == hf_tokens


def test_prefill_steps_in_pieces_generate_hf_tokens(model_parts, requests_with_reference):
    """Qwen2.5-VL (q|k|v with a bias) through ``shared.model.pieces``, run eagerly: prompts joining while
    others decode, image prompts split into chunks by the step budget, steps padded up to a bucket — every
    output HF's (the Qwen3-VL dense and MoE models: tests/test_qwen3.py)."""
    from shared.model.pieces import language_pieces

    _, lm, _ = model_parts
    engine = make_engine(model_parts, max_batched_tokens=96)
    pieces = language_pieces(lm, 64)
    seqs = [sequence(i, r) for i, r in enumerate(requests_with_reference)]
    lm.pieces = pieces
    try:
        run_to_completion(engine, joiners={2 * i: [seq] for i, seq in enumerate(seqs)})
    finally:
        lm.pieces = None
    for seq, request in zip(seqs, requests_with_reference):
        assert seq.output_ids == request[3], seq.request_id
    assert engine.blocks.num_free == engine.blocks.num_blocks


@pytest.mark.parametrize("grids", [[(1, 8, 12), (1, 16, 16), (1, 4, 4)], [(2, 8, 8)]])
def test_vision_tower_in_pieces_matches_its_plain_forward(model_parts, grids):
    """Qwen2.5-VL's tower (window attention, RMSNorm with the residual add fused) through
    ``shared.model.pieces``, run eagerly, padded up to a bucket: images of three sizes in one forward, and
    a two-frame clip — the same embeddings as its plain forward (itself checked against HF's tower)."""
    config, _, tower = model_parts
    plain, pieced = tower_plain_and_in_pieces(tower, config.vision.patch_dim, grids)
    torch.testing.assert_close(pieced, plain, rtol=1e-5, atol=1e-5)
