"""Deepstack (Qwen3-VL): features of intermediate ViT blocks, added to the image tokens' hidden states
after each of the language model's first decoder layers.

An image's embeddings travel as one tensor ``[tokens, out_dim × (1 + levels)]``: the merger's output
(the input embeddings of the image tokens) and then each deepstack level, side by side in every row.
So everything that moves, caches, borrows or slices image embeddings by rows (the data plane, the
encoder's cache, a prefill chunk that starts inside an image) carries the levels along unchanged;
only prefill splits a row apart (``split_rows``) right before the forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Deepstack:
    """The levels to add in one forward pass: ``levels[i]`` goes to ``rows`` after decoder layer ``i``."""

    rows: torch.Tensor  # [R] long: the packed positions of image tokens
    levels: list[torch.Tensor]  # each [R, hidden]

    @property
    def num_levels(self) -> int:
        return len(self.levels)

    def add(self, hidden: torch.Tensor, level: int) -> torch.Tensor:
        """``hidden`` (a tensor of the caller's, changed in place) with level ``level`` added to its rows."""
        return hidden.index_add_(0, self.rows, self.levels[level].to(hidden.dtype))


def split_rows(embeds: torch.Tensor, hidden: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One image's rows ``[n, hidden × (1 + levels)]`` → the input embeddings ``[n, hidden]`` and the
    levels (views, nothing copied)."""
    if embeds.shape[1] % hidden:
        raise ValueError(f"image embeddings of width {embeds.shape[1]} are not a multiple of hidden={hidden}")
    levels = embeds[:, hidden:].split(hidden, dim=1) if embeds.shape[1] > hidden else ()  # split() of 0 columns: 1
    return embeds[:, :hidden], list(levels)


def collect(rows: list[torch.Tensor], levels: list[list[torch.Tensor]]) -> Deepstack | None:
    """The batch's deepstack from each image's rows and levels; None when no image has levels."""
    if not rows or not levels[0]:
        return None
    return Deepstack(torch.cat(rows), [torch.cat(level) for level in zip(*levels)])
