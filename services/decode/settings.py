"""Decode settings (``EPD_`` environment variables or ``epd decode --flags``)."""

from __future__ import annotations

from pydantic import Field

from shared.engine.settings import EngineSettings


class DecodeSettings(EngineSettings):
    max_concurrent_jobs: int = Field(512, ge=1, description="hand-offs being admitted at once")
    reservation_timeout: float = Field(60.0, gt=0, description="seconds a KV reservation may wait for its "
                                                               "transfer to complete and its start")
