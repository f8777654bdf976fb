"""A prefill job becomes an engine ``Sequence``: checked against the model, its image embeddings pulled
onto the engine's device.

The job comes from the frontend, so nothing in it is trusted: every token id in the vocabulary, every
image slot over exactly one run of placeholder tokens with embeddings of the size its grid gives, and
no placeholder without an image.
"""

from __future__ import annotations

import asyncio

from shared.bus.service_api import Endpoint, Handler
from shared.bus.subjects import QUEUE, Subjects
from shared.dataplane.plane import DataPlane
from shared.dataplane.store import DataPlaneError
from shared.engine.sampling import SamplingParams
from shared.engine.sequence import ImageInput, Sequence
from shared.errors import ServiceError
from shared.messages.prefill import EMBEDDINGS_GONE, PrefillJob
from shared.model.config import ModelConfig
from shared.model.geometry import grid_tokens

_GONE_CODES = ("unreachable", "expired", "not_found", "timeout")


def embedding_width(config: ModelConfig) -> int:
    """Columns of one image token's embedding: the LM's hidden size, times one plus the deepstack levels
    a Qwen3-VL tower adds beside it."""
    return config.text.hidden_size * (1 + len(getattr(config.vision, "deepstack_indexes", ())))


def validate_sampling(sampling: SamplingParams, config: ModelConfig) -> None:
    """Token ids the sampling names (stop ids, logit biases) are in the vocabulary."""
    vocab = config.text.vocab_size
    named = list(sampling.stop_token_ids) + [token for token, _ in sampling.logit_bias]
    if any(not 0 <= t < vocab for t in named):
        raise ServiceError(400, "a stop token id or logit bias names a token out of the vocabulary")


def validate_prompt(job: PrefillJob, config: ModelConfig) -> None:
    vocab = config.text.vocab_size
    if any(not 0 <= t < vocab for t in job.token_ids):
        raise ServiceError(400, "token id out of the vocabulary")
    validate_sampling(job.sampling, config)
    covered = 0
    end = 0
    merge, width = config.vision.merge_size, embedding_width(config)
    for slot in sorted(job.images, key=lambda s: s.offset):
        t, h, w = slot.grid
        if t < 1 or h < 1 or w < 1 or h % merge or w % merge:
            raise ServiceError(400, "invalid image grid")
        n = grid_tokens(slot.grid, merge)
        if slot.offset < end or slot.offset + n > len(job.token_ids):
            raise ServiceError(400, "image slots overlap or run past the prompt")
        if any(tok != config.image_token_id for tok in job.token_ids[slot.offset:slot.offset + n]):
            raise ServiceError(400, "image slot does not cover a run of image placeholder tokens")
        if list(slot.embedding.shape) != [n, width]:
            raise ServiceError(400, "image embedding shape does not match its grid")
        covered += n
        end = slot.offset + n
    # Only the client's prompt places images; tokens the model generated earlier (a resumed request's
    # tail) are plain tokens even when they happen to be the placeholder id.
    prompt = job.token_ids[:len(job.token_ids) - job.output_offset]
    if end > len(prompt) or covered != sum(1 for tok in prompt if tok == config.image_token_id):
        raise ServiceError(400, "image placeholder tokens without an image")


class PromptIntake:
    def __init__(self, config: ModelConfig, plane: DataPlane, device, max_model_len: int):
        self.config = config
        self.plane = plane
        self.device = device  # the engine's: GPU to GPU where the transport can (UCX)
        self.max_model_len = max_model_len
        self.prompts = 0
        self.prompt_tokens = 0

    async def sequence(self, job: PrefillJob) -> Sequence:
        validate_prompt(job, self.config)
        if len(job.token_ids) >= self.max_model_len:
            raise ServiceError(400, f"prompt of {len(job.token_ids)} tokens does not fit the context "
                                    f"({self.max_model_len})")
        embeds = await self._pull(job)
        self.prompts += 1
        self.prompt_tokens += len(job.token_ids)
        images = [ImageInput(s.offset, tuple(s.grid), e) for s, e in zip(job.images, embeds)]
        return Sequence(job.request_id, list(job.token_ids), len(job.token_ids), job.sampling, images=images,
                        output_offset=job.output_offset)

    async def _pull(self, job: PrefillJob) -> list:
        try:
            return list(await asyncio.gather(*(self.plane.pull(s.embedding, device=self.device)
                                               for s in job.images)))
        except DataPlaneError as err:
            if err.code in _GONE_CODES:
                raise ServiceError(EMBEDDINGS_GONE, f"image embeddings are gone: {err.message}") from None
            raise ServiceError(502, f"could not fetch image embeddings: {err.message}") from None


def intake_endpoints(subjects: Subjects, instance: str, handler: Handler, limit: int) -> list[Endpoint]:
    """Where prompts reach a language-model worker: the queue group, and this instance's own subject
    (the frontend routes there, and watches it)."""
    return [Endpoint("prefill", subjects.prefill, QUEUE["prefill"], handler, limit),
            Endpoint("prefill-direct", subjects.prefill_on(instance), QUEUE["prefill"], handler, limit)]
