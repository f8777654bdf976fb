"""What a Qwen3-VL checkpoint directory holds besides weights: its chat template, its image-processor
settings, and the tiny architectures the tests write (``shared.model.tiny``) — dense and MoE.

The image processor is Qwen2-VL's (transformers maps ``qwen3_vl`` to it, PIL backend included) with
16-pixel patches: sides are resized to multiples of 32 (patch × merge) with the area kept within
``size`` = {shortest_edge: min pixels, longest_edge: max pixels}, and normalized with mean = std = 0.5.
"""

from __future__ import annotations

# The published limits: at least 256 × 256 pixels, at most 4096 × 4096 (a 1080p image: 2,040 tokens).
MIN_PIXELS = 65536
MAX_PIXELS = 16777216
# The published video processor's: a whole clip within 4096 … 25,165,824 pixels (t × h × w).
VIDEO_MIN_PIXELS = 4096
VIDEO_MAX_PIXELS = 25165824

# The Qwen3-VL Instruct template's format: no default system prompt, one placeholder triple per image.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def image_processor_config(min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS) -> dict:
    return {
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "processor_class": "Qwen3VLProcessor",
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "rescale_factor": 1 / 255,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "resample": 3,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
    }


def video_processor_config(min_pixels: int = VIDEO_MIN_PIXELS, max_pixels: int = VIDEO_MAX_PIXELS,
                           max_video_tokens: int = 768, max_frames: int = 768) -> dict:
    """Qwen3-VL's video processor: ``size`` bounds the whole clip (t × h × w pixels), frames at 2 per second."""
    return {
        "video_processor_type": "Qwen3VLVideoProcessor",
        "processor_class": "Qwen3VLProcessor",
        "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
        "do_sample_frames": True, "fps": 2, "min_frames": 4, "max_frames": max_frames,
        "rescale_factor": 1 / 255,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "resample": 3,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
        "cap_pixels_per_frame": True, "max_video_tokens": max_video_tokens,
    }


def tiny_config(family: str, vocab_size: int, token_ids: dict[str, int]):
    """The HF config of a tiny random Qwen3-VL of ``family`` (``qwen3_vl`` or ``qwen3_vl_moe``).

    Small, but every feature is there: head_dim × heads ≠ hidden, grouped KV heads, interleaved
    M-RoPE, two deepstack levels (one from the last block), and for MoE a dense layer among the
    expert layers and a hidden size distinct from 2 × the expert width (so an expert tensor's layout
    is never ambiguous)."""
    text = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0,
                                            "mrope_section": [6, 5, 5], "mrope_interleaved": True},
        bos_token_id=token_ids["<|endoftext|>"], eos_token_id=token_ids["<|im_end|>"], initializer_range=0.2,
    )
    vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=36,
                  deepstack_visual_indexes=[0, 2], initializer_range=0.2)
    ids = dict(image_token_id=token_ids["<|image_pad|>"], video_token_id=token_ids["<|video_pad|>"],
               vision_start_token_id=token_ids["<|vision_start|>"], vision_end_token_id=token_ids["<|vision_end|>"],
               tie_word_embeddings=False)
    if family == "qwen3_vl":
        from transformers import Qwen3VLConfig

        return Qwen3VLConfig(text_config=text, vision_config=vision, **ids)
    from transformers import Qwen3VLMoeConfig

    text.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, decoder_sparse_step=1,
                mlp_only_layers=[1])
    return Qwen3VLMoeConfig(text_config=text, vision_config=vision, **ids)
