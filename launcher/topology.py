"""What ``epd up`` runs: which worker processes, on which GPUs.

Placement (``--topology``) and the language side (``--pd``) are independent choices:
- ``aggregated``: ``--aggregated N`` processes that each encode, prefill and decode with one engine;
- ``colocated``: encoders and language workers share the GPUs of ``--gpus`` (through CUDA MPS when it
  is there, see ``mps.py``);
- ``disaggregated``: each kind on GPUs of its own (``--encoder-gpus 1,2 --language-gpus 0``).
- ``--pd joined`` (E/PD): language workers that prefill and decode (``--languages N``), fed by the
  encoders; ``--pd split`` (E/P/D): prefill workers (``--prefills``) stream KV to decode workers
  (``--decodes``).
Each process gets ``CUDA_VISIBLE_DEVICES`` from its kind's list, round-robin over its replicas (a list
left empty falls back to ``--gpus``; both empty: inherited).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Literal

from pydantic import Field, field_validator, model_validator

from shared.settings import CommonSettings

KINDS = ("encoder", "prefill", "decode", "language", "aggregated", "frontend")
WORKER_KINDS = KINDS[:-1]
_COUNT_OF = {"encoder": "encoders", "prefill": "prefills", "decode": "decodes", "language": "languages",
             "aggregated": "aggregated"}


@dataclass(frozen=True)
class Placement:
    kind: str
    gpu: str | None  # CUDA_VISIBLE_DEVICES of the process; None: inherited
    sm_share: int | None = None  # under MPS: percent of the GPU's SMs this process may use
    memory: tuple[tuple[str, str], ...] = ()  # its share of a GPU it shares (launcher/memory.py), as EPD_* variables

    def env(self) -> dict[str, str]:
        env = {} if self.gpu is None else {"CUDA_VISIBLE_DEVICES": self.gpu}
        if self.sm_share is not None:
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(self.sm_share)
        return {**env, **dict(self.memory)}


@dataclass(frozen=True)
class EncoderScale:
    """``--encoders N`` (fixed) or ``MIN:MAX`` (the launcher scales the tier between the two)."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> "EncoderScale":
        low, sep, high = str(text).partition(":")
        try:
            scale = cls(int(low), int(high) if sep else int(low))
        except ValueError:
            raise ValueError(f"--encoders {text!r}: a count (2) or a range MIN:MAX (1:4)") from None
        if scale.low < 0 or scale.high < scale.low:
            raise ValueError(f"--encoders {text!r}: need 0 <= MIN <= MAX")
        return scale

    @property
    def autoscaled(self) -> bool:
        return self.high > self.low


class TopologySettings(CommonSettings):
    topology: Literal["aggregated", "colocated", "disaggregated"] = Field(
        "colocated", description="aggregated: processes doing E+P+D each with one engine (the baseline); "
                                 "colocated: encoders and language workers on the same GPUs (--gpus); "
                                 "disaggregated: each kind on GPUs of its own (--encoder-gpus, ...)")
    pd: Literal["joined", "split"] = Field(
        "joined", description="joined (E/PD): language workers that prefill and decode; split (E/P/D): prefill "
                              "workers stream KV to decode workers")
    encoders: str = Field("1", description="encoder processes: N, or MIN:MAX to scale the tier with load "
                                           "(0: text only; image and video parts get a 400)")
    languages: int = Field(1, ge=1, description="--pd joined: language workers (prefill + decode)")
    prefills: int = Field(1, ge=1, description="--pd split: prefill workers")
    decodes: int = Field(1, ge=1, description="--pd split: decode workers")
    aggregated: int = Field(1, ge=1, description="--topology aggregated: E+P+D processes")
    gpus: str = Field("", description="GPU ids (CUDA_VISIBLE_DEVICES, comma separated) the workers share, "
                                      "round-robin over replicas; empty: inherit CUDA_VISIBLE_DEVICES")
    encoder_gpus: str = Field("", description="disaggregated: the encoders' GPUs (default: --gpus)")
    language_gpus: str = Field("", description="disaggregated: the language workers' GPUs (default: --gpus)")
    prefill_gpus: str = Field("", description="disaggregated: the prefill workers' GPUs (default: --gpus)")
    decode_gpus: str = Field("", description="disaggregated: the decode workers' GPUs (default: --gpus)")

    @field_validator("encoders")
    @classmethod
    def _encoders(cls, value: str) -> str:
        EncoderScale.parse(value)
        return value

    @model_validator(mode="after")
    def _placement(self) -> "TopologySettings":
        gpu_fields = ("gpus", "encoder_gpus", "language_gpus", "prefill_gpus", "decode_gpus")
        for name in gpu_fields:
            if any(not g or not g.replace("-", "").isalnum() for g in _split(getattr(self, name))):
                raise ValueError(f"--{_flag(name)} must be GPU ids separated by commas, e.g. 0,1")
        per_kind = [n for n in gpu_fields[1:] if getattr(self, n)]
        if per_kind and self.topology != "disaggregated":
            raise ValueError(f"--{_flag(per_kind[0])} places one kind of worker: it is for --topology "
                             f"disaggregated; {self.topology} puts every worker on --gpus")
        given = self.model_fields_set
        if self.topology == "aggregated":
            if wrong := [f for f in ("encoders", "languages", "prefills", "decodes", "pd") if f in given]:
                raise ValueError(f"--{_flag(wrong[0])} does not apply to --topology aggregated; use --aggregated N")
        elif "aggregated" in given:
            raise ValueError("--aggregated N is for --topology aggregated")
        if self.pd == "joined" and (wrong := [f for f in ("prefills", "decodes") if f in given]):
            raise ValueError(f"--{_flag(wrong[0])} is for --pd split; --pd joined runs --languages N")
        if self.pd == "split" and "languages" in given:
            raise ValueError("--languages is for --pd joined; --pd split runs --prefills and --decodes")
        return self

    @property
    def encoder_scale(self) -> EncoderScale:
        return EncoderScale.parse(self.encoders)

    @property
    def text_only(self) -> bool:
        """No encoder will ever run (``--encoders 0``): the stack serves text only."""
        return self.topology != "aggregated" and self.encoder_scale.high == 0

    def worker_counts(self) -> dict[str, int]:
        """How many processes of each worker kind to start (autoscaled encoders: the minimum)."""
        if self.topology == "aggregated":
            return {"aggregated": self.aggregated}
        language = {"language": self.languages} if self.pd == "joined" else \
            {"prefill": self.prefills, "decode": self.decodes}
        return {"encoder": self.encoder_scale.low, **language}

    def gpu_list(self, kind: str) -> list[str]:
        """The GPUs ``kind``'s replicas take turns on (empty: leave CUDA_VISIBLE_DEVICES as inherited)."""
        own = getattr(self, f"{kind}_gpus", "") if self.topology == "disaggregated" else ""
        return _split(own or self.gpus)

    def placement(self, kind: str, replica: int) -> Placement:
        gpus = self.gpu_list(kind)
        return Placement(kind, gpus[replica % len(gpus)] if gpus else None)

    def placements(self) -> list[Placement]:
        """Every worker process at start (the frontend aside), with its GPU."""
        return [self.placement(kind, i) for kind, n in self.worker_counts().items() for i in range(n)]

    def placements_at_most(self) -> list[Placement]:
        """Every worker process there may be (autoscaled encoders at MAX), with its GPU."""
        counts = dict(self.worker_counts())
        if "encoder" in counts:
            counts["encoder"] = self.encoder_scale.high
        return [self.placement(kind, i) for kind, n in counts.items() for i in range(n)]

    def shared_gpus(self) -> list[str | None]:
        """GPUs that more than one worker process would use at the most."""
        use = Counter(p.gpu for p in self.placements_at_most())
        return [gpu for gpu, n in use.items() if n > 1]


def _split(ids: str) -> list[str]:
    return [g.strip() for g in ids.split(",")] if ids.strip() else []


def _flag(field: str) -> str:
    return field.replace("_", "-")
