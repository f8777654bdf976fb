"""The other maintained bench scripts on the tiny model: bench/multi_turn_chat.py, bench/gpu_engine.py's
sections, bench/itl_target.py and bench/gpu_smoke.py (the user's path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


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
def test_gpu_smoke_windows_share_arrivals_and_shapes_not_content():
    """The smoke run's two windows: one arrival process and one set of request shapes (their p99s then
    differ by what warmed up, not by the draw), other images and text (nothing cached across them)."""
    from bench.gpu_smoke import recontent
    from tools.bench.runner import prepare
    from tools.bench.settings import BenchSettings

    settings = BenchSettings(num_prompts=30, request_rate=4, warmup=0, seed=2, input_len=16, output_len=4,
                             image_count=2, random_image_count=True, image_resolution="64x48", text_ratio=0.4,
                             repeat_ratio=0.3)
    pool, _, specs = prepare(settings)
    first = list(pool.urls)
    again = recontent(settings, pool, specs, seed=3)
    assert [(s.kind, s.image_ids, s.output_len) for s in again] == [(s.kind, s.image_ids, s.output_len) for s in specs]
    assert not {s.prompt for s in again} & {s.prompt for s in specs}
    assert len(pool.urls) == len(first) and not set(pool.urls) & set(first)


@pytest.mark.timeout(300)
def test_gpu_smoke_tiny_passes_the_users_path(tmp_path):
    """The user's path on the built-in model: `epd up` with default flags, a burst the moment /v1/models
    answers (all answered), two windows of traffic, Ctrl-C to the process group (exit 0, nothing left)."""
    done = subprocess.run([sys.executable, "bench/gpu_smoke.py", "--tiny", "--layouts", "joined", "--out",
                           str(tmp_path)], cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    checks = {c["check"]: c for c in json.loads((tmp_path / "results.json").read_text())["checks"]}
    assert {"burst at first answer", "traffic", "compiles after ready", "ctrl-c"} <= set(checks)
    assert all(c["ok"] for c in checks.values() if c["ok"] is not None)
    # timings are reported, never judged here: the window ratio on a shared CPU is the machine's noise
    reported = {name for name, c in checks.items() if c["ok"] is None}
    assert reported == {"first window p99 TTFT", "gpu memory"}
    assert "x (ITL p99" in checks["first window p99 TTFT"]["detail"]
    assert "INFO" in done.stdout and "# 5/5 checks passed" in done.stdout
    assert "4/4 ok" in checks["burst at first answer"]["detail"]
