"""How ``epd up`` divides a shared GPU (launcher/memory.py): shares that add up, weights counted exactly,
the context lowered where the room is small, and a refusal that says what to change.

The plans are pure arithmetic over the model's own classes, so they are checked here for the real
architectures (the presets) on an H200's memory; tests/test_up.py starts stacks with them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from launcher.memory import GIB, MemoryPlanError, plan, process_needs
from launcher.topology import Placement
from shared.model.config import ModelConfig
from shared.model.loader import load_language_model, load_vision_tower, parameter_bytes
from shared.model.presets import materialize_preset
from shared.model.tiny import write_tiny_checkpoint

H200 = 143771 << 20
DEFAULTS = SimpleNamespace(max_batch_patches=65536, max_batched_tokens=0, max_num_seqs=256, max_model_len=0,
                           kv_cache_mb=0)


def layout(*kinds: str) -> list[Placement]:
    return [Placement(kind, "0") for kind in kinds]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl_moe"])
def test_weights_are_counted_as_loaded(tmp_path, family):
    path = write_tiny_checkpoint(tmp_path / family, family=family)
    config = ModelConfig.from_checkpoint(path)
    text = load_language_model(path, config, dtype=torch.bfloat16)
    vision = load_vision_tower(path, config, dtype=torch.bfloat16)
    held = {id(p): p.numel() * p.element_size() for p in text.parameters()}  # a tied lm_head once
    assert parameter_bytes(config, "text") == sum(held.values())
    assert parameter_bytes(config, "vision") == sum(p.numel() * p.element_size() for p in vision.parameters())


@pytest.mark.parametrize("preset", ["qwen2.5-vl-7b", "qwen3-vl-30b-a3b"])
@pytest.mark.parametrize("kinds", [("encoder", "language"), ("encoder", "encoder", "language"),
                                   ("encoder", "prefill", "decode")])
def test_every_default_layout_fits_one_h200(preset, kinds):
    model = ModelConfig.from_checkpoint(materialize_preset(preset))
    envs, longest = plan(layout(*kinds), model, DEFAULTS, 0.9, {"0": H200})
    taken = 0
    for kind in kinds:
        env, needs = envs[(kind, "0")], process_needs(kind, model, DEFAULTS)
        if kind == "encoder":
            room = (int(env["EPD_ENCODER_CACHE_MB"]) + int(env["EPD_DATA_MAX_MB"])) << 20
            assert int(env["EPD_DATA_MAX_MB"]) >= 1024  # embeddings can always be handed out
            taken += needs.fixed + room
        else:
            # a prefill worker's store of KV chunks is bounded apart from its share
            share = float(env["EPD_GPU_MEMORY_UTILIZATION"]) * H200 + int(env.get("EPD_DATA_MAX_MB", 0)) * 2**20
            assert share > needs.fixed  # weights, context and working room, then a KV pool
            taken += share
    assert taken <= 0.9 * H200  # shares are rounded down
    # two copies of the 30B-A3B's 61 GB leave the split layout ~1.4 GB of KV on one H200
    assert longest >= (4096 if (preset, kinds) == ("qwen3-vl-30b-a3b", ("encoder", "prefill", "decode")) else 8192)
    if preset == "qwen2.5-vl-7b" or kinds[-1] == "language":
        assert longest >= model.text.max_position_embeddings  # nothing to lower


def test_a_gpu_too_small_is_refused_with_what_to_change():
    model = ModelConfig.from_checkpoint(materialize_preset("qwen3-vl-30b-a3b"))
    with pytest.raises(MemoryPlanError, match="--gpu-memory-utilization 0.9 gives the stack"):
        plan(layout("encoder", "prefill", "decode"), model, DEFAULTS, 0.9, {"0": 80 * GIB})


def test_processes_alone_on_their_gpus_keep_their_own_share():
    model = ModelConfig.from_checkpoint(materialize_preset("qwen2.5-vl-7b"))
    placements = [Placement("encoder", "1"), Placement("language", "0")]
    envs, longest = plan(placements, model, DEFAULTS, 0.9, {"0": H200, "1": H200})
    assert envs == {} and longest >= model.text.max_position_embeddings  # nothing to share, nothing to lower


def test_a_context_no_lone_pool_holds_is_lowered_to_what_it_holds():
    """The 30B-A3B aggregated on one H100 with defaults (2026-12-06): its 61 GB of weights left a KV pool of
    7,608 blocks of 16 tokens, no room for one sequence of its 262,144-token context, and the worker
    refused to start three times. Planned, the stack's context is lowered to what that pool holds."""
    model = ModelConfig.from_checkpoint(materialize_preset("qwen3-vl-30b-a3b"))
    envs, longest = plan(layout("aggregated"), model, DEFAULTS, 0.9, {"0": 81559 << 20})
    assert envs == {} and 32768 <= longest <= 7608 * 16
    # no room at all: the worker's own start says what does not fit (the plan refuses shared GPUs only)
    assert plan(layout("aggregated"), model, DEFAULTS, 0.5, {"0": 81559 << 20}) == ({}, 0)


def test_a_warm_start_plans_without_torch(tmp_path):
    """Weights are counted once per configuration: the next ``epd up`` reads the count from the cache
    directory and never imports torch to plan (seconds of a start on a GPU host)."""
    model = ModelConfig.from_checkpoint(materialize_preset("qwen3-vl-30b-a3b", root=tmp_path))
    script = ("import sys; from types import SimpleNamespace as N; from launcher.memory import process_needs; "
              "from shared.model.config import ModelConfig; from shared.model.presets import materialize_preset; "
              "model = ModelConfig.from_checkpoint(materialize_preset('qwen3-vl-30b-a3b')); "
              f"print(process_needs('aggregated', model, N(**{vars(DEFAULTS)!r})).fixed, 'torch' in sys.modules)")
    env = {**os.environ, "EPD_CACHE_DIR": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
            for _ in range(2)]
    (first, counted), (second, read) = (run.stdout.split() for run in runs)
    assert int(first) == int(second) == process_needs("aggregated", model, DEFAULTS).fixed
    assert (counted, read) == ("True", "False")


def test_the_lowered_context_fits_the_pools_the_workers_sized():
    """The 30B-A3B split on one H200 with defaults (2026-12-05): the workers sized 491 (prefill) and 725
    (decode) blocks of 16 tokens from their shares; the plan's context had said 11,008 tokens, more than the
    prefill pool holds, and the prefill worker could not start."""
    model = ModelConfig.from_checkpoint(materialize_preset("qwen3-vl-30b-a3b"))
    envs, longest = plan(layout("encoder", "prefill", "decode"), model, DEFAULTS, 0.9, {"0": H200})
    shares = {envs[(kind, "0")]["EPD_GPU_MEMORY_UTILIZATION"] for kind in ("prefill", "decode")}
    assert shares == {"0.4254"}  # the shares those workers had
    assert 0 < longest <= 491 * 16


def test_a_kv_pool_set_for_every_worker_is_part_of_what_they_need():
    """``--kv-cache-mb`` gives every language worker that pool whatever its share: the 7B split on one H100
    with 20 GiB pools (2026-12-06) left its encoder 4 GiB, and every image request failed out of memory at the
    encoder's first batch. Planned, that stack is refused at start with what to change; a pool that fits is
    kept, and the context is lowered to what the set pool holds."""
    model = ModelConfig.from_checkpoint(materialize_preset("qwen2.5-vl-7b"))
    h100, split = {"0": 81559 << 20}, layout("encoder", "prefill", "decode")
    plan(split, model, DEFAULTS, 0.9, h100)  # pools sized from the shares fit
    pools = SimpleNamespace(**{**vars(DEFAULTS), "kv_cache_mb": 20480})
    with pytest.raises(MemoryPlanError, match=r"with --kv-cache-mb 20480 each .* lower --kv-cache-mb"):
        plan(split, model, pools, 0.9, h100)
    small = SimpleNamespace(**{**vars(DEFAULTS), "kv_cache_mb": 1024})
    _, longest = plan(split, model, small, 0.9, h100)
    assert 0 < longest <= (1024 << 20) // process_needs("decode", model, small).kv_per_token
    assert process_needs("decode", model, small).fixed - process_needs("decode", model, DEFAULTS).fixed == 1024 << 20
