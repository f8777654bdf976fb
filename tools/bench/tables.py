"""Markdown rows of a sweep's records (``bench/epd_vs_aggregated.py``): one run or one unloaded summary per
row, beside its floor and the plan's prediction.

A record is ``epd bench``'s results plus ``topology``, ``request_rate`` (None: unloaded),
``stages_ms`` / ``encoder_ms`` (``measure.py``), ``floor_ms`` and ``predicted_ttft_ms`` where known.
"""

from __future__ import annotations

import math

from tools.plan.layouts import bench_layouts


def stages(means: dict, keys=("media", "encode", "first_token")) -> str:
    """``a / b / c`` of the stage means (ms), ``-`` for a stage not seen."""
    return " / ".join(f"{means[k]:.0f}" if k in means else "-" for k in keys)


def ms(value) -> str:
    return f"{value:.0f}" if value is not None and math.isfinite(value) else "unstable"


HEADER = ("| topology | offered req/s | achieved | TTFT mean / p99 (ms) | TTFT trend (s/s) | × floor "
          "| text / image TTFT (ms) | ITL p99 (ms) | TPOT mean / p99 (ms) | goodput (req/s) | failed / resumed "
          "| media / encode / to first token (ms) | ViT queue / forward, pull / job (ms per image) "
          "| step-time error (steps cut / timed) | predicted TTFT (ms, error) |\n" + "|---" * 15 + "|")


def step_model(counts: dict) -> str:
    """The language workers' step-time model over a point (``scrape.STEP_COUNTS``, as ``encoder_ms`` holds
    them): its mean |predicted − observed| ÷ observed over the steps it sized, and the steps the time budget
    cut of those timed; ``-`` where it timed none (the budget off)."""
    timed = counts.get("step_time_error_count", 0)
    if not timed:
        return "-"
    return (f"{counts['step_time_error_total'] / timed:.1%} "
            f"({counts.get('steps_paced', 0):.0f} / {counts.get('steps_timed', 0):.0f})")


def row_text(run: dict) -> str:
    """One record as a row under ``HEADER``."""
    s = run["summary"]
    classes = run.get("classes", {})
    kinds = " / ".join(f"{classes[k]['ttft_ms']['mean']:.0f}" if k in classes else "-" for k in ("text", "image"))
    floor = run.get("floor_ms", {}).get("floor_ms")
    times = f"{s['ttft_ms']['mean'] / floor:.2f}" if floor else "-"
    predicted = run.get("predicted_ttft_ms")
    error = f" ({predicted / s['ttft_ms']['mean'] - 1:+.0%})" if predicted and math.isfinite(predicted) and \
        s["ttft_ms"]["mean"] else ""
    rate = "unloaded" if run.get("request_rate") is None else f"{run['request_rate']:g}"
    achieved = "-" if run.get("request_rate") is None else f"{s['request_throughput']:.2f}"
    goodput = "-" if run.get("request_rate") is None else f"{s['goodput']:.2f}"
    trend = "-" if run.get("request_rate") is None or s.get("ttft_trend") is None else f"{s['ttft_trend']:+.2f}"
    per_token = s["tpot_ms"]
    itl, tpot = ("-", "-") if run.get("request_rate") is None else \
        (f"{s['itl_ms']['p99']:.0f}", f"{per_token['mean']:.1f} / {per_token['p99']:.1f}")  # unloaded: few tokens
    return (f"| {run['topology']} | {rate} | {achieved} | {s['ttft_ms']['mean']:.0f} / {s['ttft_ms']['p99']:.0f} "
            f"| {trend} | {times} | {kinds} | {itl} | {tpot} | {goodput} "
            f"| {s['failed']} / {run.get('resumed', 0)} | {stages(run.get('stages_ms', {}))} "
            f"| {stages(run.get('encoder_ms', {}), ('vit_queue', 'vit_forward'))}, "
            f"{stages(run.get('encoder_ms', {}), ('job_pull', 'job_encode'))} "
            f"| {step_model(run.get('encoder_ms', {}))} | {ms(predicted) if predicted is not None else '-'}{error} |")


def ordered_labels(labels) -> list[str]:
    """Topology labels in the order the layouts are listed (aggregated first), however the runs were split."""
    order = [layout.label() for gpus in (1, 2, 3, 4, 8) for layout in bench_layouts(gpus)]
    unique = list(dict.fromkeys(labels))
    return sorted(unique, key=lambda label: (order.index(label) if label in order else len(order), unique.index(label)))
