"""A request's options → the engine's ``SamplingParams``, checked against the context and the vocabulary.

Defaults, in order: what the request gives; the checkpoint's generation_config.json (temperature,
top_p, top_k, min_p, repetition_penalty — vLLM's ``--generation-config auto``); OpenAI's. ``max_tokens``
defaults to the rest of the context, bounded by ``--max-output-tokens``; asking for more than either
is a 400.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from services.frontend.errors import ApiError
from services.frontend.options import GenerationOptions
from shared.engine.grammar import Grammars
from shared.logging import get_logger
from shared.messages.sampling import Constraint, SamplingParams

log = get_logger(__name__)

_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class GenerationDefaults:
    """The sampling defaults a checkpoint ships in generation_config.json (only those it sets)."""

    values: dict = field(default_factory=dict)

    @classmethod
    def from_checkpoint(cls, path: Path) -> "GenerationDefaults":
        file = Path(path) / "generation_config.json"
        if not file.is_file():
            return cls()
        raw = json.loads(file.read_text())
        values = {k: raw[k] for k in _DEFAULTED if raw.get(k) is not None}
        if values:
            log.info("frontend.generation_defaults", **values)
        return cls(values)

    def get(self, options: GenerationOptions, name: str, fallback):
        given = getattr(options, name)
        if given is not None:
            return given
        return self.values.get(name, fallback)


def structured_constraint(options: GenerationOptions) -> Constraint | None:
    """``response_format`` or vLLM's ``guided_*`` as one constraint (the options allow at most one)."""
    fmt = options.response_format
    if fmt is not None and fmt.type == "json_object":
        return Constraint("json", "")
    if fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise ApiError(400, "response_format json_schema needs json_schema.schema", "response_format")
        return Constraint("json", json.dumps(fmt.json_schema.schema_))
    if options.guided_json is not None:
        spec = options.guided_json if isinstance(options.guided_json, str) else json.dumps(options.guided_json)
        return Constraint("json", spec)
    if options.guided_regex is not None:
        return Constraint("regex", options.guided_regex)
    if options.guided_choice is not None:
        return Constraint("choice", json.dumps(options.guided_choice))
    if options.guided_grammar is not None:
        return Constraint("lark", options.guided_grammar)
    return None


class SamplingBuilder:
    def __init__(self, defaults: GenerationDefaults, max_model_len: int, max_output_tokens: int, vocab_size: int,
                 grammars: Grammars | None):
        self.defaults = defaults
        self.max_model_len = max_model_len
        self.max_output_tokens = max_output_tokens
        self.vocab_size = vocab_size
        self.grammars = grammars

    def build(self, options: GenerationOptions, prompt_len: int, logprobs: int | None,
              constraint: Constraint | None, param: str = "messages") -> SamplingParams:
        """``logprobs``: top logprobs wanted per token (None: none); ``param``: where the prompt came from."""
        room = self.max_model_len - prompt_len
        if room < 1:
            raise ApiError(400, f"the prompt has {prompt_len} tokens; this model's context is {self.max_model_len}",
                           param)
        limit = min(room, self.max_output_tokens)
        asked = options.output_limit
        if asked is not None and asked > limit:
            raise ApiError(400, f"max_tokens={asked} is too large: the prompt leaves room for {room} tokens "
                                f"(and at most {self.max_output_tokens} are allowed)", "max_tokens")
        max_tokens = asked or limit
        if (options.min_tokens or 0) > max_tokens:
            raise ApiError(400, f"min_tokens={options.min_tokens} exceeds max_tokens={max_tokens}", "min_tokens")
        self._check_ids(options)
        if constraint is not None:
            self._check_constraint(constraint)
        d = self.defaults
        return SamplingParams(
            temperature=d.get(options, "temperature", 1.0), top_p=d.get(options, "top_p", 1.0),
            top_k=max(d.get(options, "top_k", 0), 0), min_p=d.get(options, "min_p", 0.0),
            repetition_penalty=d.get(options, "repetition_penalty", 1.0),
            presence_penalty=options.presence_penalty or 0.0, frequency_penalty=options.frequency_penalty or 0.0,
            logit_bias=tuple((int(k), float(v)) for k, v in (options.logit_bias or {}).items()),
            max_tokens=max_tokens, min_tokens=options.min_tokens or 0,
            stop_token_ids=tuple(options.stop_token_ids or ()), ignore_eos=bool(options.ignore_eos),
            seed=options.seed, logprobs=logprobs, n=options.choices, constraint=constraint,
        )

    def _check_ids(self, options: GenerationOptions) -> None:
        for name, ids in (("logit_bias", [int(k) for k in options.logit_bias or {}]),
                          ("stop_token_ids", options.stop_token_ids or [])):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ApiError(400, f"{name} names token ids outside the vocabulary (< {self.vocab_size}): {bad[:5]}",
                               name)

    def _check_constraint(self, constraint: Constraint) -> None:
        if self.grammars is None:
            raise ApiError(400, "structured output is not available on this server", "response_format")
        problem = self.grammars.validate(constraint)
        if problem:
            raise ApiError(400, f"the structured-output spec cannot be used: {problem[:300]}", "response_format")
