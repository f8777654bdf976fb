"""CUDA MPS for the processes that share a GPU: one control daemon of the stack's own.

Without MPS, processes on one GPU time-slice it (each gets the whole GPU for a slice, then waits);
with it, their kernels run side by side as streams of one context would (measured on one H200:
TTFT −31 % and −33 % at two loads, docs/architecture.md). ``--mps auto`` starts a daemon when more than one worker process
shares a GPU and the control binary exists; ``on`` insists (and fails clearly without it); ``off``
never. The daemon runs in the foreground as the launcher's child (so it dies with the launcher), with
its pipe and log directories in the stack's private temp dir; children find it through
``CUDA_MPS_PIPE_DIRECTORY`` / ``CUDA_MPS_LOG_DIRECTORY``. Optional per-kind shares of the SMs
(``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``) come from ``--mps-shares encoder=40,language=100``.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from launcher.processes import detach
from shared.logging import get_logger

log = get_logger(__name__)

CONTROL = "nvidia-cuda-mps-control"


def gpus_present() -> bool:
    return Path("/dev/nvidiactl").exists() or any(Path("/dev").glob("nvidia[0-9]*"))


def decide(mode: str, shared_gpus: list, device: str) -> tuple[bool, str]:
    """Whether to run a daemon, and why (logged)."""
    if mode == "off":
        return False, "--mps off"
    binary = shutil.which(CONTROL)
    if mode == "on":
        if binary is None:
            raise RuntimeError(f"--mps on, but {CONTROL} is not on PATH (install the NVIDIA driver utilities, "
                               "or use --mps auto/off)")
        return True, "--mps on"
    if device == "cpu" or not gpus_present():
        return False, "no GPU"
    if not shared_gpus:
        return False, "no GPU is shared by two worker processes"
    if binary is None:
        return False, f"{CONTROL} not found: processes sharing a GPU will time-slice it"
    return True, f"{len(shared_gpus)} GPU(s) shared by several worker processes"


def parse_shares(text: str) -> dict[str, int]:
    """``encoder=40,language=100`` → {kind: percentage}."""
    shares = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        kind, sep, value = item.partition("=")
        if not sep or not value.isdigit() or not 1 <= int(value) <= 100:
            raise ValueError(f"--mps-shares {text!r}: use KIND=PERCENT pairs, e.g. encoder=40,language=100")
        shares[kind.strip()] = int(value)
    return shares


class MpsDaemon:
    def __init__(self, workdir: Path, gpus: str = ""):
        self.pipe = workdir / "mps-pipe"
        self.logs = workdir / "mps-log"
        self.gpus = gpus  # CUDA_VISIBLE_DEVICES of the daemon: every GPU a worker uses ("" inherited)
        self.process: subprocess.Popen | None = None

    def env(self) -> dict[str, str]:
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe), "CUDA_MPS_LOG_DIRECTORY": str(self.logs)}

    def start(self, timeout: float = 10.0) -> None:
        for directory in (self.pipe, self.logs):
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        env = {**self._base_env(), **self.env(), **({"CUDA_VISIBLE_DEVICES": self.gpus} if self.gpus else {})}
        self.process = subprocess.Popen([shutil.which(CONTROL) or CONTROL, "-f"], env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        preexec_fn=detach)
        deadline = time.monotonic() + timeout
        while not (self.pipe / "control").exists():
            if self.process.poll() is not None:
                raise RuntimeError(f"{CONTROL} exited with status {self.process.returncode}; see {self.logs}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{CONTROL} did not open its control pipe in {timeout:g}s")
            time.sleep(0.05)
        log.info("stack.mps_started", pipe=str(self.pipe), pid=self.process.pid)

    def stop(self, timeout: float = 10.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        try:
            subprocess.run([shutil.which(CONTROL) or CONTROL], input=b"quit\n", env={**self._base_env(), **self.env()},
                           timeout=timeout, capture_output=True)
            self.process.wait(timeout)
        except (subprocess.TimeoutExpired, OSError):
            self.process.kill()
            self.process.wait()
        log.info("stack.mps_stopped")

    @staticmethod
    def _base_env() -> dict[str, str]:
        import os

        return dict(os.environ)
