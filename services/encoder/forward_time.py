"""How long a ViT forward takes, from what it holds: a linear model the aggregated worker measures at start
and corrects after every forward — what its batcher cuts a batch by while sequences are decoding. There
the forwards run in the engine thread between two engine steps, so each delays every decoding sequence's
next token by its whole length; they get what is left of the engine's time budget
(``Scheduler.gap_budget_s``), one image per forward at least so images always advance.

The costs (``features``): 1 (a forward's launch, the tower's weights), images (each image's host work:
its pixels prepared, its attention segments), patches (every block's matmuls, and windowed attention:
Qwen2.5-VL's windows are a fixed size, so their cost grows with the patches), and the patch pairs of
whole-image attention (Qwen2-VL's every block, Qwen2.5-VL's few full ones, Qwen3-VL's: each frame's patches
attend to each other, (h·w)² a frame). Fitted as the engine's step times are (``shared.fit``), on eager
forwards only: a layout the tower captured as a whole-forward graph (``shared.model.pieces.LayoutGraphs``:
a recurring batch, such as one 720p image) replays in a fraction of its eager time, and only that layout
does, so its replays are remembered per layout (a moving average) and predicted from that — fitted into
the linear model they would pull every eager prediction down (on one H100, mean error 96 % with them in).
The forward that captures a layout (a warm-up and the capture, once) is left out of both.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from shared.fit import FORGETTING, RecursiveFit
from shared.logging import get_logger
from shared.model.geometry import Grid

log = get_logger(__name__)

SCALES = (1.0, 1.0, 1e4, 1e8)  # per unit: forward, image, patches, patch pairs (a 1080p image ~1 of each)
NAMES = ("ms_per_forward", "ms_per_image", "ms_per_10k_patches", "ms_per_1e8_patch_pairs")
# Grids of the start's timed forwards ((temporal, height, width) patches; a 1080p image is 78 × 138): sizes
# no resize rule makes from a common picture, so a real batch rarely shares a layout with one of them and
# LayoutGraphs, which captures a layout at its second forward, never captures theirs.
TRIALS = ([(1, 34, 30)], [(1, 66, 62)], [(1, 66, 62)] * 2, [(1, 34, 30)] * 4, [(1, 98, 94)], [(1, 50, 46)] * 3)
CPU_SCALE = 4  # on CPU (the tiny test model) each side a quarter as long
REPLAY_WEIGHT = 0.25  # of each new replay in a captured layout's remembered time


def features(grids: Sequence[Grid]) -> np.ndarray:
    patches = sum(t * h * w for t, h, w in grids)
    pairs = sum(t * (h * w) ** 2 for t, h, w in grids)
    return np.array((1, len(grids), patches, pairs), dtype=np.float64) / SCALES


def layout_key(grids: Sequence[Grid]) -> tuple:
    """A batch's layout as ``LayoutGraphs`` keys it."""
    return tuple(map(tuple, grids))


class ForwardTimes:
    """A batcher's forward-time model, and how far its predictions were from the forwards it timed.
    ``graphs``: the tower's ``LayoutGraphs`` (GPU), whose captured layouts are predicted by their replays."""

    def __init__(self, forgetting: float = FORGETTING, graphs=None):
        self.fit = RecursiveFit(len(SCALES), forgetting)
        self.graphs = graphs
        self.replays: dict[tuple, float] = {}  # ms a captured layout's replay takes (at most the graphs' limit)
        self.observed = 0
        self.error_total = 0.0  # Σ |predicted − observed| / observed
        self.cut = 0  # batches a time budget closed before the limits on images and patches did

    def graphed(self, grids: Sequence[Grid]) -> bool:
        """Whether a forward of ``grids`` replays a captured graph (ask before the forward: it may capture)."""
        return self.graphs is not None and layout_key(grids) in self.graphs.entries

    def predict(self, grids: Sequence[Grid]) -> float:
        """Seconds."""
        return self._predict_ms(grids, self.graphed(grids)) / 1e3

    def _predict_ms(self, grids: Sequence[Grid], graphed: bool) -> float:
        remembered = self.replays.get(layout_key(grids)) if graphed else None
        return remembered if remembered is not None else self.fit.predict(features(grids))

    def calibrate(self, samples: list[tuple[list[Grid], float]]) -> None:
        self.fit = RecursiveFit.calibrated(len(SCALES), [(features(g), s * 1e3) for g, s in samples],
                                           self.fit.forgetting)

    def observe(self, grids: Sequence[Grid], seconds: float, graphed: bool = False) -> None:
        """A forward of ``grids`` took ``seconds``; ``graphed``: ``graphed(grids)`` before it ran."""
        ms = seconds * 1e3
        if ms > 0:
            self.error_total += abs(self._predict_ms(grids, graphed) - ms) / ms
            self.observed += 1
        key = layout_key(grids)
        if graphed:
            old = self.replays.get(key)
            self.replays[key] = ms if old is None else old + REPLAY_WEIGHT * (ms - old)
        elif not self.graphed(grids):  # eager (not the forward that captured the layout)
            self.fit.update(features(grids), ms)
        for gone in [k for k in self.replays if not self.graphed(k)]:
            del self.replays[gone]

    def coefficients(self) -> dict[str, float]:
        return {name: round(float(value), 4) for name, value in zip(NAMES, self.fit.theta)}

    def stats(self) -> dict[str, float]:
        return {"vit_time_error_total": round(self.error_total, 6), "vit_time_error_count": self.observed,
                "vit_batches_cut": self.cut}


@torch.inference_mode()
def calibrate(tower, times: ForwardTimes, max_patches: int) -> int:
    """Fit ``times`` to one timed forward of each of ``TRIALS`` (random patches) through ``tower``, in the
    calling thread (the one that runs the forwards); returns how many."""
    device, dtype = next(tower.parameters()).device, next(tower.parameters()).dtype
    scale = 1 if device.type == "cuda" else CPU_SCALE
    merge = tower.config.merge_size
    started, samples = time.perf_counter(), []
    for trial in TRIALS:
        grids = [(t, _even(h // scale, merge), _even(w // scale, merge)) for t, h, w in trial]
        patches = sum(t * h * w for t, h, w in grids)
        if patches > max_patches:
            continue
        x = torch.randn(patches, tower.config.patch_dim, device=device, dtype=dtype)
        _sync(device)
        began = time.perf_counter()
        tower(x, grids)
        _sync(device)
        samples.append((grids, time.perf_counter() - began))
    times.calibrate(samples)
    log.info("vision.forward_time_calibrated", forwards=len(samples), ms=round((time.perf_counter() - started) * 1e3),
             **times.coefficients())
    return len(samples)


def _even(n: int, merge: int) -> int:
    return max(merge, n // merge * merge)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
