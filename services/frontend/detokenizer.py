"""Incremental detokenization with stop strings.

The text streamed to a client, concatenated, is exactly ``tokenizer.decode(all_output_ids)`` (cut at
the first stop string). Tokens decode in a short window (``prefix``..end) and only text that can no
longer change is released: the window's new text is held while its end may still be rewritten by the
tokens that follow —

- it ends in U+FFFD: a byte-level token (Qwen's BPE) ended inside a multi-byte character;
- its last token the decoder sees (skipped special tokens are not seen: the tokens on either side of one
  meet) is a byte-fallback token (``<0xE6>``, SentencePiece-style vocabularies): the decoder turns each
  run of byte tokens into text as a whole, and a run that is not valid UTF-8 becomes one U+FFFD per
  byte — its ASCII bytes too, so a byte token that decoded to a letter on its own may still turn into
  U+FFFD;

and the last ``longest stop − 1`` characters are held until it is clear they do not start a stop
string. ``include_stop``: the text ends after the stop string instead of before it (``stop_reason``
names the string either way).
"""

from __future__ import annotations

import json
import re
from functools import lru_cache

REPLACEMENT = "\ufffd"
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


@lru_cache(maxsize=8)  # one per tokenizer the process serves; the vocabulary is read once
def byte_fallback_ids(tokenizer) -> frozenset[int]:
    """The ids of a tokenizer's byte-fallback tokens (empty unless its decoder has a ByteFallback step)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None or not _has_byte_fallback(json.loads(decoder.__getstate__())):
        return frozenset()
    return frozenset(i for token, i in tokenizer.get_vocab().items() if _BYTE_TOKEN.fullmatch(token))


@lru_cache(maxsize=8)
def special_ids(tokenizer) -> frozenset[int]:
    """The ids ``decode(skip_special_tokens=True)`` leaves out: the added tokens marked special."""
    return frozenset(i for i, token in tokenizer.added_tokens_decoder.items() if token.special)


def _has_byte_fallback(decoder: dict) -> bool:
    return decoder.get("type") == "ByteFallback" or any(_has_byte_fallback(d) for d in decoder.get("decoders") or ())


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str] | None = None, skip_special_tokens: bool = True,
                 include_stop: bool = False):
        self.tokenizer = tokenizer
        self.include_stop = include_stop
        self.stop_reason: str | None = None  # the stop string found
        self.stop = [s for s in (stop or []) if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.skip = skip_special_tokens
        self.byte_tokens = byte_fallback_ids(tokenizer)
        self.unseen = special_ids(tokenizer) if skip_special_tokens and self.byte_tokens else frozenset()
        self.ids: list[int] = []
        self.text = ""  # settled text: whole characters only
        self.emitted = 0  # characters of ``text`` already released
        self._prefix = 0  # ids[_prefix:_read] decode to the tail of ``text``
        self._read = 0
        self.stopped = False

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; the text that became final (possibly empty)."""
        if self.stopped:
            return ""
        self.ids += token_ids
        head = self._decode(self.ids[self._prefix:self._read])
        window = self._decode(self.ids[self._prefix:])
        if len(window) > len(head) and self._settled(window):
            self.text += window[len(head):]
            self._prefix, self._read = self._read, len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The rest of the text once no more tokens come."""
        if not self.stopped:
            self.text = self._decode(self.ids)
        return self._release(final=True)

    def _settled(self, window: str) -> bool:
        """Whether the tokens that follow can no longer change the end of ``window`` (see the module's
        docstring): the window is cut here only then, so the next one decodes as the continuation."""
        if window.endswith(REPLACEMENT):
            return False
        seen = next((i for i in reversed(self.ids) if i not in self.unseen), None)
        return seen not in self.byte_tokens

    def _release(self, final: bool) -> str:
        found = self._find_stop()
        if found is not None:
            cut, self.stop_reason = found
            self.text = self.text[:cut + (len(self.stop_reason) if self.include_stop else 0)]
            self.stopped = True
            final = True
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta

    def _find_stop(self) -> tuple[int, str] | None:
        if not self.stop or self.stopped:
            return None
        start = max(0, self.emitted - self.hold)
        hits = [(i, s) for i, s in ((self.text.find(s, start), s) for s in self.stop) if i >= 0]
        return min(hits, key=lambda hit: hit[0]) if hits else None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip) if ids else ""
