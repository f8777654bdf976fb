"""Encoder settings (``EPD_`` environment variables or ``epd encoder --flags``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from shared.settings import CommonSettings, CudaGraphs, JobLimit, MediaLimits


class Preprocessing(BaseModel):
    """Where encoders resize and patchify images (``epd plan`` models the same choice)."""

    preprocess: Literal["auto", "pil", "torch"] = Field(
        "auto", description="where images are resized and patchified: pil = the checkpoint's own processor on CPU "
                            "threads; torch = tensor operations on the encoder's device, the same patches (a "
                            "resample other than bicubic needs pil); auto = torch on a GPU, else pil")
    preprocess_threads: int = Field(2, ge=1, description="threads resizing and patchifying images (pil), and "
                                                         "videos on CPU: raise it for CPU-bound encoders")


class EncoderSettings(JobLimit, CudaGraphs, MediaLimits, Preprocessing, CommonSettings):
    max_batch_patches: int = Field(65536, ge=1, description="patches in one ViT forward at most (a 1080p image: "
                                                            "10,764): bounds a forward's memory and time")
    encoder_cache_mb: int = Field(4096, ge=0, description="embedding cache of this encoder, least recently used "
                                                          "out (MiB): repeated images skip the ViT; 0: no cache")
