"""`epd bench` against a real stack, the three topologies' greedy answers against HF, and `epd plan` (its
layouts, its model, its CLI). The bench scripts run end to end in test_bench_sweep.py and test_bench_scripts.py."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools.bench.client import RequestResult
from tools.bench.dataset import build_requests
from tools.bench.metrics import Slo, request_itl_p99, summarize, ttft_trend
from tools.bench.scrape import parse, stage_means
from tools.plan.costs import Costs
from tools.plan.layouts import Layout, bench_layouts, layouts
from tools.plan.model import TIMESLICE, Planner, traffic
from tools.plan.queueing import erlang_c, mdc_wait
from tools.plan.simulate import Arrival, poisson, simulate
from tools.bench.runner import arrival_times
from tools.bench.settings import BenchSettings, Workload
from launcher.up import UpSettings
from shared.settings import parse_settings
from tests.support import chat_messages, make_image
from tests.test_up import descendants

OUTPUT_LEN = 6
PROMPTS = 6


def epd(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def bench_run(stack, tiny_model, tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict, Path]:
    out = tmp_path_factory.mktemp("bench") / "run.json"
    done = epd("bench", "--base-url", stack.base_url, "--label", "disaggregated", "--num-prompts", str(PROMPTS),
               "--warmup", "1", "--request-rate", "20", "--max-concurrency", "4", "--seed", "1", "--input-len", "16", "--output-len",
               str(OUTPUT_LEN), "--image-count", "2", "--random-image-count", "--image-resolution", "64x48",
               "--text-ratio", "0.5", "--tokenizer", str(tiny_model), "--goodput", "ttft:60000",
               "--out", str(out))
    return done, json.loads(out.read_text()) if out.exists() else {}, out


def test_bench_reports_every_metric(bench_run):
    done, results, _ = bench_run
    assert done.returncode == 0, done.stderr[-2000:]
    for metric in ("TTFT", "TPOT", "ITL", "E2E", "TTFT [text]", "TTFT [image]", "goodput"):
        assert metric in done.stdout
    summary = results["summary"]
    assert (summary["requests"], summary["completed"], summary["failed"]) == (PROMPTS, PROMPTS, 0)
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(summary[name]) == {"mean", "p50", "p90", "p99"}
        assert 0 < summary[name]["p50"] <= summary[name]["p99"]
    assert 0 < summary["goodput"] == pytest.approx(summary["request_throughput"])  # a 60 s SLO: all good
    assert set(results["classes"]) == {"text", "image"}
    assert sum(c["completed"] for c in results["classes"].values()) == PROMPTS
    assert results["label"] == "disaggregated" and results["request_rate"] == 20


def test_bench_numbers_are_consistent(bench_run):
    _, results, _ = bench_run
    requests = results["requests"]
    assert all(r["ok"] and 0 < r["ttft"] <= r["e2e"] for r in requests)
    assert all(r["completion_tokens"] == OUTPUT_LEN and r["finish_reason"] == "length" for r in requests)
    assert all(len(r["itl"]) <= OUTPUT_LEN - 1 for r in requests)
    assert results["summary"]["completion_tokens"] == PROMPTS * OUTPUT_LEN
    text = [r["prompt_tokens"] for r in requests if r["kind"] == "text"]
    image = [r["prompt_tokens"] for r in requests if r["kind"] == "image"]
    assert max(text) - min(text) <= 2  # sized with the tokenizer: the same length every time
    assert min(image) > max(text)  # images add their tokens
    assert all(1 <= r["images"] <= 2 for r in requests if r["kind"] == "image")
    e2e = sorted(r["e2e"] * 1e3 for r in requests)
    assert results["summary"]["e2e_ms"]["mean"] == pytest.approx(sum(e2e) / len(e2e))


def test_bench_plot_draws_one_line_per_label(bench_run, tmp_path):
    _, results, path = bench_run
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**results, "label": "aggregated", "request_rate": 10}))
    done = epd("bench", "plot", str(path), str(other), "--out", str(tmp_path / "plot.png"))
    assert done.returncode == 0, done.stderr[-2000:]
    png = (tmp_path / "plot.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_requests_are_seeded_and_mixed_as_asked():
    settings = BenchSettings(image_count=3, random_image_count=True, text_ratio=0.5, input_len=8)
    first, distinct = build_requests(settings, 40, seed=5)
    assert build_requests(settings, 40, seed=5)[0] == first
    kinds = [r.kind for r in first]
    assert 10 < kinds.count("text") < 30
    assert distinct == sum(len(r.image_ids) for r in first)  # no repeats asked: every image is new
    repeated, distinct = build_requests(settings.model_copy(update={"repeat_ratio": 1.0}), 40, seed=5)
    assert distinct <= 3  # after the first image request, every image is one seen before


def test_arrivals_are_seeded_poisson():
    times = arrival_times(4000, 50.0, seed=2)
    assert times == arrival_times(4000, 50.0, seed=2) and times[0] == 0.0
    assert sorted(times) == times and times[-1] / 3999 == pytest.approx(1 / 50, rel=0.05)
    assert arrival_times(3, float("inf"), seed=2) == [0.0, 0.0, 0.0]


def test_queueing_formulas():
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert mdc_wait(0.5, 1.0) == pytest.approx(0.5)  # M/D/1: ρS / 2(1 − ρ)
    assert mdc_wait(1.0, 1.0) == float("inf")
    assert mdc_wait(1.0, 1.0, servers=2) < mdc_wait(0.5, 1.0)


def test_topology_flags_place_services_round_robin():
    settings = parse_settings(UpSettings, ["--topology", "disaggregated", "--pd", "split", "--encoders", "3",
                                           "--encoder-gpus", "1,2", "--prefill-gpus", "0", "--decode-gpus", "0"],
                              "epd up")
    assert [(p.kind, p.gpu) for p in settings.placements()] == [
        ("encoder", "1"), ("encoder", "2"), ("encoder", "1"), ("prefill", "0"), ("decode", "0")]
    aggregated = parse_settings(UpSettings, ["--topology", "aggregated", "--aggregated", "2", "--gpus", "0,1"], "epd up")
    assert [(p.kind, p.gpu) for p in aggregated.placements()] == [("aggregated", "0"), ("aggregated", "1")]
    assert aggregated.worker_counts() == {"aggregated": 2}
    for wrong in (["--topology", "aggregated", "--encoders", "2"], ["--topology", "colocated", "--decode-gpus", "1"],
                  ["--gpus", "0,,1"]):
        with pytest.raises(Exception, match="topology|GPU ids"):
            parse_settings(UpSettings, wrong, "epd up")


class Launcher:
    """`epd up` in a subprocess, its log in a file (an unread pipe would stall the services)."""

    def __init__(self, tiny_model: Path, log: Path, *args: str):
        env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
        env.update(EPD_MODEL=str(tiny_model), EPD_KV_CACHE_MB="32", EPD_LOG_FORMAT="json")
        self.log = log
        self.process = subprocess.Popen([sys.executable, "-m", "launcher.cli", "up", "--port", "0", *args], env=env,
                                        stderr=log.open("w"), stdout=subprocess.DEVNULL)

    def ready(self, timeout: float = 240) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log.read_text().splitlines():
                if '"stack.ready"' in line:
                    return json.loads(line)
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            time.sleep(0.5)
        pytest.fail("stack did not come up: " + self.log.read_text()[-3000:])

    def wait_stopped(self) -> None:
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()


@pytest.fixture(scope="module")
def topology_stacks(tiny_model, tmp_path_factory):
    """Aggregated and colocated stacks, started side by side (the session stack is the disaggregated one)."""
    logs = tmp_path_factory.mktemp("topologies")
    launchers = {"aggregated": Launcher(tiny_model, logs / "aggregated.log", "--topology", "aggregated"),
                 "colocated": Launcher(tiny_model, logs / "colocated.log", "--topology", "colocated", "--gpus", "0")}
    try:
        yield {name: (launcher, launcher.ready()) for name, launcher in launchers.items()}
    finally:
        for launcher in launchers.values():
            launcher.process.terminate()  # both drain at once
        for launcher in launchers.values():
            launcher.wait_stopped()


CASES = {"text": ("Hello! How are you today?", []), "image": ("Describe the image in one sentence.", [(11, 100, 150)])}


@pytest.mark.parametrize("case", CASES)
def test_every_topology_answers_like_hf(topology_stacks, stack, reference, case):
    from openai import OpenAI

    text, specs = CASES[case]
    images = [make_image(*spec) for spec in specs]
    expected = reference.text(reference.generate(text, images, 24))
    urls = {"disaggregated": stack.base_url, **{name: ready["api"] for name, (_, ready) in topology_stacks.items()}}
    for name, url in urls.items():
        client = OpenAI(base_url=url, api_key="test", max_retries=0)
        answer = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=24, temperature=0,
                                                messages=chat_messages(text, images))
        assert answer.choices[0].message.content == expected, name


def test_topologies_run_the_processes_they_name(topology_stacks):
    aggregated, ready = topology_stacks["aggregated"]
    assert ready["topology"] == "aggregated" and ready["aggregated"] == 1
    kinds = {command_kind(pid) for pid in descendants(aggregated.process.pid)}
    assert {"aggregated", "frontend"} <= kinds and not kinds & {"encoder", "prefill", "decode"}
    colocated, _ = topology_stacks["colocated"]
    placed = {command_kind(pid): gpu_env(pid) for pid in descendants(colocated.process.pid)}
    assert {placed[kind] for kind in ("encoder", "language")} == {"0"}  # joined (E/PD), all on --gpus 0


def command_kind(pid: int) -> str:
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    module = next((a.decode() for a in args if a.startswith(b"services.")), "")
    return module.removeprefix("services.")


def gpu_env(pid: int) -> str | None:
    for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        if item.startswith(b"CUDA_VISIBLE_DEVICES="):
            return item.split(b"=", 1)[1].decode()
    return None


def test_plan_recommends_a_topology(tiny_model, tmp_path):
    out = tmp_path / "plan.json"
    done = epd("plan", "--model", str(tiny_model), "--image-count", "2", "--image-resolution", "112x112",
               "--input-len", "16", "--output-len", "8", "--request-rate", "0.1", "--gpus", "2",
               "--max-model-len", "512", "--corun-seconds", "0.1", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "recommended:" in done.stdout
    plan = json.loads(out.read_text())
    [at_rate] = plan["rates"]
    topologies = {p["topology"] for p in at_rate["predictions"]}
    assert topologies == {"aggregated", "colocated", "disaggregated"}
    assert {p["layout"] for p in at_rate["predictions"]} == {layout.label() for layout in layouts(2)}
    best = at_rate["recommended"]
    assert best["stable"] and best["layout"] in done.stdout
    # A lightly loaded stack answers in about one request's own work: at least its prompt's prefill.
    assert best["ttft_ms"] >= min(plan["costs"]["prefill_ms"].values())
    pairs = {"vit|decode", "decode|vit", "vit|prefill", "prefill|vit"}  # streams (MPS-like), processes (time-sliced)
    assert set(plan["costs"]["corun"]) == pairs | {f"ts:{pair}" for pair in pairs}


# -- goodput with an ITL SLO ------------------------------------------------------------------------------
def result(ttft: float, gaps: list[float], ok: bool = True) -> RequestResult:
    return RequestResult(0, "image", 1, ok=ok, ttft=ttft, e2e=ttft + sum(gaps), itl=gaps,
                         completion_tokens=len(gaps) + 1)


def test_itl_slo_holds_each_request_to_its_own_p99_gap():
    steady = result(0.5, [0.01] * 199 + [0.3])  # one 300 ms stall in 200 gaps: its p99 is still 10 ms
    stalled = result(0.5, [0.01] * 49 + [0.3])  # the same stall in 50 gaps is past its 99th percentile
    assert request_itl_p99(steady) == pytest.approx(0.01)
    assert request_itl_p99(stalled) > 0.1
    slo = Slo(ttft_ms=2000, itl_ms=100)
    assert slo.met(steady) and not slo.met(stalled)
    assert slo.met(result(1.9, [])) and not slo.met(result(2.1, []))  # one token: no gaps to hold
    assert not slo.met(result(0.5, [0.01], ok=False))
    summary = summarize([steady, stalled, result(2.5, [0.01] * 10)], duration=2.0, slo=slo)
    assert summary["good"] == 1 and summary["goodput"] == pytest.approx(0.5)
    assert summary["slo"] == {"ttft_ms": 2000, "tpot_ms": 0.0, "itl_ms": 100}
    assert summary["itl_ms"]["p99"] < 300  # pooled over every gap of the run: the stalls are rare
    assert summary["request_itl_p99_ms"]["p50"] == pytest.approx(10.0)
    assert summarize([steady, stalled], 1.0)["good"] == 2  # no SLO set: every finished request is good


def test_ttft_trend_reads_a_growing_queue():
    def sent(at: float, ttft: float) -> RequestResult:
        return RequestResult(0, "text", 0, ok=True, sent_at=at, ttft=ttft, e2e=ttft + 0.1)

    # offered 2x what the server sustains (one a second, sent every half second): rho - 1 = 1
    growing = [sent(0.5 * i, 0.2 + 0.5 * i) for i in range(20)]
    assert summarize(growing, 10.0)["ttft_trend"] == pytest.approx(1.0)
    assert ttft_trend([sent(0.5 * i, 0.2 + 0.01 * (i % 3)) for i in range(20)]) == pytest.approx(0.0, abs=0.01)
    assert ttft_trend(growing[:2]) is None  # too few
    assert ttft_trend([sent(0.001 * i, 0.2 + i) for i in range(20)]) is None  # a burst: no arrivals to read


def test_stage_means_from_the_frontends_metrics():
    def metrics(media: float, requests: int, vit: float, images: int) -> str:
        return "\n".join([f'epd_stage_seconds_sum{{stage="media"}} {media}',
                          f'epd_stage_seconds_count{{stage="media"}} {requests}',
                          f'epd_service_stat{{instance="encoder-a",service="epd-encoder",stat="vit_forward_seconds_total"}} {vit}',
                          f'epd_service_stat{{instance="encoder-a",service="epd-encoder",stat="vit_forward_count"}} {images}',
                          'epd_service_stat{instance="encoder-b",service="epd-encoder",stat="vit_forward_count"} 1',
                          'epd_service_stat{instance="encoder-b",service="epd-encoder",stat="vit_forward_seconds_total"} 0.1'])
    before, after = parse(metrics(1.0, 10, 2.0, 20)), parse(metrics(1.5, 15, 2.4, 30))
    frontend, encoder = stage_means(before, after)
    assert frontend == {"media": pytest.approx(100.0)} and encoder == {"vit_forward": pytest.approx(40.0)}
    assert after.images_encoded == 31  # both encoders


# -- the planner's layouts and model ----------------------------------------------------------------------
def test_layouts_are_what_epd_up_accepts():
    assert [layout.label() for layout in bench_layouts(1)] == ["aggregated", "E/PD", "E/PD+MPS", "E/P/D", "E/P/D+MPS"]
    for gpus in (1, 2, 3):
        for layout in layouts(gpus) + bench_layouts(gpus):
            settings = parse_settings(UpSettings, layout.up_args(), "epd up")
            placed = settings.placements()
            assert len(placed) == layout.processes, layout
            assert {p.gpu for p in placed} <= {None, *map(str, range(gpus))}
            assert settings.mps == ("on" if layout.mps else "off") or layout.topology == "aggregated"
    disagg = parse_settings(UpSettings, Layout("disaggregated", 3, "split", False, 1, 1, 1).up_args(), "epd up")
    assert [(p.kind, p.gpu) for p in disagg.placements()] == [("encoder", "2"), ("prefill", "0"), ("decode", "1")]
    with pytest.raises(ValueError):
        Layout("disaggregated", 1, encoder_gpus=1)


def h200_like(corun: dict[str, float] | None = None) -> Costs:
    """Costs of the order of Qwen2.5-VL-7B's on one H200 (docs/benchmarks.md), 448x448 images."""
    corun = {"vit|decode": 1.3, "decode|vit": 1.4, "vit|prefill": 1.8, "prefill|vit": 1.6} if corun is None else corun
    return Costs("7b", "cuda", "bf16", "448x448", 256, 0.0, 2, {1: 5.0, 10: 40.0}, {152: 8.0, 2732: 62.0},
                 [(1, 256, 4.45), (32, 256, 5.3), (32, 4096, 6.9)], "torch", 2.0, 4, corun, {10: 8.0})


DYNAMO = Workload(image_count=10, image_resolution="448x448", input_len=128, output_len=1024)


def test_plan_unloaded_is_the_floor_and_load_adds_to_it():
    planner = Planner(h200_like(), 5.0, 3584 * 2)
    idle = traffic(DYNAMO, 1e-6)
    floor = planner.floor(idle, 10)
    assert floor == pytest.approx((8 + 40 + 62) / 1e3)
    capacity = planner.capacity(idle)
    for layout in bench_layouts(1):
        alone = planner.predict(layout, idle)
        assert alone.stable and floor * 1e3 <= alone.ttft_ms <= floor * 1e3 + 15  # + the embeddings' transfer
        half = planner.predict(layout, traffic(DYNAMO, 0.5 * capacity))
        assert half.stable and half.ttft_ms > alone.ttft_ms and half.tpot_ms > alone.tpot_ms
    assert not planner.predict(Layout("aggregated", 1), traffic(DYNAMO, 1.05 * capacity)).stable
    # a stack's fixed costs (calibration) add to every request's TTFT
    calibrated = planner.predict(Layout("colocated", 1), idle, overheads=lambda n: 0.1 * (n > 0))
    assert calibrated.ttft_ms == pytest.approx(planner.predict(Layout("colocated", 1), idle).ttft_ms + 100)


def test_plan_models_sharing_a_gpu():
    planner = Planner(h200_like(), 5.0, 3584 * 2)
    t = traffic(DYNAMO, 0.5 * planner.capacity(traffic(DYNAMO, 1.0)))
    predict = {layout.label(): planner.predict(layout, t) for layout in bench_layouts(1)}
    # measured co-run factors below time-slicing's: MPS wins for both language sides
    assert predict["E/PD+MPS"].ttft_ms < predict["E/PD"].ttft_ms
    assert predict["E/P/D+MPS"].ttft_ms < predict["E/P/D"].ttft_ms
    # a decode worker of its own decodes faster than a language worker that also prefills
    assert predict["E/P/D+MPS"].tpot_ms < predict["E/PD+MPS"].tpot_ms
    assert predict["E/P/D+MPS"].busy["slowdown_prefill"] > 1  # slowed by decode and the ViT beside it
    # with side-by-side as costly as time-slicing, MPS buys nothing
    same = Planner(h200_like(dict.fromkeys(("vit|decode", "decode|vit", "vit|prefill", "prefill|vit"), TIMESLICE)))
    assert same.predict(Layout("colocated", 1, "split", True), t).ttft_ms == pytest.approx(
        same.predict(Layout("colocated", 1, "split", False), t).ttft_ms)
    # aggregated: one engine thread, so nothing slows it but its own queue
    assert predict["aggregated"].busy["vit+prefill"] == pytest.approx(t.rate * (0.040 + 0.062))




def test_plan_aggregated_thread_waits_for_decode_and_image_prefills():
    planner = Planner(h200_like(), 5.0, 3584 * 2)
    rate = 0.5 * planner.capacity(traffic(DYNAMO, 1.0))
    short = planner.predict(Layout("aggregated", 1), traffic(DYNAMO.model_copy(update={"output_len": 128}), rate))
    long = planner.predict(Layout("aggregated", 1), traffic(DYNAMO, rate))
    assert long.ttft_ms > short.ttft_ms  # a larger running batch: longer steps to wait for, rows in every chunk
    # text prompts go ahead of image prompts but share their steps: more image traffic, slower text
    text = []
    for share in (0.2, 0.5, 0.8):
        mixed = DYNAMO.model_copy(update={"text_ratio": 1 - share, "output_len": 128})
        text.append(planner.predict(Layout("aggregated", 1), traffic(mixed, 2.0)).ttft_by_images_ms[0])
    assert text == sorted(text) and text[-1] > text[0] + 5


def test_plan_agrees_with_a_simulation_of_the_engine_thread():
    """The closed forms against tools/plan/simulate.py: the engines' scheduling request by request, from
    the same costs. The aggregated form this replaced (two Cobham classes of prompts) was 21-39 % low at
    these points and ranked aggregated ahead of E/PD+MPS where the simulation puts it behind."""
    planner = Planner(h200_like(), 5.0, 3584 * 2)
    aggregated, epd = Layout("aggregated", 1), Layout("colocated", 1, "joined", True)
    short = DYNAMO.model_copy(update={"output_len": 128})
    for workload in (short, short.model_copy(update={"text_ratio": 0.5})):
        capacity = planner.capacity(traffic(workload, 1.0))
        for fraction in (0.5, 0.8):
            t = traffic(workload, fraction * capacity)
            for layout in (aggregated, epd):
                simulated = statistics.fmean(simulate(planner, layout, t, poisson(t, 600, seed=0))) * 1e3
                assert planner.predict(layout, t).ttft_ms == pytest.approx(simulated, rel=0.12), (workload, fraction)
    t = traffic(short, 0.65 * planner.capacity(traffic(short, 1.0)))
    assert planner.predict(epd, t).ttft_ms < planner.predict(aggregated, t).ttft_ms


def test_plan_yields_the_time_budget_as_the_engine_does(monkeypatch):
    """Near saturation the aggregated engine's budget gives way to the prompts it holds (``Scheduler.yields``,
    mirrored by the simulation); the closed form follows (``Planner.yields``). Held whatever the queue, it
    predicted 8.8 s for image-heavy at 1.46 req/s on the H100's floor where the simulation gives 2.6 s."""
    planner = Planner(h200_like(), 5.0, 3584 * 2)
    aggregated = Layout("aggregated", 1)
    long = Workload(image_count=10, image_resolution="448x448", input_len=8192, output_len=256)
    t = traffic(long, 0.95 * planner.capacity(traffic(long, 1.0)))
    simulated = statistics.fmean(simulate(planner, aggregated, t, poisson(t, 600, seed=0))) * 1e3
    assert planner.predict(aggregated, t).ttft_ms == pytest.approx(simulated, rel=0.25)
    monkeypatch.setattr(Planner, "yields", lambda *args: False)
    assert planner.predict(aggregated, t).ttft_ms > 3 * simulated


def test_simulation_schedules_as_the_code_and_one_request_costs_its_floor():
    from services.encoder.batcher import MAX_BATCH_IMAGES, STEP_BUDGET_S
    from services.encoder.settings import EncoderSettings
    from services.encoder.vision import GRAPH_PATCHES
    from shared.engine.scheduler import BACKLOG_S, PRIORITY_WINDOW_S
    from tools.plan import simulate as sim

    assert sim.STEP_BUDGET_S == STEP_BUDGET_S
    assert sim.MAX_BATCH_IMAGES == MAX_BATCH_IMAGES
    assert sim.MAX_BATCH_PATCHES == EncoderSettings.model_fields["max_batch_patches"].default
    assert sim.MIX_PATCHES == GRAPH_PATCHES
    assert sim.PRIORITY_WINDOW_S == PRIORITY_WINDOW_S
    assert sim.BACKLOG_S == BACKLOG_S
    planner = Planner(h200_like(), 5.0, 3584 * 2)
    t = traffic(DYNAMO, 1e-3)
    alone = [Arrival(0.0, 10, 4), Arrival(100.0, 0, 4)]
    ttft = simulate(planner, Layout("aggregated", 1), t, alone)
    assert ttft == pytest.approx([planner.floor(t, 10), planner.floor(t, 0)])
    ttft = simulate(planner, Layout("colocated", 1, "joined", True), t, alone)
    assert ttft == pytest.approx([planner.floor(t, 10) + planner.transfer(10), planner.floor(t, 0)], rel=1e-3)
    with pytest.raises(ValueError):
        simulate(planner, Layout("colocated", 1, "split", True), t, alone)


def test_simulation_yields_the_time_budget_to_a_queue(monkeypatch):
    """As the engine does (``Scheduler.yields``): a burst of prompts behind 16 decoding sequences gets
    steps sized by tokens while budgeted ones would delay it by more than the target (its images queued
    for the aggregated worker's ViT count too), and drains sooner than under a budget held whatever the
    queue, or one held until a prompt has waited past ``BACKLOG_S``."""
    from tools.plan import simulate as sim

    planner = Planner(h200_like(), 5.0, 3584 * 2)
    decoding = [Arrival(0.0001 * i, 0, 4000) for i in range(16)]
    images = decoding + [Arrival(0.5 + 0.001 * i, 10, 64) for i in range(120)]
    texts = decoding + [Arrival(0.5 + 0.001 * i, 0, 64) for i in range(60)]
    long_texts = traffic(Workload(image_count=10, image_resolution="448x448", input_len=4096, output_len=64), 1.0)

    def late(engine, now):
        return any(now - r.ready > sim.BACKLOG_S for r in engine.prompts)

    for layout, t, burst in ((Layout("aggregated", 1), traffic(DYNAMO, 1.0), images),  # the ViT's gaps too
                             (Layout("colocated", 1, "joined", True), long_texts, texts)):  # the engine alone
        yielded = simulate(planner, layout, t, burst)[16:]
        monkeypatch.setattr(sim._Engine, "yields", late)
        lifted = simulate(planner, layout, t, burst)[16:]
        monkeypatch.setattr(sim, "BACKLOG_S", math.inf)
        held = simulate(planner, layout, t, burst)[16:]
        monkeypatch.undo()
        assert max(held) > sim.BACKLOG_S  # a backlog to lift
        assert statistics.mean(yielded) < statistics.mean(lifted) < statistics.mean(held)


def test_plan_mps_clients_share_what_the_pair_gets_done():
    lopsided = {"vit|decode": 1.15, "decode|vit": 4.56, "vit|prefill": 2.17, "prefill|vit": 1.68}
    swapped = {"vit|decode": 4.56, "decode|vit": 1.15, "vit|prefill": 1.68, "prefill|vit": 2.17}
    one, other = Planner(h200_like(lopsided), 5.0, 3584 * 2), Planner(h200_like(swapped), 5.0, 3584 * 2)
    assert one.k("vit", "decode", True) == one.k("decode", "vit", True) == pytest.approx(2 / (1 / 1.15 + 1 / 4.56))
    t = traffic(DYNAMO, 2.0)
    assert one.predict(Layout("colocated", 1, "joined", True), t).ttft_ms == pytest.approx(
        other.predict(Layout("colocated", 1, "joined", True), t).ttft_ms)
    assert one.k("vit", "decode", False) == TIMESLICE  # time-sliced: unmeasured here, the model's factor
