"""Video clips for ``epd bench --video-*``: seeded synthetic clips, encoded once before the load starts.

Each clip is H.264 in mp4 (PyAV's bundled libx264, preset ultrafast), ``--video-seconds`` long at
``--video-fps`` and ``--video-resolution``: a random low-resolution pattern scaled up smoothly and panned a
little every frame, so it compresses like camera footage rather than like noise or a still, distinct per
seed (a 10 s 720p clip at 30 fps is about 1 MB).
Every request gets clips of its own (an embedding cache would otherwise serve repeats); warm-up
requests too. Encoding runs in threads (PyAV releases the GIL) and never competes with the load.
"""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import av
import numpy as np

from tools.bench.dataset import RequestSpec


def make_clip(seed: int, seconds: float, fps: float, width: int, height: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    frames = max(2, round(seconds * fps))
    small = rng.integers(0, 256, (max(2, height // 48), max(2, width // 48), 3), dtype=np.uint8)
    # smooth, a frame's size plus a margin to pan over
    base = np.asarray(Image.fromarray(small).resize((width + 32, height + 32), Image.BICUBIC))
    drift = rng.integers(-2, 3, 2)  # pixels per frame the picture pans by
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=round(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "ultrafast", "crf": "28"}
        for i in range(frames):
            dy, dx = (int(v) % 32 for v in drift * i)
            picture = np.ascontiguousarray(base[dy:dy + height, dx:dx + width])
            for packet in stream.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def assign_videos(specs: list[RequestSpec], per_request: int, first: int,
                  drop_images: bool = False) -> tuple[list[RequestSpec], int]:
    """Every request that is not text only gets ``per_request`` clips of its own (``drop_images``: instead
    of its images); returns the requests and the number of clips they use (ids ``first`` onwards)."""
    if per_request <= 0:
        return specs, 0
    out, next_id = [], first
    for spec in specs:
        if spec.kind == "text":
            out.append(spec)
            continue
        out.append(replace(spec, kind="video", video_ids=tuple(range(next_id, next_id + per_request)),
                           image_ids=() if drop_images else spec.image_ids))
        next_id += per_request
    return out, next_id - first


class VideoPool:
    """Distinct clips by id, encoded once as ``data:video/mp4`` URLs before the run."""

    def __init__(self, seconds: float, fps: float, size: tuple[int, int], seed: int):
        self.seconds, self.fps, self.size, self.seed = seconds, fps, size, seed
        self.urls: list[str] = []
        self.bytes = 0

    def generate(self, count: int, threads: int = 8) -> None:
        width, height = self.size

        def one(i: int) -> str:
            data = make_clip(self.seed * 1_000_003 + 7919 * i + 1, self.seconds, self.fps, width, height)
            self.bytes += len(data)
            return "data:video/mp4;base64," + base64.b64encode(data).decode()

        with ThreadPoolExecutor(threads) as pool:
            self.urls = list(pool.map(one, range(count)))

    def parts(self, spec: RequestSpec) -> list[dict]:
        return [{"type": "video_url", "video_url": {"url": self.urls[i]}} for i in spec.video_ids]
