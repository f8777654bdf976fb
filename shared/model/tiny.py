"""A tiny random-weight Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint, written as a real HF checkpoint directory.

It is the embedded default (``epd up`` with no ``--model``) and the model every test runs against: config,
safetensors, a byte-level BPE tokenizer trained on the spot, the family's chat template and an image
processor config. Everything loads through the same path as a downloaded checkpoint.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from shared.model import qwen3_checkpoint
from shared.model.config import QWEN3_FAMILIES
from shared.model.presets import TINY_DIR, cache_dir

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# The chat template format of the Qwen2-VL family (system prompt by default, one placeholder triple per image),
# with the Qwen2.5 tool section: tools listed in the system turn, calls as <tool_call>{json}</tool_call>,
# results as <tool_response> blocks in a user turn. Without tools it renders exactly as the family's.
_TOOLS_SYSTEM = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% else %}You are a helpful assistant.{% endif %}"
    "{{ '\\n' }}\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n' }}</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\n</tool_call><|im_end|>\n{% endif %}"
)
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}" + _TOOLS_SYSTEM +
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ message['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}"
    "{% if loop.first and message['role'] != 'system' and not tools %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}"
    "{% endif %}"
    "{% if message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    "{% if call['function'] is defined %}{% set call = call['function'] %}{% endif %}"
    "{{ '\\n' }}<tool_call>\n{\"name\": \"{{ call['name'] }}\", \"arguments\": {{ call['arguments'] | tojson }}}\n</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Describe the image in one sentence. What colour is the square?",
    "A photo of a cat sitting on a red chair next to a window.",
    "Hello! How are you today? I am fine, thank you.",
    "Encoder, prefill and decode run as separate services on NATS.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159",
    "Café, naïve, über, 東京, Пример, 😀 emoji and multi-byte text.",
    "def main():\n    return 42\n",
    "You are a helpful assistant. user assistant system",
]


def _train_tokenizer(vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    pattern = (
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
        r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
    )
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tok


def write_tokenizer(path: Path, vocab_size: int, chat_template: str = CHAT_TEMPLATE) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(vocab_size),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
    )
    fast.chat_template = chat_template
    fast.save_pretrained(path)
    # Checkpoints of these families ship the template in its own file too; keep the real layout.
    (path / "chat_template.json").write_text(json.dumps({"chat_template": chat_template}))


def image_processor_config(family: str, max_pixels: int) -> dict:
    if family in QWEN3_FAMILIES:
        return qwen3_checkpoint.image_processor_config(min_pixels=32 * 32 * 4, max_pixels=max_pixels)
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor" if family == "qwen2_5_vl" else "Qwen2VLProcessor",
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "rescale_factor": 1 / 255,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "resample": 3,
        "min_pixels": 28 * 28 * 4,
        "max_pixels": max_pixels,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
    }


def video_processor_config(family: str) -> dict:
    """Small budgets, so a test clip costs a few dozen tokens: at most 16 per temporal patch (Qwen2 rule,
    per frame) and a per-frame cap of 16 tokens' pixels (Qwen3 rule), frames sampled at 2 per second."""
    if family in QWEN3_FAMILIES:
        return qwen3_checkpoint.video_processor_config(min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 128,
                                                       max_video_tokens=16, max_frames=64)
    return {
        "video_processor_type": "Qwen2VLVideoProcessor",
        "processor_class": "Qwen2_5_VLProcessor" if family == "qwen2_5_vl" else "Qwen2VLProcessor",
        "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
        "do_sample_frames": True, "fps": 2, "min_frames": 4, "max_frames": 64,
        "rescale_factor": 1 / 255,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "resample": 3,
        "size": {"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 16},
        "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
        "cap_pixels_per_frame": True, "max_video_tokens": 64,
    }


def _model_config(family: str, vocab_size: int, token_ids: dict[str, int]):
    if family in QWEN3_FAMILIES:
        return qwen3_checkpoint.tiny_config(family, vocab_size, token_ids)
    text = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
        bos_token_id=token_ids["<|endoftext|>"],
        eos_token_id=token_ids["<|im_end|>"],
        initializer_range=0.2,
    )
    ids = dict(
        image_token_id=token_ids["<|image_pad|>"],
        video_token_id=token_ids["<|video_pad|>"],
        vision_start_token_id=token_ids["<|vision_start|>"],
        vision_end_token_id=token_ids["<|vision_end|>"],
    )
    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig

        vision = dict(
            depth=3,
            hidden_size=32,
            intermediate_size=60,  # not a multiple of 64, like the real 3,420: exercises the padded MLP
            num_heads=2,
            out_hidden_size=64,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,
            fullatt_block_indexes=[1],
            tokens_per_second=2,
            initializer_range=0.2,
        )
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
    if family == "qwen2_vl":
        from transformers import Qwen2VLConfig

        vision = dict(
            depth=2,
            embed_dim=32,
            hidden_size=64,
            mlp_ratio=2,
            num_heads=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            initializer_range=0.2,
        )
        return Qwen2VLConfig(text_config=text, vision_config=vision, **ids)
    raise ValueError(f"unknown tiny model family {family!r}: use 'qwen2_5_vl', 'qwen2_vl', 'qwen3_vl' or 'qwen3_vl_moe'")


def write_tiny_checkpoint(path: str | os.PathLike, family: str = "qwen2_5_vl", seed: int = 0,
                          max_pixels: int | None = None) -> Path:
    """Write a tiny random-weight checkpoint of ``family`` into ``path`` and return it.

    ``max_pixels`` caps the resized image area; by default an image costs at most 64 tokens (patches
    of 14 pixels, 16 for Qwen3-VL, merged 2 × 2).
    """
    qwen3 = family in QWEN3_FAMILIES
    if max_pixels is None:
        max_pixels = (32 * 32 if qwen3 else 28 * 28) * 64
    from transformers import AutoModelForImageTextToText

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    write_tokenizer(path, vocab_size=600, chat_template=qwen3_checkpoint.CHAT_TEMPLATE if qwen3 else CHAT_TEMPLATE)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    token_ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = _model_config(family, len(tokenizer), token_ids)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = token_ids["<|im_end|>"]
    model.generation_config.pad_token_id = token_ids["<|endoftext|>"]
    model.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(image_processor_config(family, max_pixels), indent=2))
    (path / "video_preprocessor_config.json").write_text(json.dumps(video_processor_config(family), indent=2))
    return path


def default_tiny_checkpoint() -> Path:
    """The built-in model: written once per user into a cache directory, reused afterwards."""
    root = cache_dir()
    path = root / TINY_DIR
    if not (path / "config.json").exists():
        staging = Path(tempfile.mkdtemp(dir=root.mkdir(parents=True, exist_ok=True) or root))
        write_tiny_checkpoint(staging)
        try:
            staging.rename(path)
        except OSError:  # another process wrote it first
            pass
    return path
