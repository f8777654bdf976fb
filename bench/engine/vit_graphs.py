"""The vision tower through CUDA graphs between its attentions (``--vit-graph-patches``, as
``EPD_VIT_GRAPH_PATCHES``) and through one graph per recurring batch layout (``EPD_VIT_LAYOUT_GRAPHS``),
against eager, on an encoder's batch shapes: 1, 4 and 10 images of 448x448 (Dynamo's request), one and two
1080p images; each also beside a thread of pure Python (as a serving process's event loop wants the
interpreter), with each path's kernels and its largest difference from eager."""

from __future__ import annotations

import contextlib
import threading
import time

import torch

from bench.engine.common import Bench, log, without_pieces
from bench.engine.profiling import kernel_table
from bench.engine.roofline import vit_flops
from shared.model import pieces
from shared.model.loader import load_vision_tower


def run(bench: Bench, out: dict) -> None:
    dev, cfg, timer = bench.device, bench.config, bench.timer
    tower = load_vision_tower(None, cfg, dev, bench.dtype, load_format="dummy")
    small, large = bench.geometry.grid(448, 448), bench.grid_1080p
    shapes = [("448x448", small, 1), ("448x448", small, 4), ("448x448", small, 10), ("1080p", large, 1),
              ("1080p", large, 2)] if bench.big else [("tiny", (1, 8, 12), 1), ("tiny", (1, 8, 12), 3)]
    limit, repeat = bench.vit_graph_patches, 5 if bench.big else 2
    started = time.perf_counter()
    if dev.type == "cuda":
        pieces.capture(tower, limit, layouts=8)
    else:  # the same pieces, eagerly
        tower.pieces = pieces.vision_pieces(tower, limit)
    out.update(max_patches=limit, capture_s=round(time.perf_counter() - started, 1))
    rows = out.setdefault("shapes", [])
    for label, grid, images in shapes:
        patches = torch.randn(images * grid[1] * grid[2], cfg.vision.patch_dim, dtype=bench.dtype, device=dev)
        grids = [grid] * images

        def forward():
            return tower(patches, grids)

        with torch.inference_mode():
            with without_pieces(tower):
                eager_ms = timer.ms(forward, repeat=repeat, warmup=2)
                eager = forward().float()
                eager_kernels, eager_us = kernel_table(bench, forward)
            with without_layouts(tower):
                graphs_ms = timer.ms(forward, repeat=repeat, warmup=2)
                pieced = forward().float()
                with busy_interpreter():
                    graphs_busy_ms = timer.ms(forward, repeat=repeat, warmup=1)
                graph_kernels, graph_us = kernel_table(bench, forward)
            layout_ms = timer.ms(forward, repeat=repeat, warmup=2)
            whole = forward().float()
            with busy_interpreter():
                layout_busy_ms = timer.ms(forward, repeat=repeat, warmup=1)
        # full attention in every block (Qwen2-VL, Qwen3-VL): the FLOPs are exact; windowed towers do fewer
        floor = bench.compute_ms(vit_flops(cfg.vision, grid[1] * grid[2], images)) \
            if cfg.vision.window_size == 0 and bench.matmul_rate else None
        row = {"shape": f"{images} x {label}", "patches": patches.shape[0],
               "covered": tower.pieces.bucket(patches.shape[0]) is not None, "eager_ms": eager_ms,
               "graphs_ms": graphs_ms, "graphs_busy_ms": graphs_busy_ms, "layout_ms": layout_ms,
               "layout_busy_ms": layout_busy_ms, "layout_captured": layout_captured(tower, grids),
               "layout_max_abs_diff": float((whole - pieced).abs().max()), "compute_floor_ms": floor,
               "max_abs_diff": float((pieced - eager).abs().max()), "scale": float(eager.abs().max()),
               "eager_kernel_us": eager_us, "graphs_kernel_us": graph_us, "eager_kernels": eager_kernels,
               "graphs_kernels": graph_kernels}
        rows.append(row)
        log(f"vit graphs {row['shape']} ({row['patches']} patches{'' if row['covered'] else ', above the limit: eager'}): "
            f"eager {eager_ms:.2f} ms ({eager_us / 1e3:.2f} ms of kernels), graphs {graphs_ms:.2f} ms "
            f"({graph_us / 1e3:.2f}), busy interpreter {graphs_busy_ms:.2f}; layout graph {layout_ms:.2f} ms, "
            f"busy {layout_busy_ms:.2f} (captured: {row['layout_captured']}, diff {row['layout_max_abs_diff']:.3g}); "
            f"compute floor {floor and round(floor, 2)} ms; max diff {row['max_abs_diff']:.3g} of {row['scale']:.3g}")


@contextlib.contextmanager
def without_layouts(tower):
    """``tower``'s forwards skip its layout graphs inside the block (the pieces alone)."""
    held = tower.pieces.layouts if tower.pieces is not None else None
    if held is not None:
        tower.pieces.layouts = None
    try:
        yield
    finally:
        if held is not None:
            tower.pieces.layouts = held


def layout_captured(tower, grids) -> bool:
    layouts = tower.pieces.layouts if tower.pieces is not None else None
    return layouts is not None and tuple(map(tuple, grids)) in layouts.entries


@contextlib.contextmanager
def busy_interpreter():
    """A thread of pure Python beside the block (at the default switch interval): a host-bound forward
    waits for the GIL as it would beside a serving process's event loop."""
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            sum(range(2000))

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
