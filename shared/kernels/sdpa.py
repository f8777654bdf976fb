"""Fused attention calls that plan nothing per shape while serving.

On sm90 SDPA's first choice is cuDNN's fused attention. Per call it is the fastest there is (an H200,
bf16: 1.4-1.9× the flash kernel at a prompt's and a ViT batch's shapes), but it builds an execution
plan for each exact shape — sizes and strides, the batch included — 45-60 ms each, 0.6-0.9 s when a
new kernel variant compiles, and keeps it in a cache of the *calling thread* (docs/architecture.md).
Serving makes a new shape nearly every call: every prompt has its own length, every ViT batch its own
mix of images. Left to SDPA, nearly every prefill and ViT forward paid a plan, and an encoder's vision
thread, whose cache starts empty, paid it even for shapes the warm-up had seen (ten 448² images: 80-283 ms
a forward in that thread against 30 ms; with the flash kernel 32-35 ms). So:

- ``causal``: a fresh chunk's causal attention runs in cuDNN padded at the end to one of a fixed set
  of lengths (``bucket``). Exact: a causal row never sees a key after it, and the padding is zeros.
  ``warm`` plans every bucket up to the step budget, in the thread that will serve;
- ``recurring``: a ViT batch of images runs in the flash kernel until the flash kernel has done, at that
  shape in this thread, as much work as cuDNN's plan would take to pay back (``PROMOTE_FLOPS``: the
  rent-or-buy rule, never more than twice the better choice's cost), then in cuDNN — at most
  ``MAX_PROMOTED`` shapes a thread. So a shape that keeps coming back (a workload's usual image sizes and
  batch mixes) gets the faster kernel, big ones at once, and a one-off plans nothing. It matters for
  Qwen3-VL, whose tower attends over whole images in every block: a 1080p image 42 ms with cuDNN,
  54 ms with flash alone;
- ``flash``: every other shape (a chunk's queries over its prefix, video frames) runs in the flash
  kernel, which plans nothing.

Both are ``torch.ops.aten``'s own entry points, which SDPA dispatches to (the public call does not return
the log-sum-exps the split path merges by, and ``sdpa_kernel`` would switch backends for every thread of
the process). ``usable`` probes each once per device, dtype and head layout against the reference; what
fails falls back (cuDNN → flash → SDPA's own choice). On CPU both are the reference kernels.
"""

from __future__ import annotations

import contextlib
import math
import threading

import torch
import torch.nn.functional as F

# H200, bf16, ViT shapes: cuDNN saves ~1.3e-15 s a FLOP of the flash kernel's work (a third of its time) and
# a plan costs ~45 ms: flash work worth one plan
PROMOTE_FLOPS = 0.045 / 1.3e-15
MAX_PROMOTED = 64  # cuDNN plans ``recurring`` builds a thread (cuDNN's own cache is unbounded)
_MAX_TRACKED = 1024  # shapes ``recurring`` keeps count of a thread
_FIRST_GEOMETRIC = 1024  # buckets: multiples of 128 up to here, then four a doubling, rounded up to 128
_PER_DOUBLING = 4


def bucket(n: int) -> int:
    """The padded length a causal chunk of ``n`` tokens runs at: at most 19 % more rows, 128-aligned."""
    if n <= _FIRST_GEOMETRIC:
        return max(128, -(-n // 128) * 128)
    steps = math.floor(_PER_DOUBLING * math.log2(n / _FIRST_GEOMETRIC))  # the geometric point at or below n
    while (size := -(-math.ceil(_FIRST_GEOMETRIC * 2 ** (steps / _PER_DOUBLING)) // 128) * 128) < n:
        steps += 1  # the smallest rounded point that holds n
    return size


def buckets(up_to: int) -> list[int]:
    """Every bucket a chunk of at most ``up_to`` tokens can use."""
    out, n = [], 1
    while not out or out[-1] < bucket(up_to):
        out.append(bucket(n))
        n = out[-1] + 1
    return out


def _half(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def _expand(k: torch.Tensor, heads: int) -> torch.Tensor:
    return k if k.shape[1] == heads else k.repeat_interleave(heads // k.shape[1], 1)


def _lse(lse: torch.Tensor, n: int) -> torch.Tensor:
    return (lse.squeeze(-1) if lse.dim() == 4 else lse)[..., :n].float()  # cuDNN's is [B, H, n, 1]


def reference(q, k, v, causal: bool, with_lse: bool = False):
    """SDPA's own choice (CPU, float32 on the GPU); with ``with_lse``, CPU's flash kernel or the math."""
    k, v = _expand(k, q.shape[1]), _expand(v, q.shape[1])
    if not with_lse:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if not q.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)[:2]
        return out, _lse(lse, q.shape[2])
    scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v.float()).to(q.dtype), torch.logsumexp(scores, -1)


def _flash(q, k, v, causal: bool):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
        q, _expand(k, q.shape[1]), _expand(v, q.shape[1]), 0.0, causal, False)[:2]
    return out, _lse(lse, q.shape[2])


def _cudnn(q, k, v, causal: bool):
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False)[:2]
    return out, _lse(lse, q.shape[2])


def padded(q, k, v, run):
    """``run`` (causal, returning out and log-sum-exps) over q, k, v ``[1, H, n, D]`` zero-padded at the
    end to ``bucket(n)`` rows, laid out [1, n, H, D] as the projections leave them (one plan a bucket)."""
    n = q.shape[2]
    rows = bucket(n)

    def pad(x):
        buffer = x.new_empty(1, rows, x.shape[1], x.shape[3])
        buffer[:, :n] = x.transpose(1, 2)
        buffer[:, n:].zero_()  # only the padding: this runs every layer of every fresh chunk
        return buffer.transpose(1, 2)
    out, lse = run(pad(q), pad(k), pad(v), True)
    return out[:, :, :n], lse[..., :n]


_usable: dict = {}


def usable(kind: str, device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, dim: int) -> bool:
    """Whether ``kind`` ("cudnn", "flash") runs here and agrees with the reference on a probe (these
    entry points are private: a build may lack one, or lay its outputs out otherwise)."""
    key = (kind, str(device), dtype, heads, kv_heads, dim)
    if key not in _usable:
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(1, heads, 200, dim, generator=gen).to(device, dtype)
        k, v = (torch.randn(1, kv_heads, 200, dim, generator=gen).to(device, dtype) for _ in range(2))
        want, want_lse = reference(q.float(), k.float(), v.float(), True, with_lse=True)
        try:
            got, lse = padded(q, k, v, _cudnn) if kind == "cudnn" else _flash(q, k, v, True)
            _usable[key] = bool(torch.allclose(got.float(), want, atol=2e-2, rtol=0)
                                and torch.allclose(lse, want_lse, atol=2e-2, rtol=0))
        except RuntimeError:
            _usable[key] = False
    return _usable[key]


def causal(q, k, v, with_lse: bool = False):
    """Causal attention of a chunk that starts its sequence: q ``[1, H, n, D]``, k, v ``[1, KVH, n, D]``."""
    if _half(q):
        layout = (q.device, q.dtype, q.shape[1], k.shape[1], q.shape[3])
        if usable("cudnn", *layout):
            out, lse = padded(q, k, v, _cudnn)
        elif usable("flash", *layout):
            out, lse = _flash(q, k, v, True)
        else:
            return reference(q, k, v, True, with_lse)
        return (out, lse) if with_lse else out
    return reference(q, k, v, True, with_lse)


def flash(q, k, v, causal: bool = False, with_lse: bool = False):
    """Attention at any shape with no plan to build: q ``[B, H, n, D]``, k, v ``[B, KVH, m, D]``."""
    if _half(q) and usable("flash", q.device, q.dtype, q.shape[1], k.shape[1], q.shape[3]):
        out, lse = _flash(q, k, v, causal)
        return (out, lse) if with_lse else out
    return reference(q, k, v, causal, with_lse)


class _Sightings(threading.local):
    def __init__(self):
        self.work: dict[tuple, float] = {}  # shape → FLOPs the flash kernel did at it; inf: flash for good
        self.promoted: set[tuple] = set()
        self.settled: str | None = None  # ``settled``'s choice while inside it


_sightings = _Sightings()


def promoted() -> int:
    """Shapes ``recurring`` has moved to cuDNN in the calling thread."""
    return len(_sightings.promoted)


@contextlib.contextmanager
def settled(choice: str):
    """Inside, ``recurring`` runs every shape in ``choice``'s kernel ("cudnn": cuDNN where usable, else
    flash; "flash") in the calling thread, as if the shape's count were done: for work captured into a
    CUDA graph, which replays what it ran at capture and never counts again."""
    seen = _sightings
    before, seen.settled = seen.settled, choice
    try:
        yield
    finally:
        seen.settled = before


def recurring(q, k, v):
    """Bidirectional attention over ``[B, H, n, D]`` at shapes that may come back (see the module's
    docstring): the flash kernel until it has done ``PROMOTE_FLOPS`` at the shape in this thread, then cuDNN."""
    if not _half(q):
        return reference(q, k, v, False)
    if _sightings.settled is not None:
        if _sightings.settled == "cudnn" and usable("cudnn", q.device, q.dtype, q.shape[1], k.shape[1], q.shape[3]):
            return _cudnn(q, k, v, False)[0]
        return flash(q, k, v)
    key = (tuple(q.shape), q.stride(), tuple(k.shape), k.stride(), q.dtype, q.device)
    seen = _sightings
    if key in seen.promoted:
        try:
            return _cudnn(q, k, v, False)[0]
        except RuntimeError:  # a shape this build's cuDNN refuses: flash for good
            seen.promoted.discard(key)
            seen.work[key] = math.inf
    elif key in seen.work or len(seen.work) < _MAX_TRACKED:
        work = seen.work.get(key, 0.0) + 4 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3]
        seen.work[key] = work
        if work >= PROMOTE_FLOPS and work != math.inf:
            if len(seen.promoted) < MAX_PROMOTED and usable("cudnn", q.device, q.dtype, q.shape[1], k.shape[1],
                                                             q.shape[3]):
                seen.promoted.add(key)
            else:
                seen.work[key] = math.inf
    return flash(q, k, v)


def warm_recurring(device: torch.device, dtype: torch.dtype, heads: int, dim: int,
                   lengths: tuple[int, ...] = (1024, 8192)) -> int:
    """Plan cuDNN's bidirectional attention once per length in ``lengths``, in this thread, laid out as a
    ViT batch's attention is: the first plan of that kernel variant compiles it (0.6-0.9 s), which
    ``recurring``'s first promoted shape otherwise paid in a request's forward. Counts toward no shape's
    sightings. Returns how many plans (0: cuDNN not usable here)."""
    q = torch.zeros(1, heads, 1, dim, device=device, dtype=dtype)
    if not _half(q) or not usable("cudnn", device, dtype, heads, heads, dim):
        return 0
    for rows in lengths:
        q = torch.zeros(1, rows, heads, dim, device=device, dtype=dtype).transpose(1, 2)
        _cudnn(q, q, q, False)
    torch.cuda.synchronize(device)
    return len(lengths)


def warm(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, dim: int, up_to: int) -> int:
    """Plan ``causal``'s every bucket up to ``up_to`` tokens in this thread (its plans are this thread's);
    returns how many."""
    q = torch.zeros(1, heads, 1, dim, device=device, dtype=dtype)
    if not _half(q) or not usable("cudnn", device, dtype, heads, kv_heads, dim):
        return 0
    sizes = buckets(up_to)
    for rows in sizes:
        q = torch.zeros(1, rows, heads, dim, device=device, dtype=dtype).transpose(1, 2)
        k = torch.zeros(1, rows, kv_heads, dim, device=device, dtype=dtype).transpose(1, 2)
        causal(q, k, k)
    torch.cuda.synchronize(device)
    return len(sizes)
