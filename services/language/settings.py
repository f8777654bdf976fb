"""Settings of the joined language worker (``EPD_`` environment variables or ``epd language --flags``)."""

from __future__ import annotations

from pydantic import Field

from shared.engine.settings import EngineSettings


class LanguageSettings(EngineSettings):
    max_concurrent_prompts: int = Field(256, ge=1, description="prompts being admitted at once; more wait in NATS")
