"""The OpenAI chat-completions schema we accept and return (pydantic: it also feeds /openapi.json)."""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ImageURL(_Strict):
    url: Annotated[str, Field(min_length=1)]
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


# -- video (vLLM's and SGLang's convention: a content part of type video_url) ----------------------------
class VideoURL(_Strict):
    url: Annotated[str, Field(min_length=1)]


class VideoPart(_Strict):
    type: Literal["video_url"]
    video_url: VideoURL


ContentPart = Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None
    name: str | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class ChatCompletionRequest(_Strict):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = -1
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1
    user: str | None = None
    ignore_eos: bool = False  # vLLM's extension: generate exactly max_tokens (benchmarks)
    presence_penalty: Annotated[float, Field(ge=0, le=0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=0, le=0)] = 0.0
    logprobs: Literal[False] = False

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else value
        if stops and any(not s or len(s) > 256 for s in stops):
            raise ValueError("stop strings must be 1 to 256 characters")
        return value

    @model_validator(mode="after")
    def _unicode(self) -> "ChatCompletionRequest":
        """JSON escapes can spell lone surrogates (``\\ud800``), which are not text: no tokenizer takes them."""
        texts = [*self.stop_list()]
        for message in self.messages:
            if isinstance(message.content, str):
                texts.append(message.content)
            elif message.content:
                texts.extend(part.text for part in message.content if isinstance(part, TextPart))
        for text in texts:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("text contains a lone surrogate code point (e.g. \\ud800), which is not "
                                 "valid Unicode") from None
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # served from a worker's prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Choice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: None = None


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
