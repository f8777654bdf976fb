"""Settings of the joined language worker (``EPD_`` environment variables or ``epd language --flags``)."""

from __future__ import annotations

from shared.engine.settings import EngineSettings
from shared.settings import JobLimit


class LanguageSettings(JobLimit, EngineSettings):
    pass
