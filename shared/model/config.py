"""Model configuration: the parts of an HF Qwen2-VL / Qwen2.5-VL / Qwen3-VL config our model code needs.

Every family (and both config layouts, flat and ``text_config``-nested) normalizes into the frozen
dataclasses below, so the rest of the code never reads an HF config object.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
QWEN3_FAMILIES = ("qwen3_vl", "qwen3_vl_moe")


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP (Qwen3-VL-MoE): each token runs ``top_k`` of ``num_experts`` SwiGLU experts."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    norm_topk_prob: bool  # the top-k routing weights are renormalized to sum to 1
    layers: tuple[int, ...]  # decoder layers whose MLP is the mixture; the others are dense

# What transformers assumes when a config leaves these out: a hand-written config.json is read as the
# reference reads it, not with defaults of our own.
HF_DEFAULT_MROPE_SECTION = (16, 24, 24)
HF_DEFAULT_FULLATT_BLOCKS = (7, 15, 23, 31)


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # explicit in Qwen3 (q/k/v width need not equal hidden_size)
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...]
    tie_word_embeddings: bool
    max_position_embeddings: int
    attention_bias: bool = True  # q/k/v projections carry a bias (Qwen2 families)
    qk_norm: bool = False  # RMSNorm over each head of q and k before rotary (Qwen3)
    mrope_interleaved: bool = False  # M-RoPE bands cycle t, h, w (Qwen3) instead of three contiguous runs
    moe: MoEConfig | None = None


@dataclass(frozen=True)
class VisionConfig:
    family: str
    width: int  # the ViT's hidden size
    depth: int
    num_heads: int
    mlp_hidden: int
    act: str
    out_dim: int  # the language model's hidden size: the merger projects into it
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    in_channels: int
    window_size: int  # pixels; 0: every block attends over the whole image (Qwen2-VL)
    fullatt_blocks: tuple[int, ...]
    rope_theta: float
    num_position_embeddings: int = 0  # Qwen3: a learned square table, interpolated to each image's grid
    deepstack_layers: tuple[int, ...] = ()  # Qwen3: blocks whose merged features feed the first LM layers
    tokens_per_second: float = 0.0  # Qwen2.5-VL: temporal positions per second of video (0: one per patch)

    @property
    def embedding_width(self) -> int:
        """Width of one image token's row as the encoder ships it: the merger's output, then one
        ``out_dim``-wide level per deepstack block (prefill splits them apart again)."""
        return self.out_dim * (1 + len(self.deepstack_layers))

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


@dataclass(frozen=True)
class ModelConfig:
    family: str
    text: TextConfig
    vision: VisionConfig
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    eos_token_ids: tuple[int, ...]

    @property
    def embedding_width(self) -> int:
        return self.vision.embedding_width

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        family = raw.get("model_type", "")
        if family not in FAMILIES:
            raise ValueError(
                f"unsupported model_type {family!r}: epd serves the Qwen2-VL, Qwen2.5-VL and Qwen3-VL families "
                f"({', '.join(FAMILIES)})"
            )
        text_raw = {**raw, **raw.get("text_config", {})}
        return cls(
            family=family,
            text=_text_config(text_raw, raw, family),
            vision=_vision_config(family, raw["vision_config"], text_raw["hidden_size"]),
            image_token_id=raw["image_token_id"],
            video_token_id=raw["video_token_id"],
            vision_start_token_id=raw["vision_start_token_id"],
            vision_end_token_id=raw["vision_end_token_id"],
            eos_token_ids=_as_tuple(text_raw.get("eos_token_id")),
        )

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> "ModelConfig":
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in model directory {path}")
        config = cls.from_dict(json.loads(config_file.read_text()))
        generation = Path(path) / "generation_config.json"
        if generation.is_file():
            extra = _as_tuple(json.loads(generation.read_text()).get("eos_token_id"))
            config = _with_eos(config, tuple(dict.fromkeys(config.eos_token_ids + extra)))
        return config


def _as_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def _with_eos(config: ModelConfig, eos: tuple[int, ...]) -> ModelConfig:
    from dataclasses import replace

    return replace(config, eos_token_ids=eos)


def _text_config(raw: dict, top: dict, family: str) -> TextConfig:
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    num_heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
    # Absent from a config, transformers falls back to the 7B's split (which fits head_dim 128 only)
    section = tuple(rope.get("mrope_section") or HF_DEFAULT_MROPE_SECTION)
    if sum(section) != head_dim // 2:
        raise ValueError(f"mrope_section {list(section)} must sum to head_dim/2 = {head_dim // 2}")
    qwen3 = family in QWEN3_FAMILIES
    # transformers 5 ties by the top-level flag when the checkpoint has one (a MoE text_config's own
    # default says the opposite)
    tie = top["tie_word_embeddings"] if "tie_word_embeddings" in top else raw.get("tie_word_embeddings")
    return TextConfig(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta") or raw.get("rope_theta") or 1_000_000.0),
        mrope_section=section,
        tie_word_embeddings=bool(tie),
        max_position_embeddings=raw.get("max_position_embeddings", 32768),
        attention_bias=bool(raw.get("attention_bias", False)) if qwen3 else True,
        qk_norm=qwen3,
        mrope_interleaved=bool(rope.get("mrope_interleaved", qwen3)),
        moe=_moe_config(raw) if family == "qwen3_vl_moe" else None,
    )


def _moe_config(raw: dict) -> MoEConfig | None:
    experts = raw.get("num_experts") or raw.get("num_local_experts") or 0
    if not experts:
        return None
    step = raw.get("decoder_sparse_step", 1) or 1
    dense = set(raw.get("mlp_only_layers") or ())
    layers = tuple(i for i in range(raw["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)
    return MoEConfig(num_experts=experts, top_k=raw["num_experts_per_tok"],
                     intermediate_size=raw["moe_intermediate_size"],
                     norm_topk_prob=bool(raw.get("norm_topk_prob", True)), layers=layers)


def _vision_config(family: str, raw: dict, lm_hidden: int) -> VisionConfig:
    rope = raw.get("rope_parameters") or {}
    common = dict(
        family=family,
        depth=raw["depth"],
        num_heads=raw["num_heads"],
        patch_size=raw.get("patch_size", 14),
        temporal_patch_size=raw.get("temporal_patch_size", 2),
        merge_size=raw.get("spatial_merge_size", 2),
        in_channels=raw.get("in_channels", raw.get("in_chans", 3)),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
    )
    if family in QWEN3_FAMILIES:
        return VisionConfig(
            width=raw["hidden_size"],
            mlp_hidden=raw["intermediate_size"],
            act=raw.get("hidden_act", "gelu_pytorch_tanh"),
            out_dim=raw.get("out_hidden_size", lm_hidden),
            window_size=0,
            fullatt_blocks=tuple(range(raw["depth"])),
            num_position_embeddings=raw["num_position_embeddings"],
            deepstack_layers=tuple(raw.get("deepstack_visual_indexes") or ()),
            **{**common, "patch_size": raw.get("patch_size", 16)},
        )
    if family == "qwen2_5_vl":
        return VisionConfig(
            width=raw["hidden_size"],
            mlp_hidden=raw["intermediate_size"],
            act=raw.get("hidden_act", "silu"),
            out_dim=raw.get("out_hidden_size", lm_hidden),
            window_size=raw.get("window_size", 112),
            fullatt_blocks=tuple(raw.get("fullatt_block_indexes", HF_DEFAULT_FULLATT_BLOCKS)),
            tokens_per_second=raw.get("tokens_per_second", 4),  # HF's default
            **common,
        )
    width = raw["embed_dim"]
    return VisionConfig(
        width=width,
        mlp_hidden=int(width * raw.get("mlp_ratio", 4)),
        act=raw.get("hidden_act", "quick_gelu"),
        out_dim=raw.get("hidden_size", lm_hidden),
        window_size=0,
        fullatt_blocks=tuple(range(raw["depth"])),
        **common,
    )
