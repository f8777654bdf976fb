"""Settings of the services that run the language model (prefill, decode)."""

from __future__ import annotations

from pydantic import Field

from shared.settings import CommonSettings


class EngineSettings(CommonSettings):
    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV block")
    max_model_len: int = Field(0, ge=0, description="longest sequence (prompt + output); 0: the model's limit")
    max_num_seqs: int = Field(256, ge=1, description="sequences in one batch at most")
    max_batched_tokens: int = Field(16384, ge=16, description="prompt tokens in one prefill step at most")
    prefill_priority_window: float = Field(2.0, ge=0, description="waiting prompts start shortest first (text "
                                                                  "before multi-image prompts), but one passed over "
                                                                  "for this many seconds goes first; 0: first come, "
                                                                  "first served")
    kv_cache_mb: int = Field(0, ge=0, description="KV pool size in MiB; 0: from --gpu-memory-utilization "
                                                  "on GPU, 256 MiB on CPU")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="share of GPU memory this process may use")
    enforce_eager: bool = Field(False, description="never capture CUDA graphs for decode (debugging)")
