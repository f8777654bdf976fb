"""What requests do to their logits before sampling, batched: penalties, logit bias, ``min_tokens``,
the structured-output mask.

Each adjustment runs once per step over the rows that ask for it (index tensors, no per-row Python on
the device), so a request that asks for nothing costs nothing, and one that does costs its own rows.

Penalties need each row's token counts. They live in a ``PenaltyTable``: one row per penalized sequence
(``[rows, vocab]`` counts of output tokens and a mask of every token seen, prompt included), filled from
the sequence's tokens the first time it is sampled here — so a sequence handed over from prefill or
resumed elsewhere gets exactly its history — and updated with one scatter per step afterwards.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence as Seq
from typing import TYPE_CHECKING

import torch

from shared.engine.grammar import Grammars
from shared.engine.grammar_masks import GrammarMasks

if TYPE_CHECKING:
    from shared.engine.sequence import Sequence

_NEG_INF = float("-inf")


def output_tokens(seq: "Sequence") -> list[int]:
    """The request's output so far: tokens generated before this sequence existed (a resumed
    request's, ``output_offset`` of them, sit at the end of its prompt) and since."""
    return seq.token_ids[seq.prompt_len - seq.output_offset:]


class LogitsProcessors:
    def __init__(self, device: torch.device, eos_token_ids: Seq[int], grammars: Callable[[], Grammars] | None = None):
        self.device = device
        self.eos_token_ids = tuple(eos_token_ids)
        self.penalties = PenaltyTable(device)
        self.grammars = GrammarMasks(device, grammars)

    def apply(self, logits: torch.Tensor, seqs: Seq["Sequence"]) -> None:
        """Adjust ``logits`` ``[len(seqs), vocab]`` in place."""
        penalized = [i for i, s in enumerate(seqs) if _penalized(s.sampling)]
        if penalized:
            self.penalties.apply(logits, [seqs[i] for i in penalized], penalized)
        self._bias(logits, seqs)
        self._min_tokens(logits, seqs)
        constrained = [i for i, s in enumerate(seqs) if s.sampling.constraint is not None]
        if constrained:
            self.grammars.apply(logits, [seqs[i] for i in constrained], constrained)

    def accept(self, seqs: Seq["Sequence"], tokens: list[int]) -> None:
        """The step's sampled tokens: counted for penalties, fed to the grammars."""
        penalized = [i for i, s in enumerate(seqs) if _penalized(s.sampling)]
        if penalized:
            self.penalties.accept([seqs[i] for i in penalized], [tokens[i] for i in penalized])
        constrained = [i for i, s in enumerate(seqs) if s.sampling.constraint is not None]
        if constrained:
            self.grammars.accept([seqs[i] for i in constrained], [tokens[i] for i in constrained])

    def _bias(self, logits: torch.Tensor, seqs: Seq["Sequence"]) -> None:
        rows, ids, values = [], [], []
        for i, seq in enumerate(seqs):
            for token, bias in seq.sampling.logit_bias:
                rows.append(i)
                ids.append(token)
                values.append(bias)
        if rows:
            index = (torch.tensor(rows, device=logits.device), torch.tensor(ids, device=logits.device))
            logits.index_put_(index, torch.tensor(values, device=logits.device, dtype=logits.dtype), accumulate=True)

    def _min_tokens(self, logits: torch.Tensor, seqs: Seq["Sequence"]) -> None:
        rows, ids = [], []
        for i, seq in enumerate(seqs):
            params = seq.sampling
            if params.min_tokens and seq.num_output < params.min_tokens:
                stops = params.stop_token_ids + self.eos_token_ids
                rows += [i] * len(stops)
                ids += stops
        if rows:
            logits[torch.tensor(rows, device=logits.device), torch.tensor(ids, device=logits.device)] = _NEG_INF


def _penalized(params) -> bool:
    return params.presence_penalty != 0.0 or params.frequency_penalty != 0.0 or params.repetition_penalty != 1.0


class PenaltyTable:
    """Token counts of the sequences that use penalties, one table row each, grown on demand."""

    def __init__(self, device: torch.device):
        self.device = device
        self._reset(0)  # sized by the logits' width at the first step

    def _reset(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=self.device)  # output tokens
        self.seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=self.device)  # prompt or output
        self.owners: list[weakref.ref | None] = []
        self._row: "weakref.WeakKeyDictionary[Sequence, int]" = weakref.WeakKeyDictionary()

    def rows(self, seqs: Seq["Sequence"]) -> torch.Tensor:
        return torch.tensor([self._row_of(s) for s in seqs], device=self.device)

    def apply(self, logits: torch.Tensor, seqs: list["Sequence"], where: list[int]) -> None:
        if self.vocab_size != logits.shape[1]:
            self._reset(logits.shape[1])
        rows = self.rows(seqs)
        counts, seen = self.counts[rows], self.seen[rows]
        at = torch.tensor(where, device=logits.device)
        sub = logits[at]
        rep = torch.tensor([s.sampling.repetition_penalty for s in seqs], device=logits.device).unsqueeze(1)
        # repetition (HF, vLLM): a seen token's logit moves toward "less likely" by the factor
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        freq = torch.tensor([s.sampling.frequency_penalty for s in seqs], device=logits.device).unsqueeze(1)
        pres = torch.tensor([s.sampling.presence_penalty for s in seqs], device=logits.device).unsqueeze(1)
        sub -= freq * counts + pres * (counts > 0)
        logits[at] = sub

    def accept(self, seqs: list["Sequence"], tokens: list[int]) -> None:
        rows = self.rows(seqs)
        ids = torch.tensor(tokens, device=self.device)
        self.counts.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.int32), accumulate=True)
        self.seen[rows, ids] = True

    def _row_of(self, seq: "Sequence") -> int:
        row = self._row.get(seq)
        if row is None:
            row = self._row[seq] = self._free_row(seq)
            self._fill(row, seq)
        return row

    def _free_row(self, seq: "Sequence") -> int:
        for row, owner in enumerate(self.owners):
            alive = owner() if owner is not None else None
            if alive is None or alive.status.value == "finished":
                if alive is not None:
                    self._row.pop(alive, None)
                self.owners[row] = weakref.ref(seq)
                return row
        grow = max(8, len(self.owners))
        self.counts = torch.cat([self.counts, self.counts.new_zeros(grow, self.vocab_size)])
        self.seen = torch.cat([self.seen, self.seen.new_zeros(grow, self.vocab_size)])
        self.owners += [None] * grow
        self.owners[len(self.owners) - grow] = weakref.ref(seq)
        return len(self.owners) - grow

    def _fill(self, row: int, seq: "Sequence") -> None:
        """The row from the sequence's history: counts of its output so far, every token it has seen."""
        self.counts[row].zero_()
        self.seen[row].zero_()
        outputs = output_tokens(seq)
        if outputs:
            ids = torch.tensor(outputs, device=self.device)
            self.counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        self.seen[row, torch.tensor(seq.token_ids, device=self.device)] = True
