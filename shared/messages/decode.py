"""Prefill ⇄ decode: reserve KV room, stream the prompt's KV layer group by layer group, start decoding.

1. ``KVReserve`` (queue group): a decode worker with room reserves blocks for the prompt's KV and
   answers ``KVReservation`` with its instance id; from then on prefill talks to that instance only.
2. ``KVChunk`` (one per group of layers and prompt chunk, sent while later layers and chunks are still
   being computed): a handle to those layers' KV of a range of tokens; the worker pulls it into the
   reserved blocks. Chunks may arrive in any order.
3. ``DecodeStart``: the prompt, its first token and sampling; the worker admits the sequence into its
   running batch once every layer holds every token. A reservation that is not started in time is freed.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from shared.dataplane.handle import TensorHandle
from shared.messages import Message
from shared.messages.prefill import MAX_PROMPT_TOKENS
from shared.messages.sampling import SamplingParams

RequestId = Annotated[str, Meta(max_length=128)]
Subject = Annotated[str, Meta(max_length=256)]
InstanceId = Annotated[str, Meta(pattern=r"^([a-z]+-[0-9a-f]{4,32})?$")]  # a worker's id: a NATS token, no wildcard


class KVReserve(Message, frozen=True, kw_only=True):
    request_id: RequestId
    num_tokens: Annotated[int, Meta(ge=1, le=MAX_PROMPT_TOKENS)]  # prompt tokens whose KV will arrive
    max_tokens: Annotated[int, Meta(ge=1)]  # the sequence may grow by this much
    stream: Subject  # where to report a reservation that expires or fails
    prefill_id: InstanceId = ""  # who sends the KV and the start: once it is gone, the reservation ends


class KVReservation(Message, frozen=True, kw_only=True):
    decode_id: str  # the instance that holds the blocks: chunks and the start go to it


class KVChunk(Message, frozen=True, kw_only=True):
    request_id: RequestId
    first_layer: Annotated[int, Meta(ge=0)]
    last_layer: Annotated[int, Meta(ge=1)]  # exclusive
    first_token: Annotated[int, Meta(ge=0)] = 0  # the chunk holds tokens first_token .. first_token + tokens
    kv: TensorHandle  # [last_layer - first_layer, 2, tokens, kv_heads, head_dim]


class DecodeStart(Message, frozen=True, kw_only=True):
    request_id: RequestId
    token_ids: Annotated[list[int], Meta(min_length=2, max_length=MAX_PROMPT_TOKENS)]  # prompt + first token
    prompt_len: Annotated[int, Meta(ge=1)]
    rope_delta: int
    sampling: SamplingParams
    stream: Subject
    output_offset: Annotated[int, Meta(ge=0)] = 0


class DecodeAccepted(Message, frozen=True, kw_only=True):
    decode_id: str
