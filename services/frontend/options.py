"""What chat and text completion requests share: leniency rules, sampling and output options.

Requests are lenient where clients rely on it and strict where a mistake would change the answer:
- an unknown top-level field is ignored (vLLM's behaviour; the gateway logs and counts it); nested
  objects stay strict;
- a field we know but do not honour (audio output, predicted outputs, beam search, …) set to anything
  but its default is a 400 naming it — never silently dropped;
- an explicit ``null`` is the default for every field OpenAI marks nullable (sampling fields left
  ``None`` take the checkpoint's generation_config.json defaults, then OpenAI's);
- values are validated strictly (ranges, types, lengths).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

# field -> what it asks for; accepted only at its default (None, False, or the value given here)
NOT_HONOURED: dict[str, tuple[str, Any]] = {
    "audio": ("audio output", None),
    "modalities": ("output modalities other than text", ["text"]),
    "prediction": ("predicted outputs", None),
    "web_search_options": ("web search", None),
    "functions": ("the deprecated functions field (use tools)", None),
    "function_call": ("the deprecated function_call field (use tool_choice)", None),
    "use_beam_search": ("beam search", False),
    "prompt_logprobs": ("prompt logprobs", None),
    "suffix": ("suffix (insertion)", None),
    "logits_processors": ("custom logits processors", None),
    "guided_decoding_backend": ("choosing a guided decoding backend", None),
    "truncate_prompt_tokens": ("prompt truncation", None),
    "chat_template": ("a chat template of the client's: the checkpoint's own is used", None),
}
MAX_STOPS = 16


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Lenient(BaseModel):
    """A request body: unknown fields are collected in ``ignored_fields`` and dropped."""

    model_config = ConfigDict(extra="allow")
    _ignored: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _collect_unknown(self):
        extra = self.__pydantic_extra__ or {}
        refused = [name for name, value in extra.items()
                   if name in NOT_HONOURED and value not in (None, False, NOT_HONOURED[name][1])]
        if refused:
            raise ValueError("not supported by this server: " + "; ".join(
                f"'{name}' ({NOT_HONOURED[name][0]})" for name in refused))
        self._ignored = [name for name, value in extra.items() if name not in NOT_HONOURED]
        extra.clear()
        return self

    @property
    def ignored_fields(self) -> list[str]:
        return self._ignored


class StreamOptions(Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: usage in every chunk


class JsonSchemaFormat(Strict):
    name: Annotated[str, Field(max_length=64)] = "schema"
    description: str | None = None
    schema_: Annotated[dict | None, Field(alias="schema")] = None
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


Penalty = Annotated[float, Field(ge=-2, le=2)]


class GenerationOptions(Lenient):
    """Sampling, stopping and output options (OpenAI's, and vLLM's extensions clients use)."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # vLLM: -1 or 0 for no limit
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]], Field(max_length=300)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=64)] | None = None
    n: Annotated[int, Field(ge=1, le=16)] | None = None
    best_of: Annotated[int, Field(ge=1, le=16)] | None = None  # vLLM: only best_of == n is honoured
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    ignore_eos: bool | None = False  # generate exactly max_tokens (benchmarks)
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True  # accepted; our detokenizer never inserts them
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None
    guided_regex: Annotated[str, Field(max_length=4096)] | None = None
    guided_choice: Annotated[list[Annotated[str, Field(min_length=1, max_length=1024)]], Field(min_length=1, max_length=256)] | None = None
    guided_grammar: Annotated[str, Field(max_length=65536)] | None = None  # Lark, as llguidance reads it
    user: str | None = None
    # accepted for compatibility; they do not change the answer
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else value
        if stops and any(not s or len(s) > 256 for s in stops):
            raise ValueError("stop strings must be 1 to 256 characters")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, value):
        if value and any(not key.isdigit() for key in value):
            raise ValueError("logit_bias keys must be token ids (decimal strings)")
        return value

    @model_validator(mode="after")
    def _consistent(self):
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise ValueError("best_of other than n is not supported (no beam search / ranking)")
        guides = [name for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
                  if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            guides.append("response_format")
        if len(guides) > 1:
            raise ValueError(f"give at most one structured-output option, not {', '.join(guides)}")
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def choices(self) -> int:
        return self.n or 1

    @property
    def output_limit(self) -> int | None:
        return self.max_tokens

    def include_usage(self) -> bool:
        return bool(self.stream_options and (self.stream_options.include_usage or
                                             self.stream_options.continuous_usage_stats))

    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


def check_text(texts: list[str]) -> None:
    """JSON escapes can spell lone surrogates (``\\ud800``), which are not text: no tokenizer takes them."""
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("text contains a lone surrogate code point (e.g. \\ud800), which is not "
                             "valid Unicode") from None
