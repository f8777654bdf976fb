"""A prefill job becomes an engine ``Sequence``: checked against the model, its image embeddings pulled
onto the engine's device.

The job comes from the frontend, so nothing in it is trusted: every token id in the vocabulary, every
image slot over exactly one run of placeholder tokens with embeddings of the size its grid gives, and
no placeholder without an image (videos: the video placeholder, in one run or one per temporal patch).
An image sent as ``cached`` (no embeddings: the frontend's prefix lookup said this worker holds its KV)
becomes inputs without embeddings: the engine starts such a prompt from its prefix cache at once, or
refuses it (``LanguageWorker.add_prompt``: ``EMBEDDINGS_GONE``). The same cache answers the frontend's
lookups (``lookup``).
"""

from __future__ import annotations

from shared.bus.service_api import Endpoint, Handler, Request
from shared.bus.subjects import QUEUE, Subjects
from shared.dataplane.plane import DataPlane
from shared.dataplane.store import DataPlaneError
from shared.engine.block_manager import BlockManager
from shared.engine.prefix import block_hashes
from shared.engine.sequence import ImageInput, Sequence
from shared.errors import ServiceError
from shared.messages import pack, unpack
from shared.messages.prefill import EMBEDDINGS_GONE, ImageSlot, PrefillJob, PrefixFound, PrefixLookup
from shared.messages.sampling import SamplingParams
from shared.model.config import ModelConfig
from shared.model.geometry import grid_tokens
from shared.model.rope import video_time_interval

_GONE_CODES = ("unreachable", "expired", "not_found", "timeout")
EMBEDDING_DTYPES = ("float32", "float16", "bfloat16")  # an encoder's, or a client's (cast to the engine's)
LOOKUPS_AT_ONCE = 64  # each is a few dictionary reads: more wait in NATS


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
        if (slot.embedding is not None) + (slot.pixels is not None) + slot.cached != 1:
            raise ServiceError(400, "an image slot carries either its embeddings or its pixels, or is cached")
        if slot.cached and not slot.content_hash:
            raise ServiceError(400, "a cached image slot needs its content hash")
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
    ``(1, h, w)`` grid, as HF places them), named in the prefix cache by the clip's hash and its index.
    ``embeds`` None: a cached slot (its inputs carry no embeddings)."""
    spans = slot.spans(config.vision.merge_size)
    if slot.frame_offsets:
        _, h, w = slot.grid
        grid, interval = (1, h, w), 1
    else:
        grid = tuple(slot.grid)
        interval = video_time_interval(config.vision.tokens_per_second, slot.second_per_grid) if slot.video else 1
    inputs, row = [], 0
    for span in spans:
        rows = None if embeds is None else embeds[row:row + span.num_tokens]
        inputs.append(ImageInput(span.offset, grid, rows, span.content_hash, interval, span.num_tokens))
        row += span.num_tokens
    return inputs


class PromptIntake:
    def __init__(self, config: ModelConfig, plane: DataPlane, device, max_model_len: int,
                 blocks: BlockManager | None = None):
        self.config = config
        self.plane = plane
        self.device = device  # the engine's: GPU to GPU where the transport can (UCX)
        self.max_model_len = max_model_len
        self.blocks = blocks  # the engine's prefix cache: lookups read it from the event loop
        self.prompts = 0
        self.prompt_tokens = 0
        self.images_pulled = 0  # images whose embeddings were pulled, and their bytes
        self.embedding_bytes = 0

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

    def chain_hashes(self, job: PrefillJob) -> list[str]:
        """The chain hashes of the job's full blocks, named from its slots (before any embeddings came)."""
        if self.blocks is None or not self.blocks.caching:
            return []
        spans = [span for slot in job.images for span in slot.spans(self.config.vision.merge_size)]
        return block_hashes(job.token_ids, spans, self.blocks.block_size)

    async def pull_embeddings(self, slots: list[ImageSlot]) -> list:
        """Each slot's embeddings on the engine's device (a slot without them — encoded here, or cached:
        None)."""
        handles = [s.embedding for s in slots if s.embedding is not None]
        try:
            pulled = iter(await self.plane.pull_many(handles, device=self.device))
        except DataPlaneError as err:
            if err.code in _GONE_CODES:
                raise ServiceError(EMBEDDINGS_GONE, f"image embeddings are gone: {err.message}") from None
            raise ServiceError(502, f"could not fetch image embeddings: {err.message}") from None
        self.images_pulled += len(handles)
        self.embedding_bytes += sum(h.nbytes for h in handles)
        return [None if s.embedding is None else next(pulled) for s in slots]

    async def lookup(self, request: Request) -> bytes:
        """The frontend asks how many leading blocks of a prompt this worker's prefix cache holds."""
        query = unpack(PrefixLookup, request.data)
        held = 0
        if self.blocks is not None and query.block_size == self.blocks.block_size:
            held = self.blocks.count_cached(query.hashes)
        return pack(PrefixFound(blocks=held))

    def stats(self) -> dict:
        return {"prompts": self.prompts, "prompt_tokens": self.prompt_tokens, "images_pulled": self.images_pulled,
                "embedding_bytes_pulled": self.embedding_bytes}

    def metadata(self) -> dict[str, str]:
        """What a frontend needs to look prompts up here (nothing: this worker caches no prefix)."""
        return {"kv_block_size": str(self.blocks.block_size)} if self.blocks is not None and self.blocks.caching else {}


def intake_endpoints(subjects: Subjects, instance: str, handler: Handler, limit: int,
                     intake: PromptIntake) -> list[Endpoint]:
    """Where prompts reach a language-model worker: the queue group, and this instance's own subject
    (the frontend routes there, and watches it); and where the frontend looks a prompt's prefix up."""
    return [Endpoint("prefill", subjects.prefill, QUEUE["prefill"], handler, limit),
            Endpoint("prefill-direct", subjects.prefill_on(instance), QUEUE["prefill"], handler, limit),
            Endpoint("prefix-lookup", subjects.prefix_lookup(instance), None, intake.lookup, LOOKUPS_AT_ONCE)]
