"""Named real architectures for ``--load-format dummy``: the published configs with random weights.

No weights can be downloaded where the benchmarks run, so a preset is materialized as a checkpoint
directory holding the real architecture's ``config.json`` and the real image-processor settings, plus
the tiny trained tokenizer (its special-token ids are written into the config). Timing does not depend
on weight values when the output length is forced (``ignore_eos``).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

_QWEN25_VISION = dict(
    model_type="qwen2_5_vl", depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, hidden_act="silu",
    patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2, in_chans=3,
)
_QWEN2_VISION = dict(
    model_type="qwen2_vl", depth=32, embed_dim=1280, mlp_ratio=4, num_heads=16, hidden_act="quick_gelu",
    patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_chans=3,
)


# Qwen3-VL: the published config.json layout (text_config / vision_config nested, transformers 4.57).
_QWEN3_ROPE = {"rope_type": "default", "mrope_interleaved": True, "mrope_section": [24, 20, 20]}


def _qwen3_vision(depth, width, intermediate, out, deepstack):
    return dict(depth=depth, hidden_size=width, intermediate_size=intermediate, num_heads=16, out_hidden_size=out,
                hidden_act="gelu_pytorch_tanh", patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                in_channels=3, num_position_embeddings=2304, deepstack_visual_indexes=deepstack)


def _qwen3(hidden, intermediate, layers, heads, kv_heads, tie, vision, moe=None):
    text = dict(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=128, vocab_size=151936,
                rms_norm_eps=1e-6, rope_theta=5_000_000, rope_scaling=_QWEN3_ROPE, max_position_embeddings=262144,
                hidden_act="silu", attention_bias=False, tie_word_embeddings=tie)
    if moe:
        experts, top_k, expert_width = moe
        text.update(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=expert_width,
                    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    return dict(model_type="qwen3_vl_moe" if moe else "qwen3_vl", text_config=text, vision_config=vision,
                tie_word_embeddings=tie)


_QWEN3_VISION_LARGE = dict(depth=27, width=1152, intermediate=4304, deepstack=[8, 16, 24])


def _text(hidden, intermediate, layers, heads, kv_heads, vocab, tie):
    return dict(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, vocab_size=vocab, tie_word_embeddings=tie, rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, max_position_embeddings=128000, hidden_act="silu",
        rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
    )


PRESETS: dict[str, dict] = {
    "qwen2.5-vl-7b": dict(model_type="qwen2_5_vl", **_text(3584, 18944, 28, 28, 4, 152064, False),
                          vision_config={**_QWEN25_VISION, "out_hidden_size": 3584}),
    "qwen2.5-vl-3b": dict(model_type="qwen2_5_vl", **_text(2048, 11008, 36, 16, 2, 151936, True),
                          vision_config={**_QWEN25_VISION, "out_hidden_size": 2048}),
    "qwen2-vl-2b": dict(model_type="qwen2_vl", **_text(1536, 8960, 28, 12, 2, 151936, True),
                        vision_config={**_QWEN2_VISION, "hidden_size": 1536}),
    "qwen2-vl-7b": dict(model_type="qwen2_vl", **_text(3584, 18944, 28, 28, 4, 152064, False),
                        vision_config={**_QWEN2_VISION, "hidden_size": 3584}),
    "qwen3-vl-2b": _qwen3(2048, 6144, 28, 16, 8, True, _qwen3_vision(24, 1024, 4096, 2048, [5, 11, 17])),
    "qwen3-vl-8b": _qwen3(4096, 12288, 36, 32, 8, False, _qwen3_vision(**_QWEN3_VISION_LARGE, out=4096)),
    # 30B parameters, 3B active: 128 experts of width 768, 8 per token, in every layer
    "qwen3-vl-30b-a3b": _qwen3(2048, 6144, 48, 32, 4, False, _qwen3_vision(**_QWEN3_VISION_LARGE, out=2048),
                               moe=(128, 8, 768)),
    # 235B / 22B active: ~470 GB in bf16, more than one GPU holds; for planning and larger machines
    "qwen3-vl-235b-a22b": _qwen3(4096, 12288, 94, 64, 4, False, _qwen3_vision(**_QWEN3_VISION_LARGE, out=4096),
                                 moe=(128, 8, 1536)),
}

_ARCHITECTURES = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                  "qwen3_vl": "Qwen3VLForConditionalGeneration", "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration"}

# The published image-processor limits of the Qwen2(.5)-VL checkpoints: a 1080p image becomes 2,691
# tokens (Qwen3-VL's are in shared.model.qwen3_checkpoint: 2,040 tokens).
REAL_MAX_PIXELS = 12845056
REAL_MIN_PIXELS = 3136


def cache_dir() -> Path:
    """Where the built-in model and the presets' checkpoint directories are written, once per user."""
    return Path(os.environ.get("EPD_CACHE_DIR") or Path(tempfile.gettempdir()) / f"epd-{os.getuid()}")


TINY_DIR = "tiny-qwen2_5_vl-v4"  # v4: video in the template, a video processor, the tools section


def materialize_preset(name: str, root: str | os.PathLike | None = None) -> Path:
    """Write (once) a weightless checkpoint directory for preset ``name`` and return its path."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    base = Path(root) if root else cache_dir()
    path = base / f"preset-{name}-v3"  # v3: video in the chat template, Qwen3-VL's video processor
    if (path / "config.json").exists():
        return path  # written: nothing to import (the tokenizer writer pulls in torch: seconds of a start)
    from shared.model import qwen3_checkpoint
    from shared.model.config import QWEN3_FAMILIES
    from shared.model.tiny import CHAT_TEMPLATE, SPECIAL_TOKENS, image_processor_config, write_tokenizer

    staging = Path(tempfile.mkdtemp(dir=base.mkdir(parents=True, exist_ok=True) or base))
    qwen3 = PRESETS[name]["model_type"] in QWEN3_FAMILIES
    write_tokenizer(staging, vocab_size=600, chat_template=qwen3_checkpoint.CHAT_TEMPLATE if qwen3 else CHAT_TEMPLATE)
    vocab = json.loads((staging / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in vocab["added_tokens"]}
    if ids["<|endoftext|>"] != SPECIAL_TOKENS.index("<|endoftext|>"):
        raise RuntimeError("tokenizer special tokens are not where expected")
    _fill_vocabulary(staging / "tokenizer.json", PRESETS[name].get("text_config", PRESETS[name])["vocab_size"])
    config = dict(PRESETS[name])
    config.update(
        architectures=[_ARCHITECTURES[config["model_type"]]],
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        torch_dtype="bfloat16",
    )
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    if qwen3:
        processor = qwen3_checkpoint.image_processor_config()  # the published limits
        # and its video processor's (Qwen2.5-VL ships none: HF's video processor reads the image config)
        (staging / "video_preprocessor_config.json").write_text(json.dumps(
            {k: v for k, v in qwen3_checkpoint.video_processor_config().items()
             if k not in ("cap_pixels_per_frame", "max_video_tokens")}, indent=2))
    else:
        processor = image_processor_config(config["model_type"], REAL_MAX_PIXELS)
        processor["min_pixels"] = REAL_MIN_PIXELS
    (staging / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    try:
        staging.rename(path)
    except OSError:  # written concurrently by another process
        pass
    return path


def _fill_vocabulary(tokenizer_json, vocab_size: int) -> None:
    """Give the small trained tokenizer the model's full vocabulary: every id a random-weight model can
    emit then decodes to a short word (``w123456``), so streamed text and its timing behave as with a
    real tokenizer. The fillers have no merges: prompts never tokenize into them."""
    raw = json.loads(tokenizer_json.read_text())
    vocab = raw["model"]["vocab"]
    taken = set(vocab.values()) | {t["id"] for t in raw["added_tokens"]}
    for token_id in range(vocab_size):
        if token_id not in taken:
            vocab[f"w{token_id}"] = token_id
    tokenizer_json.write_text(json.dumps(raw))

