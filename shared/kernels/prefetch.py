"""Weights into L2 ahead of the kernel that reads them (decode at batch 1, Hopper and later).

A batch-1 decode step alternates kernels that stream weights from HBM (the projections, the experts) with
kernels bound by latency that read almost nothing (attention over a short context, the merge of its
splits, the router, the routing): while those run, HBM idles, and the next weight-bound kernel then
pays its own ramp-up and tail at HBM speed. Weights are never written in a forward and their addresses
are known before the step (experts' as soon as routing has picked them), so a kernel can ask the memory
system for the weights of a later kernel while it does its own work: ``cp.async.bulk.prefetch.L2``
(sm_90) hands a whole byte range to the SM's copy engine and returns at once; the later kernel then
reads from L2. H200's L2 is 50 MB: a prefetched range must be read before the expert weights streamed in
between evict it, so prefetches are marked ``evict_last`` and the streamed weights ``evict_first``.

What prefetches what is the layer's plan (``shared.model.text.few_rows_layer``, ``PLAN``): measured on an
H200 (docs/benchmarks.md). A program issues its share of a range as ``CHUNK``-byte requests, one lane
a request (``lanes`` = the program's threads, so no request is issued twice), interleaved over the
launch's programs so every SM's copy engine takes part. Without a GPU (Triton's interpreter) nothing
is issued: it is a hint, the results are the same with and without it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shared.kernels import launch


@dataclass
class Plan:
    """What a batch-1 decode layer prefetches (switched by the benchmarks to measure each part)."""

    o_in_attention: bool = True  # the attention kernel asks for o_proj's weight
    o_where: str = "before"  # where: "before" its wait, "after" it, or in the "merge" kernel
    down_in_gate_up: bool = True  # each gate|up program asks for its expert's share of down's weight
    ahead: str | None = "down"  # the kernel that asks for the next layer's q|k|v: "down", "o" or None
    evict_first: bool = True  # weights streamed from HBM are marked evict_first (they protect the prefetched)
    keep: bool = True  # prefetched lines are marked evict_last
    chunk: int = 16384  # bytes a request

    def active(self, t: torch.Tensor) -> bool:
        """Whether kernels over ``t``'s device prefetch at all: sm_90 and later, not in the interpreter."""
        return ENABLED and launch.hopper(t)

    def mode(self, on: bool) -> int:
        """A kernel's ``PREFETCH`` constant: 0 none, 1 plain requests, 2 requests marked evict_last."""
        return (2 if self.keep else 1) if on else 0

    def streamed(self, active: bool) -> str:
        """The eviction policy of weight loads from HBM in kernels where prefetching is ``active``."""
        return "evict_first" if active and self.evict_first else ""


ENABLED = True
PLAN = Plan()


def span(t: torch.Tensor | None) -> tuple[int, int]:
    """(address, bytes) of a contiguous tensor to prefetch; (0, 0) for none."""
    if t is None:
        return 0, 0
    assert t.is_contiguous()
    return t.data_ptr(), t.numel() * t.element_size()


@triton.jit
def to_l2(addr, nbytes, part, parts, record_ptr, CHUNK: tl.constexpr, LANES: tl.constexpr, KEEP: tl.constexpr = True,
          RECORD: tl.constexpr = False):
    """Program ``part`` of ``parts`` asks for its requests of the range ``[addr, addr + nbytes)`` (an int64
    address, 16-byte aligned; ``nbytes`` a multiple of 16): request ``i`` covers ``CHUNK`` bytes from
    ``addr + i · CHUNK``, and program ``p`` issues requests ``p, p + parts, …``, ``LANES`` at a time;
    ``KEEP``: marked evict_last.
    ``RECORD`` (the tests, in the interpreter): instead of issuing them, write each slot's (address, bytes)
    to ``record_ptr`` (0, 0 for an unused slot)."""
    chunks = tl.cdiv(nbytes, CHUNK)
    lane = tl.arange(0, LANES)
    row = 0
    for first in range(part, chunks, parts * LANES):
        i = first + lane.to(tl.int64) * parts
        off = i * CHUNK
        size = tl.where(i < chunks, tl.minimum(nbytes - off, CHUNK), 0).to(tl.int32)
        if RECORD:
            tl.store(record_ptr + (row + lane) * 2, tl.where(size > 0, addr + off, 0))
            tl.store(record_ptr + (row + lane) * 2 + 1, size.to(tl.int64))
            row += LANES
        elif KEEP:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; .reg .b64 pol; setp.gt.s32 p, $2, 0; "
                "createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
                "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; mov.u32 $0, 0; }",
                "=r,l,r", [addr + off, size], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
                "=r,l,r", [addr + off, size], dtype=tl.int32, is_pure=False, pack=1)
