"""Tools that measure: ``epd bench`` (a load generator for any OpenAI-compatible server) and ``epd plan``."""
