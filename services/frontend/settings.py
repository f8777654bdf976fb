"""Frontend settings (``EPD_`` environment variables or ``epd frontend --flags``)."""

from __future__ import annotations

from pydantic import Field, model_validator

from shared.settings import CommonSettings


class FrontendSettings(CommonSettings):
    host: str = Field("127.0.0.1", description="HTTP listen address (0.0.0.0 to serve other machines)")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port")
    served_model_name: str = Field("", description="model name clients use; default: the checkpoint's name")
    max_model_len: int = Field(0, ge=0, description="longest prompt + output accepted; 0: the model's limit")
    max_concurrent_requests: int = Field(256, ge=1, description="requests in flight; more get 429")
    max_images_per_request: int = Field(16, ge=0, description="image parts one request may carry")
    max_image_bytes: int = Field(20 << 20, ge=1, description="encoded size of one image at most")
    max_image_pixels: int = Field(40_000_000, ge=1, description="decoded size of one image at most (pixels)")
    max_image_embeds_bytes: int = Field(64 << 20, ge=1, description="size of one image's precomputed embeddings "
                                                                   "(an image_embeds part's rows, decoded) at most")
    max_body_bytes: int = Field(128 << 20, ge=1024, description="HTTP request body at most")
    max_output_tokens: int = Field(16384, ge=1, description="max_tokens a client may ask for; also the default "
                                                            "when it gives none (bounded by the rest of the context)")
    media_threads: int = Field(4, ge=1, description="threads decoding images")
    fetch_timeout: float = Field(10.0, gt=0, description="seconds to fetch one image URL")
    allowed_media_domains: list[str] = Field(default_factory=list,
                                             description="if set, only these hosts (and subdomains) are fetched")
    allow_http_media: bool = Field(True, description="fetch plain http:// image URLs too (public addresses only, "
                                                     "as for https); --no-allow-http-media: https only")
    allow_private_media: bool = Field(False, description="fetch from private/loopback addresses (tests, labs)")
    local_media_dir: str = Field("", description="directory file:// image URLs may read from; empty: file:// off")
    encode_timeout: float = Field(60.0, gt=0, description="seconds one encode attempt may take")
    encoder_load_margin: int = Field(0, ge=0, description="images an image's cache-favourite encoder may have in "
                                                          "flight beyond the least-loaded one and still get it")
    encode_attempts: int = Field(3, ge=1, description="tries per image when an encoder fails or vanishes")
    prefill_timeout: float = Field(30.0, gt=0, description="seconds for prefill to accept a request")
    first_token_timeout: float = Field(120.0, gt=0, description="seconds from admission to the first token")
    token_timeout: float = Field(60.0, gt=0, description="seconds between two tokens before the request fails")
    resume_attempts: int = Field(2, ge=0, description="times a request whose prefill/decode worker died is "
                                                      "resumed on other workers")
    jobs: bool = Field(True, description="answer durable jobs from JetStream (<prefix>.jobs.submit); "
                                         "needs a NATS server with JetStream")
    job_concurrency: int = Field(8, ge=1, description="jobs this frontend runs at once")
    job_ack_wait: float = Field(60.0, ge=1, description="seconds without a progress signal before JetStream "
                                                        "hands a job to another frontend")
    job_retry_delay: float = Field(1.0, gt=0, description="seconds before a job that failed transiently (no "
                                                          "workers yet, timeout, 429, 5xx) is retried; doubles "
                                                          "each attempt")
    job_retry_max_delay: float = Field(30.0, gt=0, description="longest delay between two attempts of a job")
    job_max_attempts: int = Field(0, ge=0, description="attempts before a transiently failing job gets an error "
                                                       "result; 0: retry until the stack can answer it")
    result_max_age: float = Field(24 * 3600.0, gt=0, description="seconds job results are kept in JetStream")

    # -- video ---------------------------------------------------------------------------------------
    max_videos_per_request: int = Field(4, ge=0, description="video parts one request may carry")
    max_video_bytes: int = Field(64 << 20, ge=1, description="encoded size of one video at most")
    max_video_seconds: float = Field(600.0, gt=0, description="length of one video at most (seconds)")
    max_video_fps: float = Field(240.0, gt=0, description="frame rate of a video at most (frames per second)")
    max_video_frames: int = Field(256, ge=1, description="frames one video may sample at most (the processor "
                                                         "samples 2 a second by default)")
    max_video_frame_pixels: int = Field(3840 * 2160, ge=1, description="size of one video frame at most (pixels)")
    max_video_tokens: int = Field(65536, ge=1, description="placeholder tokens of all the videos of one "
                                                           "request at most")
    video_decode_timeout: float = Field(60.0, gt=0, description="seconds to decode one video at most")

    @model_validator(mode="after")
    def _retry_delays(self) -> "FrontendSettings":
        if self.job_retry_max_delay < self.job_retry_delay:
            raise ValueError(f"job-retry-max-delay ({self.job_retry_max_delay:g}) must be at least "
                             f"job-retry-delay ({self.job_retry_delay:g})")
        return self
