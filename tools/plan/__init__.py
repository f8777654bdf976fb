"""``epd plan``: measure encode/prefill/decode costs here, predict each layout with a queueing model."""
