"""Chat messages → token ids with expanded image placeholders, rendered by the checkpoint's template.

What a client typed is always text: every text part is rendered as a random sentinel, the template's
own output (role markers, image placeholders) is tokenized with special tokens, and the client's text
with special tokens split into plain characters. So a client who types ``<|image_pad|>`` gets those
characters, never an image slot, and the template is the checkpoint's own (clients cannot supply one).
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field

from services.frontend.errors import ApiError
from services.frontend.protocol import ChatMessage, ImagePart
from shared.model.config import ModelConfig
from shared.model.geometry import Grid, ImageGeometry, grid_tokens


@dataclass
class Prompt:
    token_ids: list[int]
    image_offsets: list[int] = field(default_factory=list)
    image_grids: list[Grid] = field(default_factory=list)


def image_urls(messages: list[ChatMessage]) -> list[str]:
    return [part.image_url.url for m in messages if isinstance(m.content, list)
            for part in m.content if isinstance(part, ImagePart)]


class PromptBuilder:
    def __init__(self, tokenizer, config: ModelConfig, geometry: ImageGeometry):
        if not tokenizer.chat_template:
            raise ValueError("the checkpoint's tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.config = config
        self.geometry = geometry

    def build(self, messages: list[ChatMessage], image_sizes: list[tuple[int, int]]) -> Prompt:
        """``image_sizes``: (height, width) of each image, in the order the messages carry them."""
        sentinel = f"\x00{secrets.token_hex(8)}:"
        texts: list[str] = []
        conversation = [self._template_message(m, sentinel, texts) for m in messages]
        try:
            rendered = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        except Exception:  # a template that rejects the conversation (roles out of order, …)
            raise ApiError(400, "the conversation does not fit the model's chat template") from None
        ids = self._tokenize(rendered, sentinel, texts)
        return self._expand_images(ids, image_sizes)

    @staticmethod
    def _template_message(message: ChatMessage, sentinel: str, texts: list[str]) -> dict:
        role = "system" if message.role == "developer" else message.role

        def text(value: str) -> str:
            texts.append(value)
            return f"{sentinel}{len(texts) - 1}\x00"

        if message.content is None or isinstance(message.content, str):
            return {"role": role, "content": text(message.content or "")}
        parts = [{"type": "image"} if isinstance(p, ImagePart) else {"type": "text", "text": text(p.text)}
                 for p in message.content]
        return {"role": role, "content": parts}

    def _tokenize(self, rendered: str, sentinel: str, texts: list[str]) -> list[int]:
        ids: list[int] = []
        pattern = re.compile(re.escape(sentinel) + r"(\d+)\x00")
        pos = 0
        pending_text = ""
        for match in pattern.finditer(rendered):
            between = rendered[pos:match.start()]
            if between:
                ids += self._encode_client(pending_text)
                pending_text = ""
                ids += self.tokenizer.encode(between, add_special_tokens=False)
            pending_text += texts[int(match.group(1))]  # adjacent client parts tokenize as one text
            pos = match.end()
        ids += self._encode_client(pending_text)
        if rendered[pos:]:
            ids += self.tokenizer.encode(rendered[pos:], add_special_tokens=False)
        if len(pattern.findall(rendered)) != len(texts):
            raise ApiError(400, "the chat template dropped part of the conversation")
        return ids

    def _encode_client(self, text: str) -> list[int]:
        if not text:
            return []
        return self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def _expand_images(self, ids: list[int], image_sizes: list[tuple[int, int]]) -> Prompt:
        image_token = self.config.image_token_id
        slots = [i for i, t in enumerate(ids) if t == image_token]
        if len(slots) != len(image_sizes):
            raise ApiError(400, "the chat template did not place every image")
        prompt = Prompt(token_ids=[])
        start = 0
        for slot, (height, width) in zip(slots, image_sizes):
            try:
                grid = self.geometry.grid(height, width)
            except ValueError as err:
                raise ApiError(400, f"image cannot be processed: {err}") from None
            prompt.token_ids += ids[start:slot]
            prompt.image_offsets.append(len(prompt.token_ids))
            prompt.image_grids.append(grid)
            prompt.token_ids += [image_token] * grid_tokens(grid, self.geometry.merge_size)
            start = slot + 1
        prompt.token_ids += ids[start:]
        return prompt
