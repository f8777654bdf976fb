"""``epd bench``: seeded requests, Poisson arrivals, TTFT/TPOT/ITL/E2E, goodput, plots."""
