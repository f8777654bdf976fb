"""How ``epd up`` shares a GPU's memory between the processes it places on it.

Each worker process sizes itself from its own share of its GPU (``--gpu-memory-utilization``, vLLM's
meaning: a language worker's KV pool is what is left of its share after its weights, graphs and working
room). Several processes on one GPU therefore need shares that add up, not 0.9 each. ``epd up``'s own
``--gpu-memory-utilization`` is the share of each GPU the whole stack may take; here it is divided:

1. every process needs a fixed part: its CUDA context and libraries' workspaces, its weights (counted
   from the model's own classes on the meta device: exact, nothing is allocated; remembered in the cache
   directory, so a warm start plans without importing torch), and working room for
   its largest step (a language worker: ``--max-batched-tokens`` tokens eager; an encoder: a ViT forward of
   ``--max-batch-patches``); where ``--kv-cache-mb`` sets every language worker's KV pool, that pool too
   (it takes it whatever its share says: left out, the 7B split on one H100 with 20 GiB pools left its
   encoder 4 GiB, and every image request failed out of memory at its first ViT batch, 2026-12-06);
2. what is left is *room*: each encoder takes a tenth of it (at most 12 GiB: its embedding cache and the
   embeddings it holds until they are pulled, ``EPD_ENCODER_CACHE_MB`` / ``EPD_DATA_MAX_MB``, shrunk to
   fit), the language side the rest for its KV pools — split a third to prefill, two thirds to decode
   where split, since decode holds every running sequence and prefill only prompts in flight;
3. each process gets its share as environment variables, and logs what it took once ready.
When the room cannot hold one sequence of the model's context in the smallest KV pool (also that of a
language process alone on its GPU, e.g. the 30B-A3B's 256k context on an 80 GB card), the whole stack's
``--max-model-len`` is lowered to what fits (logged), unless the user set it; a stack whose fixed parts do
not fit a shared GPU at all is refused with one line naming what to change.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from launcher.topology import Placement
from shared.engine.settings import PREFILL_GRAPH_TOKENS

GIB = 1 << 30
MIB = 1 << 20
ENCODER_ROOM_SHARE = 0.10
ENCODER_ROOM_MAX = 12 * GIB
ENCODER_STORE_MIN = 1 * GIB  # embeddings handed out and not yet pulled: a request's images at the least
PREFILL_KV_SHARE = 1 / 3
CONTEXT_MARGIN = 0.9  # of a planned KV pool, for what the plan cannot see (allocator rounding)
GRAPH_TOKENS = PREFILL_GRAPH_TOKENS  # prefill graphs' tokens: their pool is taken before the KV pool
PREFILL_STORE = 2 * GIB  # a prefill worker's KV chunks copied out until decode pulls them (its data store)
# what a language worker holds beyond its counted parts when it sizes its KV pool: the allocator's segments
# around the loaded weights, and (prefill) its piece graphs' pool past their tensors. Measured on an H200,
# Qwen3-VL-30B-A3B: a decode worker 270 MiB, a prefill worker 420 MiB over the plan.
LOADED_SLACK = 512 * MIB
GRAPH_POOL_FACTOR = 2  # a piece-graph pool against its largest step's live tensors (350 / 200 MiB measured)
LANGUAGE_KINDS = ("language", "prefill", "decode", "aggregated")


@dataclass
class MemoryPlan:
    """What ``epd up`` gives the processes of GPUs they share: each kind's variables on each GPU, and the
    stack's context where the smallest KV pool cannot hold the model's."""

    envs: dict[tuple[str, str | None], dict[str, str]] = field(default_factory=dict)
    max_model_len: int = 0  # lowered to what every KV pool holds; 0: as configured

    @classmethod
    def for_stack(cls, settings, path) -> "MemoryPlan":
        """The plan for ``epd up``'s ``settings`` (placements, ``--gpu-memory-utilization``), with the limits
        its workers will read from this environment."""
        from services.encoder.settings import EncoderSettings
        from shared.engine.settings import EngineSettings
        from shared.model.config import ModelConfig

        engine, encoder = EngineSettings(), EncoderSettings()
        limits = SimpleNamespace(max_batch_patches=encoder.max_batch_patches, max_num_seqs=engine.max_num_seqs,
                                 max_batched_tokens=engine.max_batched_tokens, max_model_len=engine.max_model_len,
                                 kv_cache_mb=engine.kv_cache_mb)
        model = ModelConfig.from_checkpoint(path)
        envs, longest = plan(settings.placements_at_most(), model, limits, settings.gpu_memory_utilization)
        # a context the user set stays (a pool too small for it is the engine's one-line error)
        lowered = longest if longest and not engine.max_model_len and longest < model.text.max_position_embeddings \
            else 0
        return cls(envs, lowered)

    def of(self, placement: Placement) -> tuple[tuple[str, str], ...]:
        return tuple(self.envs.get((placement.kind, placement.gpu), {}).items())

    def log(self) -> None:
        if not self.envs:
            return
        from shared.logging import get_logger

        log = get_logger(__name__)
        for (kind, gpu), env in self.envs.items():
            log.info("stack.memory", kind=kind, gpu=gpu, **{k.removeprefix("EPD_").lower(): v for k, v in env.items()})
        if self.max_model_len:
            log.warning("stack.max_model_len", tokens=self.max_model_len,
                        reason="the smallest KV pool holds no longer sequence",
                        hint="--max-model-len to choose it, --gpu-memory-utilization higher, fewer processes "
                             "on a GPU, or --pd joined")


class MemoryPlanError(ValueError):
    """The processes placed on a GPU cannot fit it; the message says what to change."""


@dataclass(frozen=True)
class Needs:
    """What one process must have (bytes), and what it would like on top (room)."""

    fixed: int
    kv_per_token: int = 0  # language kinds: KV bytes of one token
    kv_set: int = 0  # language kinds: the KV pool --kv-cache-mb gives every one whatever its share (in ``fixed``)


def gpu_totals() -> dict[str, int]:
    """Total memory (bytes) of each GPU nvidia-smi lists, by index and by UUID; {} without one."""
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return {}
    try:
        out = subprocess.run([binary, "--query-gpu=index,uuid,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    totals = {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[2].isdigit():
            totals[parts[0]] = totals[parts[1]] = int(parts[2]) * MIB
    return totals


def process_needs(kind: str, model, settings, dtype_bytes: int = 2) -> Needs:
    """The fixed bytes a process of ``kind`` needs on its GPU (``model``: the ``ModelConfig``): the same
    figures a language worker subtracts before sizing its KV pool (``shared/engine/memory.py``)."""
    from shared.engine.memory import CONTEXT_BYTES, kv_bytes_per_token, step_work_bytes

    fixed = CONTEXT_BYTES
    if kind in ("encoder", "aggregated"):
        vision = model.vision
        fixed += weight_bytes(model, "vision", dtype_bytes)
        # a ViT forward's live tensors: the residual stream and q|k|v, attention's output, the MLP's hidden
        fixed += settings.max_batch_patches * (6 * vision.width + 2 * vision.mlp_hidden) * dtype_bytes
    if kind in LANGUAGE_KINDS:
        fixed += weight_bytes(model, "text", dtype_bytes) + LOADED_SLACK
        fixed += step_work_bytes(model.text, settings.max_batched_tokens or 8192, settings.max_num_seqs, dtype_bytes)
        if kind == "prefill":
            fixed += PREFILL_STORE
        kv_set = settings.kv_cache_mb * MIB
        return Needs(fixed + kv_set, kv_bytes_per_token(model.text, dtype_bytes), kv_set)
    return Needs(fixed)


def weight_bytes(model, role: str, dtype_bytes: int = 2) -> int:
    """``shared.model.loader.parameter_bytes``, remembered in the cache directory by the model's configuration
    and the model code's digest: counting imports torch, ~3 s of an ``epd up`` on a GPU host."""
    from shared.model.presets import cache_dir

    key = hashlib.blake2b(repr((role, dtype_bytes, model)).encode() + _model_code_digest(), digest_size=16)
    key = key.hexdigest()
    file = cache_dir() / "parameter-bytes.json"
    try:
        known = json.loads(file.read_text())
    except (OSError, ValueError):
        known = {}
    known = known if isinstance(known, dict) else {}
    if isinstance(known.get(key), int):
        return known[key]
    from shared.model.loader import parameter_bytes

    count = known[key] = parameter_bytes(model, role, dtype_bytes)
    try:  # written whole or not at all: starts racing each other lose an entry at worst
        file.parent.mkdir(parents=True, exist_ok=True)
        fd, staging = tempfile.mkstemp(dir=file.parent, prefix=".parameter-bytes-")
        with os.fdopen(fd, "w") as out:
            json.dump(known, out)
        os.replace(staging, file)
    except OSError:
        pass  # a read-only cache directory: counted again next time
    return count


@functools.lru_cache(maxsize=1)
def _model_code_digest() -> bytes:
    """The model classes' source (``shared/model/``): a changed layer is counted again."""
    import shared.model

    digest = hashlib.blake2b(digest_size=16)
    for source in sorted(Path(shared.model.__file__).parent.glob("*.py")):
        digest.update(source.name.encode() + source.read_bytes())
    return digest.digest()


def plan_gpu(total: int, utilization: float, kinds: list[str], needs: dict[str, Needs],
             context_bytes: int = 0) -> dict[int, dict]:
    """Shares for the processes ``kinds`` (in placement order) sharing one GPU of ``total`` bytes: for each
    position, the environment it gets and the KV bytes planned for it (language kinds)."""
    budget = int(total * utilization)
    fixed = sum(needs[k].fixed for k in kinds)
    room = budget - fixed
    if room <= 0:
        listing = ", ".join(f"{k} {needs[k].fixed / GIB:.1f}" for k in kinds)
        kv_set = max(needs[k].kv_set for k in kinds)
        kv = f"with --kv-cache-mb {kv_set // MIB} each" if kv_set else "before any KV cache"
        lower = "lower --kv-cache-mb (0: each pool sized from its share), " if kv_set else ""
        raise MemoryPlanError(
            f"the processes placed on one GPU need {fixed / GIB:.1f} GiB {kv} ({listing} GiB) but "
            f"--gpu-memory-utilization {utilization:g} gives the stack {budget / GIB:.1f} GiB of its "
            f"{total / GIB:.1f}: {lower}raise it, start fewer processes on that GPU (--encoders, --pd joined), or "
            f"give kinds GPUs of their own (--topology disaggregated)")
    encoders = [i for i, k in enumerate(kinds) if k == "encoder"]
    language = [i for i, k in enumerate(kinds) if k in LANGUAGE_KINDS]
    encoder_room = room // max(len(encoders), 1)
    if language:
        encoder_room = min(max(int(room * ENCODER_ROOM_SHARE), ENCODER_STORE_MIN), ENCODER_ROOM_MAX)
    kv_room = room - encoder_room * len(encoders)
    if language and kv_room <= 0:
        raise MemoryPlanError(f"--gpu-memory-utilization {utilization:g} leaves no room for a KV cache beside "
                              f"{len(encoders)} encoder(s) on one GPU: raise it, or start fewer encoders there")
    shares: dict[int, dict] = {}
    for i in encoders:
        # embeddings wait in the store until pulled (it must never be too small to hand them out); the cache
        # keeps them for repeats, holding the same tensors while both have them
        store = max(encoder_room // 2, min(encoder_room, ENCODER_STORE_MIN))
        shares[i] = {"env": {"EPD_ENCODER_CACHE_MB": str((encoder_room - store) // MIB),
                             "EPD_DATA_MAX_MB": str(store // MIB)},
                     "bytes": needs["encoder"].fixed + encoder_room}
    for i, kv in zip(language, split_kv(kv_room, [kinds[i] for i in language], context_bytes)):
        own = needs[kinds[i]].fixed + kv
        env = {"EPD_GPU_MEMORY_UTILIZATION": _share(own, total)}
        if kinds[i] == "prefill":  # the store is bounded by its own setting, outside the KV pool's share
            env = {"EPD_GPU_MEMORY_UTILIZATION": _share(own - PREFILL_STORE, total),
                   "EPD_DATA_MAX_MB": str(PREFILL_STORE // MIB)}
        shares[i] = {"env": env, "bytes": own, "kv": kv}
    return shares


def _share(nbytes: int, total: int) -> str:
    """``nbytes`` of ``total`` as --gpu-memory-utilization, rounded down: the shares never add up to more."""
    return f"{math.floor(nbytes / total * 1e4) / 1e4:.4f}"


def split_kv(room: int, kinds: list[str], context_bytes: int) -> list[int]:
    """The KV room of each language process on one GPU. Joined workers share it equally. Split, prefill
    takes a third (decode holds every running sequence, prefill only the prompts in flight), unless a
    third cannot hold one sequence of the model's context (``context_bytes``): then prefill and decode
    share equally, which makes the longest sequence both can hold as long as it can be."""
    if "prefill" not in kinds or "decode" not in kinds:
        return [room // len(kinds)] * len(kinds) if kinds else []
    prefill_share = PREFILL_KV_SHARE if room * PREFILL_KV_SHARE / kinds.count("prefill") >= context_bytes else 0.5
    return [int(room * (prefill_share / kinds.count("prefill") if k == "prefill" else
                        (1 - prefill_share) / kinds.count("decode"))) for k in kinds]


def plan(placements: list[Placement], model, settings, utilization: float,
         totals: dict[str, int] | None = None) -> tuple[dict[tuple[str, str | None], dict], int]:
    """The memory environment of each kind on each shared GPU (``(kind, placement.gpu)`` → variables: every
    process of a kind on a GPU gets the same), and the longest sequence every language process's KV pool
    holds with room to spare, shared GPU or not (0: nothing was planned: nvidia-smi lists no GPU)."""
    from shared.engine.memory import step_work_bytes

    totals = gpu_totals() if totals is None else totals
    by_gpu: dict[str | None, list[Placement]] = {}
    for p in placements:
        by_gpu.setdefault(p.gpu, []).append(p)
    needs = {k: process_needs(k, model, settings) for k in {p.kind for p in placements}}
    per_token = max((n.kv_per_token for n in needs.values()), default=0)
    context = settings.max_model_len or model.text.max_position_embeddings
    # the prefill graphs' pool is taken from the share before the KV pool is sized (shared/engine/builder.py)
    graphs = GRAPH_POOL_FACTOR * step_work_bytes(model.text, GRAPH_TOKENS, 0, 2)
    envs: dict[tuple[str, str | None], dict] = {}
    longest = 0
    for gpu, members in by_gpu.items():
        total = totals.get(gpu if gpu is not None else _inherited_gpu())
        if total is None:
            continue
        kinds, shared = [p.kind for p in members], len(members) > 1
        try:
            shares = plan_gpu(total, utilization, kinds, needs, context * per_token)
        except MemoryPlanError:
            if shared:
                raise
            continue  # a process alone on its GPU: its own start says what does not fit
        for position, share in shares.items():
            if shared:  # alone, a process takes the stack's share itself; its context is planned all the same
                envs[(kinds[position], gpu)] = share["env"]
            if "kv" in share:
                kv_set = needs[kinds[position]].kv_set  # a pool of that size exactly (shared/engine/builder.py)
                kv = kv_set or int((share["kv"] - graphs) * CONTEXT_MARGIN)
                tokens = kv // per_token // 256 * 256
                longest = min(longest, tokens) if longest else tokens
    return envs, longest


def _inherited_gpu() -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return visible or "0"
