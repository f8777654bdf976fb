"""Role-split loading from an HF checkpoint directory: each role reads only the tensors it runs.

The encoder reads the vision tower's tensors and never the language model's; prefill and decode read
the language model's and never the vision tower's. Both checkpoint layouts are understood: the
published one (``model.layers.*``, ``visual.*``) and transformers 5's (``model.language_model.*``,
``model.visual.*``). With ``load_format="dummy"`` no tensor is read and weights are random. The model
classes follow the config's family (Qwen3-VL has a language model and a vision tower of its own).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from shared.model.config import QWEN3_FAMILIES, ModelConfig
from shared.model.qwen3_text import Qwen3LanguageModel
from shared.model.qwen3_vision import Qwen3VisionTower
from shared.model.text import LanguageModel
from shared.model.vision import VisionTower

_LM_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
_VISION_PREFIXES = ("model.visual.", "visual.")
_FUSED = {  # our fused parameter → the checkpoint's pieces, in concatenation order
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    return files


def _role_name(name: str, role: str) -> str | None:
    """The checkpoint tensor ``name`` as our module's parameter name, or None if ``role`` does not need it."""
    if role == "vision":
        for prefix in _VISION_PREFIXES:
            if name.startswith(prefix):
                return name[len(prefix):]
        return None
    if name.startswith(("lm_head.", "language_model.lm_head.")):
        return "lm_head." + name.rsplit("lm_head.", 1)[1]
    if any(name.startswith(p) for p in _VISION_PREFIXES):
        return None
    for prefix in _LM_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return None


def read_role_tensors(path: Path, role: str) -> Iterator[tuple[str, torch.Tensor]]:
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                ours = _role_name(name, role)
                if ours is not None:
                    yield ours, f.get_tensor(name)


def _fused_target(name: str) -> tuple[str, int] | None:
    """``layers.0.self_attn.k_proj.weight`` → (``layers.0.self_attn.qkv_proj.weight``, piece 1)."""
    parts = name.split(".")
    for fused, pieces in _FUSED.items():
        if len(parts) >= 2 and parts[-2] in pieces:
            return ".".join(parts[:-2] + [fused, parts[-1]]), pieces.index(parts[-2])
    return None


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, local = name.rpartition(".")
    path, _, layer = path.rpartition(".")
    return model.get_submodule(path) if path else model, f"{layer}.{local}"


def load_into(model: nn.Module, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors into ``model``: fused projections take their pieces at the owner's
    ``fused_offsets``; parameters the owner lists in ``padded_params`` may be larger than the tensor
    (the tensor fills the leading block, the rest stays zero); an owner with ``checkpoint_layout``
    turns a tensor of another layout into its own first."""
    params = dict(model.named_parameters())
    for p in params.values():
        p.data.zero_()
    seen: set[str] = set()
    for name, tensor in tensors:
        fused = _fused_target(name) if name not in params else None
        if fused:
            target, piece = fused
            owner, _ = _owner(model, target)
            start = owner.fused_offsets[piece]
            params[target].data[start:start + tensor.shape[0]].copy_(tensor)
            seen.add(f"{target}#{piece}")
            continue
        if name == "patch_embed.proj.weight":
            tensor = tensor.reshape(tensor.shape[0], -1)
        if name not in params:
            continue  # e.g. rotary tables some exporters save
        param = params[name]
        owner, local = _owner(model, name)
        if hasattr(owner, "checkpoint_layout"):
            tensor = owner.checkpoint_layout(local, tensor)
        if param.shape != tensor.shape:
            padded = local in getattr(owner, "padded_params", ()) and tensor.dim() == param.dim() and all(
                t <= p for t, p in zip(tensor.shape, param.shape))
            if not padded:
                raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                                 f"model expects {tuple(param.shape)}")
            param.data[tuple(slice(0, t) for t in tensor.shape)].copy_(tensor)
        else:
            param.data.copy_(tensor)
        seen.add(name)
    missing = [n for n in params if n not in seen and not any(k.startswith(n + "#") for k in seen)]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


def _randomize(model: nn.Module, seed: int) -> None:
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight", "layernorm.weight")):
            p.data.fill_(1.0)
        elif name.endswith("bias"):
            p.data.zero_()
        else:
            p.data.normal_(0.0, 0.02, generator=gen)


def _allocate(model: nn.Module, device: torch.device) -> None:
    """``model.to_empty(device=device)``, without its ``empty_like`` of meta tensors: that runs torch's
    Python reference, whose first call imports sympy (~0.4 s of CPU in every process that loads a model)."""
    for module in model.modules():
        for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            empty = torch.empty(t.shape, dtype=t.dtype, device=device)
            setattr(module, name, nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty)


def _materialize(build, device: torch.device, dtype: torch.dtype) -> nn.Module:
    with torch.device("meta"):
        model = build()
    model = model.to(dtype)  # allocated in ``dtype`` at once, never in float32 first
    _allocate(model, device)
    for module in model.modules():
        if hasattr(module, "init_buffers"):
            module.init_buffers()
    return model


def _load(path: Path | None, role: str, build, device, dtype, load_format: str, seed: int) -> nn.Module:
    model = _materialize(build, torch.device(device), dtype)
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        model.lm_head.weight = model.embed_tokens.weight  # allocating breaks the tie
    if load_format == "dummy":
        _randomize(model, seed)
    elif load_format in ("auto", "safetensors"):
        load_into(model, read_role_tensors(path, role))
    else:
        raise ValueError(f"unknown load format {load_format!r}: use 'auto' or 'dummy'")
    return model.eval().requires_grad_(False)


def load_language_model(path: Path | None, config: ModelConfig, device="cpu", dtype=torch.float32,
                        load_format: str = "auto", seed: int = 0) -> LanguageModel | Qwen3LanguageModel:
    """``path`` may be None with ``load_format="dummy"`` (nothing is read)."""
    model_class = Qwen3LanguageModel if config.family in QWEN3_FAMILIES else LanguageModel
    return _load(path and Path(path), "text", lambda: model_class(config.text), device, dtype, load_format, seed)


def load_vision_tower(path: Path | None, config: ModelConfig, device="cpu", dtype=torch.float32,
                      load_format: str = "auto", seed: int = 0) -> VisionTower | Qwen3VisionTower:
    tower_class = Qwen3VisionTower if config.family in QWEN3_FAMILIES else VisionTower
    return _load(path and Path(path), "vision", lambda: tower_class(config.vision), device, dtype, load_format, seed)


def parameter_bytes(config: ModelConfig, role: str, dtype_bytes: int = 2) -> int:
    """The bytes ``role``'s weights (``"text"`` or ``"vision"``) take, counted from the model's own classes on
    the meta device (nothing is allocated): what a process of that role will hold, for memory planning."""
    qwen3 = config.family in QWEN3_FAMILIES
    if role == "text":
        build = Qwen3LanguageModel if qwen3 else LanguageModel
        sub = config.text
    else:
        build = Qwen3VisionTower if qwen3 else VisionTower
        sub = config.vision
    with torch.device("meta"):
        model = build(sub)
    count = sum(p.numel() for p in model.parameters())
    if role == "text" and config.text.tie_word_embeddings:
        count -= model.lm_head.weight.numel()  # one tensor once the tie is made (``_load``)
    return count * dtype_bytes
