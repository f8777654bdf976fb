"""Settings of the services that run the language model (prefill, decode)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field, field_validator

from shared.settings import CommonSettings, CudaGraphs, GpuMemory, ModelLength

if TYPE_CHECKING:
    import torch

GPU_STEP_TOKENS = 8192  # to confirm on the H200: bench/gpu_engine.py --sections chunked
CPU_STEP_TOKENS = 512
# prefill and mixed steps of up to this many tokens run as CUDA graphs between their attentions (padded to a
# bucket: launched kernel by kernel, short prompts waited on the host); --enforce-eager: none
PREFILL_GRAPH_TOKENS = 4096
# ITL p99 ≤ 100 ms with room for the model's error and a colocated encoder's slowdown; a 7B on an H200
# still computes ~1,500 prompt tokens beside its decode rows in it (docs/architecture.md, the engine)
DEFAULT_TARGET_ITL_MS = 50.0


class EngineSettings(GpuMemory, CudaGraphs, ModelLength, CommonSettings):
    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV block: the unit the cache is allocated, "
                                                           "shared and evicted in")
    max_num_seqs: int = Field(256, ge=1, description="sequences in one batch at most; lower it to bound a step's "
                                                     "time and memory")
    max_batched_tokens: int = Field(0, ge=0, description="tokens one step computes at most: prompt chunks plus one "
                                                         "per decoding sequence; larger gives prompts more throughput, "
                                                         "smaller keeps decode steps short; 0: 8192 on GPU, 512 on CPU")
    target_itl_ms: float = Field(DEFAULT_TARGET_ITL_MS, ge=0, le=10_000, description=(
        "time one engine step may take while sequences are decoding: their next token waits for the whole "
        "step, so its prompt chunks (and in the aggregated worker the ViT batches run between steps) are cut "
        "to what a model of step time predicts fits; the model is measured on this device at start and "
        "corrected after every step. Lower: smoother streams, prompts take more steps (more time to first "
        "token under load); steps without decode rows still use --max-batched-tokens, and so does every step "
        "while holding the budget would delay the first token of the prompts queued by more than one such step, "
        "or one has waited over 2 s (the budget costs prompt throughput). Workers that prefill and "
        "decode (aggregated, E/PD) only: a split prefill or decode worker's steps never carry both. 0: no "
        "time budget, steps are sized by --max-batched-tokens alone"))
    chunked_prefill: bool = Field(True, description="split prompts longer than the step budget into chunks, decode "
                                                    "rows riding along in every step; --no-chunked-prefill: prompts "
                                                    "whole, in steps of their own")
    prefix_caching: bool = Field(True, description="reuse the KV of a prompt's longest cached prefix (text, and "
                                                   "images by content hash); --no-prefix-caching: compute every prompt")
    kv_cache_mb: int = Field(0, ge=0, description="KV pool size in MiB; 0: from --gpu-memory-utilization "
                                                  "on GPU, 256 MiB on CPU")

    @field_validator("max_batched_tokens")
    @classmethod
    def _budget(cls, value: int, info) -> int:
        if 0 < value < 16:
            raise ValueError(f"{info.field_name} must be 0 (the default) or at least 16")
        return value

    def step_token_budget(self, device: "torch.device") -> int:
        """Tokens per step: the setting, or the device's default (GPU: large enough that chunking
        costs little prefill throughput; CPU: small enough that the CPU test suite chunks image prompts)."""
        return self.max_batched_tokens or (GPU_STEP_TOKENS if device.type == "cuda" else CPU_STEP_TOKENS)
