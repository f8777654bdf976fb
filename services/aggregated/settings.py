"""Aggregated settings: the encoder's and the language worker's, in one process (``EPD_`` variables or flags)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from services.encoder.settings import EncoderSettings
from services.language.settings import LanguageSettings


class AggregatedSettings(LanguageSettings, EncoderSettings):
    vit_thread: bool = Field(False, description="run the ViT in a thread of its own, on a CUDA stream of its "
                                                "own, beside the engine (an image need not wait for an engine "
                                                "step to end) instead of between engine steps in the engine's "
                                                "thread")
    vit_overlap: bool = Field(False, description="in the engine's thread, launch a ViT forward during an engine "
                                                "step too, on a high-priority CUDA stream (an image need not "
                                                "wait for the step in progress); off: between steps only")
    vit_overlap_priority: Literal["high", "normal"] = Field(
        "high", description="the overlapping ViT stream's priority: high, its kernels scheduled ahead of the "
                            "engine step's; normal, sharing the GPU with them")
