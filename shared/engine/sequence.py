"""A request inside the engine: its tokens, where its KV lives, and how it samples."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from shared.engine.prefix import ImageSpan
from shared.messages.sampling import SamplingParams
from shared.model.geometry import Grid


class Status(enum.Enum):
    WAITING = "waiting"  # admitted, no KV blocks yet
    RUNNING = "running"  # holds KV blocks: prefilling its prompt chunk by chunk, or generating
    SWAPPED = "swapped"  # preempted: KV parked in host memory until blocks free up
    FINISHED = "finished"


@dataclass
class ImageInput:
    """One image's embeddings and where its placeholder run starts in the prompt.

    ``embeds`` has one row per placeholder token; it may be wider than the language model's hidden
    size (models that carry extra per-token features, such as deepstack layers, concatenate them after
    the first ``hidden`` columns): a prompt chunk takes the rows it covers, all columns. ``embeds`` is
    None for an image whose KV the prompt's cached prefix holds (the frontend sent none): its ``tokens``
    are never computed, and the engine admits such a prompt at once or refuses it (``Engine.add_prompt``).
    """

    offset: int
    grid: Grid
    embeds: torch.Tensor | None  # [num_tokens, hidden (+ extra features)]
    content_hash: str = ""  # the frontend's hash of the decoded pixels; empty: the image's KV is never cached
    time_interval: float = 1  # temporal position step between a video's patches (Qwen2.5-VL); 1 for images
    tokens: int = 0  # placeholder tokens, for an image without embeds

    @property
    def num_tokens(self) -> int:
        return self.embeds.shape[0] if self.embeds is not None else self.tokens

    @property
    def span(self) -> ImageSpan:
        return ImageSpan(self.offset, self.num_tokens, self.content_hash)


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
    num_cached: int = 0  # prompt tokens whose KV came from the prefix cache instead of being computed
    block_hashes: list[str] = field(default_factory=list)  # chain hashes of full blocks (prefix caching)
    num_indexed: int = 0  # leading blocks already offered to the prefix cache
    positions: torch.Tensor | None = None  # [3, prompt_len] M-RoPE positions while the prompt is prefilled
    finish_reason: str | None = None
    swapped_kv: torch.Tensor | None = None  # [layers, 2, num_computed, kv_heads, head_dim] while SWAPPED
    arrival: float = 0.0  # monotonic: queued in this engine's scheduler
    started: float = 0.0  # monotonic: the step with its first prompt chunk began (0: not yet)
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

    @property
    def decoding(self) -> bool:
        """Past its prompt: each step computes the one token it generated last."""
        return self.num_computed >= self.prompt_len

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed
