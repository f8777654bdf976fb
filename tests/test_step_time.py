"""The step-time model and the time budget it sets: the fit against step times drawn from known costs
(as an H200 serving a 7B has them), how it follows a device that slows down, and the chunks the
scheduler cuts from it. Pure CPU arithmetic: no model runs here (tests/test_chunked_prefill.py runs the
budget on the tiny model against HF)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from shared.engine.block_manager import BlockManager
from shared.engine.warmup import trials
from shared.engine.sampling import SamplingParams
from shared.engine.scheduler import BACKLOG_S, Plan, Scheduler
from shared.engine.sequence import Sequence, Status
from shared.engine.step_time import SCALES, StepShape, StepTimes

# ms per step, per 1k tokens, per 1M attention pairs, per 100k decode context tokens: a 7B on an H200
# (prefill ~27 µs a token, a decode step of 64 rows × 2k context ~7 ms)
H200_7B = np.array([6.0, 26.0, 0.6, 1.6])


def step_ms(theta: np.ndarray, shape: StepShape) -> float:
    return float(theta @ shape.features())


def serving_shapes(rng: np.random.Generator, count: int) -> list[StepShape]:
    """Steps as a loaded engine makes them: decode rows of various contexts and a chunk or two."""
    out = []
    for _ in range(count):
        contexts = rng.integers(150, 3000, rng.integers(8, 120)).tolist()
        shape = StepShape.of_decode(contexts)
        for _ in range(rng.integers(1, 3)):
            shape = shape.with_chunk(int(rng.integers(0, 2000)), int(rng.integers(16, 2500)))
        out.append(shape)
    return out


def calibrated(theta: np.ndarray, noise: float = 0.0, seed: int = 0) -> StepTimes:
    rng = np.random.default_rng(seed)
    times = StepTimes()
    times.calibrate([(t.shape(), step_ms(theta, t.shape()) * (1 + noise * rng.standard_normal()) / 1e3)
                     for t in trials(8192, 16, 20000, 32768, 256)])
    return times


def mean_error(times: StepTimes, theta: np.ndarray, shapes: list[StepShape]) -> float:
    return float(np.mean([abs(times.predict(s) * 1e3 / step_ms(theta, s) - 1) for s in shapes]))


def test_calibration_trials_alone_recover_the_costs():
    """The start-up's eight trial steps, timed exactly, determine every coefficient."""
    times = calibrated(H200_7B)
    assert np.allclose(times.fit.theta, H200_7B, rtol=1e-2)
    assert mean_error(times, H200_7B, serving_shapes(np.random.default_rng(1), 200)) < 1e-3


def test_fit_converges_on_noisy_serving_steps():
    """Calibrated on noisy trials (5 %), then corrected by 400 serving steps (5 % noise): predictions of
    steps it has not seen come within 3 % of the true cost on average, and every step's error is counted."""
    rng = np.random.default_rng(2)
    times = calibrated(H200_7B, noise=0.05, seed=3)
    for shape in serving_shapes(rng, 400):
        times.observe(shape, step_ms(H200_7B, shape) * (1 + 0.05 * rng.standard_normal()) / 1e3)
    assert mean_error(times, H200_7B, serving_shapes(rng, 200)) < 0.03
    assert times.error_count == 400 and 0.02 < times.error_total / times.error_count < 0.1


def test_fit_follows_a_device_that_slows_down():
    """Calibrated alone on the GPU, then everything 1.5x slower (another process shares it): within 150
    steps the predictions are within 5 % of the new costs."""
    rng = np.random.default_rng(4)
    times, slow = calibrated(H200_7B), H200_7B * 1.5
    shapes = serving_shapes(rng, 150)
    assert mean_error(times, slow, shapes) > 0.3
    for shape in shapes:
        times.observe(shape, step_ms(slow, shape) * (1 + 0.03 * rng.standard_normal()) / 1e3)
    assert mean_error(times, slow, serving_shapes(rng, 100)) < 0.05


def test_steady_steps_do_not_wind_the_fit_up():
    """3,000 steps alike (a steady load): the costs they never varied keep what the calibration knew
    (forgotten towards nothing, the fit was 34 % off on other shapes), and one odd step then does not
    swing the prediction of the others."""
    rng = np.random.default_rng(5)
    times = calibrated(H200_7B)
    steady = StepShape.of_decode([1000] * 64).with_chunk(0, 1500)
    for _ in range(3000):
        times.observe(steady, step_ms(H200_7B, steady) * (1 + 0.02 * rng.standard_normal()) / 1e3)
    others = serving_shapes(rng, 200)
    assert mean_error(times, H200_7B, others) < 0.03
    odd = StepShape().with_chunk(0, 8000)
    times.observe(odd, step_ms(H200_7B, odd) * 1.05 / 1e3)
    assert mean_error(times, H200_7B, others) < 0.06


@pytest.mark.parametrize("start", [0, 700, 5000])
def test_chunk_tokens_is_the_most_that_fits(start):
    times = calibrated(H200_7B)
    shape = StepShape.of_decode([1200] * 40)
    for ms in (5.0, 20.0, 50.0, 120.0):
        n = times.chunk_tokens(shape, start, 100_000, ms / 1e3)
        assert n == 0 and times.predict(shape) > ms / 1e3 or \
            times.predict(shape.with_chunk(start, n)) <= ms / 1e3 < times.predict(shape.with_chunk(start, n + 1))
    assert times.chunk_tokens(shape, start, 300, 1.0) == 300  # the prompt's end comes first


def test_uncalibrated_model_sets_no_limit():
    assert StepTimes().chunk_tokens(StepShape.of_decode([100]), 0, 4096, 0.01) == 4096


def test_only_steps_that_waited_for_the_device_are_learnt():
    """A step that sampled nothing returned before its kernels ended: neither it nor the step after it
    (which waited for them too) is an observation."""
    times = StepTimes()
    prefill = Plan("prefill", [], StepShape.of_decode([50]).with_chunk(0, 100), paced=True)
    times.step_ended(prefill, 0.02, sampled=False)
    times.step_ended(prefill, 0.05, sampled=True)
    assert times.observed == 0 and times.paced == 2
    times.step_ended(prefill, 0.02, sampled=True)
    times.step_ended(Plan("decode", [], StepShape.of_decode([50])), 0.005, sampled=True)
    times.step_ended(prefill, 0.02, sampled=True)
    assert times.observed == 2 and times.error_count == 2
    assert times.stats()["steps_timed"] == 2


# -- the scheduler's budget ------------------------------------------------------------------------------
THETA = np.array([2.0, 10.0, 0.0, 0.0])  # 2 ms a step, 10 µs a token


def exact(theta: np.ndarray) -> StepTimes:
    times = StepTimes()
    times.calibrate([(t.shape(), step_ms(theta, t.shape()) / 1e3) for t in trials(8192, 16, 20000, 32768, 256)])
    return times


def scheduler(theta: np.ndarray, target_s: float, decoding: int, prompts: tuple[int, ...] = (600,)) -> Scheduler:
    """1,024 tokens a step, ``decoding`` sequences past their 100-token prompts, prompts of ``prompts``
    tokens waiting."""
    blocks = BlockManager(2048, 16)
    sched = Scheduler(blocks, 256, 1024, swapper=None, step_times=exact(theta), target_s=target_s)
    params = SamplingParams(temperature=0, max_tokens=100)
    for i in range(decoding):
        seq = Sequence(f"d{i}", [1] * 101, 100, params, status=Status.RUNNING, num_computed=100)
        blocks.allocate(seq, 101)
        sched.add_running(seq)
    for i, tokens in enumerate(prompts):
        sched.add_waiting(Sequence(f"p{i}", [2] * tokens, tokens, params))
    return sched


def prompt_tokens(plan: Plan) -> int:
    return sum(c.num_tokens for c in plan.chunks if not c.seq.decoding)


def test_steps_with_decode_rows_take_what_the_target_leaves():
    """4 rows: 2.04 ms predicted before prompts; a 5 ms target leaves room for 296 prompt tokens, 96
    once 2 ms of the gap went to other work (the aggregated ViT); a target below the rows' own cost
    would give the prompt a block a step, and yields (last test below)."""
    plan = scheduler(THETA, 0.005, decoding=4).schedule()  # (the fit's ridge may cost the last token)
    assert plan.kind == "prefill" and prompt_tokens(plan) in (295, 296) and plan.paced
    assert plan.shape.decode_rows == 4 and plan.shape.prompt_tokens == prompt_tokens(plan)
    assert prompt_tokens(scheduler(THETA, 0.005, decoding=4).schedule(spent_s=0.002)) in (95, 96)
    assert prompt_tokens(scheduler(THETA, 0.001, decoding=4).schedule()) == 600
    assert scheduler(THETA, 0.005, decoding=4).gap_budget_s() == pytest.approx(0.00296, rel=1e-3)


def test_steps_without_decode_rows_or_budget_use_the_token_budget():
    for sched, rows in ((scheduler(THETA, 0.005, decoding=0, prompts=(3000,)), 0),
                        (scheduler(THETA, 0.0, decoding=4, prompts=(3000,)), 4)):
        plan = sched.schedule()
        assert prompt_tokens(plan) == 1024 - rows and not plan.paced
    assert scheduler(THETA, 0.005, decoding=0).gap_budget_s() is None
    assert scheduler(THETA, 0.0, decoding=4).gap_budget_s() is None


def test_the_budget_yields_to_a_queue_it_would_delay_by_more_than_a_target_step():
    """4 rows and the 5 ms target: a budgeted step takes 296 prompt tokens where a token-sized one takes
    1,020, and every step pays the rows' 2.04 ms. Draining 600 queued tokens so costs 2.04 × (600/296 −
    600/1,020) = 2.9 ms more: the budget holds. 1,200 (two prompts) cost 5.9 ms, 3,000 (one) 14.7 ms,
    more than the 5 ms step: steps are sized by tokens, and the ViT's gap is not cut either."""
    assert scheduler(THETA, 0.005, decoding=4, prompts=(600,)).schedule().paced
    for prompts in ((600, 600), (3000,)):
        sched = scheduler(THETA, 0.005, decoding=4, prompts=prompts)
        assert sched.yields() and sched.gap_budget_s() is None
        plan = sched.schedule()
        assert prompt_tokens(plan) == 1024 - 4 and not plan.paced
    sched = scheduler(THETA, 0.005, decoding=4, prompts=(600, 900))
    assert sched.yields()  # 1,500 tokens: 7.3 ms more
    for chunk in sched.schedule().chunks[4:]:  # computed: the first prompt, 420 tokens of the second
        chunk.seq.num_computed = chunk.end
    assert not sched.yields() and sched.schedule().paced  # 480 left beside 5 rows, 2.4 ms: the budget again


def test_a_prompt_waiting_past_the_backlog_bound_lifts_the_time_budget():
    """A prompt late for any TTFT a user accepts gets steps sized by tokens, however short the queue
    (the step-time model may have been wrong about it), waiting or partly prefilled; the budget comes back
    once no prompt is that late."""
    sched = scheduler(THETA, 0.005, decoding=4)
    late = time.monotonic() - BACKLOG_S - 0.1
    sched.waiting[0].arrival = late
    plan = sched.schedule()
    assert prompt_tokens(plan) == 600 and not plan.paced and sched.gap_budget_s() is None

    sched = scheduler(THETA, 0.005, decoding=4, prompts=(1000,))
    assert sched.schedule().paced  # its first chunk, cut to the budget; the rest is still to prefill
    prompt = next(s for s in sched.running if not s.decoding)  # admitted: its chunks are planned again
    prompt.arrival = late
    assert prompt_tokens(sched.schedule()) == 1000
    prompt.num_computed = 1000  # computed: it decodes now
    sched.add_waiting(Sequence("q", [3] * 300, 300, SamplingParams(temperature=0, max_tokens=4)))
    assert sched.schedule().paced and sched.gap_budget_s() is not None  # none late: the budget again


def test_feature_scales_keep_an_h200_step_near_one():
    """The scaling that keeps the fit conditioned: a full 8,192-token step's features are O(1-100)."""
    x = StepShape.of_decode([2048] * 64).with_chunk(0, 8192).features()
    assert len(x) == len(SCALES) and 0.5 < max(x[1:]) < 100
