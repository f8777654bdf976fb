"""Structured output: the grammars of one tokenizer, compiled and validated (the frontend checks a request's
before admission; an engine's ``grammar_masks`` applies them to the logits).

The library is llguidance: on CPU with a realistic 152k vocabulary its mask costs ~0.5 ms a step and
a grammar compiles in 4–10 ms, against xgrammar's 0.9–3.3 ms and 20–90 ms (docs/architecture.md) — and
compiling happens on the engine thread, between steps.
"""

from __future__ import annotations

import json
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.messages.sampling import Constraint


def grammar_source(constraint: "Constraint") -> str:
    """The llguidance grammar of a constraint (its ``validate`` tells what is wrong with one)."""
    import llguidance as llg

    if constraint.kind == "json":
        return llg.LLMatcher.grammar_from_json_schema(constraint.spec or '{"type": "object"}',
                                                      defaults={"whitespace_flexible": False})
    if constraint.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(constraint.spec)
    if constraint.kind == "choice":
        options = json.loads(constraint.spec)
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options))
    return llg.LLMatcher.grammar_from_lark(constraint.spec)


class Grammars:
    """Compiled grammars of one tokenizer, cached by constraint (a schema sent again compiles once)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Seq[int] = ()):
        import llguidance.hf

        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                      eos_token=list(eos_token_ids) or None)
        self._compiled: dict = {}

    def validate(self, constraint: "Constraint") -> str:
        """Why the constraint cannot be used, or '' when it can."""
        import llguidance as llg

        try:
            source = grammar_source(constraint)
        except (ValueError, TypeError, json.JSONDecodeError) as err:
            return str(err)
        return llg.LLMatcher.validate_grammar(source, self.tokenizer)

    def matcher(self, constraint: "Constraint"):
        import llguidance as llg

        template = self._compiled.get(constraint)
        if template is None:
            if len(self._compiled) > 256:
                self._compiled.clear()
            template = self._compiled[constraint] = llg.LLMatcher(self.tokenizer, grammar_source(constraint))
        return template.deep_copy()
