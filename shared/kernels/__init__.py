"""Triton kernels of the GPU path. Imported lazily: on a machine without Triton they are simply absent
and every model falls back to the torch reference path (which is what runs on CPU anyway).

Triton compiles a kernel on its first launch for each specialization of its arguments (an integer
equal to 1 or divisible by 16, a pointer aligned to 16 bytes): a compile takes up to seconds, and the
thread that launched it — an engine step, every request in it — waits. So integer arguments that
change from step to step (decode rows before a chunk, tokens and assignments of a MoE layer) are
``do_not_specialize``, and ``log_compiles`` names every compile a process does, with its time: after
start-up and the first requests there should be none.
"""

from __future__ import annotations

import importlib
import importlib.util
import time


TRITON = importlib.util.find_spec("triton") is not None


ENABLED = {"fused": TRITON, "moe": TRITON, "gemv": TRITON}


def enabled(path: str) -> bool:
    """Whether the model code takes the kernels of ``path`` (on a CUDA device): all of them wherever Triton
    is installed. Benchmarks switch one off (``ENABLED[path] = False``) to measure the torch path or what a
    kernel gives; kept here, not on the lazy handles below, because once ``shared.kernels.X`` has been
    imported the package's attribute ``X`` is that module, no longer its handle."""
    return ENABLED[path]


class _Lazy:
    def __init__(self, module: str):
        self._module = module
        self._loaded = None

    def __getattr__(self, name: str):
        if self._loaded is None:
            self._loaded = importlib.import_module(self._module)
        return getattr(self._loaded, name)


fused = _Lazy("shared.kernels.fused")
attention = _Lazy("shared.kernels.attention")
decode_attention = _Lazy("shared.kernels.decode_attention")
moe = _Lazy("shared.kernels.moe")
gemv = _Lazy("shared.kernels.gemv")


def log_compiles(log) -> None:
    """Log each Triton compile of this process (``kernel.compiled``: kernel, specialization, ms)."""
    if not TRITON:
        return
    from triton import knobs

    started: dict[str, float] = {}

    def before(*, key, **_) -> bool:
        started[str(key)] = time.perf_counter()
        return False  # compile it (True would skip the kernel)

    def after(*, key, repr, fn, **_) -> None:
        began = started.pop(str(key), None)
        log.info("kernel.compiled", kernel=fn.name, ms=round((time.perf_counter() - began) * 1e3, 1) if began else None,
                 specialization=repr[:400])

    knobs.runtime.jit_cache_hook = before
    knobs.runtime.jit_post_compile_hook = after
