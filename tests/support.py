"""Helpers the tests share: images, the HF reference, a running stack, NATS service API queries."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from launcher.stack import Stack
from shared.bus.calls import endpoint_data, service_stats  # noqa: F401  (endpoint_data: for the tests)


def make_image(seed: int, height: int, width: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def tower_plain_and_in_pieces(tower, patch_dim: int, grids) -> tuple[torch.Tensor, torch.Tensor]:
    """A vision tower's output for random patches of ``grids``: its plain forward, and through
    ``shared.model.pieces`` run eagerly (up to 1,024 patches, so the forward is padded to a bucket)."""
    from shared.model.pieces import vision_pieces

    patches = torch.randn(sum(t * h * w for t, h, w in grids), patch_dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = tower(patches, grids)
        tower.pieces = vision_pieces(tower, 1024)
        try:
            return plain, tower(patches, grids)
        finally:
            tower.pieces = None


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def chat_messages(text: str, images: list[Image.Image]) -> list[dict]:
    """One user turn: the images, then the text (OpenAI format)."""
    parts = [{"type": "image_url", "image_url": {"url": data_url(img)}} for img in images]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


def openai_chat(client, messages: list[dict], max_tokens: int, stream: bool = False):
    """One greedy chat through the official ``openai`` client: (text, usage), streamed or not."""
    kwargs = dict(model=client.models.list().data[0].id, messages=messages, max_tokens=max_tokens, temperature=0)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage
    response = client.chat.completions.create(**kwargs)
    return response.choices[0].message.content, response.usage


def hf_chat_inputs(reference, messages: list[dict], images: list[Image.Image]) -> dict:
    """HF's model inputs for a conversation: the chat template renders it, each image placeholder expands
    to its grid's token count, the processor makes the patches. ``reference``: a ``Reference``."""
    rendered = reference.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs: dict = {}
    if images:
        # the layout is given: HF guesses it from the shape, and reads a 1×1 or 3×N image as channels-first
        pixels = reference.processor(images=[np.asarray(i) for i in images], return_tensors="pt",
                                     input_data_format="channels_last")
        pieces = rendered.split("<|image_pad|>")
        counts = [int(g.prod()) // reference.processor.merge_size**2 for g in pixels["image_grid_thw"]]
        rendered = pieces[0] + "".join("<|image_pad|>" * n + pieces[i + 1] for i, n in enumerate(counts))
        inputs.update(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"])
    ids = reference.tokenizer(rendered, return_tensors="pt").input_ids
    inputs.update(input_ids=ids, attention_mask=torch.ones_like(ids),
                  mm_token_type_ids=(ids == reference.model.config.image_token_id).int())
    return inputs


def hf_image_embeds(reference, image: Image.Image) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's vision tower on one image: its rows ``[tokens, out_dim × (1 + deepstack levels)]`` (Qwen3-VL's
    levels beside the merger's output, as the encoders ship them) and its grid ``[1, 3]``."""
    pixels = reference.processor(images=[np.asarray(image)], return_tensors="pt", input_data_format="channels_last")
    with torch.no_grad():
        out = reference.model.model.get_image_features(pixels["pixel_values"], pixels["image_grid_thw"])
    levels = [feature[0] for feature in getattr(out, "deepstack_features", None) or ()]
    return torch.cat([out.pooler_output[0], *levels], dim=1).contiguous(), pixels["image_grid_thw"]


def image_embeds_part(rows: torch.Tensor, grid: torch.Tensor, fmt: str = "safetensors") -> dict:
    """An ``image_embeds`` content part (vLLM's shape), its tensors as base64 safetensors or .npy bytes."""
    def encoded(tensor: torch.Tensor) -> str:
        if fmt == "npy":
            buffer = io.BytesIO()
            np.save(buffer, tensor.numpy())
            return base64.b64encode(buffer.getvalue()).decode()
        from safetensors.torch import save

        return base64.b64encode(save({"tensor": tensor.contiguous()})).decode()

    return {"type": "image_embeds", "image_embeds": {"image_embeds": encoded(rows), "image_grid_thw": encoded(grid)}}


class Reference:
    """HF transformers generate() on the same checkpoint: the ground truth for greedy output."""

    def __init__(self, path: Path):
        from transformers import AutoModelForImageTextToText, AutoTokenizer

        from shared.model.processor import load_image_processor

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.processor = load_image_processor(path)
        self.model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()

    def inputs(self, text: str, images: list[Image.Image]) -> dict:
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        return hf_chat_inputs(self, [{"role": "user", "content": content}], images)

    def generate(self, text: str, images: list[Image.Image], max_new_tokens: int, ignore_eos: bool = False) -> list[int]:
        """Greedy ids; ``ignore_eos``: exactly ``max_new_tokens`` (EOS may be generated, nothing stops it)."""
        import copy

        inputs = self.inputs(text, images)
        config = copy.deepcopy(self.model.generation_config)
        config.max_new_tokens, config.do_sample = max_new_tokens, False
        if ignore_eos:
            config.eos_token_id = []
        with torch.no_grad():
            out = self.model.generate(**inputs, generation_config=config)
        return out[0, inputs["input_ids"].shape[1]:].tolist()

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class RunningStack:
    """A stack of real service processes on a subject prefix of its own (one NATS server per session)."""

    def __init__(self, nats_url: str, model: Path, env: dict[str, str] | None = None):
        self.prefix = "t" + uuid.uuid4().hex[:8]
        base = {k: v for k, v in __import__("os").environ.items() if not k.startswith("EPD_")}
        base.update({"EPD_MODEL": str(model), "EPD_SUBJECT_PREFIX": self.prefix, "EPD_LOG_LEVEL": __import__("os").environ.get("TEST_LOG_LEVEL", "warning"),
                     "EPD_KV_CACHE_MB": "64", "EPD_DRAIN_SECONDS": "10", **(env or {})})
        self.stack = Stack.start_nats(base, nats_url)
        self.port = 0

    def start(self, encoders=1, prefills=1, decodes=1, frontend_args: tuple[str, ...] = (), languages=0,
              aggregated=0) -> "RunningStack":
        counts = {"encoder": encoders, "prefill": prefills, "decode": decodes, "language": languages,
                  "aggregated": aggregated}
        for kind, n in counts.items():
            for _ in range(n):
                self.stack.spawn(kind)
        self.stack.spawn("frontend", "--port", "0", *frontend_args)
        counts = {kind: n for kind, n in counts.items() if n} | {"frontend": 1}
        asyncio.run(self._ready(counts))
        return self

    def spawn(self, kind: str, *args: str) -> None:
        """One more service process on this stack's prefix, without waiting for it (see ``wait_for``)."""
        self.stack.spawn(kind, *args)

    def wait_for(self, counts: dict[str, int], timeout: float = 180) -> None:
        """Until the NATS service API lists ``counts[kind]`` instances of each kind on this prefix, and the
        frontend routes over all of them."""
        asyncio.run(self.stack.wait_ready(counts, timeout=timeout, prefix=self.prefix))
        if self.port:
            asyncio.run(self._routed(counts, timeout))

    async def _ready(self, counts: dict[str, int]) -> None:
        http = await self.stack.wait_ready(counts, timeout=180, prefix=self.prefix)  # the frontend's host:port
        self.port = int(http.rsplit(":", 1)[1])
        await self._routed(counts, 60)

    async def _routed(self, counts: dict[str, int], timeout: float) -> None:
        """Until the frontend's own directory lists ``counts`` (its ``epd_workers`` gauge): it refreshes
        every second, so a worker listed just now may not be in it yet, and a test that expects work spread
        over every worker would see one take it all. A scrape of /metrics refreshes the directory."""
        import httpx

        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=10) as client:
            while True:
                text = (await client.get(f"http://127.0.0.1:{self.port}/metrics")).text
                seen = {kind: float(v) for kind, v in re.findall(r'^epd_workers\{kind="(\w+)"\} (\S+)$', text, re.M)}
                if all(seen.get(kind, 0) >= n for kind, n in counts.items() if kind != "frontend"):
                    return
                assert time.monotonic() < deadline, f"the frontend routes over {seen}, not {counts}"
                await asyncio.sleep(0.2)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def client(self, **kwargs):
        from openai import OpenAI

        return OpenAI(base_url=self.base_url, api_key="test", max_retries=0, **kwargs)

    async def stats(self, service: str | None) -> list[dict]:
        """STATS of this stack's instances of ``service`` (``epd-<kind>``; None: every service)."""
        import nats

        nc = await nats.connect(self.stack.nats_url)
        try:
            found = await service_stats(nc, service, wait=0.3)
        finally:
            await nc.close()
        return [s for s in found if (s.get("metadata") or {}).get("prefix") == self.prefix]

    def stats_sync(self, service: str) -> list[dict]:
        return asyncio.run(self.stats(service))

    def figures(self, kind: str) -> list[dict]:
        """Each ``kind`` instance's own figures (its endpoints' data in the STATS answer)."""
        from shared.bus.calls import endpoint_data

        return [endpoint_data(s) for s in self.stats_sync(f"epd-{kind}")]

    def frontend_maps(self) -> str:
        """The frontend process's ``/proc/<pid>/maps`` (which libraries it loaded); skips without /proc."""
        [frontend] = [p for kind, p in self.stack.processes if kind == "frontend"]
        try:
            with open(f"/proc/{frontend.pid}/maps") as f:
                return f.read()
        except OSError:
            pytest.skip("no /proc: which libraries a process mapped is not readable here")

    def stop(self) -> None:
        self.stack.stop(grace=15)


class Chat:
    """One conversation, in the OpenAI client's form and in the chat template's (for HF); each answer
    greedy, ``max_tokens`` long."""

    def __init__(self, name: str, max_tokens: int = 6):
        self.system = f"You are the assistant of conversation {name}."
        self.turns: list[tuple[str, list, str]] = []  # (role, images, text)
        self.max_tokens = max_tokens

    def user(self, text: str, *images) -> "Chat":
        self.turns.append(("user", list(images), text))
        return self

    def assistant(self, text: str) -> "Chat":
        self.turns.append(("assistant", [], text))
        return self

    @property
    def images(self) -> list:
        return [image for _, images, _ in self.turns for image in images]

    def openai(self) -> list[dict]:
        return [{"role": "system", "content": self.system}] + [
            {"role": role, "content": [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
             + [{"type": "text", "text": text}]} if role == "user" else {"role": role, "content": text}
            for role, images, text in self.turns]

    def template(self) -> list[dict]:
        return [{"role": "system", "content": self.system}] + [
            {"role": role, "content": [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]}
            if role == "user" else {"role": role, "content": text} for role, images, text in self.turns]

    def ask(self, running: "RunningStack") -> str:
        client = running.client(timeout=60)
        return client.chat.completions.create(model=client.models.list().data[0].id, messages=self.openai(),
                                              max_tokens=self.max_tokens, temperature=0).choices[0].message.content

    def expected(self, reference: "Reference") -> str:
        """HF generate()'s greedy answer to the conversation so far."""
        inputs = hf_chat_inputs(reference, self.template(), self.images)
        with torch.no_grad():
            out = reference.model.generate(**inputs, max_new_tokens=self.max_tokens, do_sample=False)
        return reference.text(out[0, inputs["input_ids"].shape[1]:].tolist())


def dumps(obj) -> str:
    return json.dumps(obj, sort_keys=True)


async def settled(nc) -> None:
    """Returns once the server has read every command ``nc`` wrote before the call (a SUB, a PUB). One
    ``flush()`` is no such barrier for another connection: nats-py writes its PING ahead of commands still
    pending, so the PONG can come back before the server read a SUB (34 of 2,500 tries on loopback lost the
    message published next from another connection). Those commands go out while the first flush waits, so
    the second flush's PING follows them (0 of 5,000 tries)."""
    await nc.flush()
    await nc.flush()
