"""Encoder settings (``EPD_`` environment variables or ``epd encoder --flags``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from shared.settings import CommonSettings


class EncoderSettings(CommonSettings):
    max_batch_images: int = Field(32, ge=1, description="images in one ViT forward at most")
    max_batch_patches: int = Field(65536, ge=1, description="patches in one ViT forward at most (1080p: 10,764)")
    max_concurrent_jobs: int = Field(256, ge=1, description="encode jobs admitted at once; more wait in NATS")
    vit_graph_patches: int = Field(8192, ge=0, description="ViT forwards of up to this many patches run as CUDA "
                                   "graphs between their attentions, padded to a bucket (a 448x448 image: 784 "
                                   "patches; ten: 7,840; Qwen3-VL's 1080p: 8,160); 0: eager. Measured "
                                   "(docs/benchmarks.md): forwards bound by their launches (one to four 448x448 "
                                   "images, one 1080p image) take 20-45 % less time; those bound by their "
                                   "kernels (ten 448x448 images) within 10 % either way")
    preprocess: Literal["auto", "pil", "torch"] = Field(
        "auto", description="where images are resized and patchified: pil = the checkpoint's own processor on CPU "
                            "threads (exactly the reference); torch = tensor operations on the encoder's device "
                            "(pixels may differ from PIL's by one 8-bit step); auto = torch on a GPU, else pil")
    preprocess_threads: int = Field(2, ge=1, description="threads resizing and patchifying images (pil)")
    max_image_pixels: int = Field(64_000_000, ge=1, description="largest decoded image (or video frame) "
                                                                "accepted (pixels)")
    max_video_frames: int = Field(768, ge=1, description="sampled frames of one video accepted at most")
    encoder_cache_mb: int = Field(4096, ge=0, description="embedding cache of this encoder, least recently used "
                                                          "out (MiB); 0: no cache, no index")
    cache_index: bool = Field(True, description="share which encoder holds which image through a JetStream KV "
                                                "bucket, so encoders borrow instead of re-encoding (needs JetStream; "
                                                "without it each encoder caches on its own)")
    cache_index_ttl: float = Field(900.0, gt=0, description="seconds an index entry lives unless its holder "
                                                             "serves the image again (set by the first encoder "
                                                             "that creates the bucket)")
    peer_fetch_timeout: float = Field(5.0, gt=0, description="seconds to ask another encoder for an image it "
                                                             "holds (and again to pull it) before encoding it here")
