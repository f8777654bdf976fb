"""Figures of a run: latency distributions (ms), throughputs, goodput under SLOs, per traffic class."""

from __future__ import annotations

import numpy as np

from tools.bench.client import RequestResult

PERCENTILES = (50, 90, 99)


def distribution(values_s: list[float]) -> dict[str, float]:
    """Mean and percentiles, in milliseconds."""
    if not values_s:
        return {"mean": 0.0, **{f"p{p}": 0.0 for p in PERCENTILES}}
    ms = np.asarray(values_s) * 1e3
    return {"mean": float(ms.mean()), **{f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES}}


def meets_slo(result: RequestResult, slo_ttft_ms: float, slo_tpot_ms: float) -> bool:
    return (result.ok and (not slo_ttft_ms or result.ttft * 1e3 <= slo_ttft_ms)
            and (not slo_tpot_ms or result.tpot * 1e3 <= slo_tpot_ms))


def summarize(results: list[RequestResult], duration: float, slo_ttft_ms: float = 0.0,
              slo_tpot_ms: float = 0.0) -> dict:
    """Everything ``epd bench`` reports about ``results`` over a run of ``duration`` seconds."""
    done = [r for r in results if r.ok]
    duration = max(duration, 1e-9)
    prompt = sum(r.prompt_tokens for r in done)
    output = sum(r.completion_tokens for r in done)
    good = sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in results)
    return {
        "requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_throughput": output / duration,
        "total_token_throughput": (prompt + output) / duration,
        "goodput": good / duration,
        "prompt_tokens": prompt,
        "completion_tokens": output,
        "ttft_ms": distribution([r.ttft for r in done]),
        "tpot_ms": distribution([r.tpot for r in done if r.completion_tokens > 1]),
        "itl_ms": distribution([gap for r in done for gap in r.itl]),
        "e2e_ms": distribution([r.e2e for r in done]),
    }


def by_class(results: list[RequestResult], duration: float, slo_ttft_ms: float = 0.0,
             slo_tpot_ms: float = 0.0) -> dict[str, dict]:
    """The same figures for text-only and for image requests (throughputs over the whole run)."""
    return {kind: summarize([r for r in results if r.kind == kind], duration, slo_ttft_ms, slo_tpot_ms)
            for kind in ("text", "image", "video") if any(r.kind == kind for r in results)}


def format_summary(label: str, rate: float, summary: dict, classes: dict[str, dict]) -> str:
    lines = [f"==== {label or 'endpoint'}  request rate {rate:g}/s ====",
             f"completed {summary['completed']}/{summary['requests']} in {summary['duration_s']:.2f} s"
             f"   {summary['request_throughput']:.2f} req/s   goodput {summary['goodput']:.2f} req/s",
             f"tokens: {summary['output_throughput']:.1f} out/s   {summary['total_token_throughput']:.1f} total/s"
             f"   (prompt {summary['prompt_tokens']}, output {summary['completion_tokens']})",
             f"{'':14}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}   (ms)"]
    for name, figures in (("", summary), *classes.items()):
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            d = figures[metric]
            title = f"{metric[:-3].upper()}" + (f" [{name}]" if name else "")
            lines.append(f"{title:14}" + "".join(f"{d[k]:10.1f}" for k in ("mean", "p50", "p90", "p99")))
    return "\n".join(lines)
