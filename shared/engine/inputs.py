"""Staging a decode step's inputs: two pinned host buffers, two copies to the device, no allocation.

Per row ``i``: ``small[:, i] = (token id, position, slot, context length)`` and ``tables[i]`` its block
table (``small`` is column-major so each field is a contiguous vector).
The device buffers double as the static inputs of the captured CUDA graphs. Rows past the batch, up
to the graph's bucket, are padding: they read one token and write into the scratch block, and are
rewritten every step (stale rows would otherwise write into live sequences' blocks).
"""

from __future__ import annotations

import torch

from shared.engine.block_manager import SCRATCH_BLOCK
from shared.engine.sequence import Sequence

ID, POSITION, SLOT, LENGTH = range(4)


class DecodeInputs:
    def __init__(self, max_batch: int, width: int, block_size: int, device: torch.device):
        self.block_size = block_size
        self.width = width
        pin = device.type == "cuda"
        self.small = torch.zeros(4, max_batch, dtype=torch.int32, pin_memory=pin)
        self.tables = torch.zeros(max_batch, width, dtype=torch.int32, pin_memory=pin)
        self._small, self._tables = self.small.numpy(), self.tables.numpy()
        if pin:
            self.small_dev = torch.zeros_like(self.small, device=device)
            self.tables_dev = torch.zeros_like(self.tables, device=device)
        else:
            self.small_dev, self.tables_dev = self.small, self.tables

    @property
    def max_batch(self) -> int:
        return self.small.shape[1]

    def stage(self, seqs: list[Sequence], rows: int) -> None:
        """Fill rows ``[0, rows)`` for ``seqs`` (then padding) and copy them to the device."""
        bs = self.block_size
        small, tables = self._small, self._tables
        for i, seq in enumerate(seqs):
            n = len(seq)
            table = seq.block_table
            small[:, i] = (seq.last_token, n - 1 + seq.rope_delta, table[(n - 1) // bs] * bs + (n - 1) % bs, n)
            tables[i, :len(table)] = table
        pad = slice(len(seqs), rows)
        small[:, pad] = ((0,), (0,), (SCRATCH_BLOCK * bs,), (1,))
        tables[pad, 0] = SCRATCH_BLOCK
        if self.small_dev is not self.small:
            self.small_dev.copy_(self.small, non_blocking=True)  # 16 bytes a row: copy it whole
            self.tables_dev[:rows].copy_(self.tables[:rows], non_blocking=True)

    def views(self, rows: int) -> tuple[torch.Tensor, ...]:
        """(ids, positions, slots, context_lens, block_tables) on the device, ``rows`` long."""
        small = self.small_dev[:, :rows]
        return small[ID], small[POSITION], small[SLOT], small[LENGTH], self.tables_dev[:rows]


def table_width(max_model_len: int, block_size: int) -> int:
    return (max_model_len + block_size - 1) // block_size

