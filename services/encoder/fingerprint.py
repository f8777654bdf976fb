"""What makes two encoders' embeddings interchangeable: the same preprocessing (settings and where it
runs: ``pil`` and ``torch`` agree bit for bit today, ``shared/model/resample.py``, and stay apart in case
either changes), weights and dtype.

The fingerprint goes into every cache key, so an encoder never serves (or borrows) embeddings that
another configuration produced: a changed resize rule, normalization, checkpoint or dtype gives new keys.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

from shared.model.geometry import ImageGeometry
from shared.model.loader import checkpoint_files
from shared.model.processor import PixelSteps, load_image_processor
from shared.model.video import video_processor_config

_SAMPLE_BYTES = 1 << 20  # read this much at each end of every weights file


def encoder_fingerprint(path: Path, load_format: str, dtype: str, preprocess: str) -> str:
    """Hex digest over the image (and video) processor's resolved settings and implementation (``pil``/``torch``),
    the model config, and the weights' identity."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(json.dumps(_image_settings(path, preprocess), sort_keys=True, default=str).encode())
    digest.update(json.dumps(video_processor_config(path), sort_keys=True).encode())  # videos' budget and rule
    digest.update(preprocess.encode())
    digest.update((path / "config.json").read_bytes())
    digest.update(f"{load_format}/{dtype}".encode())
    if load_format != "dummy":  # dummy weights come from a fixed seed: the config names them
        for file in checkpoint_files(path):
            _weights_identity(digest, file)
    return digest.hexdigest()


def _image_settings(path: Path, preprocess: str) -> dict:
    """What the image preprocessing runs with: HF's processor, resolved (``pil``), or the settings the device
    preprocessor reads itself (``torch``: a GPU encoder never imports HF's processor, ~2.5 s of CPU)."""
    if preprocess == "torch":
        return {**asdict(PixelSteps.from_checkpoint(path)), **asdict(ImageGeometry.from_checkpoint(path))}
    return load_image_processor(path).to_dict()


def _weights_identity(digest, file: Path) -> None:
    """Name, size, the head (the safetensors header: names, shapes, offsets) and the tail (weights).

    Hashing whole checkpoints (GBs) would delay start-up; a retrained or re-initialized checkpoint
    differs in these samples.
    """
    size = file.stat().st_size
    digest.update(f"{file.name}:{size}".encode())
    with file.open("rb") as f:
        digest.update(f.read(_SAMPLE_BYTES))
        if size > _SAMPLE_BYTES:
            f.seek(max(_SAMPLE_BYTES, size - _SAMPLE_BYTES))
            digest.update(f.read(_SAMPLE_BYTES))
