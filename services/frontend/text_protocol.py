"""The schema of the text endpoints: ``/v1/completions`` (OpenAI's legacy completions, as vLLM serves
them: string or token-id prompts, echo, logprobs), ``/tokenize`` and ``/detokenize`` (vLLM's)."""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, Field, model_validator

from services.frontend.options import GenerationOptions, Lenient, check_text
from services.frontend.protocol import ChatMessage, Usage

TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1, max_length=1 << 20)]
MAX_PROMPTS = 64


class CompletionRequest(GenerationOptions):
    # one prompt: a string or token ids; several: a list of either (each answered as its own choices)
    prompt: str | TokenIds | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)] | \
        Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    echo: bool | None = False
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    add_special_tokens: bool | None = True

    @model_validator(mode="after")
    def _valid(self) -> "CompletionRequest":
        check_text([*self.stop_list(), *(p for p in self.prompts() if isinstance(p, str))])
        return self

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)

    @property
    def top_logprob_count(self) -> int | None:
        return self.logprobs


class CompletionLogprobs(BaseModel):
    """The legacy format: parallel lists, one entry per token (the echoed prompt's first is null)."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TokenizeRequest(Lenient):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)] | None = None
    add_special_tokens: bool | None = True
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict | None = None
    return_token_strs: bool | None = False

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        check_text([self.prompt or "", *(t for m in self.messages or () for t in m.texts())])
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(Lenient):
    model: str | None = None
    tokens: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=1 << 20)]


class DetokenizeResponse(BaseModel):
    prompt: str
