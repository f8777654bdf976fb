"""Video input through the whole stack: the official openai client sends ``video_url`` parts (data URLs)
to real services, and the answer is HF generate()'s greedy output on the same clip — Qwen2.5-VL on the
shared stack (two encoders, E/P/D), Qwen2-VL on an aggregated process (which also takes a client's image
embeddings there, beside pixels); Qwen3-VL is in test_qwen3_stack.

Bad clips get a 400 that says what is wrong, never a 500 or a hang, and the stack keeps serving.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys

import openai
import pytest
import torch

from shared.model.tiny import write_tiny_checkpoint
from tests.support import (Reference, RunningStack, data_url, endpoint_data, hf_image_embeds, image_embeds_part,
                           make_image, openai_chat)
from tests.video_support import VideoReference, make_clip, media_messages, video_url

MAX_TOKENS = 12
CLIP = (7, 20, 60, 80, 10)  # seed, frames, height, width, fps: 2 s → 4 sampled frames, grid (2, 4, 6)
CASES = {
    "one-video": ("Describe the video in one sentence.", [("video", CLIP)]),
    # 40 frames at 12 fps: 6 sampled, three temporal patches (each frame's attention its own)
    "image-and-video": ("What colour is the square?", [("image", (11, 100, 150)), ("video", (8, 40, 48, 64, 12))]),
    "two-videos-webm": ("Hello!", [("video", (9, 16, 56, 56, 8, "libvpx-vp9", "webm")), ("video", CLIP)]),
}


def parts(case: str) -> list[tuple[str, object]]:
    _, specs = CASES[case]
    return [(kind, make_image(*spec) if kind == "image" else make_clip(*spec[:4], *spec[4:])) for kind, spec in specs]


def ask(client, case: str, stream: bool = False):
    return openai_chat(client, media_messages(CASES[case][0], parts(case)), MAX_TOKENS, stream)


def expected(reference: VideoReference, case: str) -> tuple[str, int, int]:
    text, _ = CASES[case]
    ids = reference.generate(text, parts(case), MAX_TOKENS)
    return reference.reference.text(ids), len(ids), reference.inputs(text, parts(case))["input_ids"].shape[1]


@pytest.fixture(scope="module")
def video_reference(reference, tiny_model):
    return VideoReference(reference, tiny_model)


def test_a_clip_is_the_same_bytes_every_time():
    """Each parity test encodes its clips twice (for HF and for the request): both must be the same file,
    also when encoded in another process (x264's assembly and a webm muxer's random ids once made them
    differ)."""
    specs = [spec for _, items in CASES.values() for kind, spec in items if kind == "video"]
    here = [make_clip(*spec[:4], *spec[4:]) for spec in specs]
    assert here == [make_clip(*spec[:4], *spec[4:]) for spec in specs]
    code = ("import hashlib, sys; from tests.video_support import make_clip; "
            f"print(*(hashlib.sha256(make_clip(*s[:4], *s[4:])).hexdigest() for s in {specs!r}))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert other.stdout.split() == [hashlib.sha256(clip).hexdigest() for clip in here]


@pytest.mark.parametrize("case,stream", [("one-video", False), ("image-and-video", True), ("two-videos-webm", False)])
def test_greedy_output_equals_hf(stack, video_reference, case, stream):
    text, completion_tokens, prompt_tokens = expected(video_reference, case)
    content, usage = ask(stack.client(), case, stream)
    assert content == text
    assert (usage.completion_tokens, usage.prompt_tokens) == (completion_tokens, prompt_tokens)


def test_the_frontend_samples_a_clip_without_loading_torch(stack, video_reference):
    """Picking a Qwen2.5-VL clip's frames is the processor's torch arithmetic, done with numpy: the
    frontend never loads torch (seconds of its event loop at the first video otherwise)."""
    text, clip = "Describe the video in one sentence.", make_clip(13, 12, 40, 48, 6)  # not seen before
    answer = openai_chat(stack.client(), media_messages(text, [("video", clip)]), MAX_TOKENS)[0]
    assert answer == video_reference.reference.text(video_reference.generate(text, [("video", clip)], MAX_TOKENS))
    assert "libtorch" not in stack.frontend_maps()


def _encoder_total(stack, field: str) -> int:
    return sum(endpoint_data(s).get(field, 0) for s in stack.stats_sync("epd-encoder"))


def test_a_video_url_given_as_the_bare_string(stack, video_reference):
    """vLLM's shorthand, as for image_url: ``"video_url": "data:video/mp4;base64,…"``."""
    text, [(_, spec)] = CASES["one-video"]
    content = [{"type": "video_url", "video_url": video_url(make_clip(*spec[:4], *spec[4:]))},
               {"type": "text", "text": text}]
    assert openai_chat(stack.client(), [{"role": "user", "content": content}], MAX_TOKENS)[0] == \
        expected(video_reference, "one-video")[0]


def test_a_repeated_video_is_not_encoded_again(stack, video_reference):
    """The same clip again: no second ViT pass. Asked again as it was, the language worker's prefix cache
    holds it and the frontend leaves it out; after other text, the encoder's cache has it (its content
    hash, sampling included, is the key)."""
    answer = expected(video_reference, "one-video")[0]
    assert ask(stack.client(), "one-video")[0] == answer
    videos, hits = _encoder_total(stack, "videos"), _encoder_total(stack, "cache_hits")
    left_out = sum(f["images_cached"] for f in stack.figures("frontend"))
    assert ask(stack.client(), "one-video")[0] == answer
    assert sum(f["images_cached"] for f in stack.figures("frontend")) == left_out + 1
    text, media = CASES["one-video"][0], parts("one-video")
    openai_chat(stack.client(), [{"role": "system", "content": "Answer briefly."}, *media_messages(text, media)],
                MAX_TOKENS)
    assert _encoder_total(stack, "videos") == videos
    assert _encoder_total(stack, "cache_hits") > hits


def _mp4_without_video() -> bytes:
    import io

    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("aac", rate=8000)
        frame = av.AudioFrame(format="fltp", layout="mono", samples=1024)
        for plane in frame.planes:
            plane.update(bytes(plane.buffer_size))
        frame.sample_rate = 8000
        for packet in [*stream.encode(frame), *stream.encode()]:
            out.mux(packet)
    return buf.getvalue()


BAD = {
    "not a video": (b"this is plain text, not a clip" * 20, "could not be read as a video"),
    "truncated": (make_clip(1, 30, 48, 64, faststart=True)[:-1500], "truncated"),
    "truncated index": (make_clip(1, 30, 48, 64)[:-1500], "could not be read as a video"),
    "a few bytes of a header": (make_clip(1, 30, 48, 64)[:300], "video"),
    "no video stream": (_mp4_without_video(), "no video stream"),
    "unsupported codec": (make_clip(5, 10, 32, 32, codec="mpeg4", container="avi").replace(b"FMP4", b"ZQ9X"),
                          "codec is not supported"),
    "one frame": (make_clip(2, 1, 48, 64), "at least 2"),
    "absurd frame rate": (make_clip(3, 4, 32, 32, fps=1000), "frame rate"),
    "too long": (make_clip(4, 601, 16, 16, fps=1, codec="mpeg4"), "exceeds the limit of 600 s"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_videos_are_a_400_and_the_stack_keeps_serving(stack, name):
    data, message = BAD[name]
    client = stack.client()
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": video_url(data)}},
                                             {"type": "text", "text": "hi"}]}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=client.models.list().data[0].id, messages=messages, max_tokens=4)
    assert message in err.value.message
    ok = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=2,
                                        messages=[{"role": "user", "content": "still there?"}])
    assert ok.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("url,message", [
    ("data:image/png;base64,AAAA", "video data URLs must look like data:video/"),
    ("ftp://example.com/clip.mp4", "unsupported video URL scheme"),
    ("https://127.0.0.1/clip.mp4", "private or reserved address"),
])
def test_video_urls_follow_the_image_rules(stack, url, message):
    client = stack.client()
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}}]}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=client.models.list().data[0].id, messages=messages, max_tokens=4)
    assert message in err.value.message


@pytest.fixture(scope="module")
def qwen2_vl(nats_url, tmp_path_factory):
    """Qwen2-VL (no temporal spacing: positions step by one temporal patch) in one aggregated process."""
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("qwen2_vl"), family="qwen2_vl")
    running = RunningStack(nats_url, path)
    running.spawn("aggregated")
    try:
        running.start(encoders=0, prefills=0, decodes=0)
        running.wait_for({"aggregated": 1, "frontend": 1})
        yield running, VideoReference(Reference(path), path)
    finally:
        running.stop()


def test_qwen2_vl_video_equals_hf_in_the_aggregated_process(qwen2_vl):
    """The frontend sends the aggregated worker each request's pixels (clips: their sampled frames), which
    it encodes in place, its ViT between engine steps."""
    running, reference = qwen2_vl
    for case in ("one-video", "image-and-video"):
        assert ask(running.client(), case)[0] == expected(reference, case)[0], case
    [worker] = running.figures("aggregated")
    assert (worker["prompts_in_place"], worker["images_in_place"], worker["videos"]) == (2, 3, 2)
    assert worker["prompt_encode_count"] == 2 and worker["prompts_parked"] == 0


def test_the_aggregated_process_takes_image_embeds_beside_pixels(qwen2_vl):
    """A client's precomputed embeddings (``image_embeds``, as HF's Qwen2-VL tower makes them) reach the
    aggregated worker in the prompt's image slot: alone, the prompt enters its engine as any prompt with
    embeddings; beside an image sent as pixels, that one is encoded in place and the embeddings pulled.
    Either way the answer is the one of the images as pixels, and only pixels go through its ViT."""
    running, video_reference = qwen2_vl
    reference = video_reference.reference
    text, first, second = "What colour is the square?", make_image(51, 64, 96), make_image(52, 80, 80)
    embeds = image_embeds_part(*hf_image_embeds(reference, second))
    [before] = running.figures("aggregated")
    alone = [{"role": "user", "content": [embeds, {"type": "text", "text": text}]}]
    alone_want = reference.text(reference.generate(text, [second], MAX_TOKENS))
    assert openai_chat(running.client(), alone, MAX_TOKENS)[0] == alone_want
    mixed = [{"role": "user", "content": [{"type": "image_url", "image_url": data_url(first)}, embeds,
                                          {"type": "text", "text": text}]}]
    want = reference.text(reference.generate(text, [first, second], MAX_TOKENS))
    assert openai_chat(running.client(), mixed, MAX_TOKENS)[0] == want
    [after] = running.figures("aggregated")
    assert {k: after[k] - before[k] for k in ("prompts_in_place", "images_in_place", "images")} == \
        {"prompts_in_place": 1, "images_in_place": 1, "images": 1}


def test_the_tower_attends_within_each_frame_like_hf(reference, tiny_model):
    """Many temporal patches (windows and full-attention blocks of Qwen2.5-VL, per frame) and an image in
    one packed forward: the rows HF's tower gives each."""
    from shared.model.config import ModelConfig
    from shared.model.loader import load_vision_tower

    config = ModelConfig.from_checkpoint(tiny_model)
    tower = load_vision_tower(tiny_model, config, "cpu", torch.float32, "auto")
    torch.manual_seed(0)
    grids = [(5, 8, 12), (1, 4, 4), (3, 4, 8)]
    patches = torch.randn(sum(t * h * w for t, h, w in grids), config.vision.patch_dim)
    with torch.no_grad():
        ours = tower(patches, grids)
        hf = reference.model.model.get_video_features(patches, torch.tensor(grids)).pooler_output
    assert torch.allclose(ours, torch.cat(hf), atol=1e-4)


@pytest.mark.parametrize("limit,value,message", [
    ("max_frames", 3, "samples 4 frames; at most 3"),
    ("max_frame_pixels", 60 * 80 - 1, "exceed the limit of"),
    ("max_seconds", 1.5, "exceeds the limit of 1.5 s"),
    ("max_fps", 5, "frame rate 10 is outside"),
    ("decode_timeout", 0, "took more than 0 s to decode"),
])
def test_each_decode_limit_is_its_own_400(limit, value, message):
    from services.frontend.errors import ApiError
    from services.frontend.video import VideoLimits, decode_video
    from shared.model.tiny import video_processor_config
    from shared.model.video import VideoGeometry

    geometry = VideoGeometry.from_config("qwen2_5_vl", video_processor_config("qwen2_5_vl"))
    limits = dict(max_seconds=600, max_fps=240, max_frames=256, max_frame_pixels=1 << 30, decode_timeout=60)
    with pytest.raises(ApiError) as err:
        decode_video(make_clip(*CLIP), geometry, VideoLimits(**{**limits, limit: value}))
    assert err.value.status == 400 and message in str(err.value)
    assert decode_video(make_clip(*CLIP), geometry, VideoLimits(**limits)).num_frames == 4


def test_the_video_byte_cap_applies_before_decoding():
    from services.frontend.media import MediaLoader
    from services.frontend.settings import FrontendSettings
    from services.frontend.errors import ApiError

    loader = MediaLoader(FrontendSettings(max_media_bytes=1000), executor=None)
    with pytest.raises(ApiError, match="video exceeds 1000 bytes"):
        loader._data_url(video_url(make_clip(*CLIP)), "video")


def test_the_media_parts_of_a_request_are_capped_per_kind():
    """``--limit-mm-per-prompt``: a kind left out keeps its default; past a kind's cap, a 400 that names it."""
    from services.frontend.errors import ApiError
    from services.frontend.pipeline import Pipeline
    from services.frontend.settings import FrontendSettings

    pipeline = object.__new__(Pipeline)  # only its checks: no bus, no workers
    pipeline.settings = FrontendSettings(limit_mm_per_prompt={"video": 1})
    assert pipeline.settings.limit_mm_per_prompt == {"image": 16, "video": 1}
    pipeline._check_counts([("video", "a"), ("image", "b")] + [("image", "c")] * 15)
    with pytest.raises(ApiError, match=r"too many videos: 2 \(at most 1\)"):
        pipeline._check_counts([("video", "a"), ("video", "b")])
