"""How much two *processes* slow each other on one GPU without MPS (the GPU time-slices their contexts):
a child process runs ViT forwards in a loop while this process runs decode steps (or a prefill), each
against alone. ``costs.py``'s co-run measures two streams of one process, what MPS comes close to;
this measures what the stacks get with ``--mps off``.

The child speaks a line protocol on its stdin/stdout: it loads the vision tower and prints ``ready``;
on ``go`` it calls its forward in a loop, measures ms per call over the first ``seconds``, keeps
looping until ``stop`` (so the parent's loop never runs without it), then prints the figure; ``quit``
ends it. It is started first, so its start-up overlaps the parent's loading of the language model.

    python -m tools.plan.timeslice --resolution 448x448 --images 10 --seconds 1 [model flags]
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

from pydantic import Field

from shared.settings import CommonSettings, parse_settings


class ChildSettings(CommonSettings):
    resolution: str = Field(description="WIDTHxHEIGHT of the images")
    images: int = Field(1, ge=1, description="images per forward")
    seconds: float = Field(1.0, gt=0, description="seconds each loop is measured over")
    preprocess: str = Field("auto", description="where the encoders preprocess (as epd encoder)")


class ViTChild:
    """The child process, from the parent's side."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None):
        self.process = subprocess.Popen([sys.executable, "-m", "tools.plan.timeslice", *args], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=env)

    def _expect(self, ready: bool = False) -> str:
        """The child's next protocol line (``ready``, or a figure): what else it prints (logs) is skipped."""
        while line := self.process.stdout.readline():
            line = line.strip()
            if line == "ready" if ready else _is_number(line):
                return line
        raise RuntimeError(f"the ViT child exited ({self.process.poll()})")

    def wait_ready(self) -> None:
        self._expect(ready=True)

    def _send(self, command: str) -> None:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def alone(self, seconds: float) -> float:
        self._send("go")
        time.sleep(seconds * 1.2)
        self._send("stop")
        return float(self._expect())

    def beside(self, fn: Callable[[], object], sync: Callable[[], None], seconds: float) -> tuple[float, float]:
        """(the child's ms per forward, ``fn``'s ms per call) with both running."""
        self._send("go")
        time.sleep(0.05)  # its loop under way
        start = time.perf_counter()
        mine = loop_ms(fn, sync, seconds)
        time.sleep(max(0.0, seconds * 1.1 - (time.perf_counter() - start)))  # its measuring window is over too
        self._send("stop")
        return float(self._expect()), mine

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self._send("quit")
                self.process.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def loop_ms(fn: Callable[[], object], sync: Callable[[], None], seconds: float) -> float:
    """ms per call of ``fn`` (synchronised each time) over a loop of at least ``seconds``."""
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        fn()
        sync()
        calls += 1
    return (time.perf_counter() - start) / calls * 1e3


@contextlib.contextmanager
def vit_child(settings, resolution: str, images: int) -> Iterator[ViTChild | None]:
    """The ViT child for ``settings`` (model flags, ``corun_seconds``, ``preprocess``), started now (it
    loads while the caller does), stopped on leaving; None when co-run measurements are off (or there
    are no images)."""
    child = None
    if settings.corun_seconds > 0 and images > 0:
        child = ViTChild(["--resolution", resolution, "--images", str(images), "--seconds",
                          str(settings.corun_seconds), "--preprocess", settings.preprocess, "--model", settings.model,
                          "--load-format", settings.load_format, "--device", settings.device])
    try:
        yield child
    finally:
        if child is not None:
            child.close()


def ready_or_none(child: ViTChild | None) -> ViTChild | None:
    """The child once it is ready (idle from then on: nothing timed alone may share the GPU with it), or
    None when it failed — the measurements it serves are optional (the planner then models them)."""
    if child is None:
        return None
    try:
        child.wait_ready()
        return child
    except RuntimeError as err:
        print(f"no time-slicing measurement: {err}", file=sys.stderr, flush=True)
        child.close()
        return None


def measure_timeslice(child: ViTChild, engine, decode_batch: int, prompt: Callable[[], object],
                      seconds: float) -> dict[str, float]:
    """{"ts:vit|decode", "ts:decode|vit", "ts:vit|prefill", "ts:prefill|vit": slowdown beside / alone},
    ``engine`` an ``EngineProbe``, ``prompt`` one of its prefills."""
    import torch

    device = engine.engine.runner.device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    vit_alone = child.alone(seconds)
    out = {}
    with engine.decoding(decode_batch, min(1024, engine.engine.max_model_len // 2)) as step:
        alone = loop_ms(step, sync, seconds)
        vit, mine = child.beside(step, sync, seconds)
        out["ts:vit|decode"], out["ts:decode|vit"] = vit / vit_alone, mine / alone
    alone = loop_ms(prompt, sync, seconds)
    vit, mine = child.beside(prompt, sync, seconds)
    out["ts:vit|prefill"], out["ts:prefill|vit"] = vit / vit_alone, mine / alone
    return out


def child_main(argv: list[str]) -> int:
    import torch

    from shared.model.config import ModelConfig
    from shared.model.processor import preprocess_mode
    from tools.bench.settings import parse_resolution
    from tools.plan.costs import VisionProbe

    settings = parse_settings(ChildSettings, argv, "python -m tools.plan.timeslice")
    path = settings.model_path()
    probe = VisionProbe(settings, ModelConfig.from_checkpoint(path), path,
                        preprocess_mode(settings.preprocess, settings.torch_device()))
    width, height = parse_resolution(settings.resolution)
    forward, _, _ = probe.unit(width, height, settings.images)
    cuda = probe.device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(probe.device)) if cuda else (lambda: None)
    stop = threading.Event()
    with torch.inference_mode():
        for _ in range(2):
            forward()
        sync()
        print("ready", flush=True)
        while (line := sys.stdin.readline().strip()) not in ("quit", ""):
            if line != "go":
                continue
            stop.clear()
            threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()  # "stop"
            start, calls, per_call = time.perf_counter(), 0, 0.0
            while not stop.is_set():
                forward()
                sync()
                calls += 1
                if not per_call and time.perf_counter() - start >= settings.seconds:
                    per_call = (time.perf_counter() - start) / calls * 1e3
            print(per_call or (time.perf_counter() - start) / max(1, calls) * 1e3, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
