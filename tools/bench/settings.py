"""Settings of ``epd bench``, ``epd bench plot`` (``EPD_BENCH_`` variables or ``--flags``)."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, Field, field_validator
from pydantic_settings import BaseSettings, CliPositionalArg, SettingsConfigDict

RESOLUTIONS = {"360p": (640, 360), "720p": (1280, 720), "1080p": (1920, 1080), "4k": (3840, 2160)}


def parse_goodput(text: str) -> dict[str, float]:
    """``ttft:2000,itl:100`` → ``{"ttft_ms": 2000.0, "itl_ms": 100.0}`` (``metrics.Slo``'s fields); empty: none."""
    limits = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, ms = part.partition(":")
        try:
            value = float(ms)
        except ValueError:
            value = -1.0
        if not sep or key not in ("ttft", "tpot", "itl") or f"{key}_ms" in limits or value <= 0:
            raise ValueError(f"goodput {text!r}: ttft:MS, tpot:MS, itl:MS (positive milliseconds), comma separated")
        limits[f"{key}_ms"] = value
    return limits


def parse_resolution(value: str) -> tuple[int, int]:
    """``360p``/``720p``/``1080p``/``4k`` or ``WxH`` → (width, height)."""
    text = value.strip().lower()
    if text in RESOLUTIONS:
        return RESOLUTIONS[text]
    width, sep, height = text.partition("x")
    if not sep or not width.isdigit() or not height.isdigit() or int(width) < 1 or int(height) < 1:
        raise ValueError(f"image resolution {value!r}: use 360p, 720p, 1080p, 4k or WIDTHxHEIGHT (e.g. 448x448)")
    return int(width), int(height)


class Workload(BaseModel):
    """What the requests look like (fields shared by ``epd bench`` and ``epd plan``)."""

    input_len: int = Field(128, ge=1, description="text tokens per prompt (exact with --tokenizer; else one "
                                                  "word per token)")
    output_len: int = Field(128, ge=1, description="tokens generated per request (max_tokens + ignore_eos)")
    image_count: int = Field(1, ge=0, description="images per image request (0: text only)")
    random_image_count: bool = Field(False, description="draw each image request's count from 1..--image-count")
    image_resolution: str = Field("1080p", description="360p, 720p, 1080p, 4k or WIDTHxHEIGHT")
    text_ratio: float = Field(0.0, ge=0, le=1, description="share of requests that are text only (mixed traffic)")
    image_format: Literal["png", "jpeg"] = Field("jpeg", description="how clients send images (data URLs the "
                                                                    "frontend decodes)")

    @field_validator("image_resolution")
    @classmethod
    def _resolution(cls, value: str) -> str:
        parse_resolution(value)
        return value

    @property
    def image_size(self) -> tuple[int, int]:
        return parse_resolution(self.image_resolution)

    def mean_images(self) -> float:
        """Images per image request, on average."""
        return (1 + self.image_count) / 2 if self.random_image_count else float(self.image_count)

    def image_counts(self) -> list[int]:
        """Every image count an image request may carry (equally likely)."""
        if self.image_count == 0:
            return [0]
        return list(range(1, self.image_count + 1)) if self.random_image_count else [self.image_count]


class VideoWorkload(BaseModel):
    """Video clips per request (``epd bench --video-*``; ``tools.plan.floor`` measures clip requests too)."""

    video_count: int = Field(0, ge=0, description="video clips per request (0: none); --image-count 0 with "
                                                  "this sends video-only requests")
    video_seconds: float = Field(10.0, gt=0, le=600, description="length of each clip (seconds)")
    video_resolution: str = Field("720p", description="360p, 720p, 1080p, 4k or WIDTHxHEIGHT")
    video_fps: float = Field(30.0, gt=0, le=240, description="frame rate the clips are encoded at (the model "
                                                             "samples 2 a second of them by default)")

    @field_validator("video_resolution")
    @classmethod
    def _video_resolution(cls, value: str) -> str:
        parse_resolution(value)
        return value

    @property
    def video_size(self) -> tuple[int, int]:
        return parse_resolution(self.video_resolution)


class BenchSettings(BaseSettings, VideoWorkload, Workload):
    model_config = SettingsConfigDict(env_prefix="EPD_BENCH_", cli_kebab_case=True, cli_implicit_flags=True,
                                      extra="forbid", validate_default=True)

    base_url: str = Field("http://127.0.0.1:8000/v1", description="the OpenAI-compatible API (ours or another)")
    model: str = Field("", description="model name to ask for; empty: the first one /v1/models lists")
    label: str = Field("", description="topology or system name recorded in the results (plots group by it)")
    num_prompts: int = Field(100, ge=1, description="requests measured")
    warmup: int = Field(2, ge=0, description="requests sent (and waited for) before measuring")
    request_rate: float = Field(math.inf, gt=0, description="Poisson arrivals per second (seeded); inf: all "
                                                            "at once, bounded by --max-concurrency")
    max_concurrency: int = Field(0, ge=0, description="requests in flight at most; 0: unbounded")
    seed: int = Field(0, description="seed of arrivals, prompts and images (the same seed sends the same "
                                     "images again: change it between runs against an embedding cache)")
    tokenizer: str = Field("", description="HF tokenizer directory: size text prompts exactly to --input-len")
    repeat_ratio: float = Field(0.0, ge=0, le=1, description="share of images that repeat an earlier one "
                                                             "(exercises embedding caches)")
    ignore_eos: bool = Field(True, description="force --output-len tokens (vLLM's ignore_eos extension)")
    goodput: str = Field("", description="the SLO goodput counts requests within, in ms: ttft:MS, tpot:MS and "
                                         "itl:MS (held against each request's own 99th-percentile gap), comma "
                                         "separated, e.g. ttft:2000,itl:100 (vLLM's --goodput); empty: none")
    timeout: float = Field(600.0, gt=0, description="seconds one request may take")
    out: str = Field("", description="write the results (summary, per class, per request) to this JSON file")

    @field_validator("goodput")
    @classmethod
    def _goodput(cls, value: str) -> str:
        parse_goodput(value)
        return value


class PlotSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EPD_BENCH_", cli_kebab_case=True, cli_implicit_flags=True,
                                      extra="forbid")

    files: CliPositionalArg[list[str]] = Field(description="results JSON files of `epd bench --out` (or of "
                                                           "bench/epd_vs_aggregated.py)")
    out: str = Field("latency_vs_rate.png", description="the PNG to write")
