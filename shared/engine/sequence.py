"""A request inside the engine: its tokens, where its KV lives, and how it samples."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from shared.engine.sampling import SamplingParams
from shared.model.geometry import Grid


class Status(enum.Enum):
    WAITING = "waiting"  # admitted, prompt not yet computed
    RUNNING = "running"  # KV in the cache, generating
    SWAPPED = "swapped"  # preempted: KV parked in host memory until blocks free up
    FINISHED = "finished"


@dataclass
class ImageInput:
    """One image's embeddings and where its placeholder run starts in the prompt."""

    offset: int
    grid: Grid
    embeds: torch.Tensor  # [num_tokens, hidden]


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt followed by every generated token
    prompt_len: int
    sampling: SamplingParams
    images: list[ImageInput] = field(default_factory=list)
    rope_delta: int = 0
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache
    finish_reason: str | None = None
    swapped_kv: torch.Tensor | None = None  # [layers, 2, num_computed, kv_heads, head_dim] while SWAPPED
    arrival: float = 0.0
    output_offset: int = 0  # tokens generated before this sequence existed (a request resumed elsewhere)
    choice: int = 0  # which of the request's n choices (request_id is "<request>#<choice>" past the first)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]
