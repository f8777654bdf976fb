"""`epd bench` against a real stack, the three topologies' greedy answers against HF, `epd plan` (its
layouts, its model, its CLI), and bench/epd_vs_aggregated.py end to end on the tiny model."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools.bench.client import RequestResult
from tools.bench.dataset import build_requests
from tools.bench.metrics import Slo, request_itl_p99, summarize
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


def test_simulation_schedules_as_the_code_and_one_request_costs_its_floor():
    from services.encoder.batcher import MAX_BATCH_IMAGES, STEP_BUDGET_S
    from services.encoder.settings import EncoderSettings
    from services.encoder.vision import GRAPH_PATCHES
    from shared.engine.scheduler import PRIORITY_WINDOW_S
    from tools.plan import simulate as sim

    assert sim.STEP_BUDGET_S == STEP_BUDGET_S
    assert sim.MAX_BATCH_IMAGES == MAX_BATCH_IMAGES
    assert sim.MAX_BATCH_PATCHES == EncoderSettings.model_fields["max_batch_patches"].default
    assert sim.MIX_PATCHES == GRAPH_PATCHES
    assert sim.PRIORITY_WINDOW_S == PRIORITY_WINDOW_S
    planner = Planner(h200_like(), 5.0, 3584 * 2)
    t = traffic(DYNAMO, 1e-3)
    alone = [Arrival(0.0, 10, 4), Arrival(100.0, 0, 4)]
    ttft = simulate(planner, Layout("aggregated", 1), t, alone)
    assert ttft == pytest.approx([planner.floor(t, 10), planner.floor(t, 0)])
    ttft = simulate(planner, Layout("colocated", 1, "joined", True), t, alone)
    assert ttft == pytest.approx([planner.floor(t, 10) + planner.transfer(10), planner.floor(t, 0)], rel=1e-3)
    with pytest.raises(ValueError):
        simulate(planner, Layout("colocated", 1, "split", True), t, alone)


def test_plan_mps_clients_share_what_the_pair_gets_done():
    lopsided = {"vit|decode": 1.15, "decode|vit": 4.56, "vit|prefill": 2.17, "prefill|vit": 1.68}
    swapped = {"vit|decode": 4.56, "decode|vit": 1.15, "vit|prefill": 1.68, "prefill|vit": 2.17}
    one, other = Planner(h200_like(lopsided), 5.0, 3584 * 2), Planner(h200_like(swapped), 5.0, 3584 * 2)
    assert one.k("vit", "decode", True) == one.k("decode", "vit", True) == pytest.approx(2 / (1 / 1.15 + 1 / 4.56))
    t = traffic(DYNAMO, 2.0)
    assert one.predict(Layout("colocated", 1, "joined", True), t).ttft_ms == pytest.approx(
        other.predict(Layout("colocated", 1, "joined", True), t).ttft_ms)
    assert one.k("vit", "decode", False) == TIMESLICE  # time-sliced: unmeasured here, the model's factor

# -- bench/epd_vs_aggregated.py end to end, tiny --------------------------------------------------------
def eva(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_") or k == "EPD_CACHE_DIR"}
    return subprocess.run([sys.executable, "bench/epd_vs_aggregated.py", *args], cwd=Path(__file__).parents[1],
                          env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("eva")
    return eva("--tiny", "--stack-log", str(out / "logs"), "--out", str(out)), out


# Three stacks start on CPU (the +MPS ones would be their plain twins there): ~1 min on two idle cores.
@pytest.mark.timeout(900)
def test_tiny_sweep_measures_every_topology_and_workload(tiny_sweep):
    from bench.epd_vs_aggregated import CASES, request_classes, topologies

    cases = [c for c in CASES if not c.video]  # the default: clips only when named
    done, out = tiny_sweep
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    labels = [t.label for t in topologies(0, tiny=True) if not t.layout.mps]
    assert labels == ["aggregated", "E/PD", "E/P/D"]
    assert [s["topology"] for s in results["stacks"]] == labels and not any("error" in s for s in results["stacks"])
    points = {(r["workload"], r["topology"]) for r in results["runs"]}
    assert points == {(c.name, label) for c in cases for label in labels}
    assert all(r["summary"]["failed"] == 0 and r["summary"]["completed"] == 3 for r in results["runs"])
    for run in results["runs"]:
        assert run["floor_ms"]["floor_ms"] > 0 and run["resumed"] == 0
        assert {"first_token"} <= set(run["stages_ms"]) and run["predicted_ttft_ms"] is not None
        assert run["summary"]["slo"] == {"ttft_ms": 2000, "tpot_ms": 0.0, "itl_ms": 100}
        if run["workload"] != "dynamo-mix" or run["classes"].get("image"):
            assert {"media", "encode"} <= set(run["stages_ms"]) and "vit_forward" in run["encoder_ms"]
    classes = {c.key for c in request_classes(cases, tiny=True)}
    assert {(u["request_class"], u["topology"]) for u in results["unloaded"]} == {(c, t) for c in classes for t in labels}
    shapes = {(s["resolution"], s["images"]) for s in results["floor"]["shapes"]}
    assert {("224x224", n) for n in range(4)} | {("112x112", 0), ("112x112", 3)} == shapes
    assert set(results["floor"]["costs"]) == {"224x224", "112x112"}
    corun = results["floor"]["costs"]["224x224"]["corun"]  # two streams (MPS-like) and two processes (time-sliced)
    assert set(corun) == {f"{p}{x}|{y}" for p in ("", "ts:") for x, y in
                          (("vit", "decode"), ("decode", "vit"), ("vit", "prefill"), ("prefill", "vit"))}
    assert len(results["plan"]) == 7 and all(set(p["predictions"]) == set(labels) for p in results["plan"])
    assert all(p["plan_pick"] in labels and p["measured_best"] in labels for p in results["plan"])
    assert len(results["targets"]) >= 12  # six floors, Dynamo's three, image-heavy's two rates, the plan's two
    host = results["host"]  # what tells two machines of one kind apart
    assert host["usable_cores"] >= 1 and all(ms > 0 for ms in host["probe_ms"].values())


@pytest.mark.timeout(900)
def test_tiny_sweep_writes_the_report(tiny_sweep, tmp_path):
    done, out = tiny_sweep
    markdown = (out / "results.md").read_text()
    assert '"usable_cores"' in markdown.split("\n")[1]  # the Host line under Hardware
    for heading in ("## Floor", "## image-heavy", "## dynamo-1024", "## dynamo-mix", "## epd plan against", "## Targets"):
        assert heading in markdown
    assert markdown.count("| unloaded |") == 6 * 3  # every workload's table, every topology
    assert (out / "latency_vs_rate.png").read_bytes().startswith(b"\x89PNG")
    logs = sorted((out / "logs").iterdir())  # --stack-log: every stack's lines, a file per topology
    assert len(logs) == 3 and all(p.name.endswith(".log") and "/" not in p.stem and "+" not in p.stem for p in logs)
    assert all('"stack.ready"' in p.read_text() for p in logs)
    again = eva("--report-from", str(out / "results.json"), "--out", str(tmp_path))  # no stack: CPU only
    assert again.returncode == 0, again.stderr[-2000:]
    assert (tmp_path / "results.md").read_text().split("## Floor")[1] == markdown.split("## Floor")[1]


def test_dry_run_lists_the_stacks_and_points():
    done = eva("--quick", "--dry-run", "--gpus", "1", "--workloads", "dynamo-1024,dynamo-mix", "--topologies",
               "aggregated,E/P/D+MPS")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--topology colocated --pd split --encoders 1 --prefills 1 --decodes 1 --mps on" in done.stdout
    assert done.stdout.count("  point ") == 2 and "estimated:" in done.stdout


def test_plan_accuracy_rereads_a_recorded_run(capsys):
    """bench/plan_accuracy.py on a recorded H200 run (gzipped, as bench/results keeps them): a line per
    point, stages, the replay of its requests, totals."""
    from bench.plan_accuracy import main

    recorded = Path(__file__).parents[1] / "bench/results/serving/qwen2.5-7b-mixed/results.json.gz"
    assert main(["--stages", "--replay", str(recorded)]) == 0
    out = capsys.readouterr().out
    points = [line for line in out.splitlines() if "req/s" in line]
    assert [line.split()[0] for line in points] == ["image-heavy", "mixed", "dynamo-mix"]
    assert all("replay" in line and "pick aggregated (yes)" in line for line in points)
    assert out.count("stages measured") == 6 and "all runs: best within 25 % 3/3; best named 3/3" in out


def test_overheads_fit_ignores_one_slow_request():
    from bench.epd_vs_aggregated import lower_line

    points = [(1, 0.11), (2, 0.12), (3, 0.13), (4, 0.14), (2, 0.9)]
    intercept, slope = lower_line(points)
    assert slope == pytest.approx(0.01) and intercept == pytest.approx(0.10)
    assert lower_line([(10, 0.2), (10, 0.3), (10, 0.25)]) == (0.2, 0.0)
    # two unloaded requests, the first on a fresh stack paying a one-time cost (Qwen3-VL-30B-A3B on an H200:
    # 1,075 and 317 ms): the stack's fixed cost is the cheaper one's, not their median
    assert lower_line([(2, 1.075), (2, 0.317)]) == (pytest.approx(0.317), 0.0)
    # two image counts, the second request stalled (serving/qwen3-image-heavy-mixed: 1 image 0.074 s over the model,
    # 2 images 0.88 s): one pairwise slope is no evidence of a per-image cost, the line stays flat
    assert lower_line([(1, 0.074), (2, 0.88)]) == (pytest.approx(0.074), 0.0)


# -- video-heavy: one clip a request ---------------------------------------------------------------------
def test_video_heavy_is_a_workload_named_on_its_own():
    from bench.epd_vs_aggregated import case_workload, chosen_cases, parse_args, request_classes

    assert "video-heavy" not in [c.name for c in chosen_cases(parse_args(["--tiny"]))]  # clips only when named
    [case] = chosen_cases(parse_args(["--workloads", "video-heavy"]))
    assert case_workload(case, tiny=False) == dict(image_count=0, video_count=1, video_seconds=20.0,
                                                   video_resolution="720p", video_fps=30.0, input_len=128,
                                                   output_len=128)
    [ten] = chosen_cases(parse_args(["--workloads", "video-heavy", "--video-seconds", "10"]))
    assert case_workload(ten, tiny=False)["video_seconds"] == 10
    tiny = case_workload(ten, tiny=True)  # a small clip whatever the length asked
    assert (tiny["video_seconds"], tiny["video_resolution"], tiny["video_fps"], tiny["input_len"]) == \
        (2.0, "160x120", 10.0, 32)
    BenchSettings(**tiny)  # epd bench takes it as it is
    assert [c.key for c in request_classes([ten], tiny=False)] == ["1 x 10 s 720p clip at 30 fps, 128 in"]
    with pytest.raises(SystemExit):
        parse_args(["--workloads", "video-heavy", "--video-seconds", "45"])


@pytest.fixture(scope="module")
def clip_floor(tiny_model) -> dict:
    """tools.plan.floor's rows for a 2 s clip and a text prompt, in-process on the tiny model (~10 s)."""
    from tools.plan.floor import FloorSettings, ShapeWorkload, measure_floor

    settings = parse_settings(FloorSettings, ["--model", str(tiny_model), "--shapes", "[]", "--out", "-",
                                              "--max-model-len", "1024", "--decode-batch", "4", "--kv-cache-mb",
                                              "64", "--corun-seconds", "0"], "floor")
    clip = dict(image_count=0, video_count=1, video_seconds=2.0, video_resolution="160x120", video_fps=10.0,
                input_len=32, output_len=4)
    return measure_floor(settings, [ShapeWorkload(**clip), ShapeWorkload(image_count=0, input_len=32)])


def test_floor_of_a_clip_is_its_decode_vit_and_prefill(clip_floor):
    from bench.epd_vs_aggregated import Floor

    [row] = [r for r in clip_floor["shapes"] if "video_seconds" in r]
    [text] = [r for r in clip_floor["shapes"] if "video_seconds" not in r]
    assert "160x120" not in clip_floor["costs"]  # `epd plan`'s costs are images'
    # 20 frames at 10 fps, 2 sampled a second (at least the processor's 4): 2 temporal patches
    assert row["frames"] == 4 and row["grid"][0] == 2
    t, h, w = row["grid"]
    assert row["video_tokens"] == t * h * w // 4
    assert row["prompt_tokens"] == 32 + 24 + row["video_tokens"] + 2  # text, template, <start> clip <end>
    assert min(row["media_ms"], row["vit_ms"], row["prefill_ms"]) > 0
    assert row["floor_ms"] == pytest.approx(row["media_ms"] + row["vit_ms"] + row["prefill_ms"])
    floor = Floor(clip_floor)
    w = dict(image_count=0, video_count=1, video_seconds=2.0, video_resolution="160x120", video_fps=10.0,
             input_len=32)
    assert floor.missing(w) == [] and floor.expected(w)["floor_ms"] == row["floor_ms"]
    assert floor.capacity(w) == pytest.approx(1e3 / (row["vit_ms"] + row["prefill_ms"]))  # the GPU's part only
    assert floor.missing({**w, "video_seconds": 3.0}) == ["3 s 160x120 clip at 10 fps, 32 in"]
    assert floor.of(dict(image_resolution="1080p", input_len=32), 0) is text  # a text prompt of the same length


def test_video_points_are_not_predicted_and_a_floor_without_clips_is_refused(clip_floor, tmp_path):
    from bench.epd_vs_aggregated import Floor, main, plan_points, workload_cases

    runs = [{"workload": "video-heavy", "topology": "aggregated", "request_rate": 1.0}]
    assert plan_points(Floor(clip_floor), runs, [], [], workload_cases(), tiny=True) == []
    assert runs[0]["predicted_ttft_ms"] is None  # `epd plan` models images, not clips
    images_only = tmp_path / "floor.json"
    images_only.write_text(json.dumps({**clip_floor, "shapes": [r for r in clip_floor["shapes"]
                                                                if "video_seconds" not in r]}))
    with pytest.raises(SystemExit, match="did not measure 2 s 160x120 clip at 10 fps, 32 in"):
        main(["--tiny", "--dry-run", "--workloads", "video-heavy", "--floor", str(images_only), "--out", str(tmp_path)])


def test_video_dry_run_lists_its_point():
    done = eva("--dry-run", "--quick", "--topologies", "aggregated,E/PD+MPS", "--workloads", "video-heavy")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("  point video-heavy") == 1 and "(50% of capacity)" in done.stdout
    assert "1 x 20 s 720p clip at 30 fps, 128 in" in done.stdout and "estimated:" in done.stdout


# -- bench/multi_turn_chat.py ------------------------------------------------------------------------------
def multi_turn(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_") or k == "EPD_CACHE_DIR"}
    return subprocess.run([sys.executable, "bench/multi_turn_chat.py", *args], cwd=Path(__file__).parents[1],
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_multi_turn_chats_are_seeded_and_grow_from_their_images():
    from argparse import Namespace

    from bench.multi_turn_chat import conversations
    from tools.bench.dataset import PromptWriter

    args = Namespace(users=16, turns=6, input_len=8, seed=3, alone_users=2)
    chats = conversations(args, PromptWriter())
    assert chats == conversations(args, PromptWriter())  # both stacks get the same chats
    assert chats[:17] == conversations(Namespace(**{**vars(args), "alone_users": 0}), PromptWriter())
    assert len(chats) == 19 and all(2 <= len(c.image_ids) <= 5 and len(c.texts) == 6 for c in chats)
    ids = [i for c in chats for i in c.image_ids]
    assert ids == list(range(len(ids)))  # every user (and the warm-up) on images of its own
    assert len({len(c.image_ids) for c in chats}) > 1 and all(len(set(c.texts)) == 6 for c in chats)


def test_multi_turn_dry_run_names_both_stacks():
    done = multi_turn("--dry-run", "--topology", "E/P/D")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "16 users × 6 turns" in done.stdout and "text twin" in done.stdout
    up = "python -m launcher.cli up --port 0 --topology colocated --pd split"
    assert f"EPD_PREFIX_ROUTING=false {up}" in done.stdout and f"(defaults) {up}" in done.stdout
    assert f"EPD_PREFIX_CACHING=false {up}" in multi_turn("--dry-run", "--topology", "E/P/D", "--baseline",
                                                          "no-caching").stdout
    assert multi_turn("--dry-run", "--topology", "nonsense").returncode != 0


def test_multi_turn_gpu_stacks_get_their_environment():
    """The GPU path's stack environment, built from multi_turn_chat's own arguments (its stacks keep the
    model's max_model_len; the sweep's pass one)."""
    from bench.epd_vs_aggregated import stack_env
    from bench.multi_turn_chat import parse_args

    env = stack_env(parse_args([]))
    assert env["EPD_LOAD_FORMAT"] == "dummy" and env["EPD_MODEL"] and "EPD_MAX_MODEL_LEN" not in env


def test_stack_settings_reach_the_stacks_and_nothing_else_of_the_shell(monkeypatch):
    """--stack-env is how a sweep sets an engine option (the stacks see no other EPD_ variable)."""
    from bench.epd_vs_aggregated import parse_args, stack_env

    monkeypatch.setenv("EPD_ENFORCE_EAGER", "true")
    args = parse_args(["--stack-env", "EPD_TARGET_ITL_MS=0", "--stack-env", "EPD_MPS_ACTIVE_THREADS=50"])
    env = stack_env(args)
    assert env["EPD_TARGET_ITL_MS"] == "0" and env["EPD_MPS_ACTIVE_THREADS"] == "50"
    assert "EPD_ENFORCE_EAGER" not in env
    with pytest.raises(SystemExit):
        parse_args(["--stack-env", "DECODE=1"])


# Two tiny stacks on CPU, 2 users x 2 turns: ~40 s on two idle cores.
@pytest.mark.timeout(300)
def test_multi_turn_tiny_answers_alike_with_and_without_prefix_routing(tmp_path):
    """Before: the frontend decodes every returning image and sends its pixels; after: it leaves them out,
    decoding none; the answers are the same; the text twins run too."""
    done = multi_turn("--tiny", "--users", "2", "--turns", "2", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    summary = results["summary"]
    assert (summary["failed"], summary["mismatches"], summary["compared"]) == (0, 0, 4)
    assert (summary["first_turn_mismatches"], summary["first_turns"]) == (0, 2)
    assert (summary["alone_mismatches"], summary["alone_compared"]) == (0, 2)  # one more chat, each turn alone
    after, twin = summary["turns"]["after"], summary["turns"]["text twin"]
    assert after[0]["cached_share"] < 0.5 < after[1]["cached_share"]  # turn 2 reuses turn 1's prompt
    assert all(abs(a["prompt_tokens"] - t["prompt_tokens"]) < 0.1 * a["prompt_tokens"] for a, t in zip(after, twin))
    before, later = summary["costs"]["before"], summary["costs"]["after"]
    assert before["images_decoded"] >= 2 and before["pixel_mb"] > 0 and before["images_left_out"] == 0
    assert later["images_decoded"] == later["pixel_mb"] == later["embedding_mb"] == 0 and later["images_left_out"] >= 2
    assert summary["ratio"] > 0 and summary["over_text"] > 0
    markdown = (tmp_path / "results.md").read_text()
    assert "Hardware:" in markdown and "TTFT from turn 2 on ≤ 1.5× the text twins': measured" in markdown


# -- bench/gpu_engine.py: its sections on the tiny model, the timeline's arithmetic ------------------------
def test_engine_sections_measure_on_the_tiny_model(tmp_path):
    """The sections a GPU run reports the engine's figures from, on CPU (~5 s): each fills its own entry,
    and after waves of requests every KV block is free again."""
    sections = "ceilings,decode1,decode64,prefill,chunked,memory"
    done = subprocess.run([sys.executable, "bench/gpu_engine.py", "--tiny", "--sections", sections, "--out",
                           str(tmp_path)], cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_engine.json").read_text())
    assert list(results) == ["env", "build", *sections.split(",")]
    assert results["ceilings"]["copy_bandwidth_TBps"] > 0 and results["ceilings"]["bf16_matmul_TFLOPs"] > 0
    assert results["decode1"]["engine_step_ms"] > 0 and results["decode1"]["bandwidth_floor_ms"] > 0
    assert (results["decode64"]["batch"], results["decode64"]["context"]) == (8, 64)
    assert results["prefill"]["tokens"] == 72 and results["prefill"]["compute_floor_ms"] > 0
    chunked = results["chunked"]
    assert set(chunked["budgets"]) == {"unchunked", "16", "32", "64", "128"}
    assert chunked["prefix_hit"]["cached_tokens"] > 0  # the prompt again came from the prefix cache
    memory = results["memory"]
    assert memory["requests"] == 100 and memory["kv_blocks_free_after"] == memory["kv_blocks_total"]


def test_engine_sections_are_named_on_the_command_line():
    from bench.engine import SECTIONS
    from bench.gpu_engine import parse_args

    assert parse_args([]).sections == list(SECTIONS)
    assert parse_args(["--sections", "hf,decode1"]).sections == ["hf", "decode1"]  # in the order given
    with pytest.raises(SystemExit):
        parse_args(["--sections", "decode1,nonsense"])


def test_timeline_charges_each_kernel_its_share_of_the_critical_path():
    """Under programmatic dependent launch a kernel starts before the one ahead ends: its share of the step
    is how far its end moves the step's end, and the shares add up to the step."""
    from bench.engine.timeline import from_events

    events = []
    for replay in range(4):  # 1,000 µs apart: the idle GPU between replays separates them
        base = replay * 1000
        events += [{"cat": "kernel", "name": "void at::native::(anonymous namespace)::norm<float>(float*, int)",
                    "ts": base, "dur": 10},
                   {"cat": "kernel", "name": "gemv_kernel", "ts": base + 5, "dur": 10},  # launched early
                   {"cat": "kernel", "name": "gemv_kernel", "ts": base + 20, "dur": 5},  # after a 5 µs gap
                   {"cat": "cpu_op", "name": "replay", "ts": base, "dur": 30}]
    result = from_events(events, replays=4, drop=2, layers=2)
    assert (result["split"], result["replays"], result["kernels_per_step"]) == ("gap", 2, 3)
    assert result["profiled_span_ms"] == pytest.approx(0.025)
    kernels = {k["name"]: k for k in result["by_kernel"]}
    assert set(kernels) == {"norm<float>", "gemv_kernel"}
    assert kernels["norm<float>"]["contribution_us"] == 10 and kernels["gemv_kernel"]["contribution_us"] == 15
    assert kernels["gemv_kernel"]["gap_us"] == 5 and kernels["gemv_kernel"]["contribution_per_layer_us"] == 7.5
    assert result["contribution_sum_ms"] == pytest.approx(result["profiled_span_ms"])
    with pytest.raises(ValueError):
        from_events(events[:-2], replays=4)  # 11 kernels do not make 4 equal replays


# -- bench/itl_target.py ------------------------------------------------------------------------------------
def itl_target(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "bench/itl_target.py", *args], cwd=Path(__file__).parents[1],
                          capture_output=True, text=True, timeout=timeout)


def test_itl_target_dry_run_names_a_stack_per_topology_and_target():
    done = itl_target("--dry-run", "--targets", "50,20,0")
    assert done.returncode == 0, done.stderr
    stacks = [line for line in done.stdout.splitlines() if line.startswith("stack ")]
    assert len(stacks) == 6 and sum("EPD_TARGET_ITL_MS=0 " in line for line in stacks) == 2
    assert "720p" in done.stdout and "24 req/s" in done.stdout
    for bad in (["--targets", "50,x"], ["--targets", "-5"], ["--topologies", "E/P/D"]):
        assert itl_target("--dry-run", *bad).returncode != 0


# Two tiny stacks on CPU (the budget on, then off): ~90 s on two busy cores.
@pytest.mark.timeout(400)
def test_itl_target_tiny_measures_both_stacks_and_the_models_error(tmp_path):
    done = itl_target("--tiny", "--topologies", "aggregated", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = json.loads((tmp_path / "results.json").read_text())["records"]
    on, off = records
    assert (on["target_itl_ms"], off["target_itl_ms"]) == (50.0, 0.0)
    assert on["summary"]["failed"] == off["summary"]["failed"] == 0 and on["summary"]["completed"] >= 6
    assert on["steps"]["steps_timed"] > 0 and on["steps"]["step_time_error_count"] > 0  # the models at work
    assert on["steps"]["vit_time_error_count"] > 0
    assert off["steps"]["steps_timed"] == off["steps"]["vit_time_error_count"] == 0  # no budget, no model
    markdown = (tmp_path / "results.md").read_text()
    assert "| aggregated @ 50 ms |" in markdown and "- aggregated @ 50 ms: ITL p99" in markdown


# -- bench/gpu_smoke.py ------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_gpu_smoke_tiny_passes_the_users_path(tmp_path):
    """The user's path on the built-in model: `epd up` with default flags, a burst the moment /v1/models
    answers (all answered), two windows of traffic, Ctrl-C to the process group (exit 0, nothing left)."""
    done = subprocess.run([sys.executable, "bench/gpu_smoke.py", "--tiny", "--layouts", "joined", "--out",
                           str(tmp_path)], cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    checks = {c["check"]: c for c in json.loads((tmp_path / "results.json").read_text())["checks"]}
    assert {"burst at first answer", "traffic", "compiles after ready", "ctrl-c"} <= set(checks)
    assert all(c["ok"] for c in checks.values())
    assert "4/4 ok" in checks["burst at first answer"]["detail"]
