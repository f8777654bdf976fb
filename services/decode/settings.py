"""Decode settings (``EPD_`` environment variables or ``epd decode --flags``)."""

from __future__ import annotations

from pydantic import Field

from shared.engine.settings import EngineSettings
from shared.settings import JobLimit


class DecodeSettings(JobLimit, EngineSettings):
    reservation_timeout: float = Field(60.0, gt=0, description="seconds KV room reserved for a prompt waits for "
                                                               "its transfer and start before it is freed: above "
                                                               "the longest prompt's prefill time")
