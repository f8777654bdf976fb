#!/usr/bin/env python3
"""Inter-token latency held to a target (issue 43): one workload at one rate, each topology with the
engines' time budget on (``--target-itl-ms``, each value of ``--targets``) and off (0), in one run.

Per stack: ITL p99 (pooled gaps), TPOT p99 (over requests), mean TTFT, achieved throughput (requests and
output tokens a second), and the step-time model's prediction error: the language workers' mean
|predicted − observed| / observed over the measured steps that carried decode rows (their NATS stats
``step_time_error_total`` / ``_count``, read through the frontend's ``/metrics`` before and after), with
how many steps the budget cut; the aggregated worker's ViT forward-time model alike (its forwards, and
the batches the budget cut). Then, per topology, each target against off: the issue's targets (ITL p99
≤ 100 ms, TPOT p99 ≤ 30 ms, mean TTFT ≤ 1.1× off's, throughput ≥ 95 % of off's).

Workload (default, the issue's chat load; Qwen2.5-VL-7B with dummy weights): 40 % text only, 60 % one or
two 720p images, 30 % of images repeating an earlier one, 128 text tokens in, 256 out (ignore_eos).
Topologies: aggregated (``epd up --topology aggregated``) and E/PD (``epd up``'s default: an encoder
beside a language worker, under CUDA MPS where the daemon exists). Each stack is started with default
flags and the one setting, warmed up, measured for ``--seconds`` of Poisson arrivals, and stopped; a
target's stack runs before its off twin, so compiles left over from start-up weigh on the budget, not
on the baseline.

    python bench/itl_target.py --rate 24 --out /tmp/itl        # one H200: ~5 min for the four stacks
    python bench/itl_target.py --tiny --out /tmp/itl-tiny      # CPU: the same path on the tiny model
    python bench/itl_target.py --dry-run                        # what would run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.epd_vs_aggregated import stack_env, stack_log, stack_setting, tokenizer_dir  # noqa: E402
from shared.model.presets import PRESETS  # noqa: E402
from tools.bench import scrape  # noqa: E402
from tools.bench.environment import hardware, host, versions  # noqa: E402
from tools.bench.runner import bench  # noqa: E402
from tools.bench.settings import BenchSettings  # noqa: E402
from tools.bench.stack import StackProcess  # noqa: E402

TOPOLOGIES = {"aggregated": ("--topology", "aggregated"), "E/PD": ()}
CHAT = dict(text_ratio=0.4, image_count=2, random_image_count=True, image_resolution="720p", repeat_ratio=0.3,
            input_len=128, output_len=256)
TINY = dict(image_resolution="112x112", input_len=32, output_len=32)  # long enough that prompts meet decode rows
TARGETS = {"itl_p99_ms": 100.0, "tpot_p99_ms": 30.0, "ttft_ratio": 1.1, "throughput_ratio": 0.95}
SETTLE_S = 2.0  # the frontend's copy of the workers' stats is refreshed about once a second


class Point:
    """One stack: a topology at one target (0: no time budget)."""

    def __init__(self, topology: str, target_ms: float):
        self.topology, self.target_ms = topology, target_ms

    @property
    def label(self) -> str:
        return f"{self.topology} @ {self.target_ms:g} ms" if self.target_ms else f"{self.topology} off"


def workload(args) -> dict:
    return {**CHAT, **(TINY if args.tiny else {})}


def points(args) -> list[Point]:
    return [Point(t, target) for t in args.topologies for target in args.targets]


def settings_for(args, api: str, label: str) -> BenchSettings:
    prompts = max(args.min_prompts, round(args.rate * args.seconds))
    return BenchSettings(base_url=api, label=label, num_prompts=prompts, warmup=args.warmup,
                         request_rate=args.rate, seed=args.seed, tokenizer=args.tokenizer,
                         timeout=args.request_timeout, **workload(args))


async def measure(args, point: Point, api: str) -> dict:
    """The warm-up, the measured requests, and the workers' step-time figures over the measured ones."""
    readings: dict[str, scrape.Reading] = {}

    async def before() -> None:
        await asyncio.sleep(SETTLE_S)
        readings["before"] = await scrape.read(api)

    run = await bench(settings_for(args, api, point.label), before_measured=before)
    await asyncio.sleep(SETTLE_S)
    after = await scrape.read(api)
    counts = {k: after.counts.get(k, 0.0) - readings["before"].counts.get(k, 0.0) for k in scrape.STEP_COUNTS}
    return {"topology": point.topology, "target_itl_ms": point.target_ms, "summary": run["summary"],
            "classes": run["classes"], "errors": run["errors"], "steps": counts}


def figures(record: dict) -> dict:
    s, steps = record["summary"], record["steps"]
    timed, forwards = steps["step_time_error_count"], steps["vit_time_error_count"]
    return {"achieved": s["request_throughput"], "output_tps": s["output_throughput"],
            "ttft_mean_ms": s["ttft_ms"]["mean"], "itl_p99_ms": s["itl_ms"]["p99"], "tpot_p99_ms": s["tpot_ms"]["p99"],
            "step_error": steps["step_time_error_total"] / timed if timed else None,
            "steps_paced": steps["steps_paced"], "steps_timed": steps["steps_timed"],
            "vit_error": steps["vit_time_error_total"] / forwards if forwards else None,
            "vit_cut": steps["vit_batches_cut"], "vit_timed": forwards, "failed": s["failed"]}


def run_stacks(args) -> list[dict]:
    env = stack_env(args)
    records = []
    for point in points(args):
        started = time.monotonic()
        stack = StackProcess([*TOPOLOGIES[point.topology]], {**env, "EPD_TARGET_ITL_MS": f"{point.target_ms:g}"},
                             ROOT, stack_log(args, point))
        try:
            api = stack.wait_ready(900)
            print(f"## {point.label}: {api} (mps={stack.ready_event.get('mps')}, up in "
                  f"{time.monotonic() - started:.0f} s)", flush=True)
            record = asyncio.run(measure(args, point, api))
            record["wall_s"] = time.monotonic() - started
            records.append(record)
            print(row(record), flush=True)
        except Exception as err:  # one stack failing must not cost the others their GPU time
            print(f"## {point.label} failed: {type(err).__name__}: {err}"[:2000], flush=True)
            records.append({"topology": point.topology, "target_itl_ms": point.target_ms,
                            "error": f"{type(err).__name__}: {err}"[:2000]})
        finally:
            stack.stop()
    return records


HEADER = ("| stack | achieved req/s | output tok/s | TTFT mean (ms) | ITL p99 (ms) | TPOT p99 (ms) "
          "| step-time error | steps cut / timed | ViT forward-time error | ViT batches cut / timed | failed |\n"
          + "|---" * 11 + "|")


def row(record: dict) -> str:
    name = Point(record["topology"], record["target_itl_ms"]).label
    if "error" in record:
        return f"| {name} | did not run: {record['error'].splitlines()[0]} |" + " |" * 9
    f = figures(record)
    error, vit = (f"{f[k]:.1%}" if f[k] is not None else "-" for k in ("step_error", "vit_error"))
    return (f"| {name} | {f['achieved']:.2f} | {f['output_tps']:.0f} | {f['ttft_mean_ms']:.0f} | {f['itl_p99_ms']:.0f} "
            f"| {f['tpot_p99_ms']:.1f} | {error} | {f['steps_paced']:.0f} / {f['steps_timed']:.0f} | {vit} "
            f"| {f['vit_cut']:.0f} / {f['vit_timed']:.0f} | {f['failed']} |")


def verdicts(records: list[dict]) -> list[str]:
    """Per topology, each target against its off twin: the issue's four targets."""
    lines = []
    done = {(r["topology"], r["target_itl_ms"]): figures(r) for r in records if "error" not in r}
    for (topology, target), f in done.items():
        off = done.get((topology, 0.0))
        if not target:
            continue
        checks = [f"ITL p99 {f['itl_p99_ms']:.0f} ms ≤ {TARGETS['itl_p99_ms']:g}: {_yes(f['itl_p99_ms'] <= TARGETS['itl_p99_ms'])}",
                  f"TPOT p99 {f['tpot_p99_ms']:.1f} ms ≤ {TARGETS['tpot_p99_ms']:g}: "
                  f"{_yes(f['tpot_p99_ms'] <= TARGETS['tpot_p99_ms'])}"]
        if off and off["ttft_mean_ms"] and off["achieved"]:
            ttft, rate = f["ttft_mean_ms"] / off["ttft_mean_ms"], f["achieved"] / off["achieved"]
            checks += [f"mean TTFT {ttft:.2f}× off's ≤ {TARGETS['ttft_ratio']:g}×: {_yes(ttft <= TARGETS['ttft_ratio'])}",
                       f"throughput {rate:.0%} of off's ≥ {TARGETS['throughput_ratio']:.0%}: "
                       f"{_yes(rate >= TARGETS['throughput_ratio'])}",
                       f"(off: ITL p99 {off['itl_p99_ms']:.0f} ms, TPOT p99 {off['tpot_p99_ms']:.1f} ms)"]
        lines.append(f"- {topology} @ {target:g} ms: " + "; ".join(checks))
    return lines


def _yes(ok: bool) -> str:
    return "yes" if ok else "no"


def report(args, meta: dict, records: list[dict]) -> str:
    w = workload(args)
    lines = [f"Hardware: {meta['hardware']}", f"Host: {json.dumps(meta['host'])}",
             f"Versions: {json.dumps(meta['versions'])}", f"Command: {' '.join(meta['command'])}",
             f"Wall time: {meta['wall_s']:.0f} s", "",
             f"Load: {w['text_ratio']:.0%} text only, the rest 1-{w['image_count']} × {w['image_resolution']} "
             f"({w['repeat_ratio']:.0%} of images repeated), {w['input_len']} text tokens in, {w['output_len']} out; "
             f"Poisson at {args.rate:g} req/s for {args.seconds:g} s after {args.warmup} warm-up requests; "
             f"{meta['model']}. Step-time error: mean |predicted − observed| / observed over the measured steps "
             "that carried decode rows; ViT forward-time error: over the aggregated worker's forwards (neither "
             "model runs without a budget).", "", HEADER, *(row(r) for r in records), "",
             "Targets (issue 43):", *verdicts(records)]
    return "\n".join(lines) + "\n"


def dry_run(args) -> int:
    prompts = max(args.min_prompts, round(args.rate * args.seconds))
    print(f"load: {workload(args)}; {prompts} requests at {args.rate:g} req/s after {args.warmup} warm-up ones")
    for point in points(args):
        print(f"stack {point.label:20} EPD_TARGET_ITL_MS={point.target_ms:g} python -m launcher.cli up --port 0 "
              + " ".join(TOPOLOGIES[point.topology]))
    return 0


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/itl_target", help="directory for results")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test on the built-in tiny model")
    parser.add_argument("--dry-run", action="store_true", help="print what would run")
    parser.add_argument("--rate", type=float, default=0, help="Poisson arrivals a second (default 24; tiny: 3)")
    parser.add_argument("--seconds", type=float, default=0, help="seconds of arrivals measured (default 12; "
                                                                 "tiny: 3)")
    parser.add_argument("--min-prompts", type=int, default=6, help="measured requests at least")
    parser.add_argument("--warmup", type=int, default=0, help="warm-up requests, all at once (default 16; tiny: 2)")
    parser.add_argument("--targets", default="50,0", help="comma-separated --target-itl-ms values, 0 for off "
                                                         "(each a stack of each topology)")
    parser.add_argument("--topologies", default="aggregated,E/PD", help=f"comma-separated: {', '.join(TOPOLOGIES)}")
    parser.add_argument("--model", default="qwen2.5-vl-7b", choices=sorted(PRESETS), help="preset, dummy weights")
    parser.add_argument("--kv-cache-mb", type=int, default=0, help="KV pool of every LM process (MiB; 0: the "
                                                                  "default, from --gpu-memory-utilization)")
    parser.add_argument("--max-batched-tokens", type=int, default=0,
                        help="every LM worker's step budget (EPD_MAX_BATCHED_TOKENS; 0: the engine's default)")
    parser.add_argument("--stack-env", action="append", default=[], metavar="EPD_NAME=VALUE", type=stack_setting,
                        help="a setting for every process of every stack (repeatable)")
    parser.add_argument("--stack-log", default="", metavar="DIR", help="keep every stack's log lines in DIR")
    parser.add_argument("--transport", default="zmq", choices=("zmq", "ucx"), help="the stacks' data plane "
                                                                                   "(zmq: epd up's default)")
    parser.add_argument("--request-timeout", type=float, default=120.0, help="seconds one request may take")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.rate = args.rate or (3.0 if args.tiny else 24.0)
    args.seconds = args.seconds or (3.0 if args.tiny else 12.0)
    args.warmup = args.warmup or (2 if args.tiny else 16)
    try:
        args.targets = [float(t) for t in args.targets.split(",")]
    except ValueError:
        parser.error(f"--targets {args.targets}: comma-separated milliseconds, e.g. 50,0")
    if any(t < 0 for t in args.targets) or len(set(args.targets)) != len(args.targets):
        parser.error("--targets: distinct values ≥ 0")
    args.topologies = args.topologies.split(",")
    if unknown := set(args.topologies) - set(TOPOLOGIES):
        parser.error(f"--topologies: unknown {', '.join(sorted(unknown))}; choose from {', '.join(TOPOLOGIES)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        return dry_run(args)
    started = time.monotonic()
    args.tokenizer = tokenizer_dir(args.tiny, args.model)
    records = run_stacks(args)
    meta = {"hardware": hardware(), "host": host(), "versions": versions(), "command": sys.argv,
            "wall_s": time.monotonic() - started, "transport": args.transport,
            "model": "tiny (CPU)" if args.tiny else f"{args.model} (dummy weights)"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    markdown = report(args, meta, records)
    (out / "results.md").write_text(markdown)
    (out / "results.json").write_text(json.dumps({**meta, "settings": vars(args), "records": records}, indent=1,
                                                 default=str))
    print("\n" + markdown)
    return 0 if all("error" not in r and r["summary"]["failed"] == 0 for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
