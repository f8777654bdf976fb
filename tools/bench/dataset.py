"""The requests of a benchmark run: seeded prompts, image counts, repeats, and the images as data URLs.

Images are drawn before the run and encoded once per distinct image (PNG/JPEG), so encoding never
competes with the load. Each is a random low-resolution pattern scaled up to the asked size: smooth
enough to compress like a photo rather than like noise, distinct per seed.
"""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from tools.bench.settings import BenchSettings

# Common English words: about one token each for real tokenizers (used when no --tokenizer is given).
WORDS = ("the of and to in is was for on that with as by at from his her this they which you one all were "
         "are be had have there been their when who will more no if out so said what up its about into than "
         "them can only other new some time could these two may then first any my now such like our over man "
         "me even most made after also did many before must through back years where much your way well down "
         "should because each just those people how too little state good very make world still own see men "
         "work long get here between both life being under never day same another know while last might us "
         "great old year off come since against go came right used take three image picture colour red blue "
         "green light dark small large left top bottom window table chair street tree water sky cloud house").split()


@dataclass(frozen=True)
class RequestSpec:
    index: int
    kind: str  # "text" | "image" | "video" (clips, and any images)
    prompt: str
    image_ids: tuple[int, ...]  # into the image pool
    output_len: int
    video_ids: tuple[int, ...] = ()  # into the video pool (tools.bench.video)


class PromptWriter:
    """Random text of ``input_len`` tokens: exact with a tokenizer, one word per token without."""

    def __init__(self, tokenizer_dir: str = ""):
        self.tokenizer = None
        if tokenizer_dir:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)

    def write(self, rng: np.random.Generator, input_len: int) -> str:
        words = [WORDS[i] for i in rng.integers(0, len(WORDS), input_len)]
        text = " ".join(words)
        if self.tokenizer is None:
            return text
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        while len(ids) < input_len:  # a tokenizer may merge words: add more until long enough
            text += " " + " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), input_len - len(ids)))
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.decode(ids[:input_len])


def build_requests(settings: BenchSettings, count: int, seed: int, first_image: int = 0,
                   repeat_ratio: float | None = None) -> tuple[list[RequestSpec], int]:
    """``count`` requests and the number of distinct images they use (ids ``first_image`` onwards)."""
    rng = np.random.default_rng(seed)
    writer = PromptWriter(settings.tokenizer)
    repeat = settings.repeat_ratio if repeat_ratio is None else repeat_ratio
    used: list[int] = []
    next_id = first_image
    requests = []
    for index in range(count):
        text_only = settings.image_count == 0 or rng.random() < settings.text_ratio
        ids: list[int] = []
        if not text_only:
            for _ in range(int(rng.choice(settings.image_counts()))):
                candidates = [i for i in used if i not in ids]
                if candidates and rng.random() < repeat:
                    ids.append(int(candidates[rng.integers(0, len(candidates))]))
                else:
                    ids.append(next_id)
                    used.append(next_id)
                    next_id += 1
        prompt = writer.write(rng, settings.input_len)
        requests.append(RequestSpec(index, "text" if text_only else "image", prompt, tuple(ids), settings.output_len))
    return requests, next_id - first_image


def make_image(seed: int, width: int, height: int) -> "PIL.Image.Image":  # noqa: F821
    from PIL import Image

    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (max(1, height // 16), max(1, width // 16), 3), dtype=np.uint8)
    return Image.fromarray(small).resize((width, height), Image.BICUBIC)


def data_url(image, fmt: str) -> str:
    buf = io.BytesIO()
    image.save(buf, format="JPEG" if fmt == "jpeg" else "PNG", **({"quality": 90} if fmt == "jpeg" else {}))
    return f"data:image/{fmt};base64," + base64.b64encode(buf.getvalue()).decode()


class ImagePool:
    """Distinct images by id, encoded once as data URLs before the run."""

    def __init__(self, size: tuple[int, int], fmt: str, seed: int, videos=None):
        self.size = size
        self.fmt = fmt
        self.seed = seed
        self.urls: list[str] = []
        self.videos = videos  # a VideoPool, when requests carry clips

    def generate(self, count: int, threads: int = 8) -> None:
        width, height = self.size

        def one(i: int) -> str:
            return data_url(make_image(self.seed * 1_000_003 + i, width, height), self.fmt)

        with ThreadPoolExecutor(threads) as pool:
            self.urls = list(pool.map(one, range(count)))

    def messages(self, request: RequestSpec) -> list[dict]:
        """The request's one user turn: its images, its video clips, then its text (OpenAI format)."""
        if not request.image_ids and not request.video_ids:
            return [{"role": "user", "content": request.prompt}]
        parts = [{"type": "image_url", "image_url": {"url": self.urls[i]}} for i in request.image_ids]
        if request.video_ids:
            parts += self.videos.parts(request)
        return [{"role": "user", "content": parts + [{"type": "text", "text": request.prompt}]}]
