"""Settings shared by every service: pydantic-settings, ``EPD_`` environment variables, CLI flags.

Each service extends ``CommonSettings`` with its own fields; ``parse_settings`` maps ``--kebab-case``
flags onto them (flags win over the environment), and an unknown flag or variable is an error. A bad
value or combination is a ``BadSettings``: one line that says what is wrong and what to do, which the
``epd`` command prints before it exits with status 2.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeVar

from pydantic import BaseModel, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, CliApp, CliSettingsSource, SettingsConfigDict, SettingsError

if TYPE_CHECKING:
    import torch

S = TypeVar("S", bound="CommonSettings")


class CommonSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EPD_", cli_kebab_case=True, cli_implicit_flags=True,
                                      extra="forbid", validate_default=True)

    nats_url: str = Field("nats://127.0.0.1:4222", description="NATS server URL(s), comma separated: every "
                                                               "service of a stack connects to the same server or "
                                                               "cluster")
    nats_user: str | None = Field(None, description="NATS user name, for a server that requires one (epd "
                                                    "credentials writes one per role)")
    nats_password: str | None = Field(None, description="NATS password of --nats-user")
    nats_creds: str | None = Field(None, description="path to a NATS credentials file (JWT and nkey), for servers "
                                                     "secured with decentralized auth")
    nats_tls_ca: str | None = Field(None, description="CA bundle to verify a TLS NATS server (tls:// URLs) signed "
                                                      "by a private CA")
    subject_prefix: str = Field("epd", description="prefix of every subject: give each stack its own to let "
                                                   "several share one NATS server")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="least severe log lines "
                                                                                       "written")
    log_format: Literal["console", "json"] = Field("console", description="console for people, json for log "
                                                                          "collectors")
    model: str = Field("", description="HF checkpoint directory, or a preset name with --load-format dummy; "
                                       "empty: the built-in tiny random model")
    load_format: Literal["auto", "dummy"] = Field("auto", description="dummy: random weights in the real "
                                                                      "architecture, for benchmarks without a "
                                                                      "download")
    device: str = Field("auto", description="torch device; auto: cuda if available, else cpu")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="auto: bf16 on GPU, fp32 on "
                                                                                        "CPU")
    transport: Literal["zmq", "ucx", "inproc"] = Field("zmq", description="data plane for tensors: zmq (TCP or a "
                                                                          "Unix socket), ucx (the ucx extra; "
                                                                          "RDMA/NVLink where the hardware has "
                                                                          "them), inproc (one process)")
    data_host: str = Field("127.0.0.1", description="interface the data plane (and the health endpoint) listens "
                                                    "on: 0.0.0.0 (or this host's address) when services run on "
                                                    "several hosts or in pods; ipc://DIR for a Unix socket between "
                                                    "processes of one host")
    data_advertise: str = Field("", description="address peers dial to pull from this data plane; default: "
                                                "data-host; auto: this host's outward IP (containers, pods)")
    data_max_mb: int = Field(8192, ge=1, description="tensors this process may hold for peers to pull (MiB): past "
                                                     "it, new work is refused as busy until consumers pull")
    data_cuda_ipc: bool = Field(True, description="zmq: a pull between processes on one GPU copies device to "
                                                  "device from the holder's memory (CUDA IPC) instead of through "
                                                  "host memory; --no-data-cuda-ipc where processes must not map "
                                                  "each other's memory")
    drain_seconds: float = Field(30.0, ge=0, description="on SIGTERM, time allowed for in-flight work before the "
                                                         "process exits anyway")
    health_port: int = Field(0, ge=0, le=65535, description="port of the health endpoint (GET /live, GET /ready) "
                                                            "for an orchestrator's probes, on --data-host; 0: off")

    @field_validator("subject_prefix")
    @classmethod
    def _token(cls, value: str) -> str:
        if not value or any(c in value for c in " .*>\t\r\n"):
            raise ValueError("subject prefix must be one NATS token (no spaces, dots or wildcards)")
        return value

    def torch_device(self) -> "torch.device":
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def apply_torch_threads(self) -> None:
        """One CPU thread an operation for torch in a process on a GPU, as vLLM runs its workers, unless
        ``OMP_NUM_THREADS`` says otherwise: the compute is on the device, and each short host-side
        operation in torch's default of a thread per core is a parallel region that ends with its slowest
        thread, which a host shared by a stack's processes deschedules. On a CPU, torch's own default."""
        if "OMP_NUM_THREADS" not in os.environ and self.torch_device().type == "cuda":
            import torch

            torch.set_num_threads(1)

    def torch_dtype(self) -> "torch.dtype":
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return getattr(torch, self.dtype)

    def model_path(self) -> Path:
        """The checkpoint directory: the built-in tiny model, a dummy preset, or the given path."""
        from shared.model.presets import PRESETS, TINY_DIR, cache_dir, materialize_preset

        if not self.model:
            if (cache_dir() / TINY_DIR / "config.json").exists():
                return cache_dir() / TINY_DIR
            from shared.model.tiny import default_tiny_checkpoint  # torch and transformers: only to write it

            return default_tiny_checkpoint()
        if self.load_format == "dummy" and self.model in PRESETS:
            return materialize_preset(self.model)
        path = Path(self.model).expanduser()
        if not (path / "config.json").is_file():
            raise ValueError(f"--model {self.model!r} is not a checkpoint directory (no config.json)"
                             + (f"; presets for --load-format dummy: {', '.join(PRESETS)}" if self.model else ""))
        return path

    def nats_options(self) -> dict:
        return {"servers": [s.strip() for s in self.nats_url.split(",") if s.strip()],
                **nats_auth(self.nats_user, self.nats_password, self.nats_creds, self.nats_tls_ca)}


def nats_auth(user: str | None, password: str | None, creds: str | None, tls_ca: str | None) -> dict:
    """``nats.connect``'s options for a server's users, credentials file and TLS CA (those given)."""
    options: dict = {}
    if user:
        options.update(user=user, password=password or "")
    if creds:
        options["user_credentials"] = creds
    if tls_ca:
        import ssl

        options["tls"] = ssl.create_default_context(cafile=tls_ca)
    return options


class ModelLength(BaseModel):
    """The context, for the services that size or check prompts with it (the frontend, every engine)."""

    max_model_len: int = Field(0, ge=0, description="longest sequence (prompt + output) accepted, in tokens; lower "
                                                    "it to fit a smaller KV cache; 0: the model's limit")


class MediaLimits(BaseModel):
    """What one image or clip may be at most: the frontend refuses larger ones, and so do encoders (a NATS
    client may send them jobs directly)."""

    max_image_pixels: int = Field(40_000_000, ge=1, description="largest decoded image (or video frame) "
                                                                "accepted (pixels)")
    max_video_frames: int = Field(256, ge=1, description="sampled frames of one video accepted at most (the "
                                                         "processor samples 2 a second)")


class JobLimit(BaseModel):
    """How much a worker takes on at once from its queue group."""

    max_concurrent_jobs: int = Field(256, ge=1, description="requests of each kind (encode jobs, prompts, KV "
                                                            "hand-offs) this worker handles at once; more wait "
                                                            "in NATS for a worker with room: lower it to spread "
                                                            "bursts over more workers")


class CudaGraphs(BaseModel):
    """CUDA graphs, captured at start-up (decode steps, prefill steps and ViT forwards between their
    attentions, recurring ViT layouts whole)."""

    enforce_eager: bool = Field(False, description="never capture CUDA graphs (decode and prefill steps, ViT "
                                                   "forwards): quicker start-up and less memory, slower steps; "
                                                   "for debugging")


class GpuMemory(BaseModel):
    """How much of a GPU's memory to take."""

    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="share of each GPU's memory to take: a "
                                          "language worker's own (weights, graphs, working room, then the KV pool "
                                          "from what is left); for epd up the whole stack's, divided among the "
                                          "processes it places on one GPU")


class BadSettings(ValueError):
    """A bad option, value or combination, in one line: what is wrong and what to do."""


def parse_settings(cls: type[S], args: list[str] | None, prog: str) -> S:
    """Settings from the environment overridden by CLI ``args`` (``None``: environment only)."""
    try:
        if args is None:
            return cls()
        source = CliSettingsSource(cls, cli_prog_name=prog, cli_kebab_case=True, cli_implicit_flags=True,
                                   cli_exit_on_error=False)
        return CliApp.run(cls, cli_args=args, cli_settings_source=source)
    except ValidationError as err:
        raise BadSettings(f"{prog}: {_problem(err)}") from None
    except SettingsError as err:
        raise BadSettings(f"{prog}: {str(err).removeprefix('error parsing CLI: ')} (`{prog} --help` lists "
                          "the options)") from None


def _problem(err: ValidationError) -> str:
    """The first problem pydantic found, in the options' own terms (``--port 'abc': ...``)."""
    errors = err.errors()
    first = errors[0]
    message = first["msg"].removeprefix("Value error, ")
    field = str(first["loc"][0]) if first.get("loc") else ""
    if field and not message.startswith(f"--{field.replace('_', '-')}"):
        given = f" {first['input']!r}" if isinstance(first.get("input"), (str, int, float)) else ""
        message = f"--{field.replace('_', '-')} (EPD_{field.upper()}){given}: {message}"
    return message + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else "")
