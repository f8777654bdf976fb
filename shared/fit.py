"""A linear cost model fitted as observations come: least squares with forgetting, costs kept ≥ 0. The
engine's step times (``shared.engine.step_time``) and the aggregated worker's ViT forward times
(``services.encoder.forward_time``) are fitted with it."""

from __future__ import annotations

import numpy as np

FORGETTING = 0.98  # per observation: ~50 of memory
RIDGE = 1e-4  # information before any observation (a scaled feature of 1 is one observation's): θ = 0, barely
ANCHOR_WEIGHT = 0.1  # the calibration's share that forgetting keeps: under one observation's beside ~50 recent


class RecursiveFit:
    """Least squares y ≈ θ · x over every observation so far, each weighed ``forgetting``^age, updated one
    observation at a time (recursive least squares, in information form: a k × k system solved per
    update). Forgetting decays the information towards an ``anchor`` (``hold``: the calibration's, at a
    tenth of its weight), not towards nothing: a direction the recent steps do not vary in (every step
    alike under a steady load) keeps what the calibration knew of it instead of its uncertainty growing
    without bound until one odd step swings it (RLS's covariance wind-up)."""

    def __init__(self, size: int, forgetting: float = FORGETTING, ridge: float = RIDGE):
        self.forgetting = forgetting
        self.info = np.eye(size) * ridge  # Σ weight · x xᵀ
        self.moment = np.zeros(size)  # Σ weight · x y
        self.anchor = (self.info.copy(), self.moment.copy())
        self.theta = np.zeros(size)

    @classmethod
    def calibrated(cls, size: int, samples: list[tuple[np.ndarray, float]],
                   forgetting: float = FORGETTING) -> "RecursiveFit":
        """A fit of ``size`` costs to ``samples`` (features, y) alone, weighed alike, and held (``hold``)."""
        fit = cls(size, forgetting)
        for x, y in samples:
            fit.update(x, y, forgetting=1.0)
        fit.hold()
        return fit

    def predict(self, x: np.ndarray) -> float:
        return float(self.theta @ x)

    def update(self, x: np.ndarray, y: float, forgetting: float | None = None) -> None:
        lam = self.forgetting if forgetting is None else forgetting
        info, moment = self.anchor
        self.info = lam * self.info + (1 - lam) * info + np.outer(x, x)
        self.moment = lam * self.moment + (1 - lam) * moment + x * y
        self.theta = nonnegative_solve(self.info, self.moment)

    def hold(self, weight: float = ANCHOR_WEIGHT) -> None:
        """What forgetting decays towards from now on: what is known now, at ``weight``."""
        self.anchor = (self.info * weight, self.moment * weight)


def nonnegative_solve(info: np.ndarray, moment: np.ndarray) -> np.ndarray:
    """argmin over θ ≥ 0 of θᵀ·info·θ − 2·momentᵀθ: the least-squares θ whose every cost is ≥ 0. Costs of
    a step that vary together (rows and their context) can trade signs in the plain solution, which then
    predicts well only where they kept varying together; the constrained one cannot go below zero
    anywhere. The plain solution when it has no negative cost, else Lawson and Hanson's active set on
    the normal equations (a few k × k solves)."""
    theta = np.linalg.solve(info, moment)
    if (theta >= 0).all():
        return theta
    size = len(moment)
    tol = 1e-12 * max(1.0, float(np.abs(moment).max()))
    theta, free = np.zeros(size), np.zeros(size, dtype=bool)
    for _ in range(3 * size):
        gain = moment - info @ theta  # where raising a cost still lowers the error
        gain[free] = -np.inf
        if gain.max() <= tol:
            break
        free[int(gain.argmax())] = True
        while True:
            idx = np.flatnonzero(free)
            trial = np.zeros(size)
            trial[idx] = np.linalg.solve(info[np.ix_(idx, idx)], moment[idx])
            if (trial[idx] > 0).all():
                theta = trial
                break
            # step from θ towards the trial until a cost reaches 0, and fix that one at 0
            falling = free & (trial <= 0)
            alpha = np.min(theta[falling] / (theta[falling] - trial[falling]))
            theta = theta + alpha * (trial - theta)
            free &= theta > tol
            theta[~free] = 0.0
    return theta
