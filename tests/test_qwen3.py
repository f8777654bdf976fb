"""Qwen3-VL, dense and MoE, against HF transformers on tiny random checkpoints (fp32, CPU): the vision
tower with deepstack, the language model, role-split loading, image geometry, and the engine's greedy
output token for token (text only, one image, images of different sizes, concurrent sequences, the
prefill → decode KV hand-off)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.engine.engine import Engine
from shared.engine.kv_cache import KVCache
from shared.engine.runner import ModelRunner
from shared.messages.sampling import SamplingParams
from shared.engine.sequence import ImageInput, Sequence
from shared.model.config import ModelConfig
from shared.model.geometry import ImageGeometry
from shared.model.loader import load_language_model, load_vision_tower, read_role_tensors
from shared.model.processor import ImagePreprocessor, TorchImagePreprocessor
from shared.model.tiny import write_tiny_checkpoint
from tests.support import Reference, make_image, tower_plain_and_in_pieces

FAMILIES = ("qwen3_vl", "qwen3_vl_moe")

PROMPTS = [
    ("Hello! How are you today?", []),
    ("Describe the image in one sentence.", [(1, 100, 150)]),
    ("What colour is the square?", [(2, 60, 200), (3, 90, 90), (4, 200, 64)]),
    ("Numbers: 0 1 2 3", [(5, 300, 220)]),
]


@pytest.fixture(scope="module", params=FAMILIES)
def qwen3(request, tmp_path_factory):
    """(family, checkpoint, config, HF reference, our language model, our tower)."""
    path = write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), family=request.param)
    config = ModelConfig.from_checkpoint(path)
    return (request.param, path, config, Reference(path), load_language_model(path, config),
            load_vision_tower(path, config))


@pytest.fixture(scope="module")
def requests_with_reference(qwen3):
    """Each prompt as (token ids, image inputs built by our tower, max tokens, HF's greedy output)."""
    _, _, config, reference, _, tower = qwen3
    built = []
    for i, (text, specs) in enumerate(PROMPTS):
        images = [make_image(*spec) for spec in specs]
        max_tokens = 8 + 3 * i
        inputs = reference.inputs(text, images)
        ids = inputs["input_ids"][0].tolist()
        image_inputs = []
        if images:
            grids = [tuple(int(x) for x in g) for g in inputs["image_grid_thw"]]
            with torch.no_grad():
                embeds = tower(inputs["pixel_values"], grids).split([t * h * w // 4 for t, h, w in grids])
            starts = [j for j, t in enumerate(ids) if t == config.image_token_id and
                      (j == 0 or ids[j - 1] != config.image_token_id)]
            image_inputs = [ImageInput(o, g, e) for o, g, e in zip(starts, grids, embeds)]
        built.append((ids, image_inputs, max_tokens, reference.generate(text, images, max_tokens)))
    return built


def make_engine(qwen3, role="both", num_blocks=128) -> Engine:
    _, _, config, _, lm, _ = qwen3
    cache = KVCache(config.text, num_blocks, 16, torch.float32, "cpu")
    return Engine(ModelRunner(lm, cache, config.vision.merge_size), config.eos_token_ids,
                  max_model_len=(num_blocks - 1) * 16, role=role)


def sequence(i: int, request) -> Sequence:
    ids, images, max_tokens, _ = request
    return Sequence(f"r{i}", list(ids), len(ids), SamplingParams(temperature=0, max_tokens=max_tokens), images=images)


def run_to_completion(engine: Engine) -> None:
    while engine.has_work():
        engine.step()


# -- configuration, geometry, loading ----------------------------------------------------------------
def test_config_normalizes_qwen3_fields(qwen3):
    family, path, config, _, _, _ = qwen3
    raw = json.loads((path / "config.json").read_text())
    text, vision = raw["text_config"], raw["vision_config"]
    assert config.text.head_dim == text["head_dim"] != config.text.hidden_size // config.text.num_heads
    assert config.text.qk_norm and config.text.mrope_interleaved and not config.text.attention_bias
    assert config.vision.deepstack_layers == tuple(vision["deepstack_visual_indexes"])
    assert config.embedding_width == vision["out_hidden_size"] * (1 + len(vision["deepstack_visual_indexes"]))
    assert config.text.tie_word_embeddings is False  # the top-level flag, not the MoE text_config's default
    if family == "qwen3_vl_moe":
        assert config.text.moe.layers == (0, 2) and config.text.moe.top_k == text["num_experts_per_tok"]
    else:
        assert config.text.moe is None


def test_geometry_and_preprocessing_match_the_checkpoints_processor(qwen3):
    """Patch 16, merge 2, ``size`` limits: the frontend's token count is the grid the processor makes;
    the torch preprocessor gives the PIL processor's patches bit for bit."""
    _, path, _, _, _, _ = qwen3
    geometry = ImageGeometry.from_checkpoint(path)
    pil, on_device = ImagePreprocessor(path), TorchImagePreprocessor(path)
    assert (geometry.patch_size, geometry.min_pixels, geometry.max_pixels) == (16, 32 * 32 * 4, 32 * 32 * 64)
    for seed, height, width in [(1, 600, 900), (2, 20, 30), (3, 100, 150), (4, 64, 64), (5, 300, 200)]:
        pixels = np.asarray(make_image(seed, height, width))
        expected, grid = pil(pixels)
        assert geometry.grid(height, width) == grid
        got = on_device(torch.from_numpy(pixels.copy()))
        assert got.shape == expected.shape
        assert torch.equal(got, torch.from_numpy(expected)), (height, width)


def test_roles_read_only_their_own_tensors(qwen3):
    _, path, _, _, _, _ = qwen3
    vision = [name for name, _ in read_role_tensors(path, "vision")]
    text = [name for name, _ in read_role_tensors(path, "text")]
    assert any(n.startswith("deepstack_merger_list.") for n in vision) and "pos_embed.weight" in vision
    assert not any(n.startswith(("layers.", "embed_tokens", "lm_head")) for n in vision)
    assert not any(n.startswith(("blocks.", "merger.", "deepstack", "pos_embed", "patch_embed")) for n in text)


def test_published_expert_layout_loads_the_same(qwen3, tmp_path):
    """The published MoE checkpoints store experts as [E, in, out]; ours (transformers 5's) [E, out, in]."""
    family, path, config, _, lm, _ = qwen3
    if family != "qwen3_vl_moe":
        pytest.skip("dense model")
    tensors = load_file(str(path / "model.safetensors"))
    published = {k: v.transpose(1, 2).contiguous() if ".experts." in k else v for k, v in tensors.items()}
    assert any(".experts." in k for k in published)
    for name in ("config.json", "preprocessor_config.json"):
        (tmp_path / name).write_text((path / name).read_text())
    save_file(published, str(tmp_path / "model.safetensors"))
    reloaded = load_language_model(tmp_path, config)
    for (name, ours), (_, theirs) in zip(lm.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(ours, theirs), name


# -- model level ---------------------------------------------------------------------------------------
def test_vision_tower_with_deepstack_matches_hf(qwen3):
    """One packed forward of images of different sizes = HF's merger output and deepstack features, side
    by side in each row."""
    _, path, _, reference, _, tower = qwen3
    images = [np.asarray(make_image(s, h, w)) for s, h, w in [(1, 100, 150), (2, 64, 64), (3, 40, 300)]]
    pixels = reference.processor(images=images, return_tensors="pt")
    grids = [tuple(int(x) for x in g) for g in pixels["image_grid_thw"]]
    with torch.no_grad():
        ours = tower(pixels["pixel_values"], grids)
        hf = reference.model.model.get_image_features(pixels["pixel_values"], pixels["image_grid_thw"],
                                                      return_dict=True)
    expected = torch.cat([torch.cat(hf.pooler_output), *(torch.cat(f) for f in hf.deepstack_features)], dim=-1)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)


def test_vision_tower_in_pieces_matches_its_plain_forward(qwen3):
    """Qwen3-VL's tower (LayerNorm, x + attn(norm(x))) through ``shared.model.pieces``, run eagerly and padded
    up to a bucket, with the deepstack levels merged out between pieces: images of three sizes in one
    forward — the same embeddings and levels as its plain forward (itself checked against HF's tower)."""
    _, _, config, _, _, tower = qwen3
    plain, pieced = tower_plain_and_in_pieces(tower, config.vision.patch_dim, [(1, 8, 12), (1, 16, 16), (1, 4, 4)])
    assert config.vision.deepstack_layers and pieced.shape == plain.shape
    torch.testing.assert_close(pieced, plain, rtol=1e-5, atol=1e-5)


# -- engine level: greedy output equals HF generate() --------------------------------------------------
def test_each_request_alone(qwen3, requests_with_reference):
    for i, request in enumerate(requests_with_reference):
        engine = make_engine(qwen3)
        seq = sequence(i, request)
        engine.add_prompt(seq)
        run_to_completion(engine)
        assert seq.output_ids == request[3], f"prompt {i}"
        assert engine.blocks.num_free == engine.blocks.num_blocks


def test_concurrent_requests_in_one_batch(qwen3, requests_with_reference):
    """All prompts in one packed prefill (deepstack rows of several sequences at once), then decoded
    together."""
    engine = make_engine(qwen3)
    seqs = [sequence(i, r) for i, r in enumerate(requests_with_reference)]
    for seq in seqs:
        engine.add_prompt(seq)
    assert len(engine.step()) == len(seqs)
    run_to_completion(engine)
    for seq, request in zip(seqs, requests_with_reference):
        assert seq.output_ids == request[3], seq.request_id


def test_the_gpu_path_kernels_generate_hf_tokens(qwen3, requests_with_reference, monkeypatch):
    """The Triton attention backend (QK-norm inside its rotary kernel) and the few-rows decoder layer
    (norms fused into GEMVs) in Triton's interpreter, inside the real engine, on the two shortest prompts
    (text only; one image, with deepstack): decode steps of 2 rows, then 1 — each output a prefix of HF's
    greedy one. Short, because the interpreter is slow (the rotary kernel's program per prompt token)."""
    pytest.importorskip("triton")
    from shared.engine.attention import TritonAttention
    from tests.test_kernels import force_few_rows

    taken = force_few_rows(monkeypatch)
    _, _, config, _, lm, _ = qwen3
    cache = KVCache(config.text, 128, 16, torch.float32, "cpu")
    engine = Engine(ModelRunner(lm, cache, config.vision.merge_size,
                                backend=TritonAttention(cache, config.text.head_dim ** -0.5)),
                    config.eos_token_ids, max_model_len=127 * 16)
    seqs = [sequence(i, (ids, images, 5 - 2 * i, expected)) for i, (ids, images, _, expected)
            in enumerate(requests_with_reference[:2])]
    for seq in seqs:
        engine.add_prompt(seq)
    run_to_completion(engine)
    for seq, request in zip(seqs, requests_with_reference):
        assert seq.output_ids == request[3][:len(seq.output_ids)] and len(seq.output_ids) == seq.sampling.max_tokens
    assert {1, 2} <= set(taken)


def test_the_gpu_path_kernels_in_pieces_generate_hf_tokens(qwen3, requests_with_reference):
    """The Triton attention backend (Triton's interpreter) between the pieces of ``shared.model.pieces``:
    its rotary + cache-write kernel rotating q and k in the pieces' shared q|k|v buffer, and a mixed step
    (the second prompt, one image, joining while the first decodes: the decode row through the decode
    attention kernel, the prompt through the paged prefill kernel) padded up to a bucket — each output a
    prefix of HF's greedy one."""
    pytest.importorskip("triton")
    from shared.engine.attention import TritonAttention
    from shared.model.pieces import language_pieces

    _, _, config, _, lm, _ = qwen3
    cache = KVCache(config.text, 128, 16, torch.float32, "cpu")
    engine = Engine(ModelRunner(lm, cache, config.vision.merge_size,
                                backend=TritonAttention(cache, config.text.head_dim ** -0.5)),
                    config.eos_token_ids, max_model_len=127 * 16)
    seqs = [sequence(i, (ids, images, 4, expected)) for i, (ids, images, _, expected)
            in enumerate(requests_with_reference[:2])]
    steps: list[int] = []  # decode rows of each step through the pieces
    chosen = lm.in_pieces
    lm.in_pieces = lambda embeds, batch: chosen(embeds, batch) and not steps.append(batch.num_decode)
    lm.pieces = language_pieces(lm, 256)
    try:
        engine.add_prompt(seqs[0])
        engine.step()
        engine.add_prompt(seqs[1])
        run_to_completion(engine)
    finally:
        lm.pieces = None
        del lm.in_pieces
    for seq, request in zip(seqs, requests_with_reference):
        assert seq.output_ids == request[3][:4]
    assert 1 in steps  # the mixed step went through the pieces


def test_prefill_steps_in_pieces_generate_hf_tokens(qwen3, requests_with_reference):
    """Prefill and mixed steps through ``shared.model.pieces`` (each step's rows padded up to a bucket; the
    pieces run eagerly here, on a GPU each is a CUDA graph): prompts joining while others decode, a step
    budget that splits the image prompts into chunks (an image cut between two chunks, its deepstack rows
    with it) — every output HF's. Steps larger than the largest bucket run the plain forward."""
    from shared.model.pieces import language_pieces

    _, _, config, _, lm, _ = qwen3
    cache = KVCache(config.text, 128, 16, torch.float32, "cpu")
    runner = ModelRunner(lm, cache, config.vision.merge_size)
    engine = Engine(runner, config.eos_token_ids, max_model_len=127 * 16, max_batched_tokens=96)
    pieces = language_pieces(lm, 64)
    used: list[int] = []
    run = pieces.run
    pieces.run = lambda first, *args: used.append(first.shape[0]) or run(first, *args)
    seqs = [sequence(i, r) for i, r in enumerate(requests_with_reference)]
    lm.pieces = pieces
    try:
        for step in range(200):
            if step < len(seqs):
                engine.add_prompt(seqs[step])
            if not engine.has_work():
                break
            engine.step()
    finally:
        lm.pieces = None
    for seq, request in zip(seqs, requests_with_reference):
        assert seq.output_ids == request[3], seq.request_id
    assert used and any(t not in pieces.buckets for t in used)  # padded steps among them
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_prefill_to_decode_hand_off(qwen3, requests_with_reference):
    """KV streamed layer by layer from a prefill engine into a decode engine's reservation."""
    prefill, decode = make_engine(qwen3, role="prefill"), make_engine(qwen3, role="decode")
    request = requests_with_reference[2]
    seq = sequence(2, request)
    moved = Sequence(seq.request_id, [0] * len(seq), len(seq), seq.sampling, num_computed=len(seq))
    decode.reserve(moved)

    def on_layer_done(layer, spans):  # each step's chunk of the prompt, as role prefill streams it
        for span in spans:
            kv = prefill.read_kv(span.seq, slice(layer, layer + 1), span.start, span.end)
            decode.write_kv(moved.request_id, kv, slice(layer, layer + 1), span.start)

    prefill.add_prompt(seq)
    while not seq.output_ids:
        prefill.step(on_layer_done)
    moved.token_ids, moved.rope_delta = list(seq.token_ids), seq.rope_delta
    decode.activate(moved.request_id)
    run_to_completion(decode)
    assert moved.output_ids == request[3]


# -- presets -------------------------------------------------------------------------------------------
def _parameters(config: ModelConfig) -> tuple[float, float]:
    """(all, active per token) language-model parameters, in billions."""
    t = config.text
    attention = t.hidden_size * 2 * (t.num_heads + t.num_kv_heads) * t.head_dim
    if t.moe:
        expert = 3 * t.hidden_size * t.moe.intermediate_size
        every, active = t.moe.num_experts * expert, t.moe.top_k * expert
    else:
        every = active = 3 * t.hidden_size * t.intermediate_size
    table = t.vocab_size * t.hidden_size * (1 if t.tie_word_embeddings else 2)
    return ((t.num_layers * (attention + every) + table) / 1e9, (t.num_layers * (attention + active) + table) / 1e9)


@pytest.mark.parametrize("name,total,active,deepstack", [
    ("qwen3-vl-2b", 1.7, 1.7, (5, 11, 17)),
    ("qwen3-vl-8b", 8.2, 8.2, (8, 16, 24)),
    ("qwen3-vl-30b-a3b", 30.5, 3.3, (8, 16, 24)),
    ("qwen3-vl-235b-a22b", 235.1, 22.1, (8, 16, 24)),
])
def test_presets_have_the_published_shapes(tmp_path, name, total, active, deepstack):
    from shared.model.presets import materialize_preset

    path = materialize_preset(name, tmp_path)
    config = ModelConfig.from_checkpoint(path)
    assert config.family == ("qwen3_vl_moe" if "-a" in name else "qwen3_vl")
    assert _parameters(config) == pytest.approx((total, active), abs=0.1)
    assert config.vision.patch_size == 16 and config.vision.deepstack_layers == deepstack
    assert config.text.mrope_interleaved and config.text.head_dim == 128
    geometry = ImageGeometry.from_checkpoint(path)
    assert (geometry.min_pixels, geometry.max_pixels) == (65536, 16777216)
    assert geometry.num_tokens(1080, 1920) == 2040
    assert ImagePreprocessor(path)._processor.size["longest_edge"] == 16777216  # the same limits in HF's reader


@pytest.mark.parametrize("name", ["qwen3-vl-8b", "qwen3-vl-30b-a3b"])
def test_preset_modules_have_hfs_parameters(tmp_path, name):
    """Our language model and tower, built (on the meta device) from a preset, hold exactly as many
    parameters as HF's model of the same config: 8.77 B and 31.07 B, the published totals."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from shared.model.presets import PRESETS, materialize_preset
    from shared.model.qwen3_text import Qwen3LanguageModel
    from shared.model.qwen3_vision import Qwen3VisionTower

    config = ModelConfig.from_checkpoint(materialize_preset(name, tmp_path))
    with torch.device("meta"):
        hf = AutoModelForImageTextToText.from_config(AutoConfig.for_model(**PRESETS[name]))
        ours = [Qwen3LanguageModel(config.text), Qwen3VisionTower(config.vision)]
    count = lambda *modules: sum(p.numel() for m in modules for p in m.parameters())  # noqa: E731
    assert count(*ours) == count(hf)
    assert count(ours[1]) == count(hf.model.visual)
