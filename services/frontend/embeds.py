"""Precomputed image embeddings from a client (vLLM's ``image_embeds`` content parts), read without pickle.

A client (or an upstream service) that already ran the vision tower sends the rows it produced and the
image's patch grid; the frontend publishes them on its data plane and the language worker pulls them as
it would an encoder's, so no encoder sees the image (a stack with ``--encoders 0`` serves them too).

The part is vLLM's: ``{"type": "image_embeds", "image_embeds": {"image_embeds": <b64>, "image_grid_thw":
<b64>}}``. vLLM's tensors are ``torch.save`` payloads, which are pickles: unpickling a client's bytes
runs the client's code, so they are refused with a 400 that says what to send instead. Accepted: the
base64 of a safetensors file holding one tensor (``safetensors.torch.save({"t": tensor})``) or of a
``.npy`` file (``numpy.save``, read with ``allow_pickle=False``). The format is told by its first bytes.

Checked before anything is published, each with its own 400: the bytes (``--max-media-bytes`` a
tensor, decoded), the dtypes (float32/float16/bfloat16 rows, integer grid), the grid (``t, h, w`` ≥ 1,
``h`` and ``w`` multiples of the merge size), the rows (``t·h·w / merge²`` of them, each as wide as the
model's image rows: the vision tower's output, and on Qwen3-VL its deepstack levels beside it; see
``ModelConfig.embedding_width``), and finite values. The content hash covers the rows as sent (dtype,
shape, bytes) and the grid, in a namespace of its own: the same image sent as pixels hashes otherwise.

Read with numpy alone (safetensors is a length, a JSON header and raw data), so the frontend never loads
torch; bfloat16 rows, which numpy lacks, are widened to float32 exactly (a bfloat16 is a float32's top half).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import struct
from dataclasses import dataclass

import numpy as np

from services.frontend.errors import ApiError
from services.frontend.protocol import ImageEmbedsPart
from shared.embedding_index import content_digest
from shared.model.config import ModelConfig
from shared.model.geometry import Grid, grid_tokens

ROW_DTYPES = ("float32", "float16", "bfloat16")
GRID_DTYPES = ("int32", "int64")
SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "I32": "int32", "I64": "int64",
                      "F64": "float64", "I16": "int16", "I8": "int8", "U8": "uint8"}
PICKLE_REFUSED = ("{name} is a torch.save (pickle) payload, which this server does not load: send the tensor as "
                  "base64 of safetensors bytes (safetensors.torch.save({{'{name}': tensor}})) or of a .npy file "
                  "(numpy.save); see docs/api.md")


@dataclass(frozen=True)
class Tensor:
    """A tensor as the client sent it: its dtype's name (``bfloat16`` kept as raw 16-bit words) and values."""

    dtype: str
    values: np.ndarray  # bfloat16: uint16 words

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    def describe(self) -> str:
        return f"{self.dtype} of shape {list(self.shape)}"

    def as_float(self) -> np.ndarray:
        """The values as numpy floats: bfloat16 widened to float32 (exact), the others as they are."""
        if self.dtype == "bfloat16":
            return (self.values.astype(np.uint32) << 16).view(np.float32)
        return self.values


@dataclass(frozen=True)
class ImageEmbeds:
    """One image's embedding rows, ready to publish: what an encoder would have answered."""

    rows: np.ndarray  # [t·h·w / merge², embedding_width], float, contiguous
    grid: Grid
    content_hash: str


def prompt_size(image) -> tuple[int, int] | Grid:
    """What prompt building needs of an image: its (height, width) to encode, or its embeddings' grid."""
    return image.grid if isinstance(image, ImageEmbeds) else (image.height, image.width)


class EmbedsReader:
    def __init__(self, config: ModelConfig, max_bytes: int):
        self.merge = config.vision.merge_size
        self.width = config.embedding_width
        self.levels = len(config.vision.deepstack_layers)
        self.max_bytes = max_bytes

    def read(self, part: ImageEmbedsPart) -> ImageEmbeds:
        """The part's rows and grid, checked against each other and the model (a 400 for anything off)."""
        fields = part.image_embeds if isinstance(part.image_embeds, dict) else {"image_embeds": part.image_embeds}
        if "image_grid_thw" not in fields:
            raise ApiError(400, "image_embeds for this model needs its image_grid_thw (the patch grid t, h, w): "
                                "send {\"image_embeds\": …, \"image_grid_thw\": …}", "messages")
        grid = self._grid(self._tensor(fields["image_grid_thw"], "image_grid_thw"))
        rows = self._rows(self._tensor(fields["image_embeds"], "image_embeds"), grid)
        digest = content_digest(f"embeds:{rows.dtype}:{rows.shape[0]}x{rows.shape[1]}:"
                                f"{grid[0]}x{grid[1]}x{grid[2]}:", np.ascontiguousarray(rows.values).data)
        return ImageEmbeds(np.ascontiguousarray(rows.as_float()), grid, digest)

    def _grid(self, tensor: Tensor) -> Grid:
        if tensor.dtype not in GRID_DTYPES or tensor.shape not in ((3,), (1, 3)):
            raise ApiError(400, f"image_grid_thw must be one image's [t, h, w] as int32 or int64 (shape [3] or "
                                f"[1, 3]), not {tensor.describe()}", "messages")
        t, h, w = (int(v) for v in tensor.values.reshape(3).tolist())
        if t < 1 or h < 1 or w < 1 or h % self.merge or w % self.merge:
            raise ApiError(400, f"image_grid_thw {[t, h, w]} is not a patch grid of this model: t, h, w at least 1, "
                                f"h and w multiples of {self.merge}", "messages")
        return t, h, w

    def _rows(self, tensor: Tensor, grid: Grid) -> Tensor:
        if len(tensor.shape) == 3 and tensor.shape[0] == 1:
            tensor = Tensor(tensor.dtype, tensor.values[0])
        if tensor.dtype not in ROW_DTYPES or len(tensor.shape) != 2:
            raise ApiError(400, "image_embeds must be float32, float16 or bfloat16 of shape [tokens, width], not "
                                f"{tensor.describe()}", "messages")
        tokens = grid_tokens(grid, self.merge)
        if tensor.shape != (tokens, self.width):
            deepstack = f" (the vision output and its {self.levels} deepstack levels)" if self.levels else ""
            raise ApiError(400, f"image_embeds of shape {list(tensor.shape)} does not fit: the grid {list(grid)} "
                                f"takes {tokens} rows (t·h·w / {self.merge}²) of this model's width "
                                f"{self.width}{deepstack}", "messages")
        if not bool(np.isfinite(tensor.as_float()).all()):
            raise ApiError(400, "image_embeds holds NaN or infinite values", "messages")
        return tensor

    def _tensor(self, value: str, name: str) -> Tensor:
        if len(value) * 3 // 4 > self.max_bytes:
            raise ApiError(400, f"{name} exceeds {self.max_bytes} bytes", "messages")
        try:
            data = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, f"{name} is not valid base64", "messages") from None
        if data.startswith(b"\x93NUMPY"):
            return _npy(data, name)
        if data.startswith(b"PK\x03\x04") or data[:1] == b"\x80":  # torch.save's zip, or a bare pickle
            raise ApiError(400, PICKLE_REFUSED.format(name=name), "messages")
        return _safetensors(data, name)


def _safetensors(data: bytes, name: str) -> Tensor:
    """The one tensor of a safetensors file: an 8-byte little-endian header length, a JSON header naming each
    tensor's dtype, shape and byte range, then the raw little-endian data. No code, nothing to trust."""
    malformed = ApiError(400, f"{name} is neither safetensors nor .npy bytes (base64)", "messages")
    try:
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + length]) if 8 + length <= len(data) else None
    except (struct.error, ValueError):
        raise malformed from None
    if not isinstance(header, dict):
        raise malformed
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    if len(tensors) != 1:
        raise ApiError(400, f"{name}: a safetensors payload must hold exactly one tensor, not {len(tensors)}",
                       "messages")
    entry = next(iter(tensors.values()))
    try:
        dtype = SAFETENSORS_DTYPES[entry["dtype"]]
        shape = [int(n) for n in entry["shape"]]
        begin, end = (int(n) for n in entry["data_offsets"])
        words = np.dtype("<u2") if dtype == "bfloat16" else np.dtype(dtype).newbyteorder("<")
        raw = data[8 + length:][begin:end]
        if any(n < 0 for n in shape) or len(raw) != end - begin or len(raw) != words.itemsize * int(np.prod(shape)):
            raise ValueError
        values = np.frombuffer(raw, dtype=words).reshape(shape).astype(words.newbyteorder("="))
    except (KeyError, TypeError, ValueError):
        raise malformed from None
    return Tensor(dtype, values)


def _npy(data: bytes, name: str) -> Tensor:
    try:
        array = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError):  # object arrays (pickles) included
        raise ApiError(400, f"{name} is not a readable .npy array of numbers", "messages") from None
    if array.dtype.kind not in "fiu" or array.dtype.itemsize > 8:
        raise ApiError(400, f"{name} must be an array of numbers, not {array.dtype}", "messages")
    return Tensor(array.dtype.name, np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("=")))
