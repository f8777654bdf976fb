"""Settings shared by every service: pydantic-settings, ``EPD_`` environment variables, CLI flags.

Each service extends ``CommonSettings`` with its own fields; ``parse_settings`` maps ``--kebab-case``
flags onto them (flags win over the environment), and an unknown flag or variable is an error.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeVar

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, CliApp, CliSettingsSource, SettingsConfigDict

if TYPE_CHECKING:
    import torch

S = TypeVar("S", bound="CommonSettings")


class CommonSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EPD_", cli_kebab_case=True, cli_implicit_flags=True,
                                      extra="forbid", validate_default=True)

    nats_url: str = Field("nats://127.0.0.1:4222", description="NATS server URL(s), comma separated")
    nats_user: str | None = Field(None, description="NATS user name")
    nats_password: str | None = Field(None, description="NATS password")
    nats_creds: str | None = Field(None, description="path to a NATS credentials file")
    nats_tls_ca: str | None = Field(None, description="CA bundle to verify a TLS NATS server")
    subject_prefix: str = Field("epd", description="prefix of every subject, so stacks can share one NATS")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["console", "json"] = Field("console", description="console for people, json for collectors")
    model: str = Field("", description="HF checkpoint directory, or a preset name with --load-format dummy; "
                                       "empty: the built-in tiny random model")
    load_format: Literal["auto", "dummy"] = Field("auto", description="dummy: random weights, real architecture")
    device: str = Field("auto", description="torch device; auto: cuda if available, else cpu")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="auto: bf16 on GPU, fp32 on CPU")
    transport: Literal["zmq", "ucx", "inproc"] = Field("zmq", description="data plane for tensors")
    data_host: str = Field("127.0.0.1", description="interface the data plane listens on")
    data_advertise: str = Field("", description="address peers use to reach this data plane; default: data-host; auto: this host's outward IP")
    data_max_mb: int = Field(8192, ge=1, description="bytes this process may hold for peers to pull (MiB)")
    lease_seconds: float = Field(60.0, gt=0, description="a tensor not pulled within this time is freed")
    data_cuda_ipc: bool = Field(True, description="zmq: a pull between processes on one GPU maps the holder's "
                                                  "memory (CUDA IPC) instead of copying through host memory")
    data_cuda_ipc_pool_mb: int = Field(256, ge=0, description="zmq: GPU memory a holder stages same-GPU pulls in, "
                                       "mapped once by each consumer (MiB per GPU, allocated at the first such "
                                       "pull); 0, or a tensor that does not fit: it maps the tensor's own block "
                                       "for each pull")
    drain_seconds: float = Field(30.0, ge=0, description="on SIGTERM, time allowed for in-flight work")
    health_port: int = Field(0, ge=0, le=65535, description="port of the health endpoint (GET /live, GET /ready); "
                                                            "0: off")
    health_host: str = Field("127.0.0.1", description="interface of the health endpoint; pods set 0.0.0.0 so "
                                                      "the kubelet can probe it")

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
        from shared.model.presets import PRESETS, materialize_preset

        if not self.model:
            from shared.model.tiny import default_tiny_checkpoint  # torch and transformers: only when needed

            return default_tiny_checkpoint()
        if self.load_format == "dummy" and self.model in PRESETS:
            return materialize_preset(self.model)
        path = Path(self.model).expanduser()
        if not (path / "config.json").is_file():
            raise ValueError(f"--model {self.model!r} is not a checkpoint directory (no config.json)"
                             + (f"; presets for --load-format dummy: {', '.join(PRESETS)}" if self.model else ""))
        return path

    def nats_options(self) -> dict:
        options: dict = {"servers": [s.strip() for s in self.nats_url.split(",") if s.strip()]}
        if self.nats_user:
            options.update(user=self.nats_user, password=self.nats_password or "")
        if self.nats_creds:
            options["user_credentials"] = self.nats_creds
        if self.nats_tls_ca:
            import ssl

            options["tls"] = ssl.create_default_context(cafile=self.nats_tls_ca)
        return options


def parse_settings(cls: type[S], args: list[str] | None, prog: str) -> S:
    """Settings from the environment overridden by CLI ``args`` (``None``: environment only)."""
    if args is None:
        return cls()
    source = CliSettingsSource(cls, cli_prog_name=prog, cli_kebab_case=True, cli_implicit_flags=True)
    return CliApp.run(cls, cli_args=args, cli_settings_source=source)
