"""``epd bench`` (load generator for any OpenAI-compatible endpoint), ``epd bench plot`` and ``epd plan``."""
