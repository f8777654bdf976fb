"""Chat messages → token ids with expanded image placeholders, rendered by the checkpoint's template.

What a client typed is always text: every text part is rendered as a random sentinel, the template's
own output (role markers, image placeholders) is tokenized with special tokens, and the client's text
with special tokens split into plain characters. So a client who types ``<|image_pad|>`` gets those
characters, never an image slot, and the template is the checkpoint's own (clients cannot supply one).

Tool definitions and tool-call arguments reach the template as data it serializes itself (``tojson``),
where no sentinel survives; a client string there that spells a special token is refused instead.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

from services.frontend.errors import ApiError
from services.frontend.protocol import ChatMessage, ImagePart, Tool
from shared.model.config import ModelConfig
from shared.model.geometry import Grid, ImageGeometry, grid_tokens


# template variables a client's chat_template_kwargs may not replace
_RESERVED = {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "bos_token",
             "eos_token", "raise_exception"}


@dataclass
class TemplateOptions:
    """How the conversation is rendered (the request's chat-template options)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = None
    kwargs: dict = field(default_factory=dict)


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

    def build(self, messages: list[ChatMessage], image_sizes: list[tuple[int, int]],
              options: TemplateOptions | None = None) -> Prompt:
        """``image_sizes``: (height, width) of each image, in the order the messages carry them."""
        return self._expand_images(self.render_ids(messages, options or TemplateOptions()), image_sizes)

    def render_ids(self, messages: list[ChatMessage], options: TemplateOptions) -> list[int]:
        """The conversation's token ids, one placeholder token per image."""
        reserved = _RESERVED & set(options.kwargs)
        if reserved:
            raise ApiError(400, f"chat_template_kwargs may not set {', '.join(sorted(reserved))}",
                           "chat_template_kwargs")
        sentinel = f"\x00{secrets.token_hex(8)}:"
        texts: list[str] = []
        conversation = [self._template_message(m, sentinel, texts) for m in messages]
        tools = [tool.model_dump(exclude_none=True) for tool in options.tools] if options.tools else None
        self._refuse_special_tokens(json.dumps([tools, [m.get("tool_calls") for m in conversation]], ensure_ascii=False))
        try:
            rendered = self.tokenizer.apply_chat_template(
                conversation, tools=tools, tokenize=False, add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message, **options.kwargs)
        except Exception:  # a template that rejects the conversation (roles out of order, …)
            raise ApiError(400, "the conversation does not fit the model's chat template") from None
        return self._tokenize(rendered, sentinel, texts)

    def _refuse_special_tokens(self, data: str) -> None:
        for token in self.tokenizer.all_special_tokens:
            if token and token in data:
                raise ApiError(400, f"tool definitions and tool calls may not contain the special token {token!r}",
                               "tools")

    @staticmethod
    def _template_message(message: ChatMessage, sentinel: str, texts: list[str]) -> dict:
        role = "system" if message.role == "developer" else message.role

        def text(value: str) -> str:
            texts.append(value)
            return f"{sentinel}{len(texts) - 1}\x00"

        if message.content is None or isinstance(message.content, str):
            rendered: dict = {"role": role, "content": text(message.content or "")}
        else:
            rendered = {"role": role, "content": [{"type": "image"} if isinstance(p, ImagePart)
                                                  else {"type": "text", "text": text(p.text)} for p in message.content]}
        if message.tool_calls:  # the template wants arguments as data (vLLM passes them parsed, too)
            rendered["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": json.loads(c.function.arguments)}} for c in message.tool_calls]
        if message.tool_call_id is not None:
            rendered["tool_call_id"] = message.tool_call_id
        if message.name is not None and role == "tool":
            rendered["name"] = message.name
        return rendered

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
