"""Encoder settings (``EPD_`` environment variables or ``epd encoder --flags``)."""

from __future__ import annotations

from pydantic import Field

from shared.settings import CommonSettings


class EncoderSettings(CommonSettings):
    max_batch_images: int = Field(32, ge=1, description="images in one ViT forward at most")
    max_batch_patches: int = Field(65536, ge=1, description="patches in one ViT forward at most (1080p: 10,764)")
    max_concurrent_jobs: int = Field(256, ge=1, description="encode jobs admitted at once; more wait in NATS")
    preprocess_threads: int = Field(2, ge=1, description="threads resizing and patchifying images")
    max_image_pixels: int = Field(64_000_000, ge=1, description="largest decoded image accepted (pixels)")
