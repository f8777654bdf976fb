"""bench/epd_vs_aggregated.py end to end on the tiny model: the sweep over topologies and workloads, its report,
its dry run, a recorded run re-read, and the video-heavy workload's floor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.settings import parse_settings
from tools.bench.settings import BenchSettings


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
    from tools.bench.tables import HEADER

    header, columns = HEADER.split("\n")[0], HEADER.split("\n")[0].count("|")
    tables = [part.split("\n\n")[0].split("\n")[1:] for part in markdown.split(header + "\n")[1:]]
    rows = [line for table in tables for line in table]  # each workload's: the rule, unloaded and loaded rows
    assert len(tables) == 6 and len(rows) > 6 * 4 and all(line.count("|") == columns for line in rows)


def test_a_row_shows_the_ttft_trend_tpot_p99_and_the_step_time_model_error():
    from tools.bench.tables import HEADER, row_text

    summary = {"ttft_ms": {"mean": 200.0, "p99": 400.0}, "itl_ms": {"p99": 95.0},
               "tpot_ms": {"mean": 21.04, "p99": 29.46}, "request_throughput": 4.0, "goodput": 3.5, "failed": 0,
               "ttft_trend": 0.0912}
    counts = {"step_time_error_total": 9.0, "step_time_error_count": 60, "steps_timed": 64, "steps_paced": 40}
    row = row_text({"topology": "aggregated", "request_rate": 4.0, "summary": summary, "encoder_ms": counts})
    cells = [cell.strip() for cell in row.split("|")[1:-1]]
    assert len(cells) == HEADER.split("\n")[0].count("|") - 1
    assert cells[4] == "+0.09" and cells[8] == "21.0 / 29.5" and cells[13] == "15.0% (40 / 64)"
    budget_off = row_text({"topology": "aggregated", "request_rate": 4.0, "summary": summary, "encoder_ms": {}})
    assert budget_off.split("|")[14].strip() == "-"


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


def test_rates_are_given_for_every_workload_or_per_workload():
    from bench.epd_vs_aggregated import chosen_cases, parse_args, points

    def rates(*argv):
        args = parse_args(["--workloads", "image-heavy,mixed", *argv])
        return [(p.case.name, p.rate) for p in points(args, chosen_cases(args), None)]

    assert rates("--rates", "1,2") == [("image-heavy", 1), ("image-heavy", 2), ("mixed", 1), ("mixed", 2)]
    assert rates("--rates", "mixed=4.4,image-heavy=0.86,mixed=3") == [("image-heavy", 0.86), ("mixed", 4.4),
                                                                      ("mixed", 3)]
    assert rates("--rates", "mixed=4.4") == [("mixed", 4.4)]  # a workload not named has no point
    for wrong in ("imageheavy=1", "mixed=1,2"):
        with pytest.raises(SystemExit):
            parse_args(["--rates", wrong])



# -- --saturate: points as fractions of what each stack sustains ----------------------------------------
def test_a_burst_reads_the_requests_done_over_its_makespan():
    from bench.epd_vs_aggregated import burst_rate

    def request(first: float, end: float, ok: bool = True, sent: float = 0.0) -> dict:
        return {"ok": ok, "sent_at": sent, "ttft": first - sent, "e2e": end - sent}

    # sent at 1.0 (times below are absolute): prefills one a second, each decodes two seconds; the failed
    # request counts as sent, not as done
    burst = [request(1.0 + i, 3.0 + i, sent=1.0) for i in range(1, 7)] + [request(1.0, 1.0, ok=False, sent=1.0)]
    assert burst_rate(burst) == {"requests": 7, "failed": 1, "rate": 0.75, "makespan_s": 8.0, "tail_s": 2.0}
    # sequences that decode together finish together (the H100's image-heavy burst): the completions while
    # a request still waited came within 0.5 s (~100 req/s); over the makespan each request counts once
    together = [request(0.5 * i, 30.0 + 0.01 * i) for i in range(1, 61)] + [request(30.5, 31.0)]
    assert burst_rate(together)["rate"] == 61 / 31.0
    # every request prefilled before the first one finished: the burst never queued, no rate
    one_batch = burst_rate([request(0.2, 1), request(0.3, 1.5), request(0.4, 2)])
    assert one_batch["rate"] is None and "fit in the stack's batch" in one_batch["why"]
    assert one_batch["makespan_s"] == 2.0
    assert burst_rate([request(0, 0, ok=False)]) == {"requests": 1, "failed": 1, "rate": None,
                                                     "why": "no request of the burst succeeded"}


def test_saturate_takes_the_place_of_other_rates():
    from bench.epd_vs_aggregated import chosen_cases, parse_args, points

    args = parse_args(["--saturate", "0.5,0.9", "--workloads", "mixed"])
    assert [(p.fraction, p.saturation) for p in points(args, chosen_cases(args), None)] == [(0.5, True), (0.9, True)]
    for wrong in (["--saturate", "0.9", "--rates", "1"], ["--saturate", "0.9", "--quick"], ["--saturate", "x"],
                  ["--saturate", "0"], ["--saturation-from", "results.json"],
                  ["--saturate", "0.9", "--saturation-requests", "2"]):
        with pytest.raises(SystemExit):
            parse_args(wrong)


def test_saturation_from_must_cover_every_point(tmp_path):
    from bench.epd_vs_aggregated import main

    earlier = tmp_path / "results.json"
    earlier.write_text(json.dumps({"stacks": [{"topology": "aggregated", "saturation": {
        "mixed": {"requests": 24, "failed": 0, "rate": 5.0, "makespan_s": 4.8, "tail_s": 0.3}}}]}))
    argv = ["--tiny", "--dry-run", "--saturate", "0.9", "--saturation-from", str(earlier), "--topologies",
            "aggregated", "--out", str(tmp_path)]
    assert main([*argv, "--workloads", "mixed"]) == 0
    with pytest.raises(SystemExit, match="measured no saturation of dynamo-mix on aggregated"):
        main([*argv, "--workloads", "mixed,dynamo-mix"])
    earlier.write_text(json.dumps({"stacks": [{"topology": "aggregated"}]}))
    with pytest.raises(SystemExit, match="it measured no saturation"):
        main([*argv, "--workloads", "mixed"])


@pytest.fixture(scope="module")
def saturated_runs(tmp_path_factory) -> tuple[Path, Path, subprocess.CompletedProcess, subprocess.CompletedProcess,
                                               set[int]]:
    """A run measuring the saturation, its results.json watched while it runs; a run given its rates."""
    import time

    out = tmp_path_factory.mktemp("saturate")
    common = ("--tiny", "--workloads", "mixed,dynamo-mix", "--topologies", "aggregated")
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_") or k == "EPD_CACHE_DIR"}
    argv = [sys.executable, "bench/epd_vs_aggregated.py", *common, "--saturate", "0.9", "--out", str(out / "measured")]
    seen = set()  # how many loaded points results.json held, each time it was read while the stack ran
    stdout, stderr = out / "measured.out", out / "measured.err"
    with open(stdout, "w") as o, open(stderr, "w") as e:
        child = subprocess.Popen(argv, cwd=Path(__file__).parents[1], env=env, stdout=o, stderr=e, text=True)
        deadline = time.monotonic() + 500
        while child.poll() is None and time.monotonic() < deadline:
            try:
                written = json.loads((out / "measured" / "results.json").read_text())
                if "total_s" not in written["stacks"][0]:
                    seen.add(len(written["runs"]))
            except (OSError, ValueError, KeyError, IndexError):
                pass  # not written yet, or being written
            time.sleep(0.02)
        if child.poll() is None:  # past the deadline
            child.kill()
        child.wait()
    measured = subprocess.CompletedProcess(argv, child.returncode, stdout.read_text(), stderr.read_text())
    given = eva(*common, "--saturate", "0.5", "--saturation-from", str(out / "measured" / "results.json"),
                "--out", str(out / "given"))
    return out / "measured", out / "given", measured, given, seen


@pytest.mark.timeout(600)
def test_saturate_measures_each_stack_then_loads_it_at_its_fractions(saturated_runs):
    measured, given, first, second, seen = saturated_runs
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    results = json.loads((measured / "results.json").read_text())
    found = results["stacks"][0]["saturation"]
    assert set(found) == {"mixed", "dynamo-mix"}
    for name, sat in found.items():
        assert sat["requests"] == 48 and sat["failed"] == 0 and sat["rate"] > 0
        assert sat["makespan_s"] > sat["tail_s"] >= 0 and sat["rate"] == pytest.approx(48 / sat["makespan_s"], rel=0.01)
        [run] = [r for r in results["runs"] if r["workload"] == name]
        assert run["of_saturation"] and run["fraction"] == 0.9
        assert run["request_rate"] == float(f"{0.9 * sat['rate']:.2g}")
    markdown = (measured / "results.md").read_text()
    assert "## Saturation" in markdown and f"| mixed | aggregated | {found['mixed']['rate']:.3g} |" in markdown
    assert "(90% of saturation)" in markdown
    # written after each loaded point, not only once the stack was done: a run cut short keeps its points
    assert 1 in seen, seen
    # the same rates from the first run, not measured again
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    again = json.loads((given / "results.json").read_text())
    assert again["stacks"][0]["saturation"] == {name: {**sat, "from": str(measured / "results.json")}
                                                for name, sat in found.items()}
    assert sorted(r["request_rate"] for r in again["runs"]) == sorted(
        float(f"{0.5 * sat['rate']:.2g}") for sat in found.values())
    assert "saturation:" not in second.stdout.split("## aggregated")[0]  # no burst was sent


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
