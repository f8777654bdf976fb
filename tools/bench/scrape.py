"""Where a stack's time went, from the frontend's ``/metrics``, read before and after a measurement.

- ``epd_stage_seconds{stage}`` (histogram): per request, media (fetch + decode its images), encode (all
  its images, as the frontend waits for them), first_token (prefill job submitted → first token);
- ``epd_service_stat{service,instance,stat}`` (gauges of every worker's NATS stats): the encoders'
  own split of the encode stage — ``vit_queue`` (an image waiting for a ViT forward), ``vit_forward``
  (the forward its batch took; ``vit_forward_prep``, the host's part of preparing its pixels; on a GPU
  also ``vit_forward_launch``, queuing its kernels (the preparation included), and
  ``vit_forward_gpu``, its span on the device), ``job_pull`` (pulling its pixels), ``job_encode`` (preprocessing + ViT
  as its job saw it), and in the aggregated process ``prompt_encode`` (a request encoded in place: its
  prompt in → into the engine; per request, not per image); the language-model workers' own split of
  the first_token stage, per prompt: ``prompt_intake`` (a joined or aggregated worker: the job in → its
  prompt in the engine: embeddings pulled, checks, the engine step in progress; of it ``prompt_pull``, a
  joined worker's checks and pulls, and ``prompt_handoff``, from there to its engine thread taking the
  prompt; beside it the encoders' ``pull_serve``, a pull served from their export pool: its stage until
  the reply), ``prompt_wait`` (in the
  engine → the step with its first chunk begins), ``prompt_prefill`` (that step → its first token) — as
  ``<stage>_seconds_total`` /
  ``<stage>_count`` summed over instances; and their counters ``batches``
  (ViT forwards) and ``batches_waited`` (forwards that waited for a request's other images), summed
  over instances: how many over a measurement, beside the stages' means; and the language workers'
  step-time model (``STEP_COUNTS``: its prediction error summed over the steps it was checked on, their
  count, the steps it learnt from and those the time budget cut; the aggregated worker's ViT
  forward-time model's error and the batches it cut).

The gauges are the frontend's copy of a listing it refreshes about once a second, so a reading right
after a measurement may miss its last images (and the frontend records a request's stages as it closes
it, just after its last chunk); ``settled`` polls until both have counted what the measurement sent (or a
few seconds passed).
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field

import httpx

ENCODER_STAGES = ("vit_queue", "vit_forward", "vit_forward_prep", "vit_forward_launch", "vit_forward_gpu", "job_pull", "job_encode",
                  "prompt_encode", "prompt_intake", "prompt_pull", "prompt_handoff", "prompt_wait",
                  "prompt_prefill", "pull_serve")
ENCODER_COUNTS = ("batches", "batches_waited")  # counters: increments, never means
# the language workers' step-time model: Σ |predicted − observed| / observed and how many steps, steps timed,
# steps the time budget cut (``shared.engine.step_time``); the aggregated ViT's forward-time model alike
STEP_COUNTS = ("step_time_error_total", "step_time_error_count", "steps_timed", "steps_paced",
               "vit_time_error_total", "vit_time_error_count", "vit_batches_cut")
_STAGE = re.compile(r'^epd_stage_seconds_(sum|count)\{stage="(\w+)"\} (\S+)$', re.M)
_STAT = re.compile(r'^epd_service_stat\{([^}]*)\} (\S+)$', re.M)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


@dataclass
class Reading:
    stages: dict[str, tuple[float, float]] = field(default_factory=dict)  # stage → (seconds, requests)
    encoder: dict[str, tuple[float, float]] = field(default_factory=dict)  # stage → (seconds, images)
    counts: dict[str, float] = field(default_factory=dict)  # ENCODER_COUNTS' and STEP_COUNTS' counter → total

    @property
    def images_encoded(self) -> float:
        return self.encoder.get("vit_forward", (0.0, 0.0))[1]

    @property
    def requests_seen(self) -> float:
        """Requests the frontend has timed to their first token."""
        return self.stages.get("first_token", (0.0, 0.0))[1]


def parse(text: str) -> Reading:
    reading = Reading()
    stages: dict[str, list[float]] = {}
    for kind, stage, value in _STAGE.findall(text):
        stages.setdefault(stage, [0.0, 0.0])[kind == "count"] = float(value)
    reading.stages = {stage: (total, count) for stage, (total, count) in stages.items()}
    encoder: dict[str, list[float]] = {}
    for labels, value in _STAT.findall(text):
        stat = dict(_LABEL.findall(labels)).get("stat", "")
        for stage in ENCODER_STAGES:
            if stat in (f"{stage}_seconds_total", f"{stage}_count"):
                encoder.setdefault(stage, [0.0, 0.0])[stat.endswith("_count")] += float(value)
        if stat in ENCODER_COUNTS or stat in STEP_COUNTS:
            reading.counts[stat] = reading.counts.get(stat, 0.0) + float(value)
    reading.encoder = {stage: (total, count) for stage, (total, count) in encoder.items()}
    return reading


async def read(api: str) -> Reading:
    async with httpx.AsyncClient(timeout=30) as client:
        return parse((await client.get(api.removesuffix("/v1") + "/metrics")).text)


async def settled(api: str, images: float, requests: float = 0.0, timeout: float = 3.0) -> Reading:
    """A reading once the encoders have counted ``images`` ViT images and the frontend ``requests``
    requests, in all (or after ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    reading = await read(api)
    while (reading.images_encoded < images or reading.requests_seen < requests) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        reading = await read(api)
    return reading


def _means_ms(after: dict[str, tuple[float, float]], before: dict[str, tuple[float, float]]) -> dict[str, float]:
    out = {}
    for stage, (total, count) in after.items():
        seen = count - before.get(stage, (0.0, 0.0))[1]
        if seen > 0:
            out[stage] = (total - before.get(stage, (0.0, 0.0))[0]) / seen * 1e3
    return out


def stage_means(before: Reading, after: Reading) -> tuple[dict[str, float], dict[str, float]]:
    """({frontend stage: mean ms per request}, {encoder stage: mean ms per image, and each of
    ``ENCODER_COUNTS``: how many between the readings}) between two readings.

    Requests an aggregated worker encoded in place have no frontend encode stage: their first_token
    stage holds it. Their ``prompt_encode`` (the worker's, per request: job in → prompt in the engine)
    becomes the encode stage, and leaves first_token, so both mean what they mean for other layouts."""
    counts = {name: total - before.counts.get(name, 0.0) for name, total in after.counts.items()}
    stages, encoder = dict(after.stages), dict(after.encoder)
    done, started = encoder.get("prompt_encode", (0.0, 0.0)), before.encoder.get("prompt_encode", (0.0, 0.0))
    seconds, requests = done[0] - started[0], done[1] - started[1]  # encoded in place between the readings
    if requests > 0 and "first_token" in stages:
        total, count = stages.get("encode", (0.0, 0.0))  # (the frontend's own, cumulative: any encoded there)
        stages["encode"] = (total + seconds, count + requests)
        stages["first_token"] = (stages["first_token"][0] - seconds, stages["first_token"][1])
    return _means_ms(stages, before.stages), {**_means_ms(encoder, before.encoder), **counts}
