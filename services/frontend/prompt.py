"""Chat messages → token ids with expanded image placeholders, rendered by the checkpoint's template.

What a client typed is always text: every text part is rendered as a random sentinel, the template's
own output (role markers, image placeholders) is tokenized with special tokens, and the client's text
with special tokens split into plain characters. So a client who types ``<|image_pad|>`` gets those
characters, never an image slot, and the template is the checkpoint's own (clients cannot supply one).

Tool definitions and tool-call arguments reach the template as data it serializes itself (``tojson``),
where no sentinel survives; a client string there that spells a special token is refused instead, and so
is one in ``chat_template_kwargs`` (a template may print such a value as it is). The names that would
change the template itself or what it is given (``chat_template``, ``messages``, …) may not be set there;
``add_generation_prompt`` and ``continue_final_message`` may, as vLLM allows, and win over the request's.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

from services.frontend.errors import ApiError
from services.frontend.protocol import ChatMessage, ImageEmbedsPart, ImagePart, Tool, VideoPart
from shared.model.config import ModelConfig
from shared.model.geometry import Grid, ImageGeometry, grid_tokens
from shared.model.video import VideoGeometry, VideoTiming


# what a client's chat_template_kwargs may not replace: the template, its inputs and variables the template
# itself relies on, and apply_chat_template's switches that change what it returns
_RESERVED = {"messages", "conversation", "tools", "documents", "chat_template", "bos_token", "eos_token",
             "raise_exception", "tokenize", "return_dict", "return_tensors", "padding", "truncation", "max_length",
             "tokenizer_kwargs", "return_assistant_tokens_mask"}


@dataclass
class TemplateOptions:
    """How the conversation is rendered (the request's chat-template options)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = None
    kwargs: dict = field(default_factory=dict)


def template_options(request, tools: list[Tool] | None = None) -> TemplateOptions:
    """A chat (or /tokenize) request's options, as vLLM reads them: ``chat_template_kwargs`` may set
    ``add_generation_prompt`` and ``continue_final_message``, over the request's own fields; the two
    cannot both be true (the prompt would open a new turn and continue the last one)."""
    kwargs = dict(request.chat_template_kwargs or {})
    add = kwargs.pop("add_generation_prompt", request.add_generation_prompt is not False)
    cont = kwargs.pop("continue_final_message", bool(request.continue_final_message))
    if not isinstance(add, bool) or not isinstance(cont, bool):
        raise ApiError(400, "add_generation_prompt and continue_final_message must be true or false",
                       "chat_template_kwargs")
    if add and cont:
        raise ApiError(400, "add_generation_prompt and continue_final_message cannot both be true: set "
                            "add_generation_prompt to false to continue the final message", "continue_final_message")
    return TemplateOptions(add, cont, tools, kwargs)


@dataclass
class Prompt:
    token_ids: list[int]
    image_offsets: list[int] = field(default_factory=list)
    image_grids: list[Grid] = field(default_factory=list)
    videos: dict[int, "VideoSlotPlan"] = field(default_factory=dict)  # index into image_offsets → its video plan


def media_parts(messages: list[ChatMessage]) -> list[tuple[str, str | ImageEmbedsPart]]:
    """``("image" | "video", url)`` of every media part, ``("image_embeds", part)`` of every part of
    precomputed embeddings, in the order the messages carry them."""
    def item(part):
        if isinstance(part, ImageEmbedsPart):
            return "image_embeds", part
        return ("video", part.video_url.url) if isinstance(part, VideoPart) else ("image", part.image_url.url)

    return [item(part) for m in messages if isinstance(m.content, list)
            for part in m.content if isinstance(part, (ImagePart, VideoPart, ImageEmbedsPart))]


class PromptBuilder:
    def __init__(self, tokenizer, config: ModelConfig, geometry: ImageGeometry,
                 video_geometry: VideoGeometry | None = None):
        if not tokenizer.chat_template:
            raise ValueError("the checkpoint's tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.config = config
        self.geometry = geometry
        self.video_geometry = video_geometry

    def build(self, messages: list[ChatMessage], image_sizes: list[tuple[int, int] | Grid],
              options: TemplateOptions | None = None, videos: list["VideoShape"] = ()) -> Prompt:
        """``image_sizes``: (height, width) of each image to encode, or the (t, h, w) patch grid of its
        precomputed embeddings; ``videos`` each video's sampled shape; in the order the messages carry them."""
        ids = self.render_ids(messages, options or TemplateOptions())
        return self._expand_images(ids, image_sizes, list(videos))

    def render_ids(self, messages: list[ChatMessage], options: TemplateOptions) -> list[int]:
        """The conversation's token ids, one placeholder token per image."""
        reserved = _RESERVED & set(options.kwargs)
        if reserved:
            raise ApiError(400, f"chat_template_kwargs may not set {', '.join(sorted(reserved))}",
                           "chat_template_kwargs")
        self._refuse_special_tokens(json.dumps(options.kwargs, ensure_ascii=False), "chat_template_kwargs",
                                    "chat_template_kwargs")
        sentinel = f"\x00{secrets.token_hex(8)}:"
        texts: list[str] = []
        conversation = [self._template_message(m, sentinel, texts) for m in messages]
        tools = [tool.model_dump(exclude_none=True) for tool in options.tools] if options.tools else None
        calls = [m.get("tool_calls") for m in conversation]
        self._refuse_special_tokens(json.dumps([tools, calls], ensure_ascii=False), "tool definitions and tool calls",
                                    "tools")
        try:
            rendered = self.tokenizer.apply_chat_template(
                conversation, tools=tools, tokenize=False, add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message, **options.kwargs)
        except Exception:  # a template that rejects the conversation (roles out of order, …)
            raise ApiError(400, "the conversation does not fit the model's chat template") from None
        return self._tokenize(rendered, sentinel, texts)

    def _refuse_special_tokens(self, data: str, what: str, param: str) -> None:
        for token in self.tokenizer.all_special_tokens:
            if token and token in data:
                raise ApiError(400, f"{what} may not contain the special token {token!r}", param)

    @staticmethod
    def _template_message(message: ChatMessage, sentinel: str, texts: list[str]) -> dict:
        role = "system" if message.role == "developer" else message.role

        def text(value: str) -> str:
            texts.append(value)
            return f"{sentinel}{len(texts) - 1}\x00"

        if message.content is None or isinstance(message.content, str):
            rendered: dict = {"role": role, "content": text(message.content or "")}
        else:
            rendered = {"role": role, "content": [{"type": "image"} if isinstance(p, (ImagePart, ImageEmbedsPart))
                                                  else {"type": "video"} if isinstance(p, VideoPart)
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

    def _expand_images(self, ids: list[int], image_sizes: list[tuple[int, int]],
                       videos: list["VideoShape"] = ()) -> Prompt:
        image_token, video_token = self.config.image_token_id, self.config.video_token_id
        slots = [(i, t) for i, t in enumerate(ids) if t in (image_token, video_token)]
        if sum(t == image_token for _, t in slots) != len(image_sizes):
            raise ApiError(400, "the chat template did not place every image")
        if sum(t == video_token for _, t in slots) != len(videos):
            raise ApiError(400, "the chat template did not place every video")
        sizes, clips = iter(image_sizes), iter(videos)
        prompt = Prompt(token_ids=[])
        start = 0
        for slot, token in slots:
            prompt.token_ids += ids[start:slot]
            start = slot + 1
            if token == video_token:
                start += self._place_video(prompt, ids, slot, next(clips))
                continue
            grid = self._image_grid(next(sizes))
            prompt.image_offsets.append(len(prompt.token_ids))
            prompt.image_grids.append(grid)
            prompt.token_ids += [image_token] * grid_tokens(grid, self.geometry.merge_size)
        prompt.token_ids += ids[start:]
        return prompt

    def _image_grid(self, size: tuple[int, int] | Grid) -> Grid:
        if len(size) == 3:  # precomputed embeddings come with their grid
            return tuple(size)
        try:
            return self.geometry.grid(*size)
        except ValueError as err:
            raise ApiError(400, f"image cannot be processed: {err}") from None

    # -- video ------------------------------------------------------------------------------------
    def _place_video(self, prompt: Prompt, ids: list[int], slot: int, video: "VideoShape") -> int:
        """Expand one video placeholder; returns how many template tokens after it were consumed.

        Qwen2-VL / Qwen2.5-VL: one run of ``t·h·w/merge²`` video tokens. Qwen3-VL: the template's
        ``<|vision_start|><|video_pad|><|vision_end|>`` becomes, per temporal patch,
        ``<{seconds:.1f} seconds><|vision_start|>`` + its ``h·w/merge²`` tokens + ``<|vision_end|>`` (the
        Qwen3-VL processor's layout as the model was trained and vLLM serves it; transformers 5.24 keeps the
        template's outer pair too). Each timestamp is tokenized on its own, as vLLM does."""
        g, c = self.video_geometry, self.config
        if g is None:
            raise ApiError(400, "this model does not take video input")
        try:
            grid = g.grid(video.num_frames, video.height, video.width)
        except ValueError as err:
            raise ApiError(400, f"video cannot be processed: {err}") from None
        prompt.videos[len(prompt.image_offsets)] = plan = VideoSlotPlan(video.timing.second_per_grid)
        prompt.image_grids.append(grid)
        if g.rule != "qwen3":
            prompt.image_offsets.append(len(prompt.token_ids))
            prompt.token_ids += [c.video_token_id] * grid_tokens(grid, g.merge_size)
            return 0
        if not (prompt.token_ids and prompt.token_ids[-1] == c.vision_start_token_id and slot + 1 < len(ids)
                and ids[slot + 1] == c.vision_end_token_id):
            raise ApiError(400, "the chat template does not frame the video with vision start and end tokens")
        prompt.token_ids.pop()
        per_frame = grid[1] * grid[2] // g.merge_size ** 2
        for seconds in video.timing.timestamps:
            prompt.token_ids += self.tokenizer.encode(f"<{seconds:.1f} seconds>", add_special_tokens=False)
            prompt.token_ids.append(c.vision_start_token_id)
            plan.frame_offsets.append(len(prompt.token_ids))
            prompt.token_ids += [c.video_token_id] * per_frame
            prompt.token_ids.append(c.vision_end_token_id)
        prompt.image_offsets.append(plan.frame_offsets[0])
        return 1


@dataclass(frozen=True)
class VideoShape:
    """What prompt building needs of a decoded clip: its sampled frames' shape and their timing."""

    num_frames: int
    height: int
    width: int
    timing: VideoTiming


@dataclass
class VideoSlotPlan:
    second_per_grid: float  # Qwen2.5-VL's temporal spacing
    frame_offsets: list[int] = field(default_factory=list)  # Qwen3-VL: where each temporal patch's run starts
