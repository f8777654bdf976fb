"""One 1080p image to patches: HF's PIL processor on one CPU thread against the torch path on the device
(the pixels' copy over included, wall clock as the encoder's vision thread pays it), and how far apart
their patches are in 8-bit steps."""

from __future__ import annotations

import torch

from bench.engine.common import Bench, Timer, log


def run(bench: Bench, out: dict) -> None:
    import numpy as np

    from shared.model.processor import ImagePreprocessor, TorchImagePreprocessor
    from tools.bench.dataset import make_image

    dev = bench.device
    height, width = (1080, 1920) if bench.big else (224, 224)
    pixels = np.asarray(make_image(0, width, height))
    pil, on_device = ImagePreprocessor(bench.checkpoint), TorchImagePreprocessor(bench.checkpoint, bench.dtype)
    source = torch.from_numpy(pixels.copy())
    cpu_timer = Timer(torch.device("cpu"))
    pil_ms = cpu_timer.ms(lambda: pil(pixels), repeat=5, warmup=1)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch_ms = cpu_timer.ms(lambda: (on_device(source.to(dev)), sync()), repeat=20, warmup=3)
    expected, _ = pil(pixels)
    got = TorchImagePreprocessor(bench.checkpoint)(source.to(dev)).cpu()
    difference = (got - torch.from_numpy(expected)).abs()
    step = 1 / 255 / min(pil._processor.image_std)
    out.update(image=f"{width}x{height}", pil_cpu_ms=pil_ms, torch_device_ms=torch_ms, speedup=pil_ms / torch_ms,
               max_diff_8bit_steps=difference.max().item() / step,
               share_differing=(difference > step / 2).float().mean().item())
    log(f"preprocess {width}x{height}: PIL (1 CPU thread) {pil_ms:.1f} ms, torch on {dev.type} {torch_ms:.2f} ms "
        f"({pil_ms / torch_ms:.0f}x); patches differ by <= {difference.max().item() / step:.2f} 8-bit steps")
