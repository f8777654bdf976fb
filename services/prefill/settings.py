"""Prefill settings (``EPD_`` environment variables or ``epd prefill --flags``)."""

from __future__ import annotations

from pydantic import Field

from shared.engine.settings import EngineSettings


class PrefillSettings(EngineSettings):
    max_concurrent_jobs: int = Field(256, ge=1, description="prefill jobs admitted at once; more wait in NATS")
    handoff_timeout: float = Field(30.0, gt=0, description="seconds a decode worker has to answer (reserve, "
                                                          "take a KV chunk, start)")
    decode_wait: float = Field(20.0, ge=0, description="seconds a request waits for KV room while every decode "
                                                      "worker is full (asking again, with back-off) before it "
                                                      "fails with 503; keep below the frontend's --prefill-timeout")
    kv_chunk_layers: int = Field(4, ge=1, description="layers per KV chunk streamed to decode during prefill")
