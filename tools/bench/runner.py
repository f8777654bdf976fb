"""``epd bench``: seeded load against an OpenAI-compatible endpoint, then the figures (and a JSON file).

Arrivals are Poisson at ``--request-rate`` (exponential gaps from the seed), or all at once; at most
``--max-concurrency`` requests are in flight (a request that waits for a slot starts its clock when it
is sent). Warm-up requests go first, on images of their own, and are not measured.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import platform
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np

from tools.bench.client import RequestResult, request_body, send
from tools.bench.dataset import ImagePool, RequestSpec, build_requests
from tools.bench.metrics import Slo, by_class, format_summary, summarize
from tools.bench.settings import BenchSettings, parse_goodput
from tools.bench.video import VideoPool, assign_videos

WARMUP_TOKENS = 16  # a warm-up request exercises every stage; a long output would only add time


def arrival_times(count: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent (all zeros for an infinite rate)."""
    if math.isinf(rate):
        return [0.0] * count
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, count)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


class LoadGenerator:
    def __init__(self, settings: BenchSettings):
        self.settings = settings
        self.url = settings.base_url.rstrip("/") + "/chat/completions"
        api_key = os.environ.get("OPENAI_API_KEY", "")  # as vLLM's benchmark reads it
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(settings.timeout, connect=30),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self.model = settings.model
        self.slots = asyncio.Semaphore(settings.max_concurrency or 1 << 30)

    async def resolve_model(self) -> str:
        if not self.model:
            resp = await self.client.get(self.settings.base_url.rstrip("/") + "/models")
            resp.raise_for_status()
            self.model = resp.json()["data"][0]["id"]
        return self.model

    async def one(self, pool: ImagePool, spec: RequestSpec, t0: float) -> RequestResult:
        body = request_body(self.model, pool.messages(spec), spec, self.settings.ignore_eos)
        async with self.slots:
            return await send(self.client, self.url, body, spec, t0)

    async def run(self, pool: ImagePool, specs: list[RequestSpec], arrivals: list[float],
                  progress=None) -> tuple[list[RequestResult], float]:
        t0 = time.perf_counter()
        tasks = []
        for spec, at in zip(specs, arrivals):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(self.one(pool, spec, t0))
            if progress is not None:
                task.add_done_callback(lambda _t: progress.update(1))
            tasks.append(task)
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0

    async def close(self) -> None:
        await self.client.aclose()


def prepare(settings: BenchSettings) -> tuple[ImagePool, list[RequestSpec], list[RequestSpec]]:
    """Warm-up and measured requests, and every distinct image they use, encoded."""
    warm, warm_images = build_requests(_imaging(settings), settings.warmup, settings.seed + 1, 0, repeat_ratio=0.0)
    warm = [replace(spec, output_len=min(spec.output_len, WARMUP_TOKENS)) for spec in warm]
    measured, images = build_requests(_imaging(settings), settings.num_prompts, settings.seed, warm_images)
    videos = None
    if settings.video_count:
        only = settings.image_count == 0  # video-only requests: the image slots drawn above are dropped
        warm, warm_clips = assign_videos(warm, settings.video_count, 0, drop_images=only)
        measured, clips = assign_videos(measured, settings.video_count, warm_clips, drop_images=only)
        warm_images, images = (0, 0) if only else (warm_images, images)
        videos = VideoPool(settings.video_seconds, settings.video_fps, settings.video_size, settings.seed)
        videos.generate(warm_clips + clips)
    pool = ImagePool(settings.image_size, settings.image_format, settings.seed, videos)
    pool.generate(warm_images + images)
    return pool, warm, measured


def _imaging(settings: BenchSettings) -> BenchSettings:
    """Video-only load (clips, no images) still needs requests that are not text only: they are drawn
    as one-image requests, whose image ``assign_videos`` then replaces with clips."""
    if settings.video_count and settings.image_count == 0:
        return settings.model_copy(update={"image_count": 1, "repeat_ratio": 0.0})
    return settings


async def bench(settings: BenchSettings, before_measured: Callable[[], Awaitable[None]] | None = None) -> dict:
    """Warm-up, then the measured requests; ``before_measured`` runs between the two (e.g. to read the
    server's counters)."""
    pool, warm, measured = prepare(settings)
    generator = LoadGenerator(settings)
    try:
        await generator.resolve_model()
        if warm:
            warm_results, _ = await generator.run(pool, warm, [0.0] * len(warm))
            failed = [r.error for r in warm_results if not r.ok]
            if failed:
                raise RuntimeError(f"{len(failed)} warm-up request(s) failed, e.g. {failed[0]}")
        if before_measured is not None:
            await before_measured()
        progress = _progress_bar(settings)
        try:
            results, duration = await generator.run(pool, measured, arrival_times(
                len(measured), settings.request_rate, settings.seed), progress)
        finally:
            if progress is not None:
                progress.close()
    finally:
        await generator.close()
    return report(settings, generator.model, results, duration)


def report(settings: BenchSettings, model: str, results: list[RequestResult], duration: float) -> dict:
    slo = Slo(**parse_goodput(settings.goodput))
    summary = summarize(results, duration, slo)
    rate = settings.request_rate
    return {
        "label": settings.label or "endpoint",
        "request_rate": None if math.isinf(rate) else rate,  # JSON has no infinity: null means all at once
        "model": model,
        "config": {k: (None if isinstance(v, float) and math.isinf(v) else v)
                   for k, v in settings.model_dump().items()},
        "environment": {"python": sys.version.split()[0], "platform": platform.platform(),
                        "httpx": httpx.__version__},
        "summary": summary,
        "classes": by_class(results, duration, slo),
        "errors": sorted({r.error for r in results if r.error})[:10],
        "requests": [r.record() for r in results],
    }


def _progress_bar(settings: BenchSettings):
    """On a terminal only (a log file or another program's pipe gets the summary alone)."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=settings.num_prompts, desc=settings.label or "bench", unit="req", file=sys.stderr)


def main(settings: BenchSettings) -> int:
    try:
        results = asyncio.run(bench(settings))
    except (RuntimeError, httpx.HTTPError) as err:
        print(f"epd bench: {err}", file=sys.stderr)
        return 1
    classes = results["classes"] if len(results["classes"]) > 1 else {}
    print(format_summary(results["label"], settings.request_rate, results["summary"], classes))
    for error in results["errors"]:
        print(f"error: {error}", file=sys.stderr)
    if settings.out:
        path = Path(settings.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1))
    return 0 if results["summary"]["failed"] == 0 else 1
