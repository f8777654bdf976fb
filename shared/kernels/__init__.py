"""Triton kernels of the GPU path. Imported lazily: on a machine without Triton they are simply absent
and every model falls back to the torch reference path (which is what runs on CPU anyway)."""

from __future__ import annotations

import importlib
import importlib.util


TRITON = importlib.util.find_spec("triton") is not None


class _Lazy:
    def __init__(self, module: str):
        self._module = module
        self._loaded = None
        self.available = TRITON

    def __getattr__(self, name: str):
        if self._loaded is None:
            self._loaded = importlib.import_module(self._module)
        return getattr(self._loaded, name)


fused = _Lazy("shared.kernels.fused")
attention = _Lazy("shared.kernels.attention")
moe = _Lazy("shared.kernels.moe")
qk_norm = _Lazy("shared.kernels.qk_norm")
