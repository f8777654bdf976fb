"""Video helpers the tests share: seeded clips encoded with PyAV, data URLs, and HF generate() on video.

The reference decodes a clip with HF's own PyAV reader (``transformers.video_utils.read_video_pyav``),
samples it with the processor's rule, turns the frames into patches with ``VideoPreprocessor`` (HF's
video processors need torchvision, which does not install beside the pinned CPU torch; ours is checked
against HF's bit for bit in ``test_video_geometry``), builds the prompt as the model's processor lays it
out (Qwen3-VL: a timestamp before each temporal patch), and runs HF ``generate()``.
"""

from __future__ import annotations

import base64
import copy
import io
import tempfile
from pathlib import Path

import av
import numpy as np
import torch

from shared.model.config import ModelConfig
from shared.model.video import VideoGeometry
from shared.model.video_processor import VideoPreprocessor
from tests.support import Reference, data_url


def make_clip(seed: int, frames: int, height: int, width: int, fps: float = 10, codec: str = "libx264",
              container: str = "mp4", faststart: bool = False) -> bytes:
    """A seeded clip: each frame a smooth random picture (blocks of colour, so the codec keeps it close).
    ``faststart``: an mp4's index before its frames (as streaming sites serve them)."""
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as tmp:  # faststart rewrites the file: a real one, not a buffer
        path = Path(tmp) / f"clip.{container}"
        _encode(rng, path, frames, height, width, fps, codec, container, faststart)
        return path.read_bytes()


def _encode(rng, path: Path, frames: int, height: int, width: int, fps: float, codec: str, container: str,
            faststart: bool) -> None:
    # The same bytes on every run and every CPU: a muxer without its random ids and version strings
    # (bitexact), one encoder thread, and x264 without its hand-written assembly, whose AVX-512 paths made
    # the same seed encode differently now and then (a test's clip and its reference's then disagreed).
    options = {"fflags": "+bitexact", **({"movflags": "faststart"} if faststart else {})}
    with av.open(str(path), "w", format=container, options=options) as out:
        stream = out.add_stream(codec, rate=fps if float(fps).is_integer() else _fraction(fps),
                                options={"x264-params": "no-asm=1"} if codec == "libx264" else {})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.thread_count = 1
        stream.codec_context.flags |= av.codec.context.Flags.bitexact
        for _ in range(frames):
            blocks = rng.integers(0, 256, (max(1, height // 8), max(1, width // 8), 3), dtype=np.uint8)
            picture = np.repeat(np.repeat(blocks, 8, 0), 8, 1)[:height, :width]
            picture = np.pad(picture, ((0, height - picture.shape[0]), (0, width - picture.shape[1]), (0, 0)))
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(picture), format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def _fraction(fps: float):
    from fractions import Fraction

    return Fraction(fps).limit_denominator(1001)


def video_url(data: bytes, mime: str = "video/mp4") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def media_messages(text: str, parts: list[tuple[str, object]]) -> list[dict]:
    """One user turn: ``("image", PIL image)`` / ``("video", clip bytes)`` parts in order, then the text."""
    content = [{"type": "image_url", "image_url": {"url": data_url(p)}} if kind == "image"
               else {"type": "video_url", "video_url": {"url": video_url(p)}} for kind, p in parts]
    return [{"role": "user", "content": content + [{"type": "text", "text": text}]}]


class VideoReference:
    """HF generate() on prompts with images and videos (the checkpoint's own model, fp32 on CPU)."""

    def __init__(self, reference: Reference, path: Path):
        self.reference = reference
        self.config = ModelConfig.from_checkpoint(path)
        self.geometry = VideoGeometry.from_checkpoint(path, self.config.family)
        self.video = VideoPreprocessor.from_checkpoint(path)

    def decode(self, clip: bytes):
        """HF's PyAV reader with the processor's sampling: frames [T, H, W, 3] and their metadata. HF's
        reader needs the container's frame count; for those without one (webm) the frames are counted."""
        from transformers.video_utils import VideoMetadata, read_video_pyav

        with av.open(io.BytesIO(clip)) as container:
            counted = container.streams.video[0].frames
        if counted:
            return read_video_pyav(io.BytesIO(clip), lambda metadata, **_: self.geometry.sample(
                metadata.total_num_frames, metadata.fps))
        with av.open(io.BytesIO(clip)) as container:
            fps = float(container.streams.video[0].average_rate)
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        indices = self.geometry.sample(len(frames), fps)
        return np.stack([frames[i] for i in indices]), VideoMetadata(total_num_frames=len(frames), fps=fps,
                                                                     frames_indices=indices)

    def inputs(self, text: str, parts: list[tuple[str, object]]) -> dict:
        tok, model = self.reference.tokenizer, self.reference.model
        content = [{"type": kind} for kind, _ in parts] + [{"type": "text", "text": text}]
        rendered = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                           add_generation_prompt=True)
        images = [p for kind, p in parts if kind == "image"]
        inputs = self.reference.inputs("", images) if images else {}
        image_grids = list(inputs.get("image_grid_thw", []))
        pieces, videos = [], []
        for kind, part in parts:
            head, placeholder, rendered = self._split(rendered, kind)
            pieces.append(head)
            if kind == "image":
                grid = image_grids.pop(0)
                pieces.append("<|image_pad|>" * (int(grid.prod()) // 4))
                continue
            frames, metadata = self.decode(part)
            patches, grid = self.video(torch.from_numpy(frames))
            videos.append((patches, grid, 2 / metadata.sampled_fps))  # Qwen2_5_VLProcessor: tps / sampled fps
            pieces.append(self._video_text(grid, metadata, placeholder))
        pieces.append(rendered)
        ids = tok("".join(pieces), return_tensors="pt").input_ids
        out = {k: v for k, v in inputs.items() if k in ("pixel_values", "image_grid_thw")}
        if videos:
            out.update(pixel_values_videos=torch.cat([v[0] for v in videos]),
                       video_grid_thw=torch.tensor([list(v[1]) for v in videos]))
            if self.config.family == "qwen2_5_vl":
                out["second_per_grid_ts"] = torch.tensor([v[2] for v in videos])  # float32, as the processor's
        kinds = (ids == model.config.image_token_id).int() + 2 * (ids == model.config.video_token_id).int()
        out.update(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=kinds)
        return out

    def _split(self, rendered: str, kind: str) -> tuple[str, str, str]:
        token = "<|image_pad|>" if kind == "image" else "<|video_pad|>"
        if kind == "video" and self.geometry.rule == "qwen3":
            token = "<|vision_start|><|video_pad|><|vision_end|>"  # the processor replaces the whole triple
        head, _, tail = rendered.partition(token)
        return head, token, tail

    def _video_text(self, grid, metadata, placeholder: str) -> str:
        t, h, w = grid
        if self.geometry.rule != "qwen3":
            return "<|video_pad|>" * (t * h * w // 4)
        stamps = self.geometry.timing(list(metadata.frames_indices), metadata.total_num_frames, metadata.fps).timestamps
        return "".join(f"<{s:.1f} seconds><|vision_start|>" + "<|video_pad|>" * (h * w // 4) + "<|vision_end|>"
                       for s in stamps)

    def generate(self, text: str, parts: list[tuple[str, object]], max_new_tokens: int) -> list[int]:
        inputs = self.inputs(text, parts)
        config = copy.deepcopy(self.reference.model.generation_config)
        config.max_new_tokens, config.do_sample = max_new_tokens, False
        with torch.no_grad():
            out = self.reference.model.generate(**inputs, generation_config=config)
        return out[0, inputs["input_ids"].shape[1]:].tolist()
