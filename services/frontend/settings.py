"""Frontend settings (``EPD_`` environment variables or ``epd frontend --flags``)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, field_validator

from shared.settings import CommonSettings, MediaLimits, ModelLength

MEDIA_PER_PROMPT = {"image": 16, "video": 4}


class HttpListener(BaseModel):
    """Where the OpenAI-compatible API listens (``epd frontend``, and ``epd up`` for its frontend)."""

    host: str = Field("127.0.0.1", description="HTTP listen address: 0.0.0.0 to serve other machines")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port of the OpenAI-compatible API")


class ServedName(BaseModel):
    """The model's name for clients (``epd frontend``, and ``epd up`` for its frontend)."""

    served_model_name: str = Field("", description="model name clients use; default: --model as given (a "
                                                   "preset's name, a checkpoint directory's name)")


# threads decoding images and videos (``epd plan`` models them too); 10 on a 16-core host changed nothing
MEDIA_THREADS = 4


class FrontendSettings(MediaLimits, ModelLength, ServedName, HttpListener, CommonSettings):
    max_concurrent_requests: int = Field(256, ge=1, description="requests in flight; more get 429 (the stack's "
                                                                "capacity: raise it with more workers)")
    limit_mm_per_prompt: dict[Literal["image", "video"], Annotated[int, Field(ge=0)]] = Field(
        default_factory=lambda: dict(MEDIA_PER_PROMPT),
        description="media parts one request may carry, per kind (vLLM's option): JSON or image=N,video=N; a "
                    "kind left out keeps its default (image 16, video 4); 0 refuses the kind")
    max_media_bytes: int = Field(64 << 20, ge=1, description="size of one image or video at most, as sent (a "
                                                             "fetched URL, or a data URL's bytes), and of one "
                                                             "image's precomputed embeddings, decoded")
    max_body_bytes: int = Field(128 << 20, ge=1024, description="HTTP request body at most: data URLs travel in it")
    max_output_tokens: int = Field(16384, ge=1, description="max_tokens a client may ask for; also the default "
                                                            "when it gives none (bounded by the rest of the context)")
    fetch_timeout: float = Field(10.0, gt=0, description="seconds to fetch one image or video URL")
    allowed_media_domains: list[str] = Field(default_factory=list,
                                             description="if set, only these hosts (and subdomains) are fetched")
    allow_private_media: bool = Field(False, description="fetch from private and loopback addresses too (a "
                                                         "media server on your own network, tests)")
    local_media_dir: str = Field("", description="directory file:// media URLs may read from; empty: file:// off")
    encode_timeout: float = Field(60.0, gt=0, description="seconds one encode attempt may take before the image "
                                                          "goes to another encoder")
    prefill_timeout: float = Field(30.0, gt=0, description="seconds for a language worker to accept a request: "
                                                           "past it the request fails with 504")
    prefix_routing: bool = Field(True, description="send each prompt to the language worker whose prefix cache "
                                                   "holds the longest part of it, images included (unless that "
                                                   "worker is overloaded), and leave out the images it holds, so a "
                                                   "chat's returning images are not decoded, encoded or sent again; "
                                                   "--no-prefix-routing: by load alone, every image sent (traffic "
                                                   "that never repeats a prefix saves a lookup a request)")
    worker_wait: float = Field(30.0, ge=0, description="seconds a request waits for a worker of a kind it needs "
                               "when none is listed (one restarting, a tier scaling up from zero, this frontend "
                               "started before its workers) before it gets a 503 naming the missing kind")
    wait_for_workers: dict[Literal["encoder", "language", "prefill", "decode", "aggregated"],
                           Annotated[int, Field(ge=0)]] = Field(
        default_factory=dict,
        description="open the HTTP port only once the stack lists this many workers of each kind, e.g. "
                    "encoder=1,language=1 (epd up passes the workers it started, so its frontend starts beside "
                    "them and answers only when all can serve); empty: open at once, /health saying what is missing")
    token_timeout: float = Field(120.0, gt=0, description="seconds a request may go without a token (the first "
                                                          "counted from its admission) before it fails: above the "
                                                          "longest prompt's prefill time")
    jobs: bool = Field(True, description="answer durable jobs from JetStream (<prefix>.jobs.submit); "
                                         "--no-jobs without JetStream")

    @field_validator("limit_mm_per_prompt")
    @classmethod
    def _every_kind(cls, value: dict[str, int]) -> dict[str, int]:
        return {**MEDIA_PER_PROMPT, **value}

    @property
    def text_only(self) -> bool:
        """No image and no video accepted (``epd up --encoders 0``): the stack needs no encoder."""
        return not any(self.limit_mm_per_prompt.values())
