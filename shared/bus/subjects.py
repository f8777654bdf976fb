"""Every subject of one stack. The prefix lets several stacks share one NATS server.

Work subjects are served by queue groups (one more subscriber is one more worker); instance subjects
(``.<instance>``) reach one worker, which the frontend picks for cache affinity and load, and watches.
"""

from __future__ import annotations

from dataclasses import dataclass

# Queue group of each work subject's subscribers.
QUEUE = {"encoder": "encoder", "prefill": "prefill", "decode": "decode", "frontend": "frontend"}


@dataclass(frozen=True)
class Subjects:
    prefix: str = "epd"

    # -- frontend → encoders ----------------------------------------------------------------------
    @property
    def encode(self) -> str:
        return f"{self.prefix}.encode"

    def encode_on(self, instance: str) -> str:
        return f"{self.prefix}.encode.{instance}"

    def encode_fetch(self, instance: str) -> str:
        """Another encoder borrows an image's embeddings this one holds."""
        return f"{self.prefix}.encode.{instance}.fetch"

    # -- frontend → language-model intake (prefill, language, aggregated workers) -----------------
    @property
    def prefill(self) -> str:
        return f"{self.prefix}.prefill"

    def prefill_on(self, instance: str) -> str:
        return f"{self.prefix}.prefill.{instance}"

    def prefix_lookup(self, instance: str) -> str:
        """How much of a prompt one intake worker's prefix cache holds (the frontend asks before routing)."""
        return f"{self.prefix}.prefill.{instance}.prefix"

    # -- prefill → decode -------------------------------------------------------------------------
    @property
    def decode(self) -> str:
        """Where prefill asks any decode worker for a KV reservation (queue group)."""
        return f"{self.prefix}.decode"

    def decode_reserve(self, instance: str) -> str:
        """Where prefill asks one decode worker (the least loaded it knows, watched) for a reservation."""
        return f"{self.prefix}.decode.{instance}.reserve"

    def decode_kv(self, instance: str) -> str:
        return f"{self.prefix}.decode.{instance}.kv"

    def decode_start(self, instance: str) -> str:
        return f"{self.prefix}.decode.{instance}.start"

    # -- broadcast and per request ----------------------------------------------------------------
    @property
    def cancel(self) -> str:
        return f"{self.prefix}.cancel"

    def stream(self, request_id: str) -> str:
        return f"{self.prefix}.stream.{request_id}"

    # -- the public NATS API ----------------------------------------------------------------------
    @property
    def chat(self) -> str:
        return f"{self.prefix}.chat"

    @property
    def jobs(self) -> str:
        return f"{self.prefix}.jobs.submit"

    def results(self, job_id: str) -> str:
        return f"{self.prefix}.results.{job_id}"

    # -- replies ----------------------------------------------------------------------------------
    def inbox(self, role: str) -> str:
        """The inbox prefix of a role's connections: replies to one role land where only it may
        subscribe (a client cannot read an encoder's reply, with its data-plane token, to the frontend)."""
        return f"_INBOX.{self.prefix}.{role}"
