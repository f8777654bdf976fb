"""The vision half of an encoder: the checkpoint's vision tower with its preprocessing — decoded pixels
(an image, or a clip's sampled frames) in, embeddings out, batched with other requests' (``batcher``).

Images are resized and patchified by the checkpoint's own processor on CPU threads (``pil``, exactly the
reference), or on the tower's device by the batcher right before the forward (``torch``); clips by the
video processor, on the device or in the same threads.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack
from pathlib import Path

import torch

from services.encoder.batcher import MAX_BATCH_IMAGES, SIBLING_WAIT_S, VisionBatcher
from services.encoder.settings import EncoderSettings
from shared import kernels
from shared.dataplane.handle import TensorHandle
from shared.errors import ServiceError
from shared.logging import get_logger
from shared.messages.encode import VideoSampling, VideoTiming
from shared.model import pieces
from shared.model.config import ModelConfig
from shared.model.geometry import Grid, ImageGeometry
from shared.model.loader import load_vision_tower
from shared.model.processor import ImagePreprocessor, TorchImagePreprocessor, preprocess_mode
from shared.model.video_processor import VideoPreprocessor

log = get_logger(__name__)

# ViT forwards of up to this many patches run as CUDA graphs between their attentions, padded to a bucket (a
# 448x448 image: 784 patches; Qwen3-VL's 1080p: 8,160); bigger forwards are bound by their kernels anyway
GRAPH_PATCHES = 8192
LAYOUT_GRAPHS = 8  # besides the pieces: whole forwards captured as one CUDA graph each, per batch layout seen twice


def warm_grids(merge: int, graph_patches: int, max_patches: int) -> list[list[Grid]]:
    """The batches ``warm_up`` forwards: an image of 16, 32, 64 and 128 patches (a window or a whole image
    that short goes to the one-tile segment kernel, one variant per tile length up to
    ``SegmentAttention.SHORT``), a common one (longer segments), and one past ``graph_patches`` (the eager
    forward: its first block's norm without a residual, its rotary on freshly made q|k|v), each within
    ``max_patches``."""
    m = merge
    grids = [(1, 2 * m, 2 * m), (1, 2 * m, 4 * m), (1, 4 * m, 4 * m), (1, 4 * m, 8 * m), (1, 18 * m, 32 * m)]
    if graph_patches:
        side = math.ceil(math.sqrt(graph_patches + 1) / m) * m
        grids.append((1, side, side))
    return [[g] for g in grids if g[1] * g[2] <= max_patches]


@torch.inference_mode()
def warm_up(tower, graph_patches: int, max_patches: int) -> int:
    """Forward random patches of ``warm_grids`` through ``tower`` (its pieces where they hold the batch, not
    its layout graphs: a layout seen here must not count towards a capture), so every Triton kernel variant
    a request's forward can reach is compiled before the encoder registers, not in a first request's
    forward (three compiles, 0.6 s, in an E/PD encoder's first 1080p forward on an H100). Returns how many."""
    device, dtype = next(tower.parameters()).device, next(tower.parameters()).dtype
    started = time.perf_counter()
    batches = warm_grids(tower.config.merge_size, graph_patches, max_patches)
    for grids in batches:
        patches = torch.randn(sum(t * h * w for t, h, w in grids), tower.config.patch_dim, device=device, dtype=dtype)
        tower.run(patches, tower.layout(grids, device, device.type == "cuda"), pieces=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    log.info("vision.warmed", forwards=len(batches), ms=round((time.perf_counter() - started) * 1e3))
    return len(batches)


class VisionEncoder:
    def __init__(self, settings: EncoderSettings):
        self.settings = settings
        self.batcher: VisionBatcher | None = None
        self.preprocess_mode = ""
        self.on_device: TorchImagePreprocessor | None = None  # pixels → patches on the tower's device
        self._cpu_preprocess: ImagePreprocessor | None = None  # or the checkpoint's processor on CPU threads
        self.geometry: ImageGeometry | None = None  # the checkpoint's resize rule: an image's patch grid
        self.video: VideoPreprocessor | None = None  # frames → patches: in the pool (pil) or on the device (torch)
        self.videos = 0  # clips through the ViT
        self.video_frames = 0  # their sampled frames
        self._pool: ThreadPoolExecutor | None = None

    async def start(self, path: Path, resources: AsyncExitStack, pending: Callable[[str], int],
                    own_thread: bool) -> None:
        """Load the tower (and capture its graphs on a GPU) and the checkpoint's preprocessing; batch its
        forwards in a thread of its own, or (``own_thread=False``) leave them to the caller's engine loop.
        ``pending``: a request's images received but not queued yet, which a forward waits for."""
        s = self.settings
        device, dtype = s.torch_device(), s.torch_dtype()
        if device.type == "cuda":
            kernels.log_compiles(log)
        config = ModelConfig.from_checkpoint(path)
        tower = await asyncio.to_thread(load_vision_tower, path, config, device, dtype, s.load_format)
        # forwards of up to this many patches run through CUDA graphs (0: none)
        graph_patches = min(GRAPH_PATCHES, s.max_batch_patches) if device.type == "cuda" and not s.enforce_eager else 0
        if graph_patches:
            await asyncio.to_thread(pieces.capture, tower, graph_patches, LAYOUT_GRAPHS)
        if device.type == "cuda":  # Triton compiles (CPU runs no Triton kernel)
            await asyncio.to_thread(warm_up, tower, graph_patches, s.max_batch_patches)
        self.preprocess_mode = preprocess_mode(s.preprocess, device)
        self.geometry = ImageGeometry.from_checkpoint(path)
        self.video = VideoPreprocessor.from_checkpoint(path, dtype)
        if self.preprocess_mode == "torch":
            self.on_device = TorchImagePreprocessor(path, dtype)  # run by the batcher, before the forward
        else:
            self._cpu_preprocess = ImagePreprocessor(path)
        self._pool = ThreadPoolExecutor(s.preprocess_threads, thread_name_prefix="preprocess")  # and videos on CPU
        resources.callback(self._pool.shutdown, wait=False, cancel_futures=True)
        self.batcher = VisionBatcher(tower, asyncio.get_running_loop(), MAX_BATCH_IMAGES, s.max_batch_patches,
                                     prepare=self.on_device, sibling_wait_s=SIBLING_WAIT_S, pending=pending,
                                     mix_patches=graph_patches or None)
        if own_thread:
            await asyncio.to_thread(self.batcher.start)
            resources.push_async_callback(asyncio.to_thread, self.batcher.stop)

    def check_pixels(self, image: TensorHandle, video: VideoSampling | None) -> None:
        """An image's (or a clip's sampled frames') pixels as a job or a prompt names them, before pulling."""
        if video is not None:
            self._check_video(image, video)
        elif image.dtype != "uint8" or len(image.shape) != 3 or image.shape[2] != 3:
            raise ServiceError(400, "image must be uint8 pixels of shape [height, width, 3]")
        if image.shape[-3] * image.shape[-2] > self.settings.max_image_pixels:
            raise ServiceError(400, "image has too many pixels")

    def _check_video(self, frames: TensorHandle, sampling: VideoSampling) -> None:
        if frames.dtype != "uint8" or len(frames.shape) != 4 or frames.shape[3] != 3:
            raise ServiceError(400, "video must be uint8 frames of shape [frames, height, width, 3]")
        if frames.shape[0] != len(sampling.frame_indices) or frames.shape[0] > self.settings.max_video_frames:
            raise ServiceError(400, f"video must hold one frame per sampled index, at most "
                                    f"{self.settings.max_video_frames}")
        if max(sampling.frame_indices) >= sampling.total_frames:
            raise ServiceError(400, "video frame index past the clip's frames")
        try:
            self.video.grid(*frames.shape[:3])
        except ValueError as err:
            raise ServiceError(400, f"video cannot be processed: {err}") from None

    def video_timing(self, s: VideoSampling) -> VideoTiming:
        timing = self.video.geometry.timing(s.frame_indices, s.total_frames, s.source_fps)
        return VideoTiming(second_per_grid=timing.second_per_grid, timestamps=list(timing.timestamps))

    def grid(self, shape: tuple[int, ...], video: VideoSampling | None) -> Grid:
        """The patch grid pixels of ``shape`` (a clip's: ``[T, H, W, 3]``) are encoded at."""
        if video is not None:
            return self.video.grid(*shape[:3])
        return self.geometry.grid(shape[0], shape[1])

    async def encode(self, pixels: torch.Tensor, video: VideoSampling | None, group: str,
                     queued: Callable[[asyncio.Future], asyncio.Future],
                     on_done: Callable[[torch.Tensor], None] | None = None) -> tuple[torch.Tensor, Grid]:
        """Pulled pixels through preprocessing and the ViT, batched with ``group``'s (the request's) other
        images; ``queued`` is told once they wait for a forward (``on_done``: see ``VisionBatcher.encode``)."""
        if video is not None:
            return await self._encode_video(pixels, group, queued, on_done)
        if self.on_device is not None:  # preprocessed on the tower's device, by the batcher
            grid = self.grid(pixels.shape, None)
            return await queued(self.batcher.encode(pixels, grid, group=group, on_done=on_done)), grid
        loop = asyncio.get_running_loop()
        patches, grid = await loop.run_in_executor(self._pool, self._cpu_preprocess, pixels.numpy())
        return await queued(self.batcher.encode(torch.from_numpy(patches), grid, group=group, on_done=on_done)), grid

    async def _encode_video(self, frames: torch.Tensor, group: str, queued: Callable[[asyncio.Future], asyncio.Future],
                            on_done: Callable[[torch.Tensor], None] | None) -> tuple[torch.Tensor, Grid]:
        """A clip's frames through the video processor (on the tower's device with torch preprocessing,
        else on a CPU thread), then the ViT with other requests' images and clips."""
        grid = self.video.grid(*frames.shape[:3])
        if self.preprocess_mode == "torch":
            tensor = await queued(self.batcher.encode(frames, grid, prepare=lambda f: self.video(f)[0],
                                                      group=group, on_done=on_done))
        else:
            loop = asyncio.get_running_loop()
            patches, grid = await loop.run_in_executor(self._pool, self.video, frames)
            tensor = await queued(self.batcher.encode(patches, grid, group=group, on_done=on_done))
        self.videos += 1
        self.video_frames += int(frames.shape[0])
        return tensor, grid

    def stats(self) -> dict:
        b = self.batcher
        return {
            "images": b.images if b else 0,  # images through the ViT (cache hits are not)
            "videos": self.videos,  # clips through the ViT (counted among the images too)
            "video_frames": self.video_frames,
            "images_per_s": b.images_rate.rate() if b else 0.0,  # through the ViT, last 10 s
            "batches": b.batches if b else 0,
            "vit_cudnn_shapes": b.cudnn_shapes if b else 0,  # ViT shapes planned in cuDNN (the rest: flash)
            "batches_waited": b.waited if b else 0,  # forwards that waited for a request's other images
            "patches": b.patches if b else 0,
            **(b.batch_sizes.stats() if b else {}),
            **(b.times.stats("vit_") if b else {}),  # waiting for a forward, and the forward itself
            "queue_depth": b.queued if b else 0,
        }
