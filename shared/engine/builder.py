"""Builds an engine for a role from settings: loads the language model, sizes the KV pool."""

from __future__ import annotations

import torch

from shared import kernels
from shared.engine.engine import Engine
from shared.engine.grammar import Grammars
from shared.engine.kv_cache import KVCache
from shared.engine.memory import CONTEXT_BYTES, step_work_bytes
from shared.engine.runner import ModelRunner
from shared.engine.sampling import Sampler
from shared.engine.settings import PREFILL_GRAPH_TOKENS, EngineSettings
from shared.logging import get_logger
from shared.model import pieces
from shared.model.config import ModelConfig
from shared.model.loader import load_language_model
from shared.model.tokenizer import load_tokenizer

log = get_logger(__name__)


def kv_pool_blocks(settings: EngineSettings, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> int:
    per_block = KVCache.bytes_per_block(config.text, settings.block_size, dtype)
    if settings.kv_cache_mb:
        budget = settings.kv_cache_mb << 20
    elif device.type == "cuda":
        # this process's share of the GPU (vLLM's meaning): several processes on one GPU each take theirs;
        # what it holds already (weights, prefill graphs) is in the allocator, what it will need is counted
        _, total = torch.cuda.mem_get_info(device)
        work = step_work_bytes(config.text, settings.step_token_budget(device), settings.max_num_seqs,
                               torch.empty((), dtype=dtype).element_size())
        budget = int(total * settings.gpu_memory_utilization) - torch.cuda.memory_reserved(device) - work - CONTEXT_BYTES
    else:
        budget = 256 << 20
    return max(0, budget // per_block)


def build_engine(settings: EngineSettings, role: str) -> tuple[Engine, ModelConfig]:
    path = settings.model_path()
    config = ModelConfig.from_checkpoint(path)
    device, dtype = settings.torch_device(), settings.torch_dtype()
    if device.type == "cuda":
        kernels.log_compiles(log)
    model = load_language_model(path, config, device, dtype, settings.load_format)
    max_len = min(settings.max_model_len or config.text.max_position_embeddings, config.text.max_position_embeddings)
    if device.type == "cuda" and role != "decode" and not settings.enforce_eager:
        # before the KV pool is sized from what this process holds: the graphs' buffers and pool count in it
        pieces.capture(model, min(PREFILL_GRAPH_TOKENS, settings.step_token_budget(device)))
    blocks = kv_pool_blocks(settings, config, device, dtype)
    cache = KVCache(config.text, blocks, settings.block_size, dtype, device)
    log.info("engine.kv_pool", role=role, blocks=blocks, block_size=settings.block_size,
             mib=round(cache.nbytes / 2**20, 1), max_model_len=max_len, step_tokens=settings.step_token_budget(device),
             target_itl_ms=settings.target_itl_ms or None,
             chunked_prefill=settings.chunked_prefill, prefix_caching=settings.prefix_caching)
    sampler = Sampler(device, eos_token_ids=config.eos_token_ids,
                      grammars=lambda: Grammars(load_tokenizer(path), config.text.vocab_size, config.eos_token_ids))
    runner = ModelRunner(model, cache, config.vision.merge_size, sampler=sampler)
    engine = Engine(runner, config.eos_token_ids, max_len, role, settings.max_num_seqs,
                    settings.step_token_budget(device), chunked_prefill=settings.chunked_prefill,
                    prefix_caching=settings.prefix_caching, target_itl_s=settings.target_itl_ms / 1e3)
    if device.type == "cuda" and role != "prefill" and not settings.enforce_eager:
        runner.capture_graphs(settings.max_num_seqs, max_len)
    return engine, config
