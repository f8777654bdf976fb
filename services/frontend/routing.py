"""Which worker gets which piece of a request, from the ``Directory``'s listing.

Images → encoders. For each image, in order:
1. the encoder the embedding index (JetStream KV) names as holding it, if alive: a hit there skips the
   ViT, and sending it anywhere else would only make that encoder borrow from the holder;
2. the image's rendezvous-hash favourite among live encoders (the same image keeps landing on the same
   encoder, so its cache serves it even without the index), unless that encoder is busier than the
   least-loaded one by more than ``margin`` images, which then takes it.
Images of one request count as load as they are placed, so a request's new images spread over idle
encoders; a request that carries the same image twice sends both to one encoder (which encodes it once).

Prompts → language-model intake workers (prefill, language, aggregated):
1. the worker whose prefix cache holds the longest prefix of the prompt, images included, unless it is
   overloaded (its load passes the least-loaded's by more than ``BALANCE_ABS`` and by more than
   ``BALANCE_REL`` times: recomputing a long prefix elsewhere costs more than a somewhat longer queue);
   each worker that caches prefixes (metadata ``kv_block_size``) is asked, all at once, how many of the
   prompt's block hashes it holds (``shared.engine.prefix``, the engine's own keys): exact at that
   moment, nothing to keep in step with the workers, and a worker that does not answer within
   ``PREFIX_LOOKUP_SECONDS`` (or restarted: a new instance) simply holds nothing;
2. else the least loaded (prompts being admitted, then sequences running), so a worker that died or is
   saturated is avoided.
The route says how many of the prompt's tokens the target holds: images entirely inside them are not
sent (the target checks again). A worker whose metadata says ``encodes_in_place`` (aggregated) takes
the request's images as pixels with the prompt: they skip the encoder routing above.

A listing is up to a second old, so a burst would pile onto one worker: each router also counts what
it has sent and not yet seen answered, and takes the larger of that and the listed load.

With nothing listed (discovery not answered yet, or unavailable), work goes to the plain queue group
and NATS picks — or answers "no responders" when nobody serves it.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass

import nats.errors

from shared.bus.calls import ServiceCallError, call
from shared.bus.directory import Directory, Instance
from shared.bus.subjects import Subjects
from shared.bus.watched import Target
from shared.embedding_index import EmbeddingIndex, embedding_key
from shared.engine.prefix import ImageSpan, block_hashes, cacheable_blocks
from shared.messages import ProtocolError, pack, unpack
from shared.messages.prefill import PrefixFound, PrefixLookup

INDEX_LOOKUP_SECONDS = 0.25  # the index is an optimization: past this, route without it
PREFIX_LOOKUP_SECONDS = 0.1  # so is a prefix lookup: a worker that has not answered by then holds nothing
BALANCE_ABS, BALANCE_REL = 64, 1.5  # SGLang's cache-aware router's defaults
ENCODER_KINDS = ("encoder", "aggregated")
INTAKE_KINDS = ("prefill", "language", "aggregated")


def rendezvous_score(key: str, instance: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}/{instance}".encode(), digest_size=8).digest(), "big")


class Outstanding:
    """Work this frontend sent to each instance and has not seen answered."""

    def __init__(self):
        self.counts: Counter[str] = Counter()

    @contextmanager
    def sending(self, instance: str):
        if not instance:  # a queue group: nobody in particular
            yield
            return
        self.counts[instance] += 1
        try:
            yield
        finally:
            self.counts[instance] -= 1
            if self.counts[instance] <= 0:
                del self.counts[instance]

    def load(self, instance: Instance, listed: str) -> int:
        return max(int(instance.data.get(listed, 0)), self.counts.get(instance.instance, 0))


class EncoderRouter:
    def __init__(self, nc, directory: Directory, subjects: Subjects, margin: int = 0):
        self.outstanding = Outstanding()
        self.directory = directory
        self.subjects = subjects
        self.margin = margin
        self.index = EmbeddingIndex(nc, subjects.prefix, create=False, timeout=INDEX_LOOKUP_SECONDS, reopen=2.0)

    async def targets(self, content_hashes: list[str]) -> list[Target]:
        encoders = self.directory.of(*ENCODER_KINDS)
        if not encoders:
            return [Target(self.subjects.encode)] * len(content_hashes)
        holders = await self.holders(content_hashes, encoders)
        load = {e.instance: self.outstanding.load(e, "in_flight") for e in encoders}
        return [Target(self.subjects.encode_on(i), i) for i in assign(content_hashes, load, holders, self.margin)]

    def retarget(self, avoid: set[str]) -> Target:
        """Where a failed encode goes next: the least loaded listed encoder not in ``avoid`` (one whose
        call can be watched: if it is gone too, the caller learns it within a second), or the queue
        group when there is none (an encoder may serve before it is listed)."""
        load = {e.instance: self.outstanding.load(e, "in_flight") for e in self.directory.of(*ENCODER_KINDS)
                if e.instance not in avoid}
        if not load:
            return Target(self.subjects.encode)
        least = min(load, key=lambda instance: (load[instance], instance))
        return Target(self.subjects.encode_on(least), least)

    async def holders(self, content_hashes: list[str], encoders: list[Instance]) -> list[str | None]:
        """For each image, the live encoder the embedding index says holds it (None: unknown)."""
        fingerprints = sorted({e.metadata.get("cache_fingerprint", "") for e in encoders} - {""})
        if not fingerprints or not content_hashes:
            return [None] * len(content_hashes)
        alive = {e.instance for e in encoders}

        async def lookup(content_hash: str) -> str | None:
            for fingerprint in fingerprints:  # usually one: every encoder of a stack runs the same model
                holder = await self.index.holder(embedding_key(content_hash, fingerprint))
                if holder in alive:
                    return holder
            return None

        try:
            return list(await asyncio.wait_for(asyncio.gather(*(lookup(h) for h in content_hashes)),
                                               INDEX_LOOKUP_SECONDS * 2))
        except asyncio.TimeoutError:
            return [None] * len(content_hashes)


def assign(content_hashes: list[str], load: dict[str, int], holders: list[str | None],
           margin: int = 0) -> list[str]:
    """The encoder instance each image goes to, given each live encoder's load (images in flight)."""
    load = dict(load)
    placed: dict[str, str] = {}  # content hash → instance, for an image repeated within the request
    chosen = []
    for content_hash, holder in zip(content_hashes, holders):
        pick = placed.get(content_hash) or (holder if holder in load else None)
        if pick is None:
            pick = _by_load(content_hash, load, margin)
            load[pick] += 1  # a cache hit at its holder costs no ViT time: only new work counts
        placed[content_hash] = pick
        chosen.append(pick)
    return chosen


def _by_load(content_hash: str, load: dict[str, int], margin: int) -> str:
    favourite = max(load, key=lambda inst: rendezvous_score(content_hash, inst))
    least = min(load, key=lambda inst: (load[inst], inst))
    return favourite if load[favourite] <= load[least] + margin else least


@dataclass(frozen=True)
class Route:
    target: Target
    cached_tokens: int = 0  # leading prompt tokens whose KV the target said it holds


class IntakeRouter:
    def __init__(self, nc, directory: Directory, subjects: Subjects, by_prefix: bool = True):
        self.outstanding = Outstanding()
        self.nc = nc
        self.directory = directory
        self.subjects = subjects
        self.by_prefix = by_prefix  # False: by load alone (and nothing is left out of a prompt)
        self.lookups = 0

    async def route(self, token_ids: list[int], spans: list[ImageSpan], exclude: set[str] = frozenset()) -> Route:
        """Where the prompt goes (a live intake worker not in ``exclude``, or the queue group), and how much
        of it the target holds."""
        workers = [w for w in self.directory.of(*INTAKE_KINDS) if w.instance not in exclude]
        if not workers:
            return Route(Target(self.subjects.prefill))
        loads = {w.instance: (self.outstanding.load(w, "prompts_in_flight"), int(w.data.get("running", 0)))
                 for w in workers}
        # one worker and no image to leave out: nothing a lookup could change
        asked = self.by_prefix and (len(workers) > 1 or bool(spans))
        cached = await self.lookup(workers, token_ids, spans) if asked else {}
        best = choose(loads, cached)
        return Route(Target(self.subjects.prefill_on(best), best), cached.get(best, 0))

    async def lookup(self, workers: list[Instance], token_ids: list[int], spans: list[ImageSpan]) -> dict[str, int]:
        """Per worker that caches prefixes, the leading tokens of the prompt it holds."""
        lookups: dict[int, tuple[bytes, int] | None] = {}  # block size → (the lookup, its hashes); None: no block
        asked = []
        for worker in workers:
            size = int(worker.metadata.get("kv_block_size") or 0)
            if size > 0 and size not in lookups:
                hashes = block_hashes(token_ids[:cacheable_blocks(len(token_ids), size) * size], spans, size)
                lookups[size] = (pack(PrefixLookup(block_size=size, hashes=hashes)), len(hashes)) if hashes else None
            if size > 0 and lookups[size] is not None:
                asked.append((worker.instance, size))
        if not asked:
            return {}
        self.lookups += 1
        found = await asyncio.gather(*(self._ask(instance, *lookups[size]) for instance, size in asked))
        return {instance: blocks * size for (instance, size), blocks in zip(asked, found) if blocks}

    async def _ask(self, instance: str, payload: bytes, most: int) -> int:
        try:
            reply = await call(self.nc, self.subjects.prefix_lookup(instance), payload, PREFIX_LOOKUP_SECONDS,
                               "prefix lookup")
            return min(unpack(PrefixFound, reply).blocks, most)
        except (ServiceCallError, ProtocolError, nats.errors.Error):  # late, gone, refused: nothing we know of
            return 0

    def encodes_in_place(self, target: Target) -> bool:
        """Whether ``target`` is a listed worker that takes images as pixels and encodes them itself."""
        return bool(target.instance) and any(w.instance == target.instance and
                                             w.metadata.get("encodes_in_place") == "true"
                                             for w in self.directory.of(*INTAKE_KINDS))


def choose(loads: dict[str, tuple[int, int]], cached: dict[str, int]) -> str:
    """The worker a prompt goes to, given each one's load (prompts being admitted, sequences running) and
    the prompt's tokens each holds: the longest holder not overloaded, the least loaded among equals;
    else the least loaded."""
    least = min(loads, key=lambda w: (*loads[w], w))
    floor = sum(loads[least])

    def overloaded(worker: str) -> bool:
        load = sum(loads[worker])
        return load - floor > BALANCE_ABS and load > floor * BALANCE_REL

    holders = [w for w in loads if cached.get(w, 0) > 0 and not overloaded(w)]
    return min(holders, key=lambda w: (-cached[w], *loads[w], w)) if holders else least
