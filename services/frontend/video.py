"""Decoding video clips for the frontend: bytes → the frames the model's video processor samples, bounded.

PyAV (FFmpeg's libraries, bundled in its wheels) demuxes and decodes in the frontend's media pool, the
way HF's ``pyav`` video reader does: the stream's frame count and average rate pick the frames
(``VideoGeometry.sample``: 2 per second by default, within the processor's min/max frames), decoding runs
from the start and keeps only those frames, as RGB (``to_ndarray("rgb24")``), and stops after the last.

Everything a client controls is checked before or while it costs anything, each with its own 400:
bytes (by the loader), a container we accept (mp4/mov, webm/mkv, avi, mpeg-ts/ps, flv, ogg: no playlists or
other demuxers that open further resources), a video stream whose decoder exists, pixels per frame from
the header, a sane frame rate and duration, sampled frames, a decode deadline; a clip that fails to
decode, is truncated (fewer frames than its header says), or decodes to nothing. Only sampled frames are
held in memory. The content hash covers the sampled frames and the sampling (which frames of how many,
at what rate), so it names the video processor's input, timing included.
"""

from __future__ import annotations

import collections
import io
import time
from dataclasses import dataclass

import av
import numpy as np

from services.frontend.errors import ApiError
from shared.embedding_index import content_digest
from shared.messages.encode import VideoSampling
from shared.model.video import VideoGeometry

# FFmpeg demuxer names (as av reports them) of the containers clips come in.
CONTAINERS = {"mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm", "avi", "mpegts", "mpeg", "flv", "ogg"}


@dataclass(frozen=True)
class VideoLimits:
    """What a client's clip may be, each a 400 that names it: checked on the container's header before
    decoding (length, frame rate, frame size, frames the processor would sample), then a decode deadline."""

    max_frames: int  # sampled (the frontend's --max-video-frames)
    max_seconds: float = 600.0
    max_fps: float = 240.0
    max_frame_pixels: int = 3840 * 2160
    decode_timeout: float = 60.0  # seconds


@dataclass(frozen=True)
class DecodedVideo:
    pixels: np.ndarray  # uint8 [frames, height, width, 3]: the sampled frames
    content_hash: str
    sampling: VideoSampling

    @property
    def num_frames(self) -> int:
        return self.pixels.shape[0]

    @property
    def height(self) -> int:
        return self.pixels.shape[1]

    @property
    def width(self) -> int:
        return self.pixels.shape[2]


def video_hash(frames: np.ndarray, sampling: VideoSampling) -> str:
    t, height, width = frames.shape[:3]
    return content_digest(f"video:RGB:{t}x{width}x{height}:{sampling.total_frames}@{sampling.source_fps!r}:",
                          np.asarray(sampling.frame_indices, dtype=np.int64).tobytes(),
                          np.ascontiguousarray(frames).data)


def decode_video(data: bytes, geometry: VideoGeometry, limits: VideoLimits) -> DecodedVideo:
    """Bytes → the sampled RGB frames of the first video stream, or an ``ApiError(400)`` saying why not.

    A container without a frame count (webm, mpeg-ts) is sized from its duration; if that estimate
    overshoots, the clip is sampled again from the frames it really has (one more decode)."""
    with _open(data) as container:
        stream = container.streams.video[0]
        total, fps, counted = _check_header(container, stream, limits)
        indices = _sample(geometry, total, fps, limits)
        frames, decoded = _decode_frames(container, stream, indices, limits.decode_timeout)
    if frames is None and not counted and decoded >= 1:
        total = decoded
        indices = _sample(geometry, total, fps, limits)
        with _open(data) as container:
            frames, decoded = _decode_frames(container, container.streams.video[0], indices, limits.decode_timeout)
    if frames is None:
        raise ApiError(400, f"the video is truncated: its header promises {total} frames, {decoded} could be decoded")
    sampling = VideoSampling(source_fps=fps, total_frames=total, frame_indices=indices)
    return DecodedVideo(frames, video_hash(frames, sampling), sampling)


# PyAV before 19 decodes a file's metadata strictly unless told otherwise (bad UTF-8 in a client's file
# raised on open); 19 decodes it with surrogateescape and no longer takes the argument.
_OPEN_OPTIONS = {"metadata_errors": "ignore"} if int(av.__version__.split(".")[0]) < 19 else {}


def _open(data: bytes):
    try:
        container = av.open(io.BytesIO(data), mode="r", **_OPEN_OPTIONS)
    except (av.FFmpegError, ValueError, OSError):
        raise ApiError(400, "video data could not be read as a video") from None
    if container.format.name not in CONTAINERS:
        container.close()
        raise ApiError(400, f"unsupported video container {container.format.name!r}; use mp4, webm, mkv, "
                            "avi, mpeg-ts, flv or ogg")
    if not container.streams.video:
        container.close()
        raise ApiError(400, "the data holds no video stream")
    return container


def _sample(geometry: VideoGeometry, total: int, fps: float, limits: VideoLimits) -> list[int]:
    try:
        indices = geometry.sample(total, fps)
    except ValueError as err:
        raise ApiError(400, f"video cannot be sampled: {err}") from None
    if len(indices) > limits.max_frames:
        raise ApiError(400, f"video samples {len(indices)} frames; at most {limits.max_frames} are allowed")
    return indices


def _check_header(container, stream, limits: VideoLimits) -> tuple[int, float, bool]:
    """(frames, frame rate, whether the container counted the frames) as HF's reader takes them."""
    if stream.codec_context is None or stream.codec_context.codec is None:
        raise ApiError(400, "the video's codec is not supported")
    width, height = stream.codec_context.width, stream.codec_context.height
    if width < 1 or height < 1:
        raise ApiError(400, "the video has no picture size")
    if width * height > limits.max_frame_pixels:
        raise ApiError(400, f"video frames of {width}x{height} pixels exceed the limit of "
                            f"{limits.max_frame_pixels} pixels")
    rate = stream.average_rate or stream.guessed_rate
    fps = float(rate) if rate else 0.0
    if not 0 < fps <= limits.max_fps:
        raise ApiError(400, f"video frame rate {fps:g} is outside (0, {limits.max_fps:g}] frames per second")
    total = counted = stream.frames
    if total <= 0:  # containers without a frame count (webm, mpeg-ts): from the stream's or the file's duration
        seconds = float(stream.duration * stream.time_base) if stream.duration and stream.time_base else \
            (container.duration or 0) / av.time_base
        total = round(seconds * fps)
    if total <= 0:
        raise ApiError(400, "the video's length is unknown or zero")
    if total / fps > limits.max_seconds:
        raise ApiError(400, f"video of {total / fps:.1f} s exceeds the limit of {limits.max_seconds:g} s")
    return int(total), fps, counted > 0


def _decode_frames(container, stream, indices: list[int], timeout: float) -> tuple[np.ndarray | None, int]:
    """The sampled frames (None when the stream ended before the last of them) and the frames decoded."""
    wanted = collections.Counter(indices)
    last = indices[-1]
    stream.thread_type = "AUTO"  # frame threads: a long clip decodes several times faster
    deadline = time.monotonic() + timeout
    frames: list[np.ndarray] = []
    decoded = 0
    try:
        for i, frame in enumerate(container.decode(stream)):
            decoded = i + 1
            if i in wanted:
                rgb = frame.to_ndarray(format="rgb24")
                if frames and rgb.shape != frames[0].shape:
                    raise ApiError(400, "the video changes picture size mid-stream")
                frames.extend([rgb] * wanted[i])
            if i >= last:
                break
            if time.monotonic() > deadline:
                raise ApiError(400, f"the video took more than {timeout:g} s to decode")
    except av.FFmpegError:
        if not decoded:
            raise ApiError(400, "the video data is corrupt: no frame could be decoded") from None
        raise ApiError(400, "the video data is corrupt or truncated") from None
    if not decoded:
        raise ApiError(400, "the video has no decodable frames")
    if len(frames) < len(indices):
        return None, decoded
    return np.stack(frames), decoded
