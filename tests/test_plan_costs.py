"""`epd plan`'s cost table: the decode step of a mixture of experts (the experts a batch touches, not
the batch), dense models' fit as it was, cost files written before the MoE fields; and the encoders'
batch counters carried from the frontend's metrics into a measurement's record."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from bench.epd_vs_aggregated import media_class, unloaded_row
from tools.bench.client import RequestResult
from tools.bench.scrape import ENCODER_COUNTS, parse, stage_means
from tools.plan.cost_table import Costs, preset_moe
from tools.plan.layouts import Layout
from tools.plan.model import Planner, traffic
from tools.bench.settings import Workload

ROOT = Path(__file__).resolve().parents[1]
A, B, C = 2.6, 0.023, 7e-5  # ms: fixed, per touched expert (or per row), per token of context


def touched(batch: float, experts: int = 128, top_k: int = 8) -> float:
    return experts * (1 - (1 - top_k / experts) ** batch)


def costs(decode_ms, model="m", **moe) -> Costs:
    return Costs(model, "cuda", "bf16", "448x448", 256, 0.0, 2, {1: 5.0}, {152: 8.0, 2732: 62.0}, decode_ms,
                 "torch", **moe)


def moe_steps() -> list[tuple[int, int, float]]:
    """The floor's three steps of a Qwen3-VL-30B-A3B-like MoE, from the touched-experts model."""
    return [(b, ctx, A + B * touched(b) + C * b * ctx) for b, ctx in ((1, 256), (32, 256), (32, 4096))]


def test_a_moe_step_between_the_measured_batches_follows_the_experts_touched():
    moe = costs(moe_steps(), moe_experts=128, moe_top_k=8)
    linear = costs(moe_steps())  # the same steps, fitted as a dense model's
    assert moe.moe and not linear.moe
    assert touched(1) == pytest.approx(8) and touched(32) == pytest.approx(111.8, abs=0.1)
    assert moe.decode_fit() == pytest.approx((A, B, C))
    for batch in (2, 4, 8, 16, 24):
        for context in (256, 1500, 4096):
            exact = A + B * touched(batch) + C * batch * context
            assert moe.decode_step(batch, context) == pytest.approx(exact, rel=1e-9)
    # a line through batch 1 and 32 runs under the curve in between: 7.6 / 11.8 / 11.6 % low at batch 4 / 8 / 16
    for batch, low in ((4, 0.075), (8, 0.115), (16, 0.115)):
        exact = A + B * touched(batch) + C * batch * 256
        assert linear.decode_step(batch, 256) < (1 - low) * exact
    # per row at a full engine (capacity), and a batch's rows inside a prompt's step (whose experts are the
    # chunk's already): the step shared out, and only the rows' KV
    assert moe.decode_per_token(256, 1000) == pytest.approx((A + B * touched(256)) / 256 + C * 1000)
    assert moe.decode_per_token(float("inf"), 1000) == pytest.approx(C * 1000)
    assert moe.decode_rows(8, 1000) == pytest.approx(C * 8 * 1000)


def test_a_dense_models_decode_fit_is_unchanged():
    steps = [(1, 256, 4.45), (32, 256, 5.3), (32, 4096, 6.9)]
    dense = costs(steps)
    rows = np.array([[1.0, b, b * ctx] for b, ctx, _ in steps])
    coef, *_ = np.linalg.lstsq(rows, np.array([m for *_, m in steps]), rcond=None)
    a, b, c = (max(0.0, float(x)) for x in coef)
    assert dense.decode_fit() == (a, b, c)
    for batch, context in ((1, 256), (7.3, 1800), (64, 4096)):
        assert dense.decode_step(batch, context) == a + b * batch + c * batch * context
        assert dense.decode_rows(batch, context) == pytest.approx(batch * (b + c * context))
    assert dense.decode_per_token(256, 1800) == pytest.approx(b + c * 1800 + a / 256)
    w = Workload(image_count=10, image_resolution="448x448", input_len=128, output_len=1024)
    t = traffic(w, 1.0)
    context = t.mean(lambda n: dense.prompt_tokens(t.input_len, n)) + t.output_len / 2
    planner = Planner(dense)
    gpu = t.mean(lambda n: planner.vit(n) + planner.prefill(t, n)) * 1e3
    assert planner.capacity(t) == pytest.approx(1e3 / (gpu + 1024 * (b + c * context + a / 256)))


def test_a_moe_tpot_is_the_step_at_its_own_batch():
    moe = costs(moe_steps(), moe_experts=128, moe_top_k=8)
    w = Workload(image_count=10, image_resolution="448x448", input_len=128, output_len=1024)
    t = traffic(w, 1.4)
    planner = Planner(moe)
    split = planner.predict(Layout("disaggregated", 3, "split", False, 1, 1, 1), t)
    batch = t.rate * t.output_len * split.tpot_ms / 1e3  # Little's law
    assert split.tpot_ms == pytest.approx(planner.step(t)(batch) * 1e3, rel=1e-4)
    dense = Planner(costs(moe_steps())).predict(Layout("disaggregated", 3, "split", False, 1, 1, 1), t)
    assert split.tpot_ms > dense.tpot_ms  # at a batch of ~8, between the measured 1 and 32


def test_cost_files_without_the_moe_fields_still_load():
    old = costs(moe_steps(), model="preset-qwen3-vl-30b-a3b-v3").to_json()
    del old["moe_experts"], old["moe_top_k"]
    loaded = Costs.from_json(json.loads(json.dumps(old)))
    assert (loaded.moe_experts, loaded.moe_top_k) == (128, 8)  # from the preset the model names
    for model in ("preset-qwen2.5-vl-7b-v3", "preset-qwen3-vl-2b-v3", "some-checkpoint"):
        assert Costs.from_json({**old, "model": model}).moe is False
    assert preset_moe("Qwen3-VL-235B-A22B-Instruct") == (128, 8)
    assert preset_moe("preset-qwen3-vl-2b-v3") == (0, 0)
    # fields a file has win over its name (a dense table of a MoE model stays dense)
    assert Costs.from_json(costs(moe_steps(), model="preset-qwen3-vl-30b-a3b-v3").to_json()).moe is False
    with gzip.open(ROOT / "bench/results/serving/qwen3-dynamo/results.json.gz") as recorded_run:
        floor = json.load(recorded_run)["floor"]
    recorded = Costs.from_json(floor["costs"]["448x448"])
    assert recorded.moe and recorded.decode_ms
    for batch, context, ms in recorded.decode_ms:  # three steps, three coefficients: through every one
        assert recorded.decode_step(batch, context) == pytest.approx(ms, rel=1e-6)


def metrics(vit_s: float, images: int, batches: tuple[int, int], waited: tuple[int, int]) -> str:
    lines = [f'epd_service_stat{{instance="encoder-a",service="epd-encoder",stat="vit_forward_seconds_total"}} {vit_s}',
             f'epd_service_stat{{instance="encoder-a",service="epd-encoder",stat="vit_forward_count"}} {images}']
    for instance, b, w in zip("ab", batches, waited):
        lines += [f'epd_service_stat{{instance="encoder-{instance}",service="epd-encoder",stat="batches"}} {b}',
                  f'epd_service_stat{{instance="encoder-{instance}",service="epd-encoder",stat="batches_waited"}} {w}']
    return "\n".join(lines)


def test_the_encoders_batch_counters_reach_the_record():
    before, after = parse(metrics(2.0, 20, (5, 3), (1, 0))), parse(metrics(2.4, 30, (9, 4), (3, 1)))
    assert after.counts == {"batches": 13, "batches_waited": 4}  # summed over the encoders
    _, encoder = stage_means(before, after)
    # the stage a mean per image (ms), the counters how many over the measurement
    assert encoder == {"vit_forward": pytest.approx(40.0), "batches": 5, "batches_waited": 3}
    assert stage_means(parse(""), parse(""))[1] == {}
    w = dict(image_count=2, image_resolution="448x448", input_len=8, output_len=4)
    request = RequestResult(0, "image", 2, ok=True, ttft=0.1, e2e=0.2, completion_tokens=4).record()
    record = {"topology": "E/PD", "request_class": media_class(w), "requests": [request],
              "summary": {"ttft_ms": {"mean": 100.0}}, "stages_ms": {"encode": 30.0},
              "encoder_ms": {**encoder, "vit_queue": 2.0}, "floor_ms": {"floor_ms": 80.0}, "resumed": 0}
    row = unloaded_row("E/PD", w, [record])
    assert {k: row["encoder_ms"][k] for k in ENCODER_COUNTS if k in row["encoder_ms"]} == {"batches": 5,
                                                                                         "batches_waited": 3}
    assert row["encoder_ms"]["vit_queue"] == 2.0


def test_the_floors_decode_rows_route_as_real_tokens_do(tmp_path):
    """Each row of the probe's decode batch has its own token: rows of one token would all route to the
    same top-k experts, and a MoE batch's step would read k experts a layer instead of up to E."""
    from bench.engine.roofline import TouchedExperts
    from shared.engine.settings import EngineSettings
    from shared.model.config import ModelConfig
    from shared.model.tiny import write_tiny_checkpoint
    from shared.settings import parse_settings
    from tools.plan.costs import EngineProbe, moe_fields

    path = write_tiny_checkpoint(tmp_path, family="qwen3_vl_moe")
    config = ModelConfig.from_checkpoint(path)
    assert moe_fields(config) == {"moe_experts": 8, "moe_top_k": 2}
    settings = parse_settings(EngineSettings, ["--model", str(path), "--max-model-len", "1024", "--kv-cache-mb", "64"],
                              "probe")
    probe = EngineProbe(settings)
    with probe.decoding(8, 32) as step, TouchedExperts(probe.engine.runner.model) as touched:
        step()
    counts = touched.counts[-len(touched.blocks):]
    assert counts and min(counts) > 2  # one token's 2 experts; 8 tokens of their own: 7.2 expected


def test_the_language_workers_split_of_first_token_reaches_the_record():
    """The workers' per-prompt stages (intake, wait in the engine, prefill) come out of /metrics as means
    per prompt, summed over instances, and `plan_accuracy --stages` splits first_token by them."""
    from bench.plan_accuracy import first_token_split

    def reading(wait: float, prefill: float, intake: float, pull: float, prompts: int) -> str:
        lines = []
        for instance in "ab":  # two workers, each half of it
            for stage, seconds in (("prompt_wait", wait), ("prompt_prefill", prefill), ("prompt_intake", intake),
                                   ("prompt_pull", pull), ("prompt_handoff", pull / 3)):
                lines += [f'epd_service_stat{{instance="language-{instance}",service="epd-language",'
                          f'stat="{stage}_seconds_total"}} {seconds / 2}',
                          f'epd_service_stat{{instance="language-{instance}",service="epd-language",'
                          f'stat="{stage}_count"}} {prompts / 2}']
        return "\n".join(lines)

    _, workers = stage_means(parse(reading(0.0, 0.0, 0.0, 0.0, 0)), parse(reading(0.1, 0.5, 0.2, 0.15, 10)))
    assert workers == {"prompt_wait": pytest.approx(10.0), "prompt_prefill": pytest.approx(50.0),
                       "prompt_intake": pytest.approx(20.0), "prompt_pull": pytest.approx(15.0),
                       "prompt_handoff": pytest.approx(5.0)}
    assert first_token_split({"first_token": 95.0}, workers) == \
        "  first token: intake 20.0 (pulls 15.0, to the engine thread 5.0) + wait 10.0 + prefill 50.0, rest 15.0"
    assert first_token_split({"first_token": 95.0}, {**workers, "pull_serve": 4.0}) == \
        "  first token: intake 20.0 (pulls 15.0 [holder 4.0], to the engine thread 5.0) + wait 10.0 + prefill 50.0, " \
        "rest 15.0"
    del workers["prompt_pull"], workers["prompt_handoff"]  # records from before these were timed apart
    assert first_token_split({"first_token": 95.0}, workers) == \
        "  first token: intake 20.0 + wait 10.0 + prefill 50.0, rest 15.0"
    assert first_token_split({"first_token": 95.0}, {}) == ""


def test_the_encode_stage_splits_with_and_without_encode_jobs():
    """`plan_accuracy --stages` splits the encode stage by the encoders' means: with encode jobs (pull,
    settle), and in place (the aggregated worker: no jobs, the rest is the stage less queue and forward);
    the forward's launch and GPU span where the record kept them."""
    from bench.plan_accuracy import encode_split

    jobs = {"vit_queue": 2.0, "vit_forward": 30.0, "job_pull": 1.5, "job_encode": 33.0}
    assert encode_split({"encode": 45.0}, jobs) == "  encode: queue 2.0 + forward 30.0, settle 1.0, rest 11.5"
    in_place = {"vit_queue": 8.0, "vit_forward": 34.0, "vit_forward_launch": 29.0, "vit_forward_gpu": 33.5}
    assert encode_split({"encode": 47.0}, in_place) == \
        "  encode: queue 8.0 + forward 34.0 (launch 29.0, GPU 33.5), rest 5.0"
    assert encode_split({"encode": 47.0}, {"vit_queue": 8.0}) == ""
    assert encode_split({}, in_place) == ""
