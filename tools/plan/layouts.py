"""The layouts ``epd plan`` weighs: which processes run, on how many GPUs, sharing them how.

- aggregated: one process per GPU that encodes, prefills and decodes with one engine (its ViT runs in
  the engine thread, one batch between two engine steps);
- colocated: on every GPU an encoder and the language side — joined (E/PD: one language worker that
  prefills and decodes) or split (E/P/D: a prefill and a decode worker) — sharing the GPU either through
  CUDA MPS (kernels of the processes run side by side) or time-sliced (without MPS);
- disaggregated: encoders on GPUs of their own; the language side on the others, joined, split with a
  prefill and a decode worker sharing each LM GPU, or split over prefill GPUs and decode GPUs.

``label`` is the name ``bench/epd_vs_aggregated.py`` gives the same stack, and ``up_args`` the
``epd up`` flags that start it, so a benchmark and the planner never disagree about what ran.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Layout:
    topology: Literal["aggregated", "colocated", "disaggregated"]
    gpus: int
    pd: Literal["joined", "split"] = "joined"  # the language side; aggregated is joined by nature
    mps: bool = False  # processes sharing a GPU run side by side (CUDA MPS) instead of time-slicing it
    encoder_gpus: int = 0  # disaggregated: GPUs holding one encoder each
    prefill_gpus: int = 0  # disaggregated split: prefill GPUs (0 with decode_gpus 0: P and D share each LM GPU)
    decode_gpus: int = 0

    def __post_init__(self):
        if self.gpus < 1:
            raise ValueError("a layout needs at least one GPU")
        if self.topology == "disaggregated":
            if not 1 <= self.encoder_gpus < self.gpus:
                raise ValueError("disaggregated: encoders need GPUs of their own and leave at least one for the LM")
            if self.prefill_gpus + self.decode_gpus not in (0, self.lm_gpus) or \
                    (self.prefill_gpus > 0) != (self.decode_gpus > 0):
                raise ValueError("disaggregated split: prefill + decode GPUs must be 0 (shared) or every LM GPU")

    @property
    def lm_gpus(self) -> int:
        return self.gpus - self.encoder_gpus if self.topology == "disaggregated" else self.gpus

    @property
    def shared_pd(self) -> bool:
        """Prefill and decode workers side by side on one GPU (split, not on GPUs of their own)."""
        return self.pd == "split" and self.prefill_gpus == 0 and self.topology != "aggregated"

    @property
    def encoders(self) -> int:
        return {"aggregated": 0, "colocated": self.gpus, "disaggregated": self.encoder_gpus}[self.topology]

    @property
    def processes(self) -> int:
        if self.topology == "aggregated":
            return self.gpus
        lm = self.lm_gpus * (2 if self.shared_pd else 1) if not self.prefill_gpus else \
            self.prefill_gpus + self.decode_gpus
        return self.encoders + lm

    @property
    def shares_gpu(self) -> bool:
        """Whether any GPU runs more than one worker process (MPS then matters)."""
        return self.topology == "colocated" or self.shared_pd

    def label(self) -> str:
        times = f" x{self.gpus}" if self.gpus > 1 else ""
        mps = "+MPS" if self.mps and self.shares_gpu else ""
        side = "E/PD" if self.pd == "joined" else "E/P/D"
        if self.topology == "aggregated":
            return f"aggregated{times}"
        if self.topology == "colocated":
            return f"{side}{times}{mps}"
        lm = f"{self.lm_gpus}LM" if not self.prefill_gpus else f"{self.prefill_gpus}P+{self.decode_gpus}D"
        return f"{side} disagg {self.encoder_gpus}E+{lm}{mps}"  # GPUs: encoders', then LM (or P and D) ones

    def up_args(self, mps_flag: str = "on") -> list[str]:
        """``epd up`` flags for this layout on GPUs 0..gpus-1; ``mps_flag``: what ``+MPS`` asks for
        (``on`` insists on a daemon; ``auto`` where there may be none, as on CPU)."""
        every = _ids(0, self.gpus)
        if self.topology == "aggregated":
            return ["--topology", "aggregated"] + (["--aggregated", str(self.gpus), "--gpus", every]
                                                   if self.gpus > 1 else [])
        mps = ["--mps", mps_flag if self.mps else "off"]
        if self.topology == "colocated":
            gpus = ["--gpus", every] if self.gpus > 1 else []
            return ["--topology", "colocated", "--pd", self.pd, "--encoders", str(self.gpus),
                    *self._lm_counts(self.gpus), *gpus, *mps]
        encoders = ["--encoders", str(self.encoder_gpus), "--encoder-gpus", _ids(self.lm_gpus, self.gpus)]
        lm = _ids(0, self.lm_gpus)
        if self.pd == "joined":
            placed = ["--languages", str(self.lm_gpus), "--language-gpus", lm]
        elif self.shared_pd:
            placed = [*self._lm_counts(self.lm_gpus), "--prefill-gpus", lm, "--decode-gpus", lm]
        else:
            placed = ["--prefills", str(self.prefill_gpus), "--decodes", str(self.decode_gpus),
                      "--prefill-gpus", _ids(0, self.prefill_gpus),
                      "--decode-gpus", _ids(self.prefill_gpus, self.lm_gpus)]
        return ["--topology", "disaggregated", "--pd", self.pd, *encoders, *placed, *mps]

    def _lm_counts(self, n: int) -> list[str]:
        return ["--languages", str(n)] if self.pd == "joined" else ["--prefills", str(n), "--decodes", str(n)]


def _ids(start: int, stop: int) -> str:
    return ",".join(str(g) for g in range(start, stop))


def layouts(gpus: int) -> list[Layout]:
    """Every layout the planner weighs on ``gpus`` GPUs."""
    out = [Layout("aggregated", gpus)]
    out += [Layout("colocated", gpus, pd, mps) for pd in ("joined", "split") for mps in (False, True)]
    for encoder_gpus in range(1, gpus):
        lm = gpus - encoder_gpus
        out.append(Layout("disaggregated", gpus, "joined", False, encoder_gpus))
        out += [Layout("disaggregated", gpus, "split", mps, encoder_gpus) for mps in (False, True)]
        out += [Layout("disaggregated", gpus, "split", False, encoder_gpus, p, lm - p) for p in range(1, lm)]
    return out


def bench_layouts(gpus: int) -> list[Layout]:
    """The layouts bench/epd_vs_aggregated.py runs by default: on one GPU every way of sharing it; on
    more, the replicated layouts with MPS and encoders on GPUs of their own."""
    if gpus <= 1:
        return [Layout("aggregated", 1), Layout("colocated", 1, "joined", False), Layout("colocated", 1, "joined", True),
                Layout("colocated", 1, "split", False), Layout("colocated", 1, "split", True)]
    out = [Layout("aggregated", gpus), Layout("colocated", gpus, "joined", True),
           Layout("colocated", gpus, "split", True)]
    encoder_gpus = max(1, gpus // 4)
    out.append(Layout("disaggregated", gpus, "joined", False, encoder_gpus))
    if gpus == 2:
        out.append(Layout("disaggregated", gpus, "split", True, 1))  # P and D side by side on GPU 0
    else:
        out.append(Layout("disaggregated", gpus, "split", False, gpus - 2, 1, 1))
    return out
