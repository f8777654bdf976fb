"""Aggregated settings: the encoder's and the language worker's, in one process (``EPD_`` variables or flags)."""

from __future__ import annotations

from services.encoder.settings import EncoderSettings
from services.language.settings import LanguageSettings


class AggregatedSettings(LanguageSettings, EncoderSettings):
    pass
