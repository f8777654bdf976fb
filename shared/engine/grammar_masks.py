"""A grammar per constrained sequence, applied to an engine's logits as a batched token mask.

A sequence's matcher is built the first time the sequence is sampled on this worker and fed the
request's output so far (``output_tokens``): so the grammar's state survives the prefill → decode
hand-off and a resume elsewhere without travelling — the tokens are the state. Each step the matchers
of the constrained rows fill one shared bitmask (in parallel, in the library's threads), which is
unpacked on the device and applied to those rows in one ``masked_fill``.

A matcher that rejects a token (a bug, or a sequence whose history does not fit the grammar) stops
constraining that sequence and is logged, instead of failing the batch.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from shared.engine.grammar import Grammars
from shared.logging import get_logger

if TYPE_CHECKING:
    from shared.engine.sequence import Sequence

log = get_logger(__name__)

_BITS = 32


class GrammarMasks:
    """The per-sequence matchers of an engine, and the batched mask they make each step."""

    def __init__(self, device: torch.device, grammars: Callable[[], Grammars] | None = None):
        self.device = device
        self._grammars_factory = grammars
        self._grammars: Grammars | None = None
        self._matchers: "weakref.WeakKeyDictionary[Sequence, object]" = weakref.WeakKeyDictionary()
        self._executor = None

    @property
    def grammars(self) -> Grammars:
        if self._grammars is None:
            if self._grammars_factory is None:
                raise RuntimeError("this engine was built without a tokenizer: it cannot constrain output")
            self._grammars = self._grammars_factory()
        return self._grammars

    def apply(self, logits: torch.Tensor, seqs: list["Sequence"], where: list[int]) -> None:
        import llguidance.torch as llt

        pairs = [(m, n) for n, m in enumerate(self._matcher(s) for s in seqs) if m is not None]
        if not pairs:
            return
        if self._executor is None:
            self._executor = llt.LLExecutor()
        vocab = logits.shape[1]
        bitmask = llt.allocate_token_bitmask(len(seqs), vocab)
        bitmask.fill_(-1)  # rows without a live matcher allow everything
        llt.fill_next_token_bitmask_par(self._executor, pairs, bitmask)
        allowed = _unpack(bitmask.to(logits.device, non_blocking=True), vocab)
        rows = torch.tensor(where, device=logits.device)
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))

    def accept(self, seqs: list["Sequence"], tokens: list[int]) -> None:
        for seq, token in zip(seqs, tokens):
            matcher = self._matchers.get(seq)
            if matcher is not None and not matcher.consume_token(token):
                self._drop(seq, matcher, token)

    def _matcher(self, seq: "Sequence"):
        if seq in self._matchers:
            return self._matchers[seq]
        from shared.engine.logits import output_tokens

        matcher = self.grammars.matcher(seq.sampling.constraint)
        history = output_tokens(seq)
        if history and matcher.try_consume_tokens(history) != len(history):
            log.warning("grammar.history_rejected", request_id=seq.request_id, error=matcher.get_error())
            matcher = None
        self._matchers[seq] = matcher
        return matcher

    def _drop(self, seq: "Sequence", matcher, token: int) -> None:
        log.warning("grammar.token_rejected", request_id=seq.request_id, token=token, error=matcher.get_error())
        self._matchers[seq] = None


def _unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[rows, ceil(vocab / 32)]`` int32 bit words → ``[rows, vocab]`` bool (bit ``i % 32`` of word ``i // 32``)."""
    shifts = torch.arange(_BITS, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(1)[:, :vocab].bool()
