"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's chain of small kernels.

A decode step at batch 1 is ~10 kernels a layer, each a few µs: between two of them the GPU drains the
first, then launches and ramps up the second, and that gap is a large part of each kernel's time. With
PDL a kernel is launched while the one before it still runs: its programs start, do what needs no
input of the previous kernel (load their weights: nothing in a forward writes them), and wait in
``griddepcontrol.wait`` until the previous kernel has finished and its writes are visible. Each of our
kernels then lets the next one launch (``griddepcontrol.launch_dependents``) as soon as its own wait
returns. Inside a CUDA graph the same launches become programmatic edges.

Every kernel launched with PDL calls ``wait_for_inputs`` before it reads anything an earlier kernel
writes and before it writes anything (a buffer it writes may be one an earlier kernel still reads);
the wait also covers every kernel before the previous one, since that one passed its own wait first.
Kernels launched without it (cuBLAS, torch) wait for the previous kernel to finish, as always.

``ENABLED`` (on devices of compute capability 9 and up; never in Triton's interpreter) is switched off
by the benchmarks to measure what it gives.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

ENABLED = True


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def interpreted() -> bool:
    """Whether kernels run in Triton's interpreter (the test suite on CPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def pdl(t: torch.Tensor) -> int:
    """How kernels over ``t``'s device launch: 1 with PDL, 0 without (a kernel's ``PDL`` constant)."""
    return int(ENABLED and t.is_cuda and not interpreted() and _capable(t.device.index or 0))


def options(enabled: int) -> dict:
    """Launch options of a kernel launched with (or without) PDL."""
    return {"launch_pdl": True} if enabled else {}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Wait for the previous kernel (its writes visible); the next kernel may launch from then on."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
