"""Queue waiting times for the planner (``epd plan``): Poisson arrivals.

- M/G/1 (Pollaczek-Khinchine) where one server's service time varies with the request (a prompt of
  1 or 8 images): the wait grows with the second moment of the service time, not only its mean.
- M/D/c for identical jobs on several servers (one image on one of several encoders): half the M/M/c
  (Erlang C) wait, exact for one server and the usual approximation for several (the Cosmetatos
  correction is within a few per cent at the loads we plan for).
Every function returns ``inf`` for a stage at or beyond saturation.
"""

from __future__ import annotations

import math


def erlang_c(servers: int, offered: float) -> float:
    """Probability that an arrival waits in M/M/c; ``offered`` = arrival rate × service time (< servers)."""
    if offered <= 0:
        return 0.0
    if offered >= servers:
        return 1.0
    blocking = 1.0  # Erlang B, by the stable recurrence B(k) = a·B(k-1) / (k + a·B(k-1))
    for k in range(1, servers + 1):
        blocking = offered * blocking / (k + offered * blocking)
    rho = offered / servers
    return blocking / (1 - rho + rho * blocking)


def mmc_wait(rate: float, service: float, servers: int = 1) -> float:
    """Mean time in queue (not in service) of M/M/c, seconds."""
    offered = rate * service
    if offered >= servers:
        return math.inf
    return erlang_c(servers, offered) * service / (servers - offered)


def mdc_wait(rate: float, service: float, servers: int = 1) -> float:
    """Mean time in queue of M/D/c (≈ half of M/M/c; exact for c = 1: ρS / 2(1−ρ))."""
    return 0.5 * mmc_wait(rate, service, servers)


def mg1_wait(rate: float, mean: float, second_moment: float) -> float:
    """Mean time in queue of M/G/1: λ·E[S²] / 2(1−ρ), seconds (``mean`` = E[S], ``second_moment`` = E[S²])."""
    rho = rate * mean
    if rho >= 1:
        return math.inf
    return rate * second_moment / (2 * (1 - rho))


def utilization(rate: float, service: float, servers: int = 1) -> float:
    return rate * service / servers
