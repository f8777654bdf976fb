"""Aggregated settings: the encoder's and the language worker's, in one process (``EPD_`` variables or flags)."""

from __future__ import annotations

from pydantic import Field

from services.encoder.settings import EncoderSettings
from services.language.settings import LanguageSettings


class AggregatedSettings(LanguageSettings, EncoderSettings):
    vit_thread: bool = Field(False, description="run the ViT in a thread of its own, on a CUDA stream of its "
                                                "own, beside the engine (an image need not wait for an engine "
                                                "step to end) instead of between engine steps in the engine's "
                                                "thread")
    vit_handoff_wait_ms: float = Field(0.0, ge=0, le=1000, description="after the ViT between engine steps "
                                       "finishes a request's images, a decode-only step, then wait up to this "
                                       "long (counted from the gap's end) for the request's prompt, so it joins "
                                       "the next step; 0 (default: no gain measured on an H200): step at once")
