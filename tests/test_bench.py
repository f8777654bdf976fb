"""`epd bench` against a real stack, the three topologies' greedy answers against HF, and `epd plan`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools.bench.dataset import build_requests
from tools.plan.queueing import erlang_c, mdc_wait
from tools.bench.runner import arrival_times
from tools.bench.settings import BenchSettings
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
               "--text-ratio", "0.5", "--tokenizer", str(tiny_model), "--slo-ttft", "60000", "--no-progress",
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
    assert {placed[kind] for kind in ("encoder", "language")} == {"0"}  # all on --gpus 0


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
               "--max-model-len", "512", "--decode-batch", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "recommended:" in done.stdout
    plan = json.loads(out.read_text())
    [at_rate] = plan["rates"]
    topologies = {p["topology"] for p in at_rate["predictions"]}
    assert topologies == {"aggregated", "colocated", "disaggregated"}
    best = at_rate["recommended"]
    assert best["stable"] and best["layout"] in done.stdout
    # A lightly loaded stack answers in about one request's own work: at least its prompt's prefill.
    assert best["ttft_ms"] >= min(plan["costs"]["prefill_ms"].values())
