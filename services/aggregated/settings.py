"""Aggregated settings: the encoder's and the engine's, in one process (``EPD_`` variables or flags)."""

from __future__ import annotations

from pydantic import Field

from services.encoder.settings import EncoderSettings
from shared.engine.settings import EngineSettings


class AggregatedSettings(EngineSettings, EncoderSettings):
    max_concurrent_prompts: int = Field(256, ge=1, description="prompts being admitted at once; more wait in NATS")
