"""The OpenAI chat-completions schema we accept and return (pydantic: it also feeds /openapi.json).
What chat shares with text completions — leniency, sampling options — is in ``options.py``."""

from __future__ import annotations

import json
import time
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, Field, field_validator, model_validator

from services.frontend.options import GenerationOptions, Strict, check_text

# -- content parts -----------------------------------------------------------------------------------


class ImageURL(Strict):
    url: Annotated[str, Field(min_length=1)]
    detail: Literal["auto", "low", "high"] | None = None


def _bare_url(value):
    return {"url": value} if isinstance(value, str) else value  # vLLM accepts the URL on its own


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ImagePart(Strict):
    type: Literal["image_url"]
    image_url: Annotated[ImageURL, BeforeValidator(_bare_url)]
    uuid: str | None = None  # vLLM's name for the item in its caches: accepted, unused (content is hashed)


# -- video (vLLM's and SGLang's convention: a content part of type video_url) ----------------------------
class VideoURL(Strict):
    url: Annotated[str, Field(min_length=1)]


class VideoPart(Strict):
    type: Literal["video_url"]
    video_url: Annotated[VideoURL, BeforeValidator(_bare_url)]
    uuid: str | None = None


# -- precomputed embeddings (vLLM's image_embeds; read by ``embeds.py``) -------------------------------
EMBEDS_FIELDS = ("image_embeds", "image_grid_thw")


class ImageEmbedsPart(Strict):
    """One image's embedding rows, base64: on its own, or with its grid (which Qwen-VL models need)."""

    type: Literal["image_embeds"]
    image_embeds: str | dict[str, str]
    uuid: str | None = None

    @field_validator("image_embeds")
    @classmethod
    def _fields(cls, value):
        if isinstance(value, dict) and (set(value) - set(EMBEDS_FIELDS) or "image_embeds" not in value):
            raise ValueError(f"image_embeds as an object takes {' and '.join(EMBEDS_FIELDS)} "
                             f"(got {', '.join(sorted(value))})")
        return value


def _typed_part(part):
    """vLLM's shorthands: a bare string is a text part; an object without ``type`` is named by its key."""
    if isinstance(part, str):
        return {"type": "text", "text": part}
    if isinstance(part, dict) and "type" not in part:
        kind = next((k for k in ("text", "image_url", "video_url", "image_embeds") if k in part), None)
        return {"type": kind, **part} if kind else part
    return part


ContentPart = Annotated[TextPart | ImagePart | VideoPart | ImageEmbedsPart, Field(discriminator="type"),
                        BeforeValidator(_typed_part)]

# -- messages ----------------------------------------------------------------------------------------


class FunctionCall(Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Strict):
    id: Annotated[str, Field(max_length=128)]
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=64)] | None = None  # assistant turns that called tools
    tool_call_id: Annotated[str, Field(max_length=128)] | None = None  # a tool turn: which call it answers
    refusal: str | None = None

    @model_validator(mode="after")
    def _roles(self) -> "ChatMessage":
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        for call in self.tool_calls or ():
            try:
                json.loads(call.function.arguments)
            except json.JSONDecodeError:
                raise ValueError(f"tool call {call.id!r}: arguments are not JSON") from None
        return self

    def texts(self) -> list[str]:
        if isinstance(self.content, str):
            return [self.content]
        return [part.text for part in self.content or () if isinstance(part, TextPart)]


# -- tools -------------------------------------------------------------------------------------------


class FunctionDefinition(Strict):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice

# -- the request -------------------------------------------------------------------------------------


class ChatCompletionRequest(GenerationOptions):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted: every call the model makes is returned
    echo: bool | None = False  # vLLM: prefix the answer with the last message when it is the assistant's
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: Annotated[dict, Field(max_length=32)] | None = None

    @model_validator(mode="after")
    def _valid(self) -> "ChatCompletionRequest":
        check_text([*self.stop_list(), *(t for m in self.messages for t in m.texts())])
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = {tool.function.name for tool in self.tools or ()}
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools")
        if self.tool_choice == "required" and not self.tools:
            raise ValueError("tool_choice 'required' needs tools")
        return self

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def top_logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def uses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


# -- the answer --------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # served from a worker's prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobEntry] | None
    refusal: None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    annotations: list = Field(default_factory=list)  # OpenAI's (URL citations): none here, but the key is there
    tool_calls: list[ToolCall] = Field(default_factory=list)


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None
    stop_reason: int | str | None = None  # vLLM: the stop string or stop token id that ended it


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Choice]
    usage: Usage


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: dict | None = None  # {"name": …, "arguments": …}


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    refusal: None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "epd"
    root: str | None = None
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
