"""Figures of a run: latency distributions (ms), throughputs, goodput under SLOs, per traffic class.

Goodput counts the requests that finished within every SLO that is set, per second of the run:
- TTFT: the request's time to its first token;
- TPOT: its mean time per output token after the first;
- ITL: the 99th percentile of the request's *own* inter-token gaps (``request_itl_p99``) — one stall of
  a few hundred ms (a long prefill run between two decode steps) fails a request whose TPOT is fine, as
  a reader of the stream would notice; with fewer than 100 gaps this is nearly the longest gap. A
  request with one token has no gaps and meets it.
The ``itl_ms`` distribution pools the gaps of all requests (its p99 is the run's ITL p99).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from tools.bench.client import RequestResult

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Slo:
    """Per-request limits in ms; 0 leaves that limit unset."""

    ttft_ms: float = 0.0
    tpot_ms: float = 0.0
    itl_ms: float = 0.0  # on each request's own p99 inter-token gap

    def met(self, result: RequestResult) -> bool:
        return (result.ok and (not self.ttft_ms or result.ttft * 1e3 <= self.ttft_ms)
                and (not self.tpot_ms or result.tpot * 1e3 <= self.tpot_ms)
                and (not self.itl_ms or request_itl_p99(result) * 1e3 <= self.itl_ms))


def request_itl_p99(result: RequestResult) -> float:
    """Seconds: the 99th percentile of one request's inter-token gaps (0 without gaps)."""
    return float(np.percentile(result.itl, 99)) if result.itl else 0.0


def distribution(values_s: list[float]) -> dict[str, float]:
    """Mean and percentiles, in milliseconds."""
    if not values_s:
        return {"mean": 0.0, **{f"p{p}": 0.0 for p in PERCENTILES}}
    ms = np.asarray(values_s) * 1e3
    return {"mean": float(ms.mean()), **{f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES}}


def ttft_trend(done: list[RequestResult]) -> float | None:
    """Whether a run's queue grew: the least-squares slope of its requests' TTFT against their send times,
    seconds of TTFT per second of arrivals. About 0 where the server keeps up; offered ρ times what it
    sustains, the request sent at t gets its first token near ρ·t, so the slope nears ρ − 1 (0.1 at 1.1×,
    1 at 2×), and the rate it sustains is the offered one ÷ (1 + slope). It reads the run's
    own requests, so it does not hang on one draw's mean beside another's. None under three requests or
    when they were sent within a second (a burst)."""
    if len(done) < 3:
        return None
    sent = np.array([r.sent_at for r in done])
    if np.ptp(sent) < 1.0:
        return None
    return float(np.polyfit(sent, np.array([r.ttft for r in done]), 1)[0])


def summarize(results: list[RequestResult], duration: float, slo: Slo = Slo()) -> dict:
    """Everything ``epd bench`` reports about ``results`` over a run of ``duration`` seconds."""
    done = [r for r in results if r.ok]
    duration = max(duration, 1e-9)
    prompt = sum(r.prompt_tokens for r in done)
    output = sum(r.completion_tokens for r in done)
    good = sum(slo.met(r) for r in results)
    return {
        "requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_throughput": output / duration,
        "total_token_throughput": (prompt + output) / duration,
        "slo": asdict(slo),
        "good": good,
        "goodput": good / duration,
        "prompt_tokens": prompt,
        "completion_tokens": output,
        "ttft_ms": distribution([r.ttft for r in done]),
        "ttft_trend": ttft_trend(done),
        "tpot_ms": distribution([r.tpot for r in done if r.completion_tokens > 1]),
        "itl_ms": distribution([gap for r in done for gap in r.itl]),
        "request_itl_p99_ms": distribution([request_itl_p99(r) for r in done if r.itl]),
        "e2e_ms": distribution([r.e2e for r in done]),
    }


def by_class(results: list[RequestResult], duration: float, slo: Slo = Slo()) -> dict[str, dict]:
    """The same figures for text-only and for image requests (throughputs over the whole run)."""
    return {kind: summarize([r for r in results if r.kind == kind], duration, slo)
            for kind in ("text", "image", "video") if any(r.kind == kind for r in results)}


def format_summary(label: str, rate: float, summary: dict, classes: dict[str, dict]) -> str:
    slo = ", ".join(f"{name.removesuffix('_ms').upper()} ≤ {limit:g} ms" for name, limit in summary["slo"].items()
                    if limit)
    lines = [f"==== {label or 'endpoint'}  request rate {rate:g}/s ====",
             f"completed {summary['completed']}/{summary['requests']} in {summary['duration_s']:.2f} s"
             f"   {summary['request_throughput']:.2f} req/s   goodput {summary['goodput']:.2f} req/s"
             + (f" ({slo}; ITL on each request's p99 gap)" if slo else ""),
             f"tokens: {summary['output_throughput']:.1f} out/s   {summary['total_token_throughput']:.1f} total/s"
             f"   (prompt {summary['prompt_tokens']}, output {summary['completion_tokens']})",
             f"{'':14}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}   (ms)"]
    for name, figures in (("", summary), *classes.items()):
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            d = figures[metric]
            title = f"{metric[:-3].upper()}" + (f" [{name}]" if name else "")
            lines.append(f"{title:14}" + "".join(f"{d[k]:10.1f}" for k in ("mean", "p50", "p90", "p99")))
    return "\n".join(lines)
