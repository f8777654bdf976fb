"""A prefill job becomes an engine ``Sequence``: checked against the model, its image embeddings pulled
onto the engine's device.

The job comes from the frontend, so nothing in it is trusted: every token id in the vocabulary, every
image slot over exactly one run of placeholder tokens with embeddings of the size its grid gives, and
no placeholder without an image (videos: the video placeholder, in one run or one per temporal patch).
"""

from __future__ import annotations

from shared.bus.service_api import Endpoint, Handler
from shared.bus.subjects import QUEUE, Subjects
from shared.dataplane.plane import DataPlane
from shared.dataplane.store import DataPlaneError
from shared.engine.sequence import ImageInput, Sequence
from shared.errors import ServiceError
from shared.messages.prefill import EMBEDDINGS_GONE, ImageSlot, PrefillJob
from shared.messages.sampling import SamplingParams
from shared.model.config import ModelConfig
from shared.model.geometry import grid_tokens
from shared.model.rope import video_time_interval

_GONE_CODES = ("unreachable", "expired", "not_found", "timeout")
EMBEDDING_DTYPES = ("float32", "float16", "bfloat16")  # an encoder's, or a client's (cast to the engine's)


def validate_sampling(sampling: SamplingParams, config: ModelConfig) -> None:
    """Token ids the sampling names (stop ids, logit biases) are in the vocabulary."""
    vocab = config.text.vocab_size
    named = list(sampling.stop_token_ids) + [token for token, _ in sampling.logit_bias]
    if any(not 0 <= t < vocab for t in named):
        raise ServiceError(400, "a stop token id or logit bias names a token out of the vocabulary")


def validate_prompt(job: PrefillJob, config: ModelConfig, pixels: bool = False) -> None:
    """``pixels``: the worker encodes slots that carry pixels itself (their pixels are checked where
    they are encoded); otherwise every slot must carry its embeddings."""
    vocab = config.text.vocab_size
    if any(not 0 <= t < vocab for t in job.token_ids):
        raise ServiceError(400, "token id out of the vocabulary")
    validate_sampling(job.sampling, config)
    merge, width = config.vision.merge_size, config.embedding_width  # Qwen3-VL: deepstack levels too
    runs: list[tuple[int, int, int]] = []  # (first token, tokens, placeholder id) of every placeholder run
    for slot in job.images:
        t, h, w = slot.grid
        if t < 1 or h < 1 or w < 1 or h % merge or w % merge:
            raise ServiceError(400, "invalid image grid")
        n = grid_tokens(slot.grid, merge)
        if (slot.embedding is None) == (slot.pixels is None):
            raise ServiceError(400, "an image slot carries either its embeddings or its pixels")
        if slot.pixels is not None and not pixels:
            raise ServiceError(400, "this worker does not encode images: send their embeddings")
        if slot.sampling is not None and (slot.pixels is None or not slot.video):
            raise ServiceError(400, "only a video slot's pixels have a frame sampling")
        if slot.embedding is not None and list(slot.embedding.shape) != [n, width]:
            raise ServiceError(400, "image embedding shape does not match its grid")
        if slot.embedding is not None and slot.embedding.dtype not in EMBEDDING_DTYPES:
            raise ServiceError(400, "image embeddings must be float32, float16 or bfloat16")
        runs += _slot_runs(slot, n, merge, config)
    end = 0
    covered = {config.image_token_id: 0, config.video_token_id: 0}
    for start, n, token in sorted(runs):
        if start < end or start + n > len(job.token_ids):
            raise ServiceError(400, "image slots overlap or run past the prompt")
        if any(tok != token for tok in job.token_ids[start:start + n]):
            raise ServiceError(400, "image slot does not cover a run of image placeholder tokens")
        covered[token] += n
        end = start + n
    # Only the client's prompt places images; tokens the model generated earlier (a resumed request's
    # tail) are plain tokens even when they happen to be the placeholder id.
    prompt = job.token_ids[:len(job.token_ids) - job.output_offset]
    if end > len(prompt) or any(n != sum(1 for tok in prompt if tok == token) for token, n in covered.items()):
        raise ServiceError(400, "image placeholder tokens without an image")


def _slot_runs(slot: ImageSlot, n: int, merge: int, config: ModelConfig) -> list[tuple[int, int, int]]:
    """A slot's placeholder runs: one, or one per temporal patch of a Qwen3-VL clip (``frame_offsets``)."""
    token = config.video_token_id if slot.video else config.image_token_id
    if not slot.video and (slot.frame_offsets or slot.second_per_grid):
        raise ServiceError(400, "only a video slot has frame offsets or temporal spacing")
    if not slot.frame_offsets:
        return [(slot.offset, n, token)]
    t, h, w = slot.grid
    offsets = slot.frame_offsets
    if len(offsets) != t or offsets[0] != slot.offset or any(b <= a for a, b in zip(offsets, offsets[1:])):
        raise ServiceError(400, "a video slot needs one increasing frame offset per temporal patch, from its offset")
    return [(offset, h * w // (merge * merge), token) for offset in offsets]


def image_inputs(slot: ImageSlot, embeds, config: ModelConfig) -> list[ImageInput]:
    """The engine's inputs for one slot: a Qwen3-VL clip becomes one input per temporal patch (a
    ``(1, h, w)`` grid, as HF places them), named in the prefix cache by the clip's hash and its index."""
    if not slot.frame_offsets:
        interval = video_time_interval(config.vision.tokens_per_second, slot.second_per_grid) if slot.video else 1
        return [ImageInput(slot.offset, tuple(slot.grid), embeds, slot.content_hash, interval)]
    _, h, w = slot.grid
    rows = h * w // config.vision.merge_size ** 2
    return [ImageInput(offset, (1, h, w), embeds[i * rows:(i + 1) * rows],
                       f"{slot.content_hash}#{i}" if slot.content_hash else "")
            for i, offset in enumerate(slot.frame_offsets)]


class PromptIntake:
    def __init__(self, config: ModelConfig, plane: DataPlane, device, max_model_len: int):
        self.config = config
        self.plane = plane
        self.device = device  # the engine's: GPU to GPU where the transport can (UCX)
        self.max_model_len = max_model_len
        self.prompts = 0
        self.prompt_tokens = 0

    def check(self, job: PrefillJob, pixels: bool = False) -> None:
        """The job fits the model and this worker's context (``pixels``: see ``validate_prompt``)."""
        validate_prompt(job, self.config, pixels)
        if len(job.token_ids) >= self.max_model_len:
            raise ServiceError(400, f"prompt of {len(job.token_ids)} tokens does not fit the context "
                                    f"({self.max_model_len})")

    async def sequence(self, job: PrefillJob) -> Sequence:
        self.check(job)
        embeds = await self.pull_embeddings(job.images)
        return self.make_sequence(job, [i for s, e in zip(job.images, embeds) for i in image_inputs(s, e, self.config)])

    def make_sequence(self, job: PrefillJob, images: list[ImageInput]) -> Sequence:
        self.prompts += 1
        self.prompt_tokens += len(job.token_ids)
        return Sequence(job.request_id, list(job.token_ids), len(job.token_ids), job.sampling, images=images,
                        output_offset=job.output_offset)

    async def pull_embeddings(self, slots: list[ImageSlot]) -> list:
        """Each slot's embeddings on the engine's device (a slot without them, encoded here: None)."""

        try:
            pulled = iter(await self.plane.pull_many([s.embedding for s in slots if s.embedding is not None],
                                                     device=self.device))
            return [None if s.embedding is None else next(pulled) for s in slots]
        except DataPlaneError as err:
            if err.code in _GONE_CODES:
                raise ServiceError(EMBEDDINGS_GONE, f"image embeddings are gone: {err.message}") from None
            raise ServiceError(502, f"could not fetch image embeddings: {err.message}") from None


def intake_endpoints(subjects: Subjects, instance: str, handler: Handler, limit: int) -> list[Endpoint]:
    """Where prompts reach a language-model worker: the queue group, and this instance's own subject
    (the frontend routes there, and watches it)."""
    return [Endpoint("prefill", subjects.prefill, QUEUE["prefill"], handler, limit),
            Endpoint("prefill-direct", subjects.prefill_on(instance), QUEUE["prefill"], handler, limit)]
