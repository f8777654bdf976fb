"""Prefill settings (``EPD_`` environment variables or ``epd prefill --flags``)."""

from __future__ import annotations

from shared.engine.settings import EngineSettings
from shared.settings import JobLimit


class PrefillSettings(JobLimit, EngineSettings):
    pass
