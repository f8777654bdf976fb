"""Qwen3-VL, dense and MoE, through the whole stack: the official openai client against real services
(two encoders, a prefill and a decode worker; the aggregated process for MoE) gives HF generate()'s
greedy output. Deepstack levels ride in the embedding rows across encoders, the data plane and the
prefill → decode hand-off. `epd plan` sizes the embeddings with them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from shared.model.config import ModelConfig
from shared.model.tiny import write_tiny_checkpoint
from tests.support import (Chat, Reference, RunningStack, chat_messages, hf_image_embeds, image_embeds_part, make_image,
                           openai_chat)

MAX_TOKENS = 16

CASES = {
    "text-only": ("Hello! How are you today?", []),
    "one-image": ("Describe the image in one sentence.", [(11, 100, 150)]),
    "three-images": ("What colour is the square?", [(21, 60, 200), (22, 90, 90), (23, 300, 70)]),
    "two-images": ("A photo of a cat", [(31, 128, 128), (32, 50, 260)]),
}


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_vl_moe"])
def family_model(request, tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), family=request.param)
    return request.param, path, Reference(path)


@pytest.fixture(scope="module")
def qwen3_stack(family_model, nats_url):
    _, path, _ = family_model
    running = RunningStack(nats_url, path).start(encoders=2, frontend_args=("--max-output-tokens", "64"))
    yield running
    running.stop()


def expected(reference: Reference, case: str) -> tuple[str, int, int]:
    text, specs = CASES[case]
    images = [make_image(*spec) for spec in specs]
    ids = reference.generate(text, images, MAX_TOKENS)
    return reference.text(ids), len(ids), reference.inputs(text, images)["input_ids"].shape[1]


def ask(client, case: str, stream: bool = False):
    text, specs = CASES[case]
    return openai_chat(client, chat_messages(text, [make_image(*s) for s in specs]), MAX_TOKENS, stream)


@pytest.mark.parametrize("case,stream", [("text-only", False), ("one-image", True), ("three-images", False)])
def test_greedy_output_equals_hf(qwen3_stack, family_model, case, stream):
    text, completion_tokens, prompt_tokens = expected(family_model[2], case)
    content, usage = ask(qwen3_stack.client(), case, stream)
    assert content == text
    assert (usage.completion_tokens, usage.prompt_tokens) == (completion_tokens, prompt_tokens)


def test_concurrent_requests_equal_hf(qwen3_stack, family_model):
    cases = list(CASES) * 2
    client = qwen3_stack.client()
    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(lambda case: ask(client, case)[0], cases))
    for case, answer in zip(cases, answers):
        assert answer == expected(family_model[2], case)[0], case


def test_image_embeds_carry_their_deepstack_levels(qwen3_stack, family_model):
    """A client's precomputed rows, as HF's tower makes them: the merger's output with each deepstack level
    beside it (``out_dim × (1 + levels)`` wide). The answer is the image's; the merger's output alone is a
    400 that names the levels."""
    _, path, reference = family_model
    text, [spec] = CASES["one-image"]
    rows, grid = hf_image_embeds(reference, make_image(*spec))
    messages = [{"role": "user", "content": [image_embeds_part(rows, grid), {"type": "text", "text": text}]}]
    assert openai_chat(qwen3_stack.client(), messages, MAX_TOKENS)[0] == expected(reference, "one-image")[0]
    out_dim = ModelConfig.from_checkpoint(path).vision.out_dim
    messages[0]["content"][0] = image_embeds_part(rows[:, :out_dim].contiguous(), grid)
    with pytest.raises(openai.BadRequestError) as err:
        openai_chat(qwen3_stack.client(), messages, MAX_TOKENS)
    assert "deepstack levels" in err.value.response.json()["error"]["message"]


def test_the_aggregated_process_serves_the_same(family_model, nats_url):
    """The aggregated process (its ViT in the engine thread, between steps), concurrent requests: their
    images sent as pixels with the prompt and encoded in place (the embeddings placed from the batcher's
    hooks), the text-only one with none; then a conversation whose returning images are left out: every
    answer HF's."""
    family, path, reference = family_model
    if family != "qwen3_vl_moe":
        pytest.skip("one aggregated stack is enough: the MoE one")
    running = RunningStack(nats_url, path)
    running.spawn("aggregated")
    try:
        running.start(encoders=0, prefills=0, decodes=0)
        running.wait_for({"aggregated": 1, "frontend": 1})
        cases = ["one-image", "two-images", "three-images", "text-only"]
        with ThreadPoolExecutor(len(cases)) as pool:
            answers = list(pool.map(lambda case: ask(running.client(), case)[0], cases))
        for case, answer in zip(cases, answers):
            assert answer == expected(reference, case)[0], case
        [worker] = running.figures("aggregated")
        assert worker["images"] == 6  # through its ViT (six different images)
        assert (worker["prompts_in_place"], worker["images_in_place"]) == (3, 6)
        # where the first_token stage goes: every prompt timed once in the engine; the intake of the one
        # that came with no images
        assert worker["prompt_wait_count"] == worker["prompt_prefill_count"] == len(cases)
        assert worker["prompt_intake_count"] == 1
        # the intake's parts: its pulls, then the engine thread taking the prompt, within the whole
        assert worker["prompt_pull_count"] == worker["prompt_handoff_count"] == worker["prompt_intake_count"]
        assert worker["prompt_pull_seconds_total"] + worker["prompt_handoff_seconds_total"] <= \
            worker["prompt_intake_seconds_total"]
        # a conversation resending its images: turn 2's are left out (its KV and deepstack rows come from
        # the prefix cache), turn 3 brings a new one, encoded in place beside the cached two
        chat = Chat("moe", max_tokens=MAX_TOKENS).user("Describe both.", make_image(41, 112, 84), make_image(42, 56, 140))
        chat.assistant(chat.ask(running)).user("Which one is larger?")
        assert chat.ask(running) == chat.expected(reference)
        chat.assistant("The second.").user("And this one?", make_image(43, 84, 84))
        assert chat.ask(running) == chat.expected(reference)
        [after] = running.figures("aggregated")
        assert after["images_cached"] - worker.get("images_cached", 0) == 4
        assert after["images_in_place"] - worker["images_in_place"] == 3
    finally:
        running.stop()


def test_plan_sizes_embeddings_with_their_deepstack_levels(family_model, tmp_path):
    """`epd plan` on Qwen3-VL: costs measured with the model's own embedding rows (deepstack included)."""
    family, path, _ = family_model
    if family != "qwen3_vl_moe":
        pytest.skip("one plan is enough: the MoE one")
    out = tmp_path / "plan.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    done = subprocess.run([sys.executable, "-m", "launcher.cli", "plan", "--model", str(path), "--image-count", "2",
                           "--image-resolution", "128x128", "--input-len", "16", "--output-len", "8",
                           "--request-rate", "0.1", "--gpus", "2", "--max-model-len", "512",
                           "--corun-seconds", "0.1", "--out", str(out)], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "recommended:" in done.stdout
    config = ModelConfig.from_checkpoint(path)
    assert json.loads(out.read_text())["embedding_bytes"] == config.embedding_width * 4  # float32 on CPU


def test_video_equals_hf(qwen3_stack, family_model):
    """Qwen3-VL video: a timestamp before each temporal patch's run, every run its own (1, h, w) grid in
    M-RoPE, deepstack rows sliced per run; with an image beside it."""
    from tests.test_video import ask as ask_video, expected as expected_video
    from tests.video_support import VideoReference

    _, path, reference = family_model
    video_reference = VideoReference(reference, path)
    for case in ("one-video", "image-and-video"):
        content, usage = ask_video(qwen3_stack.client(), case)
        text, completion_tokens, prompt_tokens = expected_video(video_reference, case)
        assert content == text, case
        assert (usage.completion_tokens, usage.prompt_tokens) == (completion_tokens, prompt_tokens)
