"""``n > 1``: a request's choices share one computed prompt.

The prompt is prefilled once, as choice 0. Right after (in the joined engine, once its first token is
sampled; on a decode worker, once its KV has landed) every other choice is forked from it: a child
sequence with the same prompt whose KV for all tokens but the last is a copy of choice 0's blocks, and
whose first step is a decode step over that last prompt token — it samples its own first token from the
same distribution, with a seed of its own (``choice_seed``). The copy is a device-side gather of the
prompt's slots; a child the pool has no room for waits with that copy in host memory, exactly as a
preempted sequence does, and is swapped in when blocks free up.

This copies blocks rather than sharing them: block sharing (reference counts on prompt blocks) belongs
with prefix caching, which can replace the copy with shared references.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
import torch

from shared.engine.sampling import choice_seed
from shared.engine.sequence import Sequence, Status
from shared.messages.sampling import MAX_CHOICES

if TYPE_CHECKING:
    from shared.engine.engine import Engine

SEPARATOR = "#"


def child_id(request_id: str, choice: int) -> str:
    return request_id if choice == 0 else f"{request_id}{SEPARATOR}{choice}"


def request_of(sequence_id: str) -> str:
    """The request a sequence id belongs to (its choice 0's id)."""
    return sequence_id.split(SEPARATOR, 1)[0]


def family(request_id: str) -> list[str]:
    """Every sequence id a request may have in an engine."""
    return [child_id(request_id, c) for c in range(MAX_CHOICES)]


def should_fork(seq: Sequence) -> bool:
    """Choice 0 of a request with more choices, right after its prompt's first token."""
    return seq.sampling.n > 1 and seq.choice == 0 and seq.num_output == 1


def fork(engine: "Engine", parent: Sequence) -> list[Sequence]:
    """The parent's other choices, as swapped sequences holding a copy of its prompt's KV (waiting
    ones for a one-token prompt)."""
    computed = parent.prompt_len - 1  # the last prompt token is each child's first decode step
    slots = torch.tensor(engine.runner.cache.slots(parent.block_table, 0, computed), dtype=torch.long)
    kv = engine.runner.cache.gather(slots)
    children = []
    for choice in range(1, parent.sampling.n):
        sampling = msgspec.structs.replace(parent.sampling, n=1, seed=choice_seed(parent.sampling.seed, choice))
        child = Sequence(child_id(parent.request_id, choice), parent.token_ids[:parent.prompt_len], parent.prompt_len,
                         sampling, rope_delta=parent.rope_delta, num_computed=computed,
                         output_offset=parent.output_offset, choice=choice)
        if computed == 0:  # a one-token prompt: nothing to copy, the child computes it as a prompt
            child.status = Status.WAITING
        else:
            room = engine.blocks.can_allocate((computed + 1) * choice)
            child.swapped_kv = kv if room else kv.to("cpu")
            child.status = Status.SWAPPED
        children.append(child)
    return children
